#!/usr/bin/env python3
"""Figures of the quality evaluations, from the JSONL files `laplace eval copy|passkey|position --out DIR` writes.

  copy.jsonl      {"mode": "copy", "m": 16, "d": 1024, "accuracy": 0.42, ...}        → heatmap, m × d
  passkey.jsonl   {"mode": "passkey", "context": 4096, "depth": 0.5, "accuracy": 1.0} → heatmap, depth × context
  position.jsonl  {"mode": "position", "begin": 64, "end": 128, "loss": 3.1, "memory_bytes": ...}
                                                                                     → loss by position (log x)
                                                                                       and the memory held
  longdoc.jsonl   the same fields, from `eval position --documents` (each held-out document from a zero
                  state)                                                             → the same plot

  scripts/plot_eval.py runs/eval/copy.jsonl --out docs/img/recall_copy.png
  scripts/plot_eval.py runs/eval/position.jsonl other/position.jsonl --labels 125m,350m --out pos.svg

Several position files draw one curve each; a heatmap takes one file. Errors (a missing file, a
line that is not a JSON object, a missing field, mixed modes) are one line on stderr and exit 1.
"""
import argparse
import math
import os
import sys

from plot_common import InputError, check_out, pyplot, read_json_lines, require_numbers, save

FIELDS = {
    "copy": ("m", "d", "accuracy"),
    "passkey": ("context", "depth", "accuracy"),
    "position": ("begin", "end", "loss", "memory_bytes"),
    "longdoc": ("begin", "end", "loss", "memory_bytes"),
}


def read(path):
    recs, mode = [], None
    for where, rec in read_json_lines(path):
        if rec.get("mode") not in FIELDS:
            raise InputError(f"{where}: not a copy, passkey, position or longdoc line")
        if mode and rec["mode"] != mode:
            raise InputError(f"{where}: a {rec['mode']} line among {mode} lines")
        mode = rec["mode"]
        require_numbers(rec, FIELDS[mode], where)
        if "accuracy" in rec and not 0 <= rec["accuracy"] <= 1:
            raise InputError(f"{where}: \"accuracy\" {rec['accuracy']} is outside [0, 1]")
        recs.append(rec)
    if not recs:
        raise InputError(f"{path}: no results")
    return mode, recs


def heatmap(ax, recs, row_key, col_key, row_label, col_label, fmt_row):
    rows = sorted({r[row_key] for r in recs})
    cols = sorted({r[col_key] for r in recs})
    grid = [[math.nan] * len(cols) for _ in rows]
    for r in recs:
        grid[rows.index(r[row_key])][cols.index(r[col_key])] = r["accuracy"]
    im = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto", origin="lower")
    for i in range(len(rows)):
        for j in range(len(cols)):
            v = grid[i][j]
            if not math.isnan(v):
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8, color="white" if v < 0.6 else "black")
    ax.set_xticks(range(len(cols)), [f"{c:,}" for c in cols])
    ax.set_yticks(range(len(rows)), [fmt_row(r) for r in rows])
    ax.set_xlabel(col_label)
    ax.set_ylabel(row_label)
    return im


def plot(mode, files, args):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.8))
    if mode == "copy":
        im = heatmap(ax, files[0][1], "m", "d", "string length m", "held-out tokens between the copies (d)", str)
        fig.colorbar(im, ax=ax, label="accuracy of the second copy")
        title = "copy test: recall after d tokens of real text"
    elif mode == "passkey":
        im = heatmap(ax, files[0][1], "depth", "context", "needle depth", "context (tokens)", lambda p: f"{p:.0%}")
        fig.colorbar(im, ax=ax, label="keys recalled")
        title = "passkey retrieval by context and depth"
    else:
        mem = ax.twinx()
        for label, recs in files:
            recs = sorted(recs, key=lambda r: r["begin"])
            xs = [math.sqrt(max(r["begin"], 1) * r["end"]) for r in recs]
            ax.plot(xs, [r["loss"] for r in recs], marker="o", label=label)
            mem.plot(xs, [r["memory_bytes"] / 2**20 for r in recs], linestyle=":", color="gray")
        ax.set_xscale("log")
        ax.set_xlabel("position in the context (bucket's geometric middle)")
        ax.set_ylabel("held-out loss (nats/token)")
        mem.set_ylabel("memory held (MiB, dotted)")
        lo = min(r["memory_bytes"] for _, recs in files for r in recs) / 2**20
        mem.set_ylim(0, max(1.0, lo * 2))
        ax.grid(True, which="both", alpha=0.3)
        if len(files) > 1:
            ax.legend(fontsize=8)
        title = ("loss by position in held-out long documents, each from a zero state" if mode == "longdoc"
                 else "loss by position at constant memory")
    ax.set_title(args.title or title)
    fig.tight_layout()
    save(fig, plt, args.out)


def main(argv=None):
    p = argparse.ArgumentParser(description="Plot copy/passkey heatmaps or loss by position from laplace eval output.")
    p.add_argument("paths", nargs="+", help="copy.jsonl, passkey.jsonl, position.jsonl or longdoc.jsonl files")
    p.add_argument("--out", required=True, help="the figure: a .png or .svg file")
    p.add_argument("--labels", default="", help="comma-separated curve labels (position files)")
    p.add_argument("--title", default="")
    args = p.parse_args(argv)
    try:
        check_out(args.out)
        read_all = [read(path) for path in args.paths]
        modes = {m for m, _ in read_all}
        if len(modes) > 1:
            raise InputError("the files mix modes: " + ", ".join(sorted(modes)))
        mode = modes.pop()
        if mode not in ("position", "longdoc") and len(read_all) > 1:
            raise InputError(f"a {mode} heatmap takes one file")
        labels = args.labels.split(",") if args.labels else [os.path.basename(os.path.dirname(os.path.abspath(p))) or p
                                                            for p in args.paths]
        if len(labels) != len(args.paths):
            raise InputError(f"--labels names {len(labels)} curves for {len(args.paths)} files")
        plot(mode, [(labels[i], recs) for i, (_, recs) in enumerate(read_all)], args)
        n = sum(len(r) for _, r in read_all)
        print(f"{mode}: {n} points -> {args.out}")
        return 0
    except InputError as e:
        print(f"plot_eval: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
