"""scripts/bench_table.py: the newest record per name, rows grouped by area, the block rewritten
between its markers (and nothing else), --check on a stale and a current document, bad input.
Run: /usr/bin/python3 -m unittest -v tests/test_bench_table.py
"""
import importlib.util
import io
import json
import os
import subprocess
import sys
import tempfile
import unittest
from contextlib import redirect_stderr

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "..", "scripts", "bench_table.py")

spec = importlib.util.spec_from_file_location("bench_table", SCRIPT)
bt = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bt)


def rec(bench, value, date, unit="ms", commit="abc1234", note="a note", **kw):
    r = {"bench": bench, "value": value, "unit": unit, "device": "NVIDIA H200", "commit": commit,
         "date": date, "note": note}
    r.update(kw)
    return r


RECS = [
    rec("decode_tok_s_x", 100.0, "2026-12-01T10:00:00Z", unit="tok/s", commit="old0001"),
    rec("decode_tok_s_x", 200.0, "2026-12-02T10:00:00Z", unit="tok/s", commit="new0002"),
    rec("decode_tok_s_x", 150.0, "2026-11-30T10:00:00Z", unit="tok/s", commit="older03"),  # older, later line
    rec("train_tok_s_y", 30957.4, "2026-12-01T00:00:00Z", unit="tokens/s"),
    rec("train_tok_s_y_gpus2", 40772, "2026-11-30T00:00:00Z", unit="tokens/s"),
    rec("muon_step_ms_gather_gpus2", 393, "2026-11-30T00:00:00Z"),
    rec("gla_fwd_relerr", 0.00165937, "2026-11-30T00:00:00Z", unit="relative RMS"),
    rec("prefill_ms_z", 77.2774, "2026-12-02T00:00:00Z", note="x | y " + "long " * 80),
    rec("serve_poisson_tok_s", 15934.9, "2026-12-02T00:00:00Z", unit="tok/s",
        command="laplace bench serve --rate 64"),
    rec("weird_figure", 1, "2026-12-02T00:00:00Z", unit=""),
    rec("same_date", 1, "2026-12-02T00:00:00Z", commit="first01"),
    rec("same_date", 2, "2026-12-02T00:00:00Z", commit="second2"),
]


def write_jsonl(path, recs):
    with open(path, "w", encoding="utf-8") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")


class Selection(unittest.TestCase):
    def test_newest_by_date_ties_to_the_later_line(self):
        best = bt.newest(RECS)
        self.assertEqual(best["decode_tok_s_x"]["commit"], "new0002")
        self.assertEqual(best["same_date"]["commit"], "second2")
        self.assertEqual(len(best), 9)

    def test_areas(self):
        self.assertEqual(bt.area_of("train_tok_s_laplace3b_t2048"), "train")
        self.assertEqual(bt.area_of("train_tok_s_laplace3b_t2048_gpus2"), "dist")
        self.assertEqual(bt.area_of("serve_decode_tok_s_3b_1280_replicas_gpus2"), "dist")
        self.assertEqual(bt.area_of("muon_step_ms_all_to_all_gpus2"), "dist")
        self.assertEqual(bt.area_of("gla_fwd_ms_b8t2048h16"), "gla")
        self.assertEqual(bt.area_of("decode_ms_per_step_3b_1280"), "decode")
        self.assertEqual(bt.area_of("prefill_ms_3b_t8192"), "prefill")
        self.assertEqual(bt.area_of("serve_poisson_tok_s"), "serve")
        self.assertEqual(bt.area_of("weird_figure"), "other")
        self.assertEqual(bt.area_of("training_without_underscore_prefix"), "other")


class Block(unittest.TestCase):
    def setUp(self):
        self.text = bt.block(RECS, shapes={"long long": "LL"})
        self.rows = [l for l in self.text.splitlines() if l.startswith("| ") and "`" in l]

    def test_retired_name_has_no_row(self):
        recs = RECS + [rec("decode_tok_s_x", None, "2026-12-03T00:00:00Z", retired=True, note="replaced")]
        self.assertNotIn("decode_tok_s_x", [n for _, n, _ in bt.rows(bt.newest(recs))])
        self.assertIn("train_tok_s_y", [n for _, n, _ in bt.rows(bt.newest(recs))])
        # a newer measurement after the retirement brings the row back
        recs.append(rec("decode_tok_s_x", 300.0, "2026-12-04T00:00:00Z", unit="tok/s"))
        self.assertIn("decode_tok_s_x", [n for _, n, _ in bt.rows(bt.newest(recs))])

    def test_one_row_per_name_in_area_order(self):
        names = [l.split("`")[1] for l in self.rows]
        self.assertEqual(names, ["train_tok_s_y", "gla_fwd_relerr", "decode_tok_s_x", "prefill_ms_z",
                                 "serve_poisson_tok_s", "muon_step_ms_gather_gpus2", "train_tok_s_y_gpus2",
                                 "same_date", "weird_figure"])

    def test_cells(self):
        row = {l.split("`")[1]: [c.strip() for c in l.strip("|").split(" | ")] for l in self.rows}
        self.assertEqual(row["decode_tok_s_x"][2:6], ["200 tok/s", "2026-12-02", "NVIDIA H200", "`new0002`"])
        self.assertEqual(row["train_tok_s_y"][2], "30,957 tokens/s")
        self.assertEqual(row["gla_fwd_relerr"][2], "0.001659 relative RMS")
        self.assertEqual(row["weird_figure"][2], "1")
        self.assertEqual(row["serve_poisson_tok_s"][6], "laplace bench serve --rate 64")  # command over note
        self.assertEqual(row["train_tok_s_y_gpus2"][0], "distributed")

    def test_long_note_shortened_escaped_abbreviated(self):
        line = next(l for l in self.rows if "prefill_ms_z" in l)
        self.assertIn("x \\| y LL", line)
        note = line.rsplit(" | ", 1)[1][:-2]
        self.assertLessEqual(len(note.replace("\\|", "|")), bt.MAX_TEXT)
        self.assertTrue(note.endswith("…"))

    def test_deterministic(self):  # names with distinct dates: file order does not matter
        self.assertEqual(bt.block(list(reversed(RECS[3:10])), shapes={}), bt.block(RECS[3:10], shapes={}))


class Document(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        d = self.dir.name
        self.results = os.path.join(d, "results.jsonl")
        self.doc = os.path.join(d, "BENCHMARKS.md")
        write_jsonl(self.results, RECS)
        self.head = "# Benchmarks\n\nIntro.\n\n"
        self.tail = "\n\n## History\n\nKept as it is.\n"
        with open(self.doc, "w", encoding="utf-8") as f:
            f.write(self.head + bt.BEGIN + "\nstale table\n" + bt.END + self.tail)

    def tearDown(self):
        self.dir.cleanup()

    def run_main(self, *args):
        err = io.StringIO()
        with redirect_stderr(err):
            rc = bt.main(["--results", self.results, "--doc", self.doc, *args])
        return rc, err.getvalue()

    def read(self):
        with open(self.doc, encoding="utf-8") as f:
            return f.read()

    def test_check_rewrite_check(self):
        rc, err = self.run_main("--check")
        self.assertEqual(rc, 1)
        self.assertIn("stale", err)
        self.assertEqual(self.run_main()[0], 0)
        text = self.read()
        self.assertTrue(text.startswith(self.head + bt.BEGIN + "\n"))
        self.assertTrue(text.endswith(bt.END + self.tail))
        self.assertIn("`new0002`", text)
        self.assertNotIn("stale table", text)
        self.assertEqual(self.run_main("--check")[0], 0)
        self.assertEqual(self.run_main()[0], 0)  # rewriting a current block changes nothing
        self.assertEqual(self.read(), text)
        self.assertEqual([f for f in os.listdir(self.dir.name) if f.startswith(".bench_table")], [])

    def test_new_record_makes_it_stale(self):
        self.run_main()
        write_jsonl(self.results, RECS + [rec("decode_tok_s_x", 300.0, "2026-12-03T00:00:00Z")])
        self.assertEqual(self.run_main("--check")[0], 1)

    def test_print_changes_nothing(self):
        before = self.read()
        out = subprocess.run([sys.executable, SCRIPT, "--results", self.results, "--doc", self.doc, "--print"],
                             capture_output=True, text=True)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("| decode | `decode_tok_s_x` | 200 tok/s |", out.stdout)
        self.assertEqual(self.read(), before)

    def test_bad_input(self):
        with open(self.doc, "w", encoding="utf-8") as f:
            f.write("no markers here\n")
        rc, err = self.run_main("--check")
        self.assertEqual(rc, 2)
        self.assertIn("current-figures:begin", err)
        with open(self.results, "a", encoding="utf-8") as f:
            f.write("{not json\n")
        rc, err = self.run_main("--print")
        self.assertEqual(rc, 2)
        self.assertIn("results.jsonl:13", err)


if __name__ == "__main__":
    unittest.main()
