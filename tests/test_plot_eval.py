#!/usr/bin/env python3
"""scripts/plot_eval.py end to end: generated copy/passkey/position lines → PNG and SVG; bad input →
one error line, exit status 1. Run as `python3 tests/test_plot_eval.py` (ctest: plot_eval). Exits 77
(ctest: skipped) when matplotlib is missing."""
import json
import os
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "plot_eval.py")


def write(path, recs):
    with open(path, "w") as f:
        for r in recs:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")


class PlotEval(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        d = self.dir = self.tmp.name
        self.copy = os.path.join(d, "copy.jsonl")
        write(self.copy, [{"mode": "copy", "m": m, "d": dd, "accuracy": 1.0 / (1 + dd / 1024) / (1 + m / 64)}
                          for m in (16, 64, 256) for dd in (0, 1024, 4096)])
        self.passkey = os.path.join(d, "passkey.jsonl")
        write(self.passkey, [{"mode": "passkey", "context": c, "depth": p, "accuracy": p}
                             for c in (1024, 4096) for p in (0, 0.5, 1)])
        self.position = os.path.join(d, "position.jsonl")
        edges = [0, 64, 128, 256, 512, 1024]
        write(self.position, [{"mode": "position", "begin": a, "end": b, "loss": 4 - 0.1 * i, "memory_bytes": 1 << 26}
                              for i, (a, b) in enumerate(zip(edges, edges[1:]))])

    def tearDown(self):
        self.tmp.cleanup()

    def run_script(self, *args):
        return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=300)

    def test_each_mode_draws(self):
        for src, ext, n in ((self.copy, "png", 9), (self.passkey, "svg", 6), (self.position, "png", 5)):
            out = os.path.join(self.dir, "fig." + ext)
            r = self.run_script(src, "--out", out)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertIn(f"{n} points", r.stdout)
            with open(out, "rb") as f:
                data = f.read()
            if ext == "png":
                self.assertTrue(data.startswith(b"\x89PNG\r\n\x1a\n"))
            else:
                self.assertIn(b"<svg", data[:2000])
            os.remove(out)

    def test_two_position_curves(self):
        out = os.path.join(self.dir, "two.svg")
        r = self.run_script(self.position, self.position, "--labels", "a,b", "--out", out)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("10 points", r.stdout)

    def test_two_longdoc_curves(self):
        # eval position --documents writes "longdoc" lines: the same plot, one curve per model.
        longdoc = os.path.join(self.dir, "longdoc.jsonl")
        with open(self.position) as f:
            recs = [json.loads(line) for line in f if line.strip()]
        write(longdoc, [dict(r, mode="longdoc") for r in recs])
        out = os.path.join(self.dir, "longdoc.png")
        r = self.run_script(longdoc, longdoc, "--labels", "T 2k,T 32k", "--out", out)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("longdoc: 10 points", r.stdout)
        r = self.run_script(longdoc, self.position, "--out", out)
        self.assertEqual(r.returncode, 1)
        self.assertIn("mix modes", r.stderr)

    def test_bad_input(self):
        bad = os.path.join(self.dir, "bad.jsonl")
        cases = [
            (["nothing.jsonl"], "cannot read"),
            ([self.copy, self.passkey], "mix modes"),
            ([self.copy, self.copy], "takes one file"),
        ]
        write(bad, ['{"mode": "copy", "m": 4, "d": 0}'])
        cases.append(([bad], '"accuracy" is missing'))
        write(os.path.join(self.dir, "b2.jsonl"), ["[1, 2]"])
        cases.append(([os.path.join(self.dir, "b2.jsonl")], "not a JSON object"))
        write(os.path.join(self.dir, "b3.jsonl"), ['{"mode": "copy", "m": 4, "d": 0, "accuracy": 2}'])
        cases.append(([os.path.join(self.dir, "b3.jsonl")], "outside [0, 1]"))
        for paths, says in cases:
            r = self.run_script(*paths, "--out", os.path.join(self.dir, "x.png"))
            self.assertEqual(r.returncode, 1, (paths, r.stdout, r.stderr))
            self.assertIn(says, r.stderr)
            self.assertNotIn("Traceback", r.stderr)
        r = self.run_script(self.copy, "--out", os.path.join(self.dir, "x.pdf"))
        self.assertEqual(r.returncode, 1)
        self.assertIn("--out must end in .png or .svg", r.stderr)


if __name__ == "__main__":
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("plot_eval: matplotlib is missing (Debian: python3-matplotlib); skipped")
        sys.exit(77)
    unittest.main()
