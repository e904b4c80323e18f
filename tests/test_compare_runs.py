#!/usr/bin/env python3
"""scripts/compare_runs.py on generated metrics.jsonl pairs whose differences are known: the mean
and largest |Δ loss| over the last N common steps, the signed mean, the moving-average figure, the
validation difference and the JSON lines it records; bad input → exit 2 with one message. No pytest:
run as `python3 tests/test_compare_runs.py` (ctest: compare_runs)."""
import json
import os
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "compare_runs.py")


def write(path, losses, vals=(), skipped=()):
    with open(path, "w") as f:
        for s, x in enumerate(losses):
            f.write(json.dumps({"step": s, "loss": x, "skipped": s in skipped}) + "\n")
        for s, v in vals:
            f.write(json.dumps({"step": s, "val_loss": v}) + "\n")


def run(*args):
    p = subprocess.run([sys.executable, SCRIPT] + list(args), capture_output=True, text=True)
    return p.returncode, p.stdout, p.stderr


class CompareRuns(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.d = self.tmp.name

    def tearDown(self):
        self.tmp.cleanup()

    def path(self, name):
        return os.path.join(self.d, name)

    def test_known_differences(self):
        # Ours alternates +0.02 / −0.02 around the reference over the last 10 steps: mean |Δ| 0.02,
        # signed mean 0, and a 2-step moving average that cancels it to 0.
        ref = [5.0 - 0.1 * s for s in range(30)]
        ours = [x + (0.02 if s % 2 else -0.02) for s, x in enumerate(ref)]
        write(self.path("ours.jsonl"), ours, vals=[(9, 4.0), (29, 2.02)])
        write(self.path("ref.jsonl"), ref, vals=[(9, 4.0), (29, 2.0)])
        res = self.path("results.jsonl")
        rc, out, err = run(self.path("ours.jsonl"), self.path("ref.jsonl"), "--last", "10", "--smooth", "2",
                           "--tag", "t", "--results", res, "--commit", "abc", "--device", "dev")
        self.assertEqual(rc, 0, err)
        o = json.loads(out)
        self.assertEqual(o["window"], [20, 29])
        self.assertAlmostEqual(o["mean_abs_dloss"], 0.02, places=9)
        self.assertAlmostEqual(o["max_abs_dloss"], 0.02, places=9)
        self.assertAlmostEqual(o["mean_dloss"], 0.0, places=9)
        self.assertAlmostEqual(o["mean_abs_dloss_ma2"], 0.0, places=9)
        self.assertEqual(o["val_step"], 29)
        self.assertAlmostEqual(o["val_rel_diff"], 0.01, places=9)
        lines = {r["bench"]: r for r in map(json.loads, open(res))}
        self.assertEqual(sorted(lines), ["convergence_mean_abs_dloss_ma2_t", "convergence_mean_abs_dloss_t",
                                         "convergence_val_rel_diff_t"])
        self.assertAlmostEqual(lines["convergence_mean_abs_dloss_t"]["value"], 0.02, places=6)
        self.assertAlmostEqual(lines["convergence_val_rel_diff_t"]["value"], 0.01, places=6)
        self.assertEqual(lines["convergence_mean_abs_dloss_t"]["commit"], "abc")
        self.assertEqual(lines["convergence_mean_abs_dloss_t"]["device"], "dev")

    def test_prefix_names_the_figures(self):
        ref = [4.0 - 0.1 * s for s in range(10)]
        write(self.path("ours.jsonl"), [x + 0.01 for x in ref], vals=[(9, 3.03)])
        write(self.path("ref.jsonl"), ref, vals=[(9, 3.0)])
        res = self.path("results.jsonl")
        rc, _, err = run(self.path("ours.jsonl"), self.path("ref.jsonl"), "--tag", "m", "--prefix", "fp8",
                         "--results", res)
        self.assertEqual(rc, 0, err)
        lines = {r["bench"]: r["value"] for r in map(json.loads, open(res))}
        self.assertEqual(sorted(lines), ["fp8_mean_abs_dloss_m", "fp8_mean_abs_dloss_ma20_m", "fp8_val_rel_diff_m"])
        self.assertAlmostEqual(lines["fp8_val_rel_diff_m"], 0.01, places=6)

    def test_a_steady_offset_survives_smoothing(self):
        # A bias is not noise: the moving averages differ by it as much as the raw curves.
        ref = [3.0] * 40
        write(self.path("ours.jsonl"), [3.05] * 40)
        write(self.path("ref.jsonl"), ref)
        rc, out, err = run(self.path("ours.jsonl"), self.path("ref.jsonl"), "--last", "20")
        self.assertEqual(rc, 0, err)
        o = json.loads(out)
        self.assertAlmostEqual(o["mean_abs_dloss"], 0.05, places=9)
        self.assertAlmostEqual(o["mean_abs_dloss_ma20"], 0.05, places=9)
        self.assertAlmostEqual(o["mean_dloss"], 0.05, places=9)

    def test_only_common_unskipped_steps_count(self):
        # The reference stopped at step 14 and our step 12 was skipped: steps 0-11 and 13-14 compare.
        write(self.path("ours.jsonl"), [1.0] * 30, skipped={12})
        write(self.path("ref.jsonl"), [1.5] * 15)
        rc, out, err = run(self.path("ours.jsonl"), self.path("ref.jsonl"), "--last", "200")
        self.assertEqual(rc, 0, err)
        o = json.loads(out)
        self.assertEqual(o["steps_compared"], 14)
        self.assertEqual(o["window"], [0, 14])
        self.assertNotIn("val_rel_diff", o)

    def test_bad_input_is_one_message(self):
        write(self.path("ours.jsonl"), [1.0] * 5)
        with open(self.path("bad.jsonl"), "w") as f:
            f.write('{"step": 0, "loss": 1.0}\nnot json\n')
        rc, out, err = run(self.path("ours.jsonl"), self.path("bad.jsonl"))
        self.assertEqual(rc, 2)
        self.assertIn("bad.jsonl:2: not valid JSON", err)
        self.assertNotIn("Traceback", err)
        rc, out, err = run(self.path("ours.jsonl"), self.path("missing.jsonl"))
        self.assertEqual(rc, 2)
        self.assertIn("cannot read", err)
        write(self.path("later.jsonl"), [])
        rc, out, err = run(self.path("ours.jsonl"), self.path("later.jsonl"))
        self.assertEqual(rc, 2)
        self.assertIn("share no training step", err)
        rc, out, err = run(self.path("ours.jsonl"), self.path("ours.jsonl"), "--smooth", "0")
        self.assertEqual(rc, 2)
        self.assertIn("--smooth", err)


if __name__ == "__main__":
    unittest.main()
