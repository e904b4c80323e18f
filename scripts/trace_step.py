#!/usr/bin/env python3
"""Where a decode step's time goes, from a GPU kernel trace.

Input: a CSV with the columns "Start (ns)", "Duration (ns)" and "Name", one row per kernel or
copy, every node of a replayed CUDA graph its own row: experiments/trace/cupti_trace.cpp writes it
(CUPTI, on machines without Nsight Systems), as does `nsys stats --report cuda_gpu_trace
--format csv` of a run profiled with `--cuda-graph-trace=node`.
A step is taken to end with the argmax kernel (one per greedy decode step), or, with
--split-gap-ms G, to be a run of work between two idle gaps longer than G ms (e.g. the
repetitions of `laplace bench prefill`, which synchronise with the host in between). For the last
--steps steps it prints the step's wall time, the time some kernel or copy was running, the
idle time between them (launch and dependency bubbles), the largest gaps with the kernels on
either side, and the time per kernel name per step.

  CUDA_INJECTION64_PATH=build-gpu/libcupti_trace.so CUPTI_TRACE_OUT=trace.csv laplace bench decode …
  python3 scripts/trace_step.py trace.csv --steps 8
  python3 scripts/trace_step.py prefill.csv --steps 3 --split-gap-ms 1
"""
import argparse
import collections
import csv
import re
import sys


def column(header, *prefixes):
    for p in prefixes:
        for i, h in enumerate(header):
            if h.startswith(p):
                return i
    sys.exit(f"trace_step: no column starting with {prefixes} in {header}")


def short(name):
    name = name.replace("(anonymous namespace)::", "")  # or the next line would cut the name there
    name = re.sub(r"\(.*", "", name)  # drop the argument list
    name = re.sub(r"^void ", "", name)
    name = re.sub(r"<.*", "<…>", name) if len(name) > 70 else name
    return name.replace("laplace::cuda::", "")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--end-kernel", default="argmax_rows")
    ap.add_argument("--top", type=int, default=24)
    ap.add_argument("--split-gap-ms", type=float, default=None)
    a = ap.parse_args()
    with open(a.csv, newline="") as f:
        rows = list(csv.reader(f))
    # nsys may print notices before the header: take the first row naming a start column.
    h = next(i for i, r in enumerate(rows) if r and r[0].startswith("Start"))
    header, body = rows[h], rows[h + 1:]
    cs, cd, cn = column(header, "Start"), column(header, "Duration"), column(header, "Name")
    ev = sorted((int(r[cs]), int(r[cd]), r[cn]) for r in body if len(r) > cn and r[cs].isdigit())
    # Each step: (t0, first event, last event); its idle time is counted from t0.
    steps = []
    if a.split_gap_ms is None:
        ends = [i for i, e in enumerate(ev) if a.end_kernel in e[2]]
        if len(ends) < a.steps + 1:
            sys.exit(f"trace_step: {len(ends)} '{a.end_kernel}' kernels, need {a.steps + 1}")
        for s in range(1, len(ends)):
            lo = ends[s - 1]
            steps.append((ev[lo][0] + ev[lo][1], lo + 1, ends[s]))
    else:
        first, reach = 0, ev[0][0] + ev[0][1] if ev else 0
        for i in range(1, len(ev) + 1):
            if i == len(ev) or ev[i][0] - reach > a.split_gap_ms * 1e6:
                steps.append((ev[first][0], first, i - 1))
                first = i
            if i < len(ev):
                reach = max(reach, ev[i][0] + ev[i][1])
        if len(steps) < a.steps:
            sys.exit(f"trace_step: {len(steps)} runs between gaps > {a.split_gap_ms} ms, need {a.steps}")
    steps = steps[-a.steps:]
    per_name = collections.defaultdict(float)
    count = collections.Counter()
    gaps = []
    walls, busys = [], []
    for t0, lo, hi in steps:
        busy, cursor = 0, t0
        for i in range(lo, hi + 1):
            st, du, nm = ev[i]
            if st > cursor:
                gaps.append((st - cursor, short(ev[i - 1][2]), short(nm)))
            busy += max(0, st + du - max(st, cursor))
            cursor = max(cursor, st + du)
            per_name[short(nm)] += du
            count[short(nm)] += 1
        walls.append(cursor - t0)
        busys.append(busy)
    n = a.steps
    wall, busy = sum(walls) / n / 1e6, sum(busys) / n / 1e6
    print(f"steps {n}: wall {wall:.3f} ms per step (min {min(walls) / 1e6:.3f}, max {max(walls) / 1e6:.3f}); "
          f"busy {busy:.3f} ms; idle {wall - busy:.3f} ms ({100 * (wall - busy) / wall:.1f} %)")
    gsum = collections.defaultdict(lambda: [0, 0])
    for g, p, q in gaps:
        gsum[(p, q)][0] += g
        gsum[(p, q)][1] += 1
    print("idle between kernels, by pair (ms per step, gaps per step, mean µs):")
    for (p, q), (g, c) in sorted(gsum.items(), key=lambda kv: -kv[1][0])[:12]:
        print(f"  {g / n / 1e6:8.4f}  {c / n:6.1f}  {g / c / 1e3:7.2f}  {p} -> {q}")
    print("kernels (ms per step, calls per step, mean µs):")
    for nm, t in sorted(per_name.items(), key=lambda kv: -kv[1])[:a.top]:
        print(f"  {t / n / 1e6:8.4f}  {count[nm] / n:6.1f}  {t / count[nm] / 1e3:8.2f}  {nm}")


if __name__ == "__main__":
    main()
