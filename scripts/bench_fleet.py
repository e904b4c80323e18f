#!/usr/bin/env python3
"""A fleet's throughput and latency through HAProxy against its replicas reached directly.

Starts N CPU replicas behind HAProxy (scripts/serve_fleet.sh), then, alternating the
arrangements R times (the median of each counts):

  alone     one replica under S streams, the others idle          -> T1, its TTFT p99
  direct    each replica under S streams of its own, all at once  -> TD (summed), TTFT p99
  balancer  N clients of S streams each through the front door    -> TB (summed), TTFT p99
            (the same N load generators as `direct`, so the two differ only by the balancer)

and /health over fresh connections, directly and through the front door (idle fleet).
Records (bench/results.jsonl):

  fleet_scaling_pct_cpu_nN    TB / (N x T1): the fleet against N replicas each alone
  fleet_vs_direct_pct_cpu_nN  TB / TD: the balancer's own cost at the same load
  fleet_added_ttft_p99_ms     TTFT p99 through the balancer minus directly (same load)
  fleet_added_health_p99_ms   /health p99 through the balancer minus directly

Each replica computes on one thread (OMP_NUM_THREADS=1): N replicas need N cores besides the
load generator's for TB to reach N x T1, so on a machine with fewer the scaling figure says
how many cores there were, and fleet_vs_direct says what the balancer costs.

Usage: /usr/bin/python3 scripts/bench_fleet.py [--replicas 3] [--streams 16] [--max-tokens 256]
       [--rounds 3] [--model DIR] [--device-name NAME] [--results bench/results.jsonl]
"""
import argparse
import datetime
import http.client
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(cmd, **kw):
    return subprocess.run(cmd, check=True, text=True, capture_output=True, **kw)


def make_model(laplace, work):
    """laplace-tiny's shapes, random weights, a 400-piece tokenizer (bench http sends ids)."""
    corpus = os.path.join(work, "corpus.txt")
    with open(corpus, "w") as f:
        for i in range(300):
            f.write(f"the quick brown fox {i} jumps over the lazy dog; a fortune a day keeps the doctor away.\n")
    run([laplace, "tokenizer", "train", "--input", corpus, "--model-prefix", os.path.join(work, "tok"),
         "--vocab-size", "400"])
    model = os.path.join(work, "model")
    run([laplace, "init", "--config", os.path.join(ROOT, "configs", "laplace-tiny.json"), "--out", model,
         "--seed", "5"])
    os.replace(os.path.join(work, "tok.model"), os.path.join(model, "tokenizer.model"))
    return model


def bench_http(laplace, url, streams, max_tokens, seed):
    """One `laplace bench http` run: (decode tok/s, TTFT p99 ms)."""
    m = re.match(r"http://([^:/]+):(\d+)", url)
    out = run([laplace, "bench", "http", "--host", m.group(1), "--port", m.group(2), "--streams", str(streams),
               "--prompt-len", "16", "--max-tokens", str(max_tokens), "--seed", str(seed), "--results", ""]).stdout
    r = re.search(r"decode ([0-9.]+) tok/s .*TTFT p50 [0-9.]+ ms, p99 ([0-9.]+) ms", out)
    if not r:
        raise RuntimeError("unexpected bench http output:\n" + out)
    return float(r.group(1)), float(r.group(2))


def bench_http_parallel(laplace, urls, streams, max_tokens, seed):
    """One bench http per URL, all at once: [(tok/s, TTFT p99 ms)]."""
    procs = []
    for k, url in enumerate(urls):
        m = re.match(r"http://([^:/]+):(\d+)", url)
        procs.append(subprocess.Popen(
            [laplace, "bench", "http", "--host", m.group(1), "--port", m.group(2), "--streams", str(streams),
             "--prompt-len", "16", "--max-tokens", str(max_tokens), "--seed", str(seed + k), "--results", ""],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    res = []
    for p in procs:
        out, err = p.communicate()
        r = re.search(r"decode ([0-9.]+) tok/s .*TTFT p50 [0-9.]+ ms, p99 ([0-9.]+) ms", out)
        if p.returncode != 0 or not r:
            raise RuntimeError("bench http failed:\n" + out + err)
        res.append((float(r.group(1)), float(r.group(2))))
    return res


def health_p99_ms(urls, count):
    """/health over a fresh connection each time, the URLs taken in turn (so drift in the
    machine's load falls on each alike): the p99 in ms of each."""
    lat = [[] for _ in urls]
    for i in range(count * len(urls)):
        k = i % len(urls)
        m = re.match(r"http://([^:/]+):(\d+)", urls[k])
        t0 = time.perf_counter()
        c = http.client.HTTPConnection(m.group(1), int(m.group(2)), timeout=10)
        c.request("GET", "/health")
        r = c.getresponse()
        r.read()
        c.close()
        if r.status != 200:
            raise RuntimeError(f"/health at {urls[k]}: {r.status}")
        lat[k].append(1e3 * (time.perf_counter() - t0))
    return [sorted(x)[min(len(x) - 1, int(0.99 * len(x)))] for x in lat]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--streams", type=int, default=16, help="streams per replica")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--health-count", type=int, default=500)
    ap.add_argument("--model", default="", help="model directory (default: laplace-tiny, random weights)")
    ap.add_argument("--laplace", default=os.environ.get("LAPLACE", os.path.join(ROOT, "build", "laplace")))
    ap.add_argument("--device-name", default="")
    ap.add_argument("--results", default=os.path.join(ROOT, "bench", "results.jsonl"))
    a = ap.parse_args(argv)
    n, s = a.replicas, a.streams
    work = tempfile.mkdtemp(prefix="bench-fleet-")
    model = a.model or make_model(a.laplace, work)
    run_dir = os.path.join(work, "fleet")
    env = dict(os.environ, LAPLACE=a.laplace, OMP_NUM_THREADS="1")
    fleet = os.path.join(ROOT, "scripts", "serve_fleet.sh")
    run(["bash", fleet, "start", str(n), "--model", model, "--port", "0", "--dir", run_dir, "--",
         "--max-slots", str(2 * s), "--max-queue", str(8 * s), "--threads", "2"], env=env)
    try:
        conf = {}
        with open(os.path.join(run_dir, "fleet.env")) as f:
            for line in f:
                k, _, v = line.strip().partition("=")
                conf[k] = shlex.split(v)[0] if v else ""
        front = conf["FRONT_URL"]
        replicas = [conf[f"URL_r{k}"] for k in range(n)]
        alone, direct, through = [], [], []
        for rnd in range(a.rounds):
            alone.append(bench_http(a.laplace, replicas[rnd % n], s, a.max_tokens, 100 + rnd))
            d = bench_http_parallel(a.laplace, replicas, s, a.max_tokens, 200 + 10 * rnd)
            direct.append((sum(x[0] for x in d), statistics.mean(x[1] for x in d)))
            t = bench_http_parallel(a.laplace, [front] * n, s, a.max_tokens, 300 + 10 * rnd)
            through.append((sum(x[0] for x in t), statistics.mean(x[1] for x in t)))
            print(f"round {rnd}: alone {alone[-1][0]:.0f} tok/s, direct {direct[-1][0]:.0f}, "
                  f"balancer {through[-1][0]:.0f}; TTFT p99 direct {direct[-1][1]:.1f} ms, "
                  f"balancer {through[-1][1]:.1f} ms", flush=True)
        h_direct, h_front = health_p99_ms([replicas[0], front], a.health_count)
    finally:
        subprocess.run(["bash", fleet, "stop", "--dir", run_dir], env=env, capture_output=True)
    med = lambda xs, i: statistics.median(x[i] for x in xs)
    t1, td, tb = med(alone, 0), med(direct, 0), med(through, 0)
    figures = {
        f"fleet_scaling_pct_cpu_n{n}": (100 * tb / (n * t1), "%"),
        f"fleet_vs_direct_pct_cpu_n{n}": (100 * tb / td, "%"),
        "fleet_added_ttft_p99_ms": (med(through, 1) - med(direct, 1), "ms"),
        "fleet_added_health_p99_ms": (h_front - h_direct, "ms"),
    }
    cores = os.cpu_count()
    note = (f"{n} CPU replicas (laplace-tiny shapes{'' if a.model else ', random weights'}, OMP_NUM_THREADS=1 each) "
            f"behind HAProxy on loopback, {cores} cores in all; {s} streams per replica, 16-id prompts, "
            f"{a.max_tokens} tokens each (laplace bench http; directly and through the balancer alike {n} clients of {s} streams); median of {a.rounds} rounds: one replica alone "
            f"{t1:.0f} tok/s, all {n} reached directly at once {td:.0f}, through the balancer {tb:.0f}; TTFT p99 "
            f"directly {med(direct, 1):.1f} ms (mean over replicas), through it {med(through, 1):.1f} ms; /health p99 "
            f"over {a.health_count} fresh connections each, taken in turn, idle: directly {h_direct:.2f} ms, through it {h_front:.2f} ms")
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short=7", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "unknown"
    device = a.device_name or f"CPU x{cores}"
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    command = "scripts/bench_fleet.py " + " ".join(shlex.quote(x) for x in (argv if argv is not None else sys.argv[1:]))
    for name, (value, unit) in figures.items():
        print(f"{name} = {value:.2f} {unit}")
        if a.results:
            with open(a.results, "a") as f:
                f.write(json.dumps({"bench": name, "value": value, "unit": unit, "device": device, "commit": commit,
                                    "date": date, "note": note, "command": command.strip()}) + "\n")
    print(note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
