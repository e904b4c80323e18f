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
"""
import argparse
import hashlib
import json
import lzma
import os
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
    a = p.parse_args(argv)

    if not os.path.isfile(a.tarball):
        fail("%s not found: install Debian's package with `apt-get install linux-source-6.1` "
             "(scripts/corpus.sh does), or pass --tarball" % a.tarball)
    os.makedirs(a.out, exist_ok=True)

    docs = []          # (sort key, path, text bytes)
    skipped = []       # (path, reason)
    seen = {}          # sha256 -> first path
    stats = {"members_read": 0, "kept": {"c": 0, "rst": 0}, "kept_bytes": {"c": 0, "rst": 0}, "skipped": {}}
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
            # Paths are stored without the tarball's top folder so they read as in a kernel tree.
            path = m.name.split("/", 1)[1] if "/" in m.name else m.name
            if m.size > a.max_file_bytes:
                skipped.append((path, "too-large"))
                continue
            f = tf.extractfile(m)
            data = f.read() if f is not None else b""
            reason = classify(data, a.max_file_bytes)
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
    except (tarfile.TarError, OSError, lzma.LZMAError, EOFError) as e:
        fail("%s is damaged or truncated after %d members: %s" % (a.tarball, stats["members_read"], e))
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
