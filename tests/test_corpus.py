"""scripts/corpus.py on small tarballs made here: what is kept, what is skipped and why, the split-stable
shuffled order, the carry slice, and clear errors (never a traceback) for a missing or damaged tarball; and
--long-docs: a document per directory (.h before .c, a path line before each file), Documentation books, the
split by directory, determinism and the length report.
Run by ctest: /usr/bin/python3 -m unittest -v tests/test_corpus.py
"""
import io
import json
import lzma
import os
import subprocess
import sys
import tarfile
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "..", "scripts", "corpus.py")

GOOD_C = b"#include <linux/module.h>\n\nstatic int __init hello_init(void)\n{\n\treturn 0;\n}\n"
GOOD_H = b"/* SPDX-License-Identifier: GPL-2.0 */\n#define HELLO 1\n"
GOOD_RST = "Héllo\n=====\n\nThe kernel's *documentation*, in UTF-8: naïve, 日本語.\n".encode()


def make_tarball(path, members):
    with tarfile.open(path, "w:xz") as tf:
        for name, data in members:
            info = tarfile.TarInfo("linux-source-6.1/" + name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))


def run(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True)


class Corpus(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = self.tmp.name

    def tearDown(self):
        self.tmp.cleanup()

    def test_keeps_sources_and_docs_and_skips_bad_files_with_reasons(self):
        tb = os.path.join(self.dir, "linux.tar.xz")
        members = [
            ("kernel/hello.c", GOOD_C),
            ("include/linux/hello.h", GOOD_H),
            ("Documentation/admin-guide/hello.rst", GOOD_RST),
            ("drivers/copy_of_hello.c", GOOD_C),                # exact duplicate
            ("drivers/empty.c", b""),                           # empty
            ("drivers/blank.h", b"  \n\t\n"),                    # whitespace only
            ("firmware/blob.c", b"int x;\x00\x01\x02"),         # binary
            ("drivers/latin1.c", "/* caf\xe9 */\n".encode("latin-1")),  # not UTF-8
            ("drivers/huge_regs.h", b"#define R 0\n" * 200),    # over --max-file-bytes
            ("tools/README.rst", b"not under Documentation/\n"),  # not a corpus file
            ("Makefile", b"obj-y += hello.o\n"),                 # not a corpus file
        ]
        make_tarball(tb, members)
        out = os.path.join(self.dir, "out")
        r = run("--tarball", tb, "--out", out, "--max-file-bytes", "1000", "--carry-bytes", "4096")
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(os.path.join(out, "docs.jsonl"), encoding="utf-8") as f:
            docs = [json.loads(l) for l in f]
        kept = {d["path"]: d["text"].encode() for d in docs}
        self.assertEqual(set(kept), {"kernel/hello.c", "include/linux/hello.h", "Documentation/admin-guide/hello.rst"})
        self.assertEqual(kept["kernel/hello.c"], GOOD_C)            # whole files, byte for byte
        self.assertEqual(kept["Documentation/admin-guide/hello.rst"], GOOD_RST)
        with open(os.path.join(out, "skipped.tsv")) as f:
            skipped = dict(l.rstrip("\n").split("\t") for l in f)
        self.assertEqual(skipped, {"drivers/copy_of_hello.c": "duplicate", "drivers/empty.c": "empty",
                                   "drivers/blank.h": "empty", "firmware/blob.c": "binary",
                                   "drivers/latin1.c": "invalid-utf8", "drivers/huge_regs.h": "too-large"})
        # The order is fixed by the paths alone: the same files in another tar order give the same bytes.
        tb2 = os.path.join(self.dir, "linux2.tar.xz")
        make_tarball(tb2, list(reversed(members[:3])))
        out2 = os.path.join(self.dir, "out2")
        self.assertEqual(run("--tarball", tb2, "--out", out2).returncode, 0)
        with open(os.path.join(out, "docs.jsonl"), "rb") as a, open(os.path.join(out2, "docs.jsonl"), "rb") as b:
            self.assertEqual(a.read(), b.read())
        # The carry slice is a prefix of docs.jsonl within its cap.
        carry = os.path.join(out, "docs.carry.jsonl.xz")
        self.assertLessEqual(os.path.getsize(carry), 4096)
        with open(carry, "rb") as f, open(os.path.join(out, "docs.jsonl"), "rb") as g:
            sl, full = lzma.decompress(f.read()), g.read()
        self.assertTrue(len(sl) > 0 and full.startswith(sl))
        with open(os.path.join(out, "stats.json")) as f:
            st = json.load(f)
        self.assertEqual(st["documents"], 3)
        self.assertEqual(st["skipped"], {"duplicate": 1, "empty": 2, "binary": 1, "invalid-utf8": 1, "too-large": 1})

    def test_missing_or_damaged_tarball_is_a_clear_error(self):
        out = os.path.join(self.dir, "out")
        r = run("--tarball", os.path.join(self.dir, "absent.tar.xz"), "--out", out)
        self.assertEqual(r.returncode, 2)
        self.assertIn("apt-get install linux-source-6.1", r.stderr)
        self.assertNotIn("Traceback", r.stderr)
        bad = os.path.join(self.dir, "bad.tar.xz")
        with open(bad, "wb") as f:
            f.write(b"this is not an xz stream at all")
        r = run("--tarball", bad, "--out", out)
        self.assertEqual(r.returncode, 2)
        self.assertNotIn("Traceback", r.stderr)
        # Truncated in the middle of a member.
        good = os.path.join(self.dir, "good.tar.xz")
        make_tarball(good, [("kernel/%d.c" % i, GOOD_C + b"/* %d */\n" % i + os.urandom(3000).hex().encode())
                            for i in range(20)])
        with open(good, "rb") as f:
            data = f.read()
        with open(bad, "wb") as f:
            f.write(data[:len(data) // 2])
        r = run("--tarball", bad, "--out", out)
        self.assertEqual(r.returncode, 2, r.stdout + r.stderr)
        self.assertIn("damaged or truncated", r.stderr)
        self.assertNotIn("Traceback", r.stderr)
        # A tarball with no corpus files at all.
        empty = os.path.join(self.dir, "none.tar.xz")
        make_tarball(empty, [("Makefile", b"all:\n")])
        r = run("--tarball", empty, "--out", out)
        self.assertEqual(r.returncode, 2)
        self.assertIn("no C, header or Documentation", r.stderr)


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(l) for l in f]


def part(path, text, kind="c"):
    return ("// file: " if kind == "c" else ".. file: ") + path + "\n" + text


class LongDocs(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = self.tmp.name

    def tearDown(self):
        self.tmp.cleanup()

    def build(self, members, *args, name="out"):
        tb = os.path.join(self.dir, name + ".tar.xz")
        make_tarball(tb, members)
        out = os.path.join(self.dir, name)
        r = run("--tarball", tb, "--out", out, "--long-docs", *args)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        return out

    def test_a_directory_is_one_document_headers_first_each_file_after_its_path(self):
        a_h, b_h = b"struct foo { int x; };\n", b"#define B 2"           # the second without a final newline
        a_c, b_c = b"#include \"a.h\"\nint f(struct foo *p) { return p->x; }\n", b"int g(void) { return B; }\n"
        members = [
            ("drivers/net/b.c", b_c), ("drivers/net/b.h", b_h), ("drivers/net/a.c", a_c),
            ("drivers/net/a.h", a_h),
            ("drivers/net/sub/x.c", b"int x;\n"),                     # a subdirectory: its own document
            ("drivers/net/blob.c", b"\x00\x01"),                       # binary: skipped, the rest kept
            ("drivers/net/huge.h", b"#define R 0\n" * 200),            # too large
            ("kernel/a.c", a_c),                                        # duplicate of drivers/net/a.c
            ("Documentation/foo/b.rst", b"B\n=\n"), ("Documentation/foo/a.rst", GOOD_RST),
            ("Documentation/foo/ex.c", b"int main(void) { return 0; }\n"),  # a source document of that folder
            ("Documentation/foo/bar/c.rst", b"C\n"),
            ("Makefile", b"all:\n"),
        ]
        out = self.build(members, "--max-file-bytes", "1000")
        docs = read_jsonl(os.path.join(out, "docs.jsonl"))
        by = {(d["path"], d["kind"]): d for d in docs}
        self.assertEqual(set(by), {("drivers/net", "c"), ("drivers/net/sub", "c"), ("Documentation/foo", "rst"),
                                   ("Documentation/foo", "c"), ("Documentation/foo/bar", "rst")})
        net = by[("drivers/net", "c")]
        self.assertEqual(net["files"], 4)
        self.assertEqual(net["text"], "\n".join([
            part("drivers/net/a.h", a_h.decode()), part("drivers/net/b.h", b_h.decode() + "\n"),
            part("drivers/net/a.c", a_c.decode()), part("drivers/net/b.c", b_c.decode())]))
        self.assertEqual(by[("drivers/net/sub", "c")]["text"], "// file: drivers/net/sub/x.c\nint x;\n")
        self.assertEqual(by[("Documentation/foo", "rst")]["text"], "\n".join([
            part("Documentation/foo/a.rst", GOOD_RST.decode(), "rst"), part("Documentation/foo/b.rst", "B\n=\n", "rst")]))
        with open(os.path.join(out, "skipped.tsv")) as f:
            skipped = dict(l.rstrip("\n").split("\t") for l in f)
        self.assertEqual(skipped, {"drivers/net/blob.c": "binary", "drivers/net/huge.h": "too-large",
                                   "kernel/a.c": "duplicate"})  # the first path in path order is kept
        with open(os.path.join(out, "stats.json")) as f:
            st = json.load(f)
        self.assertEqual(st["documents"], 5)
        self.assertEqual(st["files_kept"], {"c": 6, "rst": 3})

    def test_split_by_directory_no_file_in_both_and_deterministic(self):
        members = []
        for i in range(300):
            members.append(("drivers/d%03d/x.h" % i, b"#define X%d %d\n" % (i, i)))
            members.append(("drivers/d%03d/x.c" % i, b"int v%d = X%d;\n" % (i, i)))
        for i in range(40):
            members.append(("Documentation/d%03d/a.rst" % i, b"Book %d\n" % i))
            members.append(("Documentation/d%03d/e.c" % i, b"int e%d;\n" % i))
        out = self.build(members, "--val-fraction", "0.1", "--bytes-per-token", "1", "--long-tokens", "1")
        docs = read_jsonl(os.path.join(out, "docs.jsonl"))
        train, val = read_jsonl(os.path.join(out, "train.jsonl")), read_jsonl(os.path.join(out, "val.jsonl"))
        self.assertEqual(len(docs), 380)
        self.assertEqual(len(train) + len(val), len(docs))
        self.assertTrue(all(d["split"] == "train" for d in train) and all(d["split"] == "val" for d in val))
        self.assertGreater(len(val), 10)
        self.assertLess(len(val), 70)
        # No file in both splits, and both documents of a directory on the same side.
        with open(os.path.join(out, "files.tsv")) as f:
            rows = [l.rstrip("\n").split("\t") for l in f]
        self.assertEqual(len(rows), 680)
        self.assertEqual(len({r[0] for r in rows}), 680)
        side = {}
        for path, d, s in rows:
            self.assertEqual(side.setdefault(d, s), s, d)
        # val_long: with --long-tokens 1, every val document.
        self.assertEqual(read_jsonl(os.path.join(out, "val_long.jsonl")), val)
        # The same files in another member order give the same bytes; a directory's split depends on its path
        # alone, so dropping other directories does not move it.
        out2 = self.build(list(reversed(members)), "--val-fraction", "0.1", "--bytes-per-token", "1",
                          "--long-tokens", "1", name="out2")
        for name in ("docs.jsonl", "train.jsonl", "val.jsonl", "val_long.jsonl", "manifest.tsv", "stats.json"):
            with open(os.path.join(out, name), "rb") as a, open(os.path.join(out2, name), "rb") as b:
                self.assertEqual(a.read(), b.read(), name)
        out3 = self.build(members[:100], "--val-fraction", "0.1", name="out3")
        for d in read_jsonl(os.path.join(out3, "docs.jsonl")):
            if d["kind"] == "c":
                self.assertEqual(d["split"], next(x["split"] for x in docs if x["path"] == d["path"]), d["path"])

    def test_length_report(self):
        # Ten directories of 1..10 files of 100 bytes: documents of known lengths.
        members, body = [], b"x" * 99 + b"\n"
        for i in range(10):
            for j in range(i + 1):
                members.append(("k/d%d/f%d.c" % (i, j), body[:-5] + b"%03d%d\n" % (i, j)))
        out = self.build(members, "--bytes-per-token", "10", "--val-fraction", "0.5", "--long-tokens", "40")
        with open(os.path.join(out, "stats.json")) as f:
            L = json.load(f)["lengths"]
        self.assertIn("estimate: bytes / 10", L["tokens_source"])
        with open(os.path.join(out, "manifest.tsv")) as f:
            man = {r[0]: r for r in (l.rstrip("\n").split("\t") for l in f)}
        sizes = {}
        for i in range(10):
            n = sum(len("// file: k/d%d/f%d.c\n" % (i, j)) + 100 for j in range(i + 1)) + i  # + joining newlines
            sizes["k/d%d" % i] = n
            self.assertEqual(int(man["k/d%d" % i][4]), n)
            self.assertEqual(int(man["k/d%d" % i][5]), n // 10)
        s = sorted(sizes.values())
        self.assertEqual(L["all"]["documents"], 10)
        self.assertEqual(L["all"]["bytes"], {"p50": s[4], "p90": s[8], "p99": s[9], "max": s[9], "total": sum(s)})
        self.assertEqual(L["all"]["tokens"]["max"], s[9] // 10)
        self.assertEqual(L["all"]["at_least_tokens"], {"8192": 0, "32768": 0, "131072": 0})
        val = [d for d in read_jsonl(os.path.join(out, "docs.jsonl")) if d["split"] == "val"]
        self.assertEqual(L["val"]["documents"], len(val))
        self.assertEqual(L["train"]["documents"] + len(val), 10)
        long_ = [d["path"] for d in read_jsonl(os.path.join(out, "val_long.jsonl"))]
        self.assertEqual(long_, [d["path"] for d in val if sizes[d["path"]] // 10 >= 40])
        self.assertEqual(L["val_long"]["documents"], len(long_))
        with open(os.path.join(out, "lengths.md")) as f:
            table = f.read()
        self.assertIn("| all | 10 | %s / %s / %s / %s |" % tuple("{:,}".format(v) for v in (s[4], s[8], s[9], s[9])),
                      table)

    def test_tokens_counted_with_a_tokenizer(self):
        try:
            import sentencepiece as spm
        except ImportError:
            self.skipTest("python3-sentencepiece is not installed")
        corpus = os.path.join(self.dir, "tok.txt")
        with open(corpus, "w") as f:
            for i in range(300):
                f.write("static int foo_%d(struct bar *b) { return b->x + %d; }\n" % (i, i))
        prefix = os.path.join(self.dir, "tok")
        spm.SentencePieceTrainer.train(input=corpus, model_prefix=prefix, vocab_size=300, model_type="bpe",
                                       byte_fallback=True, minloglevel=2)
        members = [("a/x.c", b"static int foo_1(struct bar *b) { return 1; }\n"),
                   ("a/y.h", "/* \u2581 mark */ struct bar { int x; };\n".encode())]
        out = self.build(members, "--tokenizer", prefix + ".model", "--val-fraction", "0")
        doc = read_jsonl(os.path.join(out, "docs.jsonl"))[0]
        sp = spm.SentencePieceProcessor(model_file=prefix + ".model")
        want = sum(len(sp.encode(p)) for p in doc["text"].split("\u2581")) + 3
        with open(os.path.join(out, "stats.json")) as f:
            L = json.load(f)["lengths"]
        self.assertEqual(L["all"]["tokens"]["max"], want)
        self.assertIn("tokenizer", L["tokens_source"])
        self.assertEqual(read_jsonl(os.path.join(out, "val.jsonl")), [])
        r = run("--tarball", os.path.join(self.dir, "out.tar.xz"), "--out", out, "--long-docs",
                "--tokenizer", os.path.join(self.dir, "absent.model"))
        self.assertEqual(r.returncode, 2)
        self.assertIn("absent.model", r.stderr)
        self.assertNotIn("Traceback", r.stderr)


if __name__ == "__main__":
    unittest.main()
