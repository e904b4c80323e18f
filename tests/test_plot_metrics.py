#!/usr/bin/env python3
"""scripts/plot_metrics.py end to end: two tiny generated metrics.jsonl runs → a PNG and an
SVG; bad input → one error line, exit status 1, no traceback. No pytest: run as
`python3 tests/test_plot_metrics.py` (ctest: plot_metrics). Exits 77 (ctest: skipped) when
matplotlib is missing."""
import json
import os
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "plot_metrics.py")


def write_run(path, steps, start, val_every, extra_lines=()):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for s in range(steps):
            f.write(json.dumps({"step": s, "loss": start * 0.97**s, "lr": 0.01, "grad_norm": 1.0,
                                "tokens_per_s": 500.0, "flops_per_s": 5e9, "elapsed_s": s, "skipped": False}) + "\n")
            if (s + 1) % val_every == 0:
                f.write(json.dumps({"step": s, "val_loss": start * 0.98**s}) + "\n")
        for line in extra_lines:
            f.write(line + "\n")


class PlotMetrics(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = self.tmp.name
        self.a = os.path.join(self.dir, "muon", "metrics.jsonl")
        self.b = os.path.join(self.dir, "adamw", "metrics.jsonl")
        # b: a skipped step (loss null) and a resume that repeats steps 8, 9.
        write_run(self.a, 40, 7.6, 10)
        write_run(self.b, 30, 7.9, 10, ['{"step": 8, "loss": null}', "", '{"step": 9, "loss": 6.0}'])

    def tearDown(self):
        self.tmp.cleanup()

    def run_script(self, *args):
        return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=300)

    def test_png_from_two_positional_runs(self):
        out = os.path.join(self.dir, "loss.png")
        r = self.run_script(self.a, self.b, "--out", out, "--smooth", "5", "--logy")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("2 runs", r.stdout)
        with open(out, "rb") as f:
            data = f.read()
        self.assertTrue(data.startswith(b"\x89PNG\r\n\x1a\n"), data[:16])
        self.assertGreater(len(data), 10000)

    def test_svg_with_labels_and_tokens_axis(self):
        out = os.path.join(self.dir, "loss.svg")
        r = self.run_script("--run", "first=" + self.a, "--run", "second=" + self.b, "--x", "tokens",
                            "--tokens-per-step", "1024", "--out", out)
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(out) as f:
            svg = f.read()
        self.assertIn("<svg", svg)
        for text in ("first", "second", "tokens", "validation loss"):
            self.assertIn(text, svg)  # matplotlib keeps text as <!-- comments --> beside the glyphs

    def expect_error(self, args, message):
        r = self.run_script(*args)
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        self.assertIn(message, r.stderr)
        self.assertNotIn("Traceback", r.stderr)
        self.assertEqual(len(r.stderr.strip().splitlines()), 1, r.stderr)

    def test_bad_input(self):
        out = os.path.join(self.dir, "x.png")
        missing = os.path.join(self.dir, "nope", "metrics.jsonl")
        self.expect_error([missing, "--out", out], "cannot read " + missing)
        bad = os.path.join(self.dir, "bad", "metrics.jsonl")
        write_run(bad, 3, 7.0, 10, ['{"step": 3, "loss": 6.5'])
        self.expect_error([self.a, bad, "--out", out], bad + ":4: not valid JSON")
        write_run(bad, 3, 7.0, 10, ['{"step": "x", "loss": 6.5}'])
        self.expect_error([bad, "--out", out], bad + ':4: "step"')
        write_run(bad, 3, 7.0, 10, ['{"step": 3, "loss": "high"}'])
        self.expect_error([bad, "--out", out], '"loss" is not a number')
        self.expect_error([self.a, "--out", os.path.join(self.dir, "x.pdf")], "--out must end in .png or .svg")
        self.expect_error([self.a, "--x", "tokens", "--out", out], "--tokens-per-step")
        self.expect_error(["--run", "nolabel", "--out", out], "LABEL=PATH")
        self.expect_error([self.a, "--out", os.path.join(self.dir, "no", "dir", "x.png")], "cannot write")
        self.assertFalse(os.path.exists(out))


if __name__ == "__main__":
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("plot_metrics test skipped: matplotlib is not installed (apt-get install python3-matplotlib)")
        sys.exit(77)
    unittest.main(verbosity=2)
