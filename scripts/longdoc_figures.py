#!/usr/bin/env python3
"""The long-context comparison's two headline figures, from the longdoc.jsonl files that
`laplace eval position --documents --out DIR` writes for a model trained at T = 2,048 (SHORT)
and one trained at T = 32,768 (LONG) on the same tokens (docs/quality.md "Long context"):

  longdoc_gain_32k_vs_2k_MODEL  mean loss of SHORT minus LONG over positions 8,192-32,768
                                (> 0: the long-trained model uses what the short one cannot)
  longdoc_slope_MODEL_t32k      LONG's mean loss at positions 16,384-32,768 minus 2,048-4,096
                                (< 0: its loss keeps falling with position)

Means weigh each position bucket by its tokens; only buckets wholly inside the range count, so
the position buckets must be cut at those bounds (eval position's powers of two are). Prints one
bench/results.jsonl line per figure.

  scripts/longdoc_figures.py SHORT.jsonl LONG.jsonl --model laplace125m --device H100 --commit abc1234
"""
import argparse
import datetime
import json
import math
import sys


def rows(path):
    with open(path, encoding="utf-8") as f:
        out = [json.loads(line) for line in f if line.strip()]
    if not out or any(r.get("mode") != "longdoc" for r in out):
        raise ValueError(f"{path}: not the longdoc.jsonl of eval position --documents")
    return out


def mean_loss(rs, lo, hi):
    sel = [r for r in rs if r["begin"] >= lo and r["end"] <= hi and r["tokens"] > 0]
    covered = sum(r["end"] - r["begin"] for r in sel)
    if covered != hi - lo:
        raise ValueError(f"the buckets cover {covered} of the {hi - lo} positions {lo}-{hi}")
    n = sum(r["tokens"] for r in sel)
    return sum(r["loss"] * r["tokens"] for r in sel) / n


def figures(short, long_, model):
    return [
        ("longdoc_gain_32k_vs_2k_" + model, mean_loss(short, 8192, 32768) - mean_loss(long_, 8192, 32768),
         "mean loss over positions 8,192-32,768 of the T=2,048 run minus the T=32,768 run's"),
        ("longdoc_slope_%s_t32k" % model, mean_loss(long_, 16384, 32768) - mean_loss(long_, 2048, 4096),
         "T=32,768 run: loss at positions 16k-32k minus 2k-4k"),
    ]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("short", help="longdoc.jsonl of the model trained at T = 2,048")
    p.add_argument("long", help="longdoc.jsonl of the model trained at T = 32,768")
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="")
    p.add_argument("--commit", default="")
    p.add_argument("--command", default="scripts/device/long_context.sh")
    a = p.parse_args(argv)
    try:
        out = figures(rows(a.short), rows(a.long), a.model)
    except (OSError, ValueError, KeyError) as e:
        print(f"longdoc_figures: error: {e}", file=sys.stderr)
        return 1
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    for name, value, note in out:
        if not math.isfinite(value):
            print(f"longdoc_figures: error: {name} is {value}", file=sys.stderr)
            return 1
        print(json.dumps({"bench": name, "value": round(value, 6), "unit": "nats", "device": a.device,
                          "commit": a.commit, "date": now,
                          "note": note + "; held-out documents of at least 32,768 tokens, each from a zero state",
                          "command": a.command}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
