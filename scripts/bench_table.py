#!/usr/bin/env python3
"""The "Current figures" table of BENCHMARKS.md, generated from bench/results.jsonl.

Every benchmark program appends one JSON line per figure to bench/results.jsonl:
{"bench", "value", "unit", "device", "commit", "date", "note"[, "command"]}. This script
keeps, for each bench name, its newest record (by "date"; of equal dates the later line)
and writes one table row per name: figure, value and unit, date, device, commit, and the
command (or, for records without one, the note), shortened. A name whose newest record
says "retired": true (with a note saying what replaces it) has no row: the figure is kept
in the results' history but is no longer current. Rows are grouped by area in a
fixed order (train, gla, decode, prefill, serve, dist, other) and sorted by name within an
area, so the same results give the same bytes.

  scripts/bench_table.py            rewrite the block between the markers in BENCHMARKS.md
  scripts/bench_table.py --print    print the block instead
  scripts/bench_table.py --check    exit 1 if BENCHMARKS.md's block is not what this prints

Exit status: 0 done / current, 1 stale (--check), 2 bad input (no markers, unreadable or
malformed results).
"""
import argparse
import json
import os
import re
import sys
import tempfile

BEGIN = "<!-- current-figures:begin -->"
END = "<!-- current-figures:end -->"
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEFAULT_RESULTS = os.path.join(ROOT, "bench", "results.jsonl")
DEFAULT_DOC = os.path.join(ROOT, "BENCHMARKS.md")
DEFAULT_CONFIGS = os.path.join(ROOT, "configs")
MAX_TEXT = 100  # characters of command / note kept in a row

# Areas in table order, with the label shown in the table's first column.
ORDER = ["train", "gla", "decode", "prefill", "serve", "dist", "other"]
LABEL = {"train": "training", "gla": "GLA mixer", "decode": "decode", "prefill": "prefill",
         "serve": "serving", "dist": "distributed", "other": "other"}


class BadInput(Exception):
    pass


def area_of(name):
    """The area of a bench name: multi-GPU runs (`_gpusN`, `dist…`, `muon_…`) are "dist"
    whatever their prefix; otherwise the prefix train_, gla_, decode_, prefill_, serve_ (fleet_:
    serving too)."""
    if re.search(r"_gpus\d+", name) or name.startswith(("dist", "muon_")):
        return "dist"
    if name.startswith("fleet_"):
        return "serve"
    for a in ("train", "gla", "decode", "prefill", "serve"):
        if name.startswith(a + "_"):
            return a
    return "other"


def load(path):
    """The records of a results file, in file order. Blank lines are skipped; a line that
    is not a JSON object with "bench", "value" and "date" is an error naming the line."""
    recs = []
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except OSError as e:
        raise BadInput(f"{path}: {e.strerror}")
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError as e:
            raise BadInput(f"{path}:{i}: not JSON ({e.msg})")
        if not isinstance(r, dict) or not all(k in r for k in ("bench", "value", "date")):
            raise BadInput(f"{path}:{i}: a record needs \"bench\", \"value\" and \"date\"")
        recs.append(r)
    return recs


def newest(recs):
    """{name: record}: each name's record with the greatest date (ISO 8601 UTC strings
    compare as times); of equal dates, the one later in the file."""
    best = {}
    for r in recs:
        n = str(r["bench"])
        if n not in best or str(r["date"]) >= str(best[n]["date"]):
            best[n] = r
    return best


def fmt_value(v):
    """1,234 for values ≥ 1000, else 4 significant digits (77.28, 0.5532, 0.002582)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.4g}"


def cell(s):
    """Text safe inside one Markdown table cell."""
    return " ".join(str(s).split()).replace("|", "\\|")


def shorten(s, n=MAX_TEXT):
    s = " ".join(str(s).split())
    return s if len(s) <= n else s[: n - 1].rstrip() + "…"


def presets(config_dir=DEFAULT_CONFIGS):
    """{"L24 D3072 H16 dk96 dv192 F8192 V92160": "laplace-3b", ...} from configs/*.json: the
    shape string `laplace bench` writes into its notes, and the preset it belongs to."""
    out = {}
    try:
        names = sorted(os.listdir(config_dir))
    except OSError:
        return out
    for fn in names:
        if not fn.endswith(".json"):
            continue
        try:
            with open(os.path.join(config_dir, fn), encoding="utf-8") as f:
                c = json.load(f)
            key = "L{num_layers} D{hidden_size} H{num_heads} dk{head_k_dim} dv{head_v_dim} F{ffn_size} V{vocab_size}".format(**c)
        except (OSError, ValueError, KeyError, TypeError):
            continue
        out.setdefault(key, fn[: -len(".json")])
    return out


def abbreviate(text, shapes):
    """The text with each preset's shape string replaced by the preset's name."""
    for key, name in shapes.items():
        text = text.replace(key, name)
    return text


def rows(best):
    """[(area, name, record)] in table order; retired names left out."""
    out = [(area_of(n), n, r) for n, r in best.items() if r.get("retired") is not True]
    out.sort(key=lambda t: (ORDER.index(t[0]), t[1]))
    return out


def block(recs, shapes=None):
    """The generated text between the markers (markers excluded), ending in a newline.
    `shapes`: presets() by default."""
    best = newest(recs)
    shapes = presets() if shapes is None else shapes
    lines = [
        "<!-- generated by scripts/bench_table.py from bench/results.jsonl; do not edit by hand -->",
        "",
        "| area | figure | value | date | device | commit | command / note |",
        "|---|---|---|---|---|---|---|",
    ]
    for area, name, r in rows(best):
        unit = str(r.get("unit", "")).strip()
        value = fmt_value(r["value"]) + (" " + unit if unit else "")
        text = r.get("command") or r.get("note") or ""
        lines.append("| " + " | ".join([
            LABEL[area],
            "`" + cell(name) + "`",
            cell(value),
            cell(str(r["date"])[:10]),
            cell(r.get("device", "")),
            "`" + cell(r.get("commit", "")) + "`",
            cell(shorten(abbreviate(str(text), shapes))),
        ]) + " |")
    return "\n".join(lines) + "\n"


def split_doc(text, path):
    """(before, old block, after) around the markers; BadInput unless each appears once, in order."""
    if text.count(BEGIN) != 1 or text.count(END) != 1:
        raise BadInput(f"{path}: needs exactly one {BEGIN} and one {END}")
    head, rest = text.split(BEGIN, 1)
    old, tail = rest.split(END, 1)
    return head + BEGIN + "\n", old.lstrip("\n"), END + tail


def write_atomic(path, text):
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".bench_table.", dir=d)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(path):
            os.chmod(tmp, os.stat(path).st_mode & 0o7777)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", default=DEFAULT_RESULTS, help="results file (default bench/results.jsonl)")
    ap.add_argument("--doc", default=DEFAULT_DOC, help="document to update (default BENCHMARKS.md)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--print", action="store_true", help="print the block, change nothing")
    mode.add_argument("--check", action="store_true", help="exit 1 if the document's block is stale")
    a = ap.parse_args(argv)
    try:
        new = block(load(a.results))
        if a.print:
            sys.stdout.write(new)
            return 0
        try:
            with open(a.doc, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise BadInput(f"{a.doc}: {e.strerror}")
        head, old, tail = split_doc(text, a.doc)
        if a.check:
            if old == new:
                return 0
            print(f"{a.doc}: the current-figures table is stale; run scripts/bench_table.py", file=sys.stderr)
            return 1
        if old != new:
            write_atomic(a.doc, head + new + tail)
        return 0
    except BadInput as e:
        print(f"bench_table: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
