#!/usr/bin/env python3
"""scripts/plot_mqar.py end to end: a generated mqar.jsonl grid → a PNG and an SVG; bad input →
one error line, exit status 1, no traceback. No pytest: run as `python3 tests/test_plot_mqar.py`
(ctest: plot_mqar). Exits 77 (ctest: skipped) when matplotlib is missing."""
import json
import os
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "plot_mqar.py")


def state_bytes(h, dk, dv, layers=2, dim=128):
    return layers * (h * dk * dv + 4 * dim) * 4


def write_grid(path, states, pairs_list, seqs, extra_lines=()):
    """A grid shaped like `laplace eval mqar --out`'s: accuracy rising with state, falling with pairs."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for seq in seqs:
            for pairs in pairs_list:
                for h, dk, dv in states:
                    b = state_bytes(h, dk, dv)
                    acc = min(1.0, b / (pairs * 4000.0))
                    f.write(json.dumps({"state": f"{h}x{dk}x{dv}", "heads": h, "dk": dk, "dv": dv, "state_bytes": b,
                                        "pairs": pairs, "seq": seq, "accuracy": acc, "correct": int(acc * 100),
                                        "total": 100, "chance": 1 / 4096, "train_loss": 1.0}) + "\n")
        for line in extra_lines:
            f.write(line + "\n")


class PlotMqar(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = self.tmp.name
        self.grid = os.path.join(self.dir, "grid", "mqar.jsonl")
        write_grid(self.grid, [(2, 16, 32), (4, 32, 64), (8, 64, 128)], [4, 16, 64], [64, 256])

    def tearDown(self):
        self.tmp.cleanup()

    def run_script(self, *args):
        return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=300)

    def test_png(self):
        out = os.path.join(self.dir, "mqar.png")
        r = self.run_script(self.grid, "--out", out)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("18 points, 6 (pairs, seq) lines", r.stdout)
        with open(out, "rb") as f:
            data = f.read()
        self.assertTrue(data.startswith(b"\x89PNG\r\n\x1a\n"), data[:16])
        self.assertGreater(len(data), 10000)

    def test_svg_merges_files_and_labels_lines(self):
        other = os.path.join(self.dir, "other", "mqar.jsonl")
        # A second grid with one point measured again (the last line wins) and one new line.
        write_grid(other, [(2, 16, 32)], [4, 8], [64])
        out = os.path.join(self.dir, "mqar.svg")
        r = self.run_script(self.grid, other, "--title", "two grids", "--out", out)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("19 points, 7 (pairs, seq) lines", r.stdout)
        with open(out) as f:
            svg = f.read()
        self.assertIn("<svg", svg)
        for text in ("two grids", "8 pairs, seq 64", "64 pairs, seq 256", "4x32x64", "chance"):
            self.assertIn(text, svg)  # matplotlib keeps text as <!-- comments --> beside the glyphs

    def expect_error(self, args, message):
        r = self.run_script(*args)
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        self.assertIn(message, r.stderr)
        self.assertNotIn("Traceback", r.stderr)
        self.assertEqual(len(r.stderr.strip().splitlines()), 1, r.stderr)

    def test_bad_input(self):
        out = os.path.join(self.dir, "x.png")
        missing = os.path.join(self.dir, "nope", "mqar.jsonl")
        self.expect_error([missing, "--out", out], "cannot read " + missing)
        bad = os.path.join(self.dir, "bad", "mqar.jsonl")
        write_grid(bad, [(2, 16, 32)], [4], [64], ['{"state": "2x16x32", "pairs": 4'])
        self.expect_error([bad, "--out", out], bad + ":2: not valid JSON")
        write_grid(bad, [(2, 16, 32)], [4], [64], ['{"state": "2x16x32", "state_bytes": 1, "pairs": 4, "seq": 64}'])
        self.expect_error([bad, "--out", out], bad + ':2: "accuracy" is missing')
        write_grid(bad, [(2, 16, 32)], [4], [64],
                   ['{"state": "2x16x32", "state_bytes": 1, "pairs": 4, "seq": 64, "accuracy": 1.5}'])
        self.expect_error([bad, "--out", out], "outside [0, 1]")
        empty = os.path.join(self.dir, "empty.jsonl")
        open(empty, "w").close()
        self.expect_error([empty, "--out", out], "no results")
        self.expect_error([self.grid, "--out", os.path.join(self.dir, "x.pdf")], "--out must end in .png or .svg")
        self.expect_error([self.grid, "--out", os.path.join(self.dir, "no", "dir", "x.png")], "cannot write")
        self.assertFalse(os.path.exists(out))


if __name__ == "__main__":
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("plot_mqar test skipped: matplotlib is not installed (apt-get install python3-matplotlib)")
        sys.exit(77)
    unittest.main(verbosity=2)
