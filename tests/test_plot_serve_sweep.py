#!/usr/bin/env python3
"""scripts/plot_serve_sweep.py: a generated sweep → PNG and SVG; bad input → one error line, exit 1.
Run as `python3 tests/test_plot_serve_sweep.py` (ctest: plot_serve_sweep); exits 77 without matplotlib."""
import json
import os
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "plot_serve_sweep.py")


class PlotServeSweep(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.sweep = os.path.join(self.tmp.name, "sweep.jsonl")
        with open(self.sweep, "w") as f:
            for r in (8, 2, 4, 16):  # unsorted on purpose
                f.write(json.dumps({"rate": r, "req_s": r * 0.98, "tok_s": r * 300, "ttft_p50_ms": 20 * r,
                                    "ttft_p99_ms": 40 * r, "tpot_p50_ms": 5 + r, "tpot_p99_ms": 9 + 4 * r,
                                    "ttft_slo_ms": 300, "tpot_slo_ms": 60, "slo_met": 40 * r <= 300}) + "\n")

    def tearDown(self):
        self.tmp.cleanup()

    def run_script(self, *args):
        return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=300)

    def test_png_and_svg(self):
        for ext in ("png", "svg"):
            out = os.path.join(self.tmp.name, "fig." + ext)
            r = self.run_script(self.sweep, "--out", out)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertIn("4 rates", r.stdout)
            with open(out, "rb") as f:
                head = f.read(2000)
            self.assertTrue(head.startswith(b"\x89PNG") if ext == "png" else b"<svg" in head)

    def test_bad_input(self):
        bad = os.path.join(self.tmp.name, "bad.jsonl")
        with open(bad, "w") as f:
            f.write('{"rate": 4, "ttft_p50_ms": 1}\n')
        for args, says in (([bad], '"ttft_p99_ms" is missing'), (["/nonexistent.jsonl"], "cannot read"),
                           ([self.sweep], "--out must end in .png or .svg")):
            out = os.path.join(self.tmp.name, "x.pdf" if "--out must" in says else "x.png")
            r = self.run_script(*args, "--out", out)
            self.assertEqual(r.returncode, 1, r.stdout)
            self.assertIn(says, r.stderr)
            self.assertNotIn("Traceback", r.stderr)


if __name__ == "__main__":
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("plot_serve_sweep: matplotlib is missing (Debian: python3-matplotlib); skipped")
        sys.exit(77)
    unittest.main()
