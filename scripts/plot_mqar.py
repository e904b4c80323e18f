#!/usr/bin/env python3
"""MQAR accuracy against state size, from the mqar.jsonl files `laplace eval mqar --out DIR` writes.

Each line of mqar.jsonl is one trained model:
  {"state": "2x16x32", "state_bytes": 10240, "pairs": 4, "seq": 64, "accuracy": 0.97, "chance": 0.000244, ...}
The figure draws accuracy (y) against state bytes per sequence (x, logarithmic), one line per
(pairs, seq), points labelled by their HxDKxDV, and chance (1 / value vocabulary) dashed.
Several files (several grids or devices) are merged; a point measured twice (same state
size, pairs and seq) keeps its last line.

  scripts/plot_mqar.py runs/mqar/mqar.jsonl --out mqar.png
  scripts/plot_mqar.py a/mqar.jsonl b/mqar.jsonl --title "laplace, V8192 D128 L2" --out mqar.svg

Errors (a missing file, a line that is not a JSON object, a missing field, ...) are one line
on stderr and exit status 1.
"""
import argparse
import sys

from plot_common import InputError, check_out, is_number, pyplot, read_json_lines, save

FIELDS = {"state": str, "state_bytes": int, "pairs": int, "seq": int, "accuracy": float}


def read_points(path, points):
    """Adds {(state, pairs, seq): record} from one mqar.jsonl to points; returns how many lines it had."""
    n = 0
    for where, rec in read_json_lines(path):
        for key, kind in FIELDS.items():
            v = rec.get(key)
            ok = (isinstance(v, str) if kind is str else
                  isinstance(v, int) and not isinstance(v, bool) if kind is int else is_number(v))
            if not ok:
                raise InputError(f"{where}: \"{key}\" is missing or not {'a string' if kind is str else 'a number'}")
        if not 0.0 <= rec["accuracy"] <= 1.0:
            raise InputError(f"{where}: \"accuracy\" {rec['accuracy']} is outside [0, 1]")
        if rec["state_bytes"] <= 0:
            raise InputError(f"{where}: \"state_bytes\" must be positive")
        points[(rec["state"], rec["pairs"], rec["seq"])] = rec
        n += 1
    if n == 0:
        raise InputError(f"{path}: no results")
    return n


def plot(points, args):
    plt = pyplot()
    lines = {}
    for (state, pairs, seq), rec in points.items():
        lines.setdefault((pairs, seq), []).append(rec)
    fig, ax = plt.subplots(figsize=(8.5, 5.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    markers = "osD^v<>ph*"
    for i, (pairs, seq) in enumerate(sorted(lines)):
        recs = sorted(lines[(pairs, seq)], key=lambda r: (r["state_bytes"], r["state"]))
        xs = [r["state_bytes"] for r in recs]
        ys = [r["accuracy"] for r in recs]
        ax.plot(xs, ys, color=colors[i % len(colors)], marker=markers[(i // len(colors)) % len(markers)],
                linewidth=1.5, markersize=5, label=f"{pairs} pairs, seq {seq}")
        if args.label_points:
            for r in recs:
                ax.annotate(r["state"], (r["state_bytes"], r["accuracy"]), textcoords="offset points",
                            xytext=(4, -10), fontsize=7, color="gray")
    chances = sorted({r["chance"] for r in points.values() if isinstance(r.get("chance"), (int, float))})
    if len(chances) == 1:
        ax.axhline(chances[0], color="gray", linestyle="--", linewidth=1, label=f"chance ({chances[0]:.3g})")
    ax.set_xscale("log")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("state bytes per sequence: L·(H·dk·dv + K·D)·4")
    ax.set_ylabel("MQAR accuracy (answer positions)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    ax.set_title(args.title or "multi-query associative recall against state size")
    fig.tight_layout()
    save(fig, plt, args.out)


def main(argv=None):
    p = argparse.ArgumentParser(description="Plot MQAR accuracy against state bytes from mqar.jsonl files.")
    p.add_argument("paths", nargs="+", help="mqar.jsonl files (laplace eval mqar --out DIR writes DIR/mqar.jsonl)")
    p.add_argument("--out", required=True, help="the figure: a .png or .svg file")
    p.add_argument("--title", default="", help="the figure's title")
    p.add_argument("--no-point-labels", dest="label_points", action="store_false",
                   help="do not write each point's HxDKxDV beside it")
    args = p.parse_args(argv)
    try:
        check_out(args.out)
        points = {}
        for path in args.paths:
            read_points(path, points)
        plot(points, args)
    except InputError as e:
        print(f"plot_mqar: error: {e}", file=sys.stderr)
        return 1
    n_lines = len({(pairs, seq) for _, pairs, seq in points})
    print(f"plot_mqar: wrote {args.out} ({len(points)} points, {n_lines} (pairs, seq) line{'s' if n_lines != 1 else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
