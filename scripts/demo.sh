#!/usr/bin/env bash
# The main job: set up, build, prepare an embedded corpus (Debian's fortunes),
# train the tokenizer and laplace-tiny on the CPU, save a checkpoint, generate text.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
./scripts/build.sh
exec ./scripts/run_demo.sh "$@"
