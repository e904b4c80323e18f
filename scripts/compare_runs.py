#!/usr/bin/env python3
"""Compares two training runs step by step from their metrics.jsonl files (docs/quality.md):

  scripts/compare_runs.py OURS/metrics.jsonl REF/metrics.jsonl [--last 200] [--tag laplace125m]
                          [--results bench/results.jsonl --commit C --device D --command "..."]

Over the steps both runs logged: the mean and largest |Δ loss| over the last --last of them, the mean
signed Δ (ours − reference), and at the last validation step both logged, the relative difference of the
validation losses |ours − ref| / ref. With --results, appends convergence_mean_abs_dloss_<tag> and
convergence_val_rel_diff_<tag> as JSON lines. Exit 2 on unreadable input or no common steps.
"""
import argparse
import json
import sys
import time


def fail(msg):
    sys.stderr.write("compare_runs: " + msg + "\n")
    sys.exit(2)


def read(path):
    train, val = {}, {}
    try:
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    r = json.loads(line)
                except ValueError:
                    fail("%s:%d: not valid JSON" % (path, n))
                if "val_loss" in r:
                    val[int(r["step"])] = float(r["val_loss"])
                elif "loss" in r and not r.get("skipped", False):
                    train[int(r["step"])] = float(r["loss"])
    except OSError as e:
        fail("cannot read %s: %s" % (path, e.strerror))
    return train, val


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ours")
    p.add_argument("ref")
    p.add_argument("--last", type=int, default=200)
    p.add_argument("--tag", default="laplace125m")
    p.add_argument("--results")
    p.add_argument("--commit", default="unknown")
    p.add_argument("--device", default="unknown")
    p.add_argument("--command", default="")
    a = p.parse_args(argv)
    (ot, ov), (rt, rv) = read(a.ours), read(a.ref)
    steps = sorted(set(ot) & set(rt))
    if not steps:
        fail("the runs share no training step")
    tail = steps[-a.last:]
    d = [ot[s] - rt[s] for s in tail]
    mean_abs = sum(abs(x) for x in d) / len(d)
    out = {"steps_compared": len(steps), "window": [tail[0], tail[-1]], "mean_abs_dloss": mean_abs,
           "max_abs_dloss": max(abs(x) for x in d), "mean_dloss": sum(d) / len(d),
           "ours_mean_loss": sum(ot[s] for s in tail) / len(tail), "ref_mean_loss": sum(rt[s] for s in tail) / len(tail)}
    vsteps = sorted(set(ov) & set(rv))
    if vsteps:
        s = vsteps[-1]
        out.update(val_step=s, ours_val_loss=ov[s], ref_val_loss=rv[s], val_rel_diff=abs(ov[s] - rv[s]) / rv[s])
        out["val_by_step"] = {str(s): [ov[s], rv[s]] for s in vsteps}
    print(json.dumps(out, indent=1))
    if a.results:
        date = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        note = "steps %d-%d (0-based) of %d common; ours %s vs reference %s" % (tail[0], tail[-1], len(steps),
                                                                                a.ours, a.ref)
        lines = [("convergence_mean_abs_dloss_" + a.tag, mean_abs, "nats")]
        if vsteps:
            lines.append(("convergence_val_rel_diff_" + a.tag, out["val_rel_diff"], "fraction"))
        with open(a.results, "a") as f:
            for name, v, unit in lines:
                f.write(json.dumps({"bench": name, "value": round(v, 6), "unit": unit, "device": a.device,
                                    "commit": a.commit, "date": date, "note": note, "command": a.command}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
