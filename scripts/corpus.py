#!/usr/bin/env python3
"""Builds the Linux-source corpus (docs/quality.md) from Debian's linux-source tarball.

Reads the .tar.xz as a stream (nothing is unpacked to disk) and keeps, as one document each:
  * C sources and headers (*.c, *.h), and
  * the English prose of the kernel's documentation (Documentation/**/*.rst).
A file is skipped, with its reason recorded in skipped.tsv, when it is
  * empty or only whitespace                      (empty),
  * binary: holds a NUL byte                       (binary),
  * not valid UTF-8                                (invalid-utf8),
  * larger than --max-file-bytes (generated register tables, firmware arrays)  (too-large),
  * an exact byte-for-byte copy of a file already kept                          (duplicate).
Kept documents are written in a deterministic shuffled order (sorted by SHA-256 of their path), so any
prefix of the output is a uniform sample of the corpus and a sequential reader sees a stationary mix.

Outputs in --out:
  docs.jsonl         every kept document: {"text": ..., "path": ...}, shuffled order
  docs.sample.jsonl  the first --sample-bytes of docs.jsonl (tokenizer training, quick experiments)
  manifest.tsv       path, bytes, sha256 of every kept document, in output order
  skipped.tsv        path, reason of every skipped file
  stats.json         counts and bytes by kind and reason
With --carry-bytes N, also docs.carry.jsonl.xz: the longest prefix of docs.jsonl whose xz stream stays under
N bytes (what one device call can take; see docs/quality.md).

With --long-docs, the same files (the same skip rules, file by file; duplicates settled in path order) make
long documents instead, for long-context evaluation:
  * one per source directory: its own .h files, then its own .c files (not its subdirectories'), each in path
    order and opened by a line "// file: PATH", so later files use the types, macros and functions defined
    earlier;
  * one per Documentation directory (a "book"): its .rst files in path order, each opened by ".. file: PATH".
A hash of the directory path alone holds out --val-fraction of the directories (both documents of a directory
go together, so no file is in both splits). Outputs in --out:
  docs.jsonl         every document: {"text", "path" (the directory), "kind" (c or rst), "files", "split"}
  train.jsonl        the train documents, val.jsonl the val ones (JSONL with "text": `laplace data prepare`)
  val_long.jsonl     the val documents of at least --long-tokens tokens (default 32,768): the long test set
  manifest.tsv       directory, kind, split, files, bytes, tokens, sha256 of every document, in output order
  files.tsv          every kept file, its directory (document) and split
  skipped.tsv        path, reason of every skipped file
  stats.json         counts, and the length report: documents, quantiles (50/90/99/max) of bytes and tokens,
                     and how many reach 8k, 32k and 131k tokens, for all, train, val and val_long
  lengths.md         the length report as a table
Tokens are counted with --tokenizer (python3-sentencepiece, as `laplace data prepare` encodes) or, without
one, estimated as bytes / --bytes-per-token (stated in the report).
"""
import argparse
import hashlib
import json
import lzma
import math
import os
import posixpath
import sys
import subprocess
import tarfile


def fail(msg):
    sys.stderr.write("corpus: " + msg + "\n")
    sys.exit(2)


def kind_of(name):
    """'c' for C sources and headers, 'rst' for documentation prose, None for everything else."""
    parts = name.split("/")
    if name.endswith((".c", ".h")):
        return "c"
    if name.endswith(".rst") and "Documentation" in parts[:-1]:
        return "rst"
    return None


def classify(data, max_bytes):
    if len(data) > max_bytes:
        return "too-large"
    if not data.strip():
        return "empty"
    if b"\x00" in data:
        return "binary"
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return "invalid-utf8"
    return None


def write_atomic(path, write):
    """Writes through a temporary name unique to this process, then renames over `path`."""
    tmp = "%s.tmp.%d" % (path, os.getpid())
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def xz_size(data, preset):
    return len(lzma.compress(data, preset=preset))


def write_carry(out_dir, lines, cap, preset=6):
    """docs.carry.jsonl.xz: the longest prefix of the documents (so they keep their indices, and the
    data-prepare split) whose xz stream fits in `cap` bytes. The prefix length is estimated from the
    ratio of a 16 MB sample, then shortened by 2 %% steps until the stream fits."""
    sample = b"".join(lines[:max(1, len(lines) // 8)])[:16 << 20]
    ratio = len(sample) / max(1, xz_size(sample, preset))
    budget = cap * ratio
    n, raw = 0, 0
    while n < len(lines) and raw + len(lines[n]) <= budget:
        raw += len(lines[n])
        n += 1
    path = os.path.join(out_dir, "docs.carry.jsonl.xz")
    while True:
        tmp = "%s.tmp.%d" % (path, os.getpid())
        # xz(1) compresses on every core; Python's lzma would take one.
        with open(tmp, "wb") as f:
            proc = subprocess.Popen(["xz", "-%d" % preset, "-T0", "-c"], stdin=subprocess.PIPE, stdout=f)
            for ln in lines[:n]:
                proc.stdin.write(ln)
            proc.stdin.close()
            if proc.wait() != 0:
                os.unlink(tmp)
                fail("xz failed while writing the carry slice")
        size = os.path.getsize(tmp)
        if size <= cap or n <= 1:
            os.replace(tmp, path)
            return {"documents": n, "bytes": sum(len(x) for x in lines[:n]), "xz_bytes": size}
        os.unlink(tmp)
        n = int(n * 0.98)


def read_members(a, stats):
    """Yields (path, kind, data, reason) for every C, header and Documentation .rst member of the tarball, in
    tar order: reason is None for a file to keep, else why it is skipped (data is then not needed). Paths lose
    the tarball's top folder so they read as in a kernel tree. Exits with a clear message on a bad tarball."""
    try:
        tf = tarfile.open(a.tarball, mode="r|*")
    except (tarfile.TarError, OSError, lzma.LZMAError, EOFError) as e:
        fail("cannot read %s as a tar archive: %s" % (a.tarball, e))
    try:
        for m in tf:
            if a.limit_files and stats["members_read"] >= a.limit_files:
                break
            stats["members_read"] += 1
            if not m.isfile():
                continue
            kind = kind_of(m.name)
            if kind is None:
                continue
            path = m.name.split("/", 1)[1] if "/" in m.name else m.name
            if m.size > a.max_file_bytes:
                yield path, kind, None, "too-large"
                continue
            f = tf.extractfile(m)
            data = f.read() if f is not None else b""
            yield path, kind, data, classify(data, a.max_file_bytes)
    except (tarfile.TarError, OSError, lzma.LZMAError, EOFError) as e:
        fail("%s is damaged or truncated after %d members: %s" % (a.tarball, stats["members_read"], e))


# ---- --long-docs: one document per source directory and per Documentation book ------------------------

LONG_THRESHOLDS = (8192, 32768, 131072)


def header_line(path, kind):
    """The line that opens each file inside a long document: a comment in the file's own syntax."""
    return ("// file: %s\n" if kind == "c" else ".. file: %s\n") % path


def long_documents(files):
    """files: (path, kind, text) of the kept files. Returns (dir, kind, [paths], text) per document: for each
    directory, its own .h files then its own .c files (kind "c"), and separately its .rst files (kind "rst"),
    each in path order and each opened by its header line, so later files follow what earlier ones define."""
    groups = {}
    for path, kind, text in files:
        d = posixpath.dirname(path) or "."
        groups.setdefault((d, kind), []).append((path, text))
    out = []
    for (d, kind), members in groups.items():
        if kind == "c":
            members.sort(key=lambda m: (not m[0].endswith(".h"), m[0]))
        else:
            members.sort()
        parts = [header_line(p, kind) + t + ("" if t.endswith("\n") else "\n") for p, t in members]
        out.append((d, kind, [p for p, _ in members], "\n".join(parts)))
    return out


def split_of(directory, val_fraction):
    """'val' for about val_fraction of the directories, by a hash of the path alone (no other input)."""
    h = hashlib.sha256(b"laplace-corpus-long\0" + directory.encode("utf-8", "surrogateescape")).digest()
    return "val" if int.from_bytes(h[:8], "big") / 2.0**64 < val_fraction else "train"


def quantile(sorted_values, q):
    """Nearest rank: the smallest value with at least q of the values at or below it."""
    if not sorted_values:
        return 0
    k = max(0, min(len(sorted_values) - 1, math.ceil(q * len(sorted_values)) - 1))
    return sorted_values[k]


def distribution(values):
    v = sorted(values)
    return {"p50": quantile(v, 0.5), "p90": quantile(v, 0.9), "p99": quantile(v, 0.99),
            "max": v[-1] if v else 0, "total": sum(v)}


def length_report(byte_lengths, token_lengths):
    """Count, quantiles of bytes and tokens, and how many documents reach each long-context threshold."""
    return {"documents": len(byte_lengths), "bytes": distribution(byte_lengths),
            "tokens": distribution(token_lengths),
            "at_least_tokens": {str(t): sum(1 for n in token_lengths if n >= t) for t in LONG_THRESHOLDS}}


class TokenCounter:
    """Token counts as `laplace data prepare` gets them (Tokenizer::encode: SentencePiece on the text between
    literal U+2581 marks, each mark 3 byte pieces), without the separator that precedes each document."""

    def __init__(self, model):
        try:
            import sentencepiece
        except ImportError:
            fail("--tokenizer needs SentencePiece's Python module: apt-get install python3-sentencepiece")
        self.sp = sentencepiece.SentencePieceProcessor()
        try:
            ok = self.sp.Load(model)
        except (OSError, RuntimeError) as e:
            fail("cannot load the tokenizer %s: %s" % (model, e))
        if not ok:
            fail("cannot load the tokenizer %s" % model)

    def count(self, texts, threads=0):
        pieces, owner = [], []
        for i, t in enumerate(texts):
            for j, part in enumerate(t.split("\u2581")):
                if part:
                    pieces.append(part)
                    owner.append(i)
        counts = [3 * t.count("\u2581") for t in texts]
        ids = self.sp.encode(pieces, out_type=int, num_threads=threads or os.cpu_count() or 1)
        for i, x in zip(owner, ids):
            counts[i] += len(x)
        return counts


def length_table(report, unit):
    rows = ["| split | documents | bytes p50 / p90 / p99 / max | %s p50 / p90 / p99 / max | ≥ 8k | ≥ 32k | ≥ 131k |"
            % unit, "|---|---|---|---|---|---|---|"]
    for name in ("all", "train", "val", "val_long"):
        r = report[name]
        b, t, n = r["bytes"], r["tokens"], r["at_least_tokens"]
        rows.append("| %s | %s | %s | %s | %s | %s | %s |" % (
            name.replace("_", " "), "{:,}".format(r["documents"]),
            " / ".join("{:,}".format(b[q]) for q in ("p50", "p90", "p99", "max")),
            " / ".join("{:,}".format(t[q]) for q in ("p50", "p90", "p99", "max")),
            "{:,}".format(n["8192"]), "{:,}".format(n["32768"]), "{:,}".format(n["131072"])))
    return "\n".join(rows) + "\n"


def main_long(a):
    if a.carry_bytes:
        fail("--carry-bytes is for the file-per-document corpus, not --long-docs")
    if not 0 <= a.val_fraction < 1:
        fail("--val-fraction must be in [0, 1)")
    counter = TokenCounter(a.tokenizer) if a.tokenizer else None
    files, skipped = [], []
    stats = {"mode": "long-docs", "members_read": 0, "files_kept": {"c": 0, "rst": 0}, "skipped": {}}
    for path, kind, data, reason in read_members(a, stats):
        if reason is None:
            files.append((path, kind, data))
        else:
            skipped.append((path, reason))
    # Duplicates are settled in path order, so the result does not depend on the tarball's member order.
    files.sort(key=lambda f: f[0])
    seen, kept = set(), []
    for path, kind, data in files:
        h = hashlib.sha256(data).digest()
        if h in seen:
            skipped.append((path, "duplicate"))
            continue
        seen.add(h)
        kept.append((path, kind, data.decode("utf-8")))
        stats["files_kept"][kind] += 1
    files = None
    if not kept:
        fail("no C, header or Documentation/*.rst files found in %s" % a.tarball)
    skipped.sort()
    for _, r in skipped:
        stats["skipped"][r] = stats["skipped"].get(r, 0) + 1

    docs = long_documents(kept)
    kept = None
    # A fixed shuffle, as in the file-per-document corpus: any prefix is a uniform sample.
    docs.sort(key=lambda d: hashlib.sha256(("%s\0%s" % (d[0], d[1])).encode("utf-8", "surrogateescape")).digest())
    texts = [d[3] for d in docs]
    nbytes, digests = [], []
    for t in texts:
        raw = t.encode("utf-8")
        nbytes.append(len(raw))
        digests.append(hashlib.sha256(raw).hexdigest())
    if counter is not None:
        ntokens = counter.count(texts)
        tokens_source = "tokenizer %s (without the separator before each document)" % a.tokenizer
    else:
        ntokens = [int(n / a.bytes_per_token) for n in nbytes]
        tokens_source = "estimate: bytes / %g (no --tokenizer)" % a.bytes_per_token
    splits = [split_of(d[0], a.val_fraction) for d in docs]
    is_long = [s == "val" and n >= a.long_tokens for s, n in zip(splits, ntokens)]

    lines = [json.dumps({"text": d[3], "path": d[0], "kind": d[1], "files": len(d[2]), "split": s},
                        ensure_ascii=False).encode("utf-8") + b"\n" for d, s in zip(docs, splits)]
    texts = None
    write_atomic(os.path.join(a.out, "docs.jsonl"), lambda f: f.writelines(lines))
    for name, keep in (("train", lambda i: splits[i] == "train"), ("val", lambda i: splits[i] == "val"),
                       ("val_long", lambda i: is_long[i])):
        write_atomic(os.path.join(a.out, name + ".jsonl"),
                     lambda f, keep=keep: f.writelines(ln for i, ln in enumerate(lines) if keep(i)))
    write_atomic(os.path.join(a.out, "manifest.tsv"), lambda f: f.writelines(
        ("%s\t%s\t%s\t%d\t%d\t%d\t%s\n" % (d[0], d[1], s, len(d[2]), b, t, h))
        .encode("utf-8", "surrogateescape") for d, s, b, t, h in zip(docs, splits, nbytes, ntokens, digests)))
    write_atomic(os.path.join(a.out, "files.tsv"), lambda f: f.writelines(
        ("%s\t%s\t%s\n" % (p, d[0], s)).encode("utf-8", "surrogateescape")
        for d, s in zip(docs, splits) for p in d[2]))
    write_atomic(os.path.join(a.out, "skipped.tsv"),
                 lambda f: f.writelines(("%s\t%s\n" % s).encode("utf-8", "surrogateescape") for s in skipped))

    def report(select):
        idx = [i for i in range(len(docs)) if select(i)]
        return length_report([nbytes[i] for i in idx], [ntokens[i] for i in idx])
    lengths = {"tokens_source": tokens_source, "long_tokens": a.long_tokens,
               "all": report(lambda i: True), "train": report(lambda i: splits[i] == "train"),
               "val": report(lambda i: splits[i] == "val"), "val_long": report(lambda i: is_long[i])}
    stats["documents"] = len(docs)
    stats["documents_by_kind"] = {k: sum(1 for d in docs if d[1] == k) for k in ("c", "rst")}
    stats["bytes"] = sum(nbytes)
    stats["val_fraction"] = a.val_fraction
    stats["lengths"] = lengths
    write_atomic(os.path.join(a.out, "stats.json"), lambda f: f.write(json.dumps(stats, indent=1).encode() + b"\n"))
    table = length_table(lengths, "tokens" if counter is not None else "tokens (estimated)")
    write_atomic(os.path.join(a.out, "lengths.md"), lambda f: f.write(
        ("Document lengths (%s; quantiles by nearest rank; val long = val documents of at least %d tokens)\n\n"
         % (tokens_source, a.long_tokens) + table).encode()))
    sys.stdout.write("corpus: %d long documents (%d source directories, %d Documentation books) from %d files, "
                     "%.1f MB; val %d directories, %d of them at least %d tokens; skipped %s\n" % (
                         len(docs), stats["documents_by_kind"]["c"], stats["documents_by_kind"]["rst"],
                         sum(stats["files_kept"].values()), stats["bytes"] / 1e6, lengths["val"]["documents"],
                         lengths["val_long"]["documents"], a.long_tokens,
                         ", ".join("%s %d" % kv for kv in sorted(stats["skipped"].items())) or "none"))
    sys.stdout.write("lengths, %s:\n%s" % (tokens_source, table))
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tarball", default="/usr/src/linux-source-6.1.tar.xz",
                   help="Debian's linux-source tarball (package linux-source-6.1)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--max-file-bytes", type=int, default=512 * 1024,
                   help="skip larger files (generated tables); default 512 KiB")
    p.add_argument("--sample-bytes", type=int, default=48 << 20, help="size of docs.sample.jsonl")
    p.add_argument("--carry-bytes", type=int, default=0,
                   help="also write docs.carry.jsonl.xz, at most this many bytes (0 = none)")
    p.add_argument("--limit-files", type=int, default=0, help="read at most this many members (tests)")
    g = p.add_argument_group("long documents (--long-docs)")
    g.add_argument("--long-docs", action="store_true",
                   help="one document per source directory (its .h then .c files) and per Documentation book")
    g.add_argument("--val-fraction", type=float, default=0.02,
                   help="fraction of directories held out for validation, by a hash of the path (default 0.02)")
    g.add_argument("--tokenizer", default="", help="a SentencePiece .model: count tokens with it")
    g.add_argument("--bytes-per-token", type=float, default=2.5,
                   help="without --tokenizer, tokens are estimated as bytes / this (default 2.5, the corpus "
                        "tokenizer's average)")
    g.add_argument("--long-tokens", type=int, default=32768,
                   help="val documents of at least this many tokens go to val_long.jsonl (default 32768)")
    a = p.parse_args(argv)

    if not os.path.isfile(a.tarball):
        fail("%s not found: install Debian's package with `apt-get install linux-source-6.1` "
             "(scripts/corpus.sh does), or pass --tarball" % a.tarball)
    os.makedirs(a.out, exist_ok=True)
    if a.long_docs:
        return main_long(a)

    docs = []          # (sort key, path, text bytes)
    skipped = []       # (path, reason)
    seen = {}          # sha256 -> first path
    stats = {"members_read": 0, "kept": {"c": 0, "rst": 0}, "kept_bytes": {"c": 0, "rst": 0}, "skipped": {}}
    for path, kind, data, reason in read_members(a, stats):
        if reason is None:
            h = hashlib.sha256(data).hexdigest()
            if h in seen:
                reason = "duplicate"
            else:
                seen[h] = path
                key = hashlib.sha256(path.encode("utf-8", "surrogateescape")).hexdigest()
                docs.append((key, path, data, h, kind))
                stats["kept"][kind] += 1
                stats["kept_bytes"][kind] += len(data)
        if reason is not None:
            skipped.append((path, reason))
    if not docs:
        fail("no C, header or Documentation/*.rst files found in %s" % a.tarball)
    for _, r in skipped:
        stats["skipped"][r] = stats["skipped"].get(r, 0) + 1
    docs.sort()

    lines = [json.dumps({"text": d[2].decode("utf-8"), "path": d[1]}, ensure_ascii=False).encode("utf-8") + b"\n"
             for d in docs]
    write_atomic(os.path.join(a.out, "docs.jsonl"), lambda f: f.writelines(lines))

    def write_sample(f):
        n = 0
        for ln in lines:
            if n and n + len(ln) > a.sample_bytes:
                break
            f.write(ln)
            n += len(ln)
    write_atomic(os.path.join(a.out, "docs.sample.jsonl"), write_sample)
    write_atomic(os.path.join(a.out, "manifest.tsv"),
                 lambda f: f.writelines(("%s\t%d\t%s\n" % (d[1], len(d[2]), d[3])).encode() for d in docs))
    write_atomic(os.path.join(a.out, "skipped.tsv"),
                 lambda f: f.writelines(("%s\t%s\n" % s).encode("utf-8", "surrogateescape") for s in skipped))
    stats["documents"] = len(docs)
    stats["bytes"] = sum(len(d[2]) for d in docs)

    if a.carry_bytes > 0:
        stats["carry"] = write_carry(a.out, lines, a.carry_bytes)

    write_atomic(os.path.join(a.out, "stats.json"), lambda f: f.write(json.dumps(stats, indent=1).encode() + b"\n"))
    sys.stdout.write("corpus: %d documents (%d C/headers, %d rst), %.1f MB; skipped %s\n" % (
        len(docs), stats["kept"]["c"], stats["kept"]["rst"], stats["bytes"] / 1e6,
        ", ".join("%s %d" % kv for kv in sorted(stats["skipped"].items())) or "none"))
    if "carry" in stats:
        sys.stdout.write("corpus: carry slice %d documents, %.1f MB of text in %.1f MB of xz\n" % (
            stats["carry"]["documents"], stats["carry"]["bytes"] / 1e6, stats["carry"]["xz_bytes"] / 1e6))
    return 0


if __name__ == "__main__":
    sys.exit(main())
