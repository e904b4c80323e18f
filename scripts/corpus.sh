#!/usr/bin/env bash
# The Linux-source corpus (docs/quality.md), from Debian's linux-source-6.1 package, in one command:
#
#   scripts/corpus.sh [--out DIR] [--carry] [--no-shards] [--laplace PATH]
#
#   1. installs linux-source-6.1 if it is missing (as root; otherwise says how);
#   2. scripts/corpus.py: C sources, headers and Documentation/**/*.rst as whole-file documents,
#      empty/binary/non-UTF-8/oversized files skipped with a reason, exact duplicates removed, a
#      deterministic shuffled order -> DIR/docs.jsonl (+ docs.sample.jsonl, manifest.tsv, skipped.tsv);
#   3. a 32,768-piece BPE tokenizer with byte fallback trained on docs.sample.jsonl -> DIR/tokenizer.model;
#   4. token shards (unless --no-shards): 1 % of the documents, whole files, held out for validation
#      -> DIR/data/{train,val}_*.bin;
#   5. --carry: the slice a GPU machine can take in one call (at most 54 MiB of xz) and the tokenizer
#      -> .carry/corpus/, which scripts/device_train125m.sh tokenizes there.
# DIR defaults to runs/corpus. Nothing is downloaded beyond Debian's package.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=runs/corpus
CARRY=0
SHARDS=1
LAPLACE=${LAPLACE:-build/laplace}
while (($#)); do
  case "$1" in
    --out) OUT=$2; shift 2 ;;
    --carry) CARRY=1; shift ;;
    --no-shards) SHARDS=0; shift ;;
    --laplace) LAPLACE=$2; shift 2 ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "corpus.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
TARBALL=/usr/src/linux-source-6.1.tar.xz
if [ ! -f "$TARBALL" ]; then
  if [ "$(id -u)" = 0 ]; then
    echo "corpus: installing Debian's linux-source-6.1"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends linux-source-6.1 xz-utils ||
      { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
          linux-source-6.1 xz-utils; } ||
      { echo "corpus: cannot install linux-source-6.1" >&2; exit 1; }
  else
    echo "corpus: $TARBALL is missing; install it with: sudo apt-get install linux-source-6.1" >&2
    exit 1
  fi
fi
[ -x "$LAPLACE" ] || { echo "corpus: $LAPLACE not found: build first (scripts/build.sh) or pass --laplace" >&2; exit 1; }
mkdir -p "$OUT"
CARRY_ARGS=()
((CARRY)) && CARRY_ARGS=(--carry-bytes $((54 * 1024 * 1024)))
python3 scripts/corpus.py --tarball "$TARBALL" --out "$OUT" "${CARRY_ARGS[@]}"
if [ ! -f "$OUT/tokenizer.model" ] || [ "$OUT/docs.sample.jsonl" -nt "$OUT/tokenizer.model" ]; then
  "$LAPLACE" tokenizer train --input "$OUT/docs.sample.jsonl" --model-prefix "$OUT/tokenizer" --vocab-size 32768
fi
if ((SHARDS)); then
  "$LAPLACE" data prepare --input "$OUT/docs.jsonl" --tokenizer "$OUT/tokenizer.model" --out "$OUT/data" \
    --val-fraction 0.01 --overwrite
fi
if ((CARRY)); then
  mkdir -p .carry/corpus
  cp "$OUT/docs.carry.jsonl.xz" "$OUT/tokenizer.model" .carry/corpus/
  echo "corpus: .carry/corpus/ ready ($(du -sh .carry/corpus | cut -f1)); name .carry/corpus in the device call's carry"
fi
