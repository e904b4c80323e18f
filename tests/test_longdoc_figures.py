#!/usr/bin/env python3
"""scripts/longdoc_figures.py on made-up longdoc.jsonl files whose figures are known by hand:
the gain and slope are token-weighted means over whole buckets, and bad input is one error line.
Run as `python3 tests/test_longdoc_figures.py` (ctest: longdoc_figures)."""
import json
import os
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "longdoc_figures.py")
EDGES = [0, 1024, 2048, 4096, 8192, 16384, 32768, 65536]


def write(path, losses, tokens=None, mode="longdoc"):
    with open(path, "w") as f:
        for i, loss in enumerate(losses):
            n = tokens[i] if tokens else EDGES[i + 1] - EDGES[i]
            f.write(json.dumps({"mode": mode, "begin": EDGES[i], "end": EDGES[i + 1], "loss": loss, "tokens": n,
                                "documents": 1, "memory_bytes": 1 << 20}) + "\n")


class LongdocFigures(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.short = os.path.join(self.tmp.name, "short.jsonl")
        self.long = os.path.join(self.tmp.name, "long.jsonl")

    def tearDown(self):
        self.tmp.cleanup()

    def run_script(self, *args):
        return subprocess.run([sys.executable, SCRIPT, *args, "--model", "m", "--commit", "c", "--device", "d"],
                              capture_output=True, text=True)

    def figures(self):
        r = self.run_script(self.short, self.long)
        self.assertEqual(r.returncode, 0, r.stderr)
        return {j["bench"]: j for j in map(json.loads, r.stdout.splitlines())}

    def test_gain_and_slope(self):
        # Buckets 8k-16k and 16k-32k: short 3.0 and 3.3, long 2.5 and 2.2 with tokens 8,192 and 16,384.
        write(self.short, [4, 3.6, 3.4, 3.2, 3.0, 3.3, 3.5])
        write(self.long, [4, 3.6, 3.1, 2.8, 2.5, 2.2, 2.1])
        f = self.figures()
        gain = (3.0 * 8192 + 3.3 * 16384) / 24576 - (2.5 * 8192 + 2.2 * 16384) / 24576
        self.assertAlmostEqual(f["longdoc_gain_32k_vs_2k_m"]["value"], gain, places=5)
        self.assertAlmostEqual(f["longdoc_slope_m_t32k"]["value"], 2.2 - 3.1, places=5)
        self.assertEqual(f["longdoc_slope_m_t32k"]["unit"], "nats")
        self.assertEqual(f["longdoc_gain_32k_vs_2k_m"]["commit"], "c")

    def test_weights_by_tokens(self):
        write(self.short, [4] * 7)
        write(self.long, [4, 4, 4, 4, 1.0, 3.0, 4], tokens=[1, 1, 1, 1, 300, 100, 1])
        self.assertAlmostEqual(self.figures()["longdoc_gain_32k_vs_2k_m"]["value"], 4 - 1.5, places=5)

    def test_bad_input(self):
        write(self.short, [4] * 7)
        write(self.long, [4] * 7, mode="position")
        r = self.run_script(self.short, self.long)
        self.assertEqual(r.returncode, 1)
        self.assertIn("not the longdoc.jsonl", r.stderr)
        write(self.long, [4] * 5)  # ends at 16,384: positions 16k-32k missing
        r = self.run_script(self.short, self.long)
        self.assertEqual(r.returncode, 1)
        self.assertIn("cover", r.stderr)
        r = self.run_script(self.short, os.path.join(self.tmp.name, "none.jsonl"))
        self.assertEqual(r.returncode, 1)
        self.assertEqual(len(r.stderr.strip().splitlines()), 1)


if __name__ == "__main__":
    unittest.main()
