#!/usr/bin/env python3
"""TTFT and TPOT against the arrival rate, from `laplace bench serve --rates ... --out FILE`.

Each line of FILE is one rate of the sweep:
  {"rate": 4.0, "req_s": 3.9, "ttft_p50_ms": ..., "ttft_p99_ms": ..., "tpot_p50_ms": ..., "tpot_p99_ms": ...,
   "ttft_slo_ms": 300, "tpot_slo_ms": 60, "slo_met": true}
Two panels share the rate axis: TTFT (p50, p99) and TPOT (p50, p99), each with its SLO dashed; the
highest rate that met both is marked.

  scripts/plot_serve_sweep.py runs/sweep.jsonl --out docs/img/serve_sweep.png

Errors (a missing file, a line that is not a JSON object, a missing field) are one line on stderr
and exit status 1.
"""
import argparse
import sys

from plot_common import InputError, check_out, pyplot, read_json_lines, require_numbers, save

FIELDS = ("rate", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")


def read(path):
    pts = []
    for where, rec in read_json_lines(path):
        require_numbers(rec, FIELDS, where)
        pts.append(rec)
    if not pts:
        raise InputError(f"{path}: no points")
    return sorted(pts, key=lambda r: r["rate"])


def plot(pts, out, title):
    plt = pyplot()
    rates = [p["rate"] for p in pts]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4.2), sharex=True)
    for ax, key, label in ((a1, "ttft", "time to first token (ms)"), (a2, "tpot", "time per output token (ms)")):
        ax.plot(rates, [p[key + "_p50_ms"] for p in pts], marker="o", label="p50")
        ax.plot(rates, [p[key + "_p99_ms"] for p in pts], marker="s", label="p99")
        slo = pts[0].get(key + "_slo_ms")
        if isinstance(slo, (int, float)):
            ax.axhline(slo, color="gray", linestyle="--", linewidth=1, label=f"SLO {slo:g} ms")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("arrival rate (requests/s, Poisson)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        met = [p["rate"] for p in pts if p.get("slo_met")]
        if met:
            ax.axvline(max(met), color="green", alpha=0.4, linewidth=2, label=f"highest met: {max(met):g}/s")
        ax.legend(fontsize=8)
    fig.suptitle(title or "serving latency against arrival rate")
    fig.tight_layout()
    save(fig, plt, out)


def main(argv=None):
    p = argparse.ArgumentParser(description="Plot TTFT/TPOT against rate from a bench serve sweep.")
    p.add_argument("path", help="the sweep's JSON lines (bench serve --rates ... --out FILE)")
    p.add_argument("--out", required=True, help="a .png or .svg file")
    p.add_argument("--title", default="")
    args = p.parse_args(argv)
    try:
        check_out(args.out)
        pts = read(args.path)
        plot(pts, args.out, args.title)
        print(f"{len(pts)} rates -> {args.out}")
        return 0
    except InputError as e:
        print(f"plot_serve_sweep: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
