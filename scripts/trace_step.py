#!/usr/bin/env python3
"""Where a decode step's time goes, from a GPU kernel trace.

Input: a CSV with the columns "Start (ns)", "Duration (ns)" and "Name", one row per kernel or
copy, every node of a replayed CUDA graph its own row: lab/trace/cupti_trace.cpp writes it
(CUPTI, on machines without Nsight Systems), as does `nsys stats --report cuda_gpu_trace
--format csv` of a run profiled with `--cuda-graph-trace=node`.
A step is taken to end with the argmax kernel (one per greedy decode step). For the last
--steps steps it prints the step's wall time, the time some kernel or copy was running, the
idle time between them (launch and dependency bubbles), the largest gaps with the kernels on
either side, and the time per kernel name per step.

  CUDA_INJECTION64_PATH=build-gpu/libcupti_trace.so CUPTI_TRACE_OUT=trace.csv laplace bench decode …
  python3 scripts/trace_step.py trace.csv --steps 8
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
    a = ap.parse_args()
    with open(a.csv, newline="") as f:
        rows = list(csv.reader(f))
    # nsys may print notices before the header: take the first row naming a start column.
    h = next(i for i, r in enumerate(rows) if r and r[0].startswith("Start"))
    header, body = rows[h], rows[h + 1:]
    cs, cd, cn = column(header, "Start"), column(header, "Duration"), column(header, "Name")
    ev = sorted((int(r[cs]), int(r[cd]), r[cn]) for r in body if len(r) > cn and r[cs].isdigit())
    ends = [i for i, e in enumerate(ev) if a.end_kernel in e[2]]
    if len(ends) < a.steps + 1:
        sys.exit(f"trace_step: {len(ends)} '{a.end_kernel}' kernels, need {a.steps + 1}")
    per_name = collections.defaultdict(float)
    count = collections.Counter()
    gaps = []
    walls, busys = [], []
    for s in range(len(ends) - a.steps, len(ends)):
        lo, hi = ends[s - 1], ends[s]
        t0 = ev[lo][0] + ev[lo][1]
        t_end = ev[hi][0] + ev[hi][1]
        busy, cursor = 0, t0
        for i in range(lo + 1, hi + 1):
            st, du, nm = ev[i]
            if st > cursor:
                gaps.append((st - cursor, short(ev[i - 1][2]), short(nm)))
            busy += max(0, st + du - max(st, cursor))
            cursor = max(cursor, st + du)
            per_name[short(nm)] += du
            count[short(nm)] += 1
        walls.append(t_end - t0)
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
