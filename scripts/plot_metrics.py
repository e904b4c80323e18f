#!/usr/bin/env python3
"""Loss curves from one or more metrics.jsonl files (laplace train, or the PyTorch reference trainer).

Each file is one run. Its lines are JSON objects: training steps
  {"step": 0, "loss": 7.64, "lr": 0.002, "grad_norm": 1.45, "tokens_per_s": 562, ...}
and validations
  {"step": 9, "val_loss": 6.11}
(0-based steps). Blank lines and records with neither key are ignored; a loss of null (a
non-finite value, as a skipped step writes it) leaves a gap. A run resumed from an earlier
checkpoint repeats some steps in its appended metrics.jsonl: the last record of a step wins.

Panel 1: training loss against step (with --smooth N: the trailing N-step moving average
solid, the raw curve faint). Panel 2: validation loss against step.

  scripts/plot_metrics.py runs/a/metrics.jsonl runs/b/metrics.jsonl --out loss.png
  scripts/plot_metrics.py --run muon=runs/a/metrics.jsonl --run adamw=runs/b/metrics.jsonl \\
      --smooth 20 --x tokens --tokens-per-step 524288 --logy --out loss.svg

Positional paths are labelled by their parent directory's name. Errors (a missing file, a
line that is not a JSON object, ...) are one line on stderr and exit status 1.
"""
import argparse
import json
import math
import os
import sys

from plot_common import InputError, read_json_lines


def number(v, where, key):
    if v is None:
        return math.nan
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise InputError(f"{where}: \"{key}\" is not a number: {json.dumps(v)}")
    return float(v)


def read_metrics(path):
    """Returns ({step: loss}, {step: val_loss}) of one metrics.jsonl."""
    train, val = {}, {}
    for where, rec in read_json_lines(path):
        if "loss" not in rec and "val_loss" not in rec:
            continue
        step = rec.get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            raise InputError(f"{where}: \"step\" is missing or not an integer")
        if "loss" in rec:
            train[step] = number(rec["loss"], where, "loss")
        if "val_loss" in rec:
            val[step] = number(rec["val_loss"], where, "val_loss")
    if not train and not val:
        raise InputError(f"{path}: no \"loss\" or \"val_loss\" records")
    return train, val


def parse_runs(args):
    runs = []
    for spec in args.run:
        label, sep, path = spec.partition("=")
        if not sep or not label or not path:
            raise InputError(f"--run wants LABEL=PATH, got '{spec}'")
        runs.append((label, path))
    for path in args.paths:
        label = os.path.basename(os.path.dirname(os.path.abspath(path))) or path
        runs.append((label, path))
    if not runs:
        raise InputError("no runs: give metrics.jsonl paths or --run LABEL=PATH")
    return runs


def moving_average(ys, n):
    """Trailing mean over the last n finite values (fewer at the start); NaN stays NaN."""
    out, window, total = [], [], 0.0
    for y in ys:
        if math.isnan(y):
            out.append(math.nan)
            continue
        window.append(y)
        total += y
        if len(window) > n:
            total -= window.pop(0)
        out.append(total / len(window))
    return out


def plot(runs, args):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scale = args.tokens_per_step if args.x == "tokens" else 1
    xlabel = "tokens" if args.x == "tokens" else "step"
    # A step's x: tokens seen after it ((step + 1) · tokens per step), or the step itself.
    xs_of = (lambda steps: [(s + 1) * scale for s in steps]) if args.x == "tokens" else (lambda steps: list(steps))

    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(13, 4.8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    any_val = False
    for i, (label, (train, val)) in enumerate(runs):
        c = colors[i % len(colors)]
        if train:
            steps = sorted(train)
            xs, ys = xs_of(steps), [train[s] for s in steps]
            if args.smooth > 1:
                ax_train.plot(xs, ys, color=c, alpha=0.25, linewidth=0.8)
                ax_train.plot(xs, moving_average(ys, args.smooth), color=c, linewidth=1.6, label=label)
            else:
                ax_train.plot(xs, ys, color=c, linewidth=1.2, label=label)
        if val:
            any_val = True
            steps = sorted(val)
            ax_val.plot(xs_of(steps), [val[s] for s in steps], color=c, marker="o", markersize=3, linewidth=1.2,
                        label=label)
    title = "training loss" + (f" (moving average of {args.smooth} steps)" if args.smooth > 1 else "")
    for ax, t in ((ax_train, title), (ax_val, "validation loss")):
        ax.set_title(t)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("loss")
        ax.grid(True, alpha=0.3)
        if args.logy:
            ax.set_yscale("log")
    if any(train for _, (train, _) in runs):
        ax_train.legend()
    if any_val:
        ax_val.legend()
    else:
        ax_val.text(0.5, 0.5, "no validation records", ha="center", va="center", transform=ax_val.transAxes,
                    color="gray")
    if args.title:
        fig.suptitle(args.title)
    fig.tight_layout()
    try:
        fig.savefig(args.out)
    except OSError as e:
        raise InputError(f"cannot write {args.out}: {e.strerror or e}") from None
    finally:
        plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description="Plot training and validation loss from metrics.jsonl files.")
    p.add_argument("paths", nargs="*", help="metrics.jsonl files, each labelled by its parent directory's name")
    p.add_argument("--run", action="append", default=[], metavar="LABEL=PATH", help="a labelled run (repeatable)")
    p.add_argument("--out", required=True, help="the figure: a .png or .svg file")
    p.add_argument("--smooth", type=int, default=1, metavar="N",
                   help="also draw the trailing N-step moving average of the training loss (raw curve faint)")
    p.add_argument("--x", choices=["step", "tokens"], default="step", help="x axis (default: step)")
    p.add_argument("--tokens-per-step", type=int, default=0, metavar="N",
                   help="tokens per optimizer step (batch·seq·grad-accum); needed by --x tokens")
    p.add_argument("--logy", action="store_true", help="logarithmic loss axis")
    p.add_argument("--title", default="", help="a title over both panels")
    args = p.parse_args(argv)
    try:
        ext = os.path.splitext(args.out)[1].lower()
        if ext not in (".png", ".svg"):
            raise InputError(f"--out must end in .png or .svg, got '{args.out}'")
        if args.smooth < 1:
            raise InputError("--smooth must be at least 1")
        if args.x == "tokens" and args.tokens_per_step <= 0:
            raise InputError("--x tokens needs --tokens-per-step N (N > 0)")
        runs = [(label, read_metrics(path)) for label, path in parse_runs(args)]
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise InputError("matplotlib is not installed (Debian: apt-get install python3-matplotlib)") from None
        plot(runs, args)
    except InputError as e:
        print(f"plot_metrics: error: {e}", file=sys.stderr)
        return 1
    print(f"plot_metrics: wrote {args.out} ({len(runs)} run{'s' if len(runs) != 1 else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
