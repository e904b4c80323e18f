"""scripts/corpus.py on small tarballs made here: what is kept, what is skipped and why, the split-stable
shuffled order, the carry slice, and clear errors (never a traceback) for a missing or damaged tarball.
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


if __name__ == "__main__":
    unittest.main()
