#!/usr/bin/env bash
# Installs everything Laplace needs from Debian packages (nothing else is fetched);
# `setup.sh --demo` only what the demo needs. Idempotent: packages already present are not
# reinstalled.
set -euo pipefail

# What the demo needs (scripts/demo.sh: `setup.sh --demo`): compilers, CMake, OpenBLAS,
# sentencepiece, nlohmann-json, CLI11, xxhash and its corpus.
PACKAGES=(
  build-essential cmake ninja-build pkg-config
  libopenblas-dev libopenblas0-openmp libsentencepiece-dev nlohmann-json3-dev libcli11-dev libxxhash-dev
  fortunes fortunes-min
)
# Everything else, for the tests, the server, MPI and the Python reference.
if [ "${1:-}" != --demo ]; then
  PACKAGES+=(
    sentencepiece libboost-dev
    libgtest-dev libgmock-dev libbenchmark-dev
    libopenmpi-dev openmpi-bin
    python3 python3-numpy python3-torch python3-matplotlib python3-sentencepiece python3-setuptools python3-pip
    curl
    chromium
    haproxy
  )
fi
# The server tests drive `laplace serve` with the official openai client (npm).
if [ "${LAPLACE_SETUP_NODE:-0}" = 1 ]; then
  command -v node > /dev/null || PACKAGES+=(nodejs)
  command -v npm > /dev/null || PACKAGES+=(npm)
fi

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""
  if [ "$(id -u)" != 0 ]; then SUDO=sudo; fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
else
  echo "setup: all Debian packages present"
fi

if [ "${LAPLACE_SETUP_NODE:-0}" = 1 ]; then
  # Exact versions from tests/openai_client/package-lock.json (npm registry).
  dir="$(dirname "$0")/../tests/openai_client"
  if ! cmp -s "$dir/package-lock.json" "$dir/node_modules/.laplace-installed-lock" 2>/dev/null; then
    echo "setup: npm ci in tests/openai_client"
    npm ci --prefix "$dir" --no-audit --no-fund --loglevel=error
    cp "$dir/package-lock.json" "$dir/node_modules/.laplace-installed-lock"
  else
    echo "setup: tests/openai_client up to date"
  fi
fi
