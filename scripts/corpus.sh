#!/usr/bin/env bash
# The Linux-source corpus (docs/quality.md), from Debian's linux-source-6.1 package, in one command:
#
#   scripts/corpus.sh [--out DIR] [--carry] [--no-shards] [--laplace PATH] [--long [--long-out LDIR]]
#
#   1. installs linux-source-6.1 if it is missing (as root; otherwise says how);
#   2. scripts/corpus.py: C sources, headers and Documentation/**/*.rst as whole-file documents,
#      empty/binary/non-UTF-8/oversized files skipped with a reason, exact duplicates removed, a
#      deterministic shuffled order -> DIR/docs.jsonl (+ docs.sample.jsonl, manifest.tsv, skipped.tsv);
#   3. a 32,768-piece BPE tokenizer with byte fallback trained on docs.sample.jsonl -> DIR/tokenizer.model;
#   4. token shards (unless --no-shards): 1 % of the documents, whole files, held out for validation
#      -> DIR/data/{train,val}_*.bin;
#   5. --carry: the slice a GPU machine can take in one call (at most 54 MiB of xz) and the tokenizer
#      -> .carry/corpus/, which scripts/device/train125m.sh tokenizes there;
#   6. --long: the long-document corpus (scripts/corpus.py --long-docs): a document per source directory
#      (its .h then .c files) and per Documentation book, 2 % of the directories held out, lengths counted
#      with DIR's tokenizer -> LDIR/{docs,train,val,val_long}.jsonl, stats.json, lengths.md; and its shards
#      (unless --no-shards) with the same tokenizer, so token ids are shared with DIR's: LDIR/data/train_*.bin,
#      LDIR/data/val_*.bin (the held-out directories) and LDIR/test/long_*.bin (the held-out documents of at
#      least 32,768 tokens: `laplace eval position --documents --min-doc-tokens 32768`).
# DIR defaults to runs/corpus, LDIR to runs/corpus-long. Nothing is downloaded beyond Debian's package.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=runs/corpus
CARRY=0
SHARDS=1
LONG=0
LONG_OUT=runs/corpus-long
LAPLACE=${LAPLACE:-build/laplace}
while (($#)); do
  case "$1" in
    --out) OUT=$2; shift 2 ;;
    --carry) CARRY=1; shift ;;
    --no-shards) SHARDS=0; shift ;;
    --laplace) LAPLACE=$2; shift 2 ;;
    --long) LONG=1; shift ;;
    --long-out) LONG_OUT=$2; shift 2 ;;
    -h|--help) sed -n '2,/^# DIR defaults/p' "$0"; exit 0 ;;
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
if ((LONG)); then
  mkdir -p "$LONG_OUT"
  python3 scripts/corpus.py --tarball "$TARBALL" --out "$LONG_OUT" --long-docs --tokenizer "$OUT/tokenizer.model"
  if ((SHARDS)); then
    # One `data prepare` per split (no hash split inside it: the split is by directory, made above); the
    # held-out shards are renamed from prepare's train_* to val_* and long_*.
    prepare() { "$LAPLACE" data prepare --input "$1" --tokenizer "$OUT/tokenizer.model" --out "$2" \
                  --val-fraction 0 --overwrite; }
    prepare "$LONG_OUT/train.jsonl" "$LONG_OUT/data"
    for split in val val_long; do
      if [ "$split" = val ]; then dest="$LONG_OUT/data" name=val; else dest="$LONG_OUT/test" name=long; fi
      mkdir -p "$dest"
      rm -f "$dest/${name}"_*.bin
      if [ ! -s "$LONG_OUT/$split.jsonl" ]; then
        echo "corpus: $LONG_OUT/$split.jsonl holds no documents: no $name shards" >&2
        continue
      fi
      tmp="$LONG_OUT/.prepare-$split"
      rm -rf "$tmp"
      prepare "$LONG_OUT/$split.jsonl" "$tmp"
      for f in "$tmp"/train_*.bin; do
        [ -e "$f" ] && mv "$f" "$dest/${name}_${f##*/train_}"
      done
      rm -rf "$tmp"
    done
    echo "corpus: long-document shards in $LONG_OUT/data (train_*, val_*) and $LONG_OUT/test (long_*)"
  fi
fi
