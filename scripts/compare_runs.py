#!/usr/bin/env python3
"""Compares two training runs step by step from their metrics.jsonl files (docs/quality.md):

  scripts/compare_runs.py OURS/metrics.jsonl REF/metrics.jsonl [--last 200] [--tag laplace125m]
                          [--results bench/results.jsonl --commit C --device D --command "..."]

Over the steps both runs logged: the mean and largest |Δ loss| over the last --last of them, the mean
signed Δ (ours − reference), the mean |Δ| of the two curves' --smooth-step moving averages (what is
left when the per-batch noise of two trajectories that rounding has separated averages out), and at
the last validation step both logged, the relative difference of the validation losses |ours − ref| /
ref. With --results, appends <prefix>_mean_abs_dloss_<tag>, <prefix>_mean_abs_dloss_ma<N>_<tag>
and <prefix>_val_rel_diff_<tag> as JSON lines (prefix: convergence unless --prefix says otherwise). Exit 2 on unreadable input or no common steps.
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


def moving_average(xs, n):
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= n:
            acc -= xs[i - n]
        out.append(acc / min(i + 1, n))
    return out


def plot(path, steps, ot, rt, ov, rv, labels, last):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        fail("--plot needs matplotlib (Debian: python3-matplotlib)")
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    for runs, val, name, color in ((ot, ov, labels[0], "C0"), (rt, rv, labels[1], "C1")):
        ys = [runs[s] for s in steps]
        ax.plot(steps, ys, color=color, alpha=0.25, linewidth=0.6)
        ax.plot(steps, moving_average(ys, 20), color=color, linewidth=1.4, label=name + " (train, 20-step mean)")
        vs = sorted(s for s in val if s <= steps[-1])
        if vs:
            ax.plot(vs, [val[s] for s in vs], "o--", color=color, markersize=4, label=name + " (validation)")
    ax.set_ylabel("loss (nats)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    d = [ot[s] - rt[s] for s in steps]
    bx.plot(steps, d, color="0.6", linewidth=0.5, label="per step")
    bx.plot(steps, moving_average(d, 20), color="k", linewidth=1.2, label="20-step mean")
    bx.axhline(0, color="k", linewidth=0.5)
    bx.axvspan(steps[-min(last, len(steps))], steps[-1], color="C2", alpha=0.1, label="last %d steps" % last)
    bx.set_ylabel("Δ loss (%s − %s)" % tuple(labels))
    bx.set_xlabel("step")
    bx.legend(fontsize=8)
    bx.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ours")
    p.add_argument("ref")
    p.add_argument("--last", type=int, default=200)
    p.add_argument("--smooth", type=int, default=20, help="moving-average length for the smoothed figure")
    p.add_argument("--tag", default="laplace125m")
    p.add_argument("--prefix", default="convergence",
                   help="the figures' first word (fp8: a run in --precision fp8 against the same run in bf16)")
    p.add_argument("--results")
    p.add_argument("--commit", default="unknown")
    p.add_argument("--device", default="unknown")
    p.add_argument("--command", default="")
    p.add_argument("--plot", help="also draw both curves over the common steps and their difference (.png/.svg)")
    p.add_argument("--labels", default="laplace,reference", help="the two runs' names in the plot")
    a = p.parse_args(argv)
    (ot, ov), (rt, rv) = read(a.ours), read(a.ref)
    steps = sorted(set(ot) & set(rt))
    if not steps:
        fail("the runs share no training step")
    tail = steps[-a.last:]
    d = [ot[s] - rt[s] for s in tail]
    mean_abs = sum(abs(x) for x in d) / len(d)
    if a.smooth < 1:
        fail("--smooth must be at least 1")
    # Moving averages over the common steps (each step's mean with the --smooth − 1 before it).
    oma = dict(zip(steps, moving_average([ot[s] for s in steps], a.smooth)))
    rma = dict(zip(steps, moving_average([rt[s] for s in steps], a.smooth)))
    mean_abs_ma = sum(abs(oma[s] - rma[s]) for s in tail) / len(tail)
    out = {"steps_compared": len(steps), "window": [tail[0], tail[-1]], "mean_abs_dloss": mean_abs,
           "max_abs_dloss": max(abs(x) for x in d), "mean_dloss": sum(d) / len(d),
           "mean_abs_dloss_ma%d" % a.smooth: mean_abs_ma,
           "ours_mean_loss": sum(ot[s] for s in tail) / len(tail), "ref_mean_loss": sum(rt[s] for s in tail) / len(tail)}
    vsteps = sorted(set(ov) & set(rv))
    if vsteps:
        s = vsteps[-1]
        out.update(val_step=s, ours_val_loss=ov[s], ref_val_loss=rv[s], val_rel_diff=abs(ov[s] - rv[s]) / rv[s])
        out["val_by_step"] = {str(s): [ov[s], rv[s]] for s in vsteps}
    print(json.dumps(out, indent=1))
    if a.plot:
        plot(a.plot, steps, ot, rt, ov, rv, a.labels.split(",", 1), a.last)
    if a.results:
        date = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        note = "steps %d-%d (0-based) of %d common; ours %s vs reference %s" % (tail[0], tail[-1], len(steps),
                                                                                a.ours, a.ref)
        lines = [(a.prefix + "_mean_abs_dloss_" + a.tag, mean_abs, "nats"),
                 ("%s_mean_abs_dloss_ma%d_%s" % (a.prefix, a.smooth, a.tag), mean_abs_ma, "nats")]
        if vsteps:
            lines.append((a.prefix + "_val_rel_diff_" + a.tag, out["val_rel_diff"], "fraction"))
        with open(a.results, "a") as f:
            for name, v, unit in lines:
                f.write(json.dumps({"bench": name, "value": round(v, 6), "unit": unit, "device": a.device,
                                    "commit": a.commit, "date": date, "note": note, "command": a.command}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
