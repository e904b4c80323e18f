#!/usr/bin/env bash
# Prepares .carry/boost/ (ignored by git) so that a machine without Boost — the GPU machine:
# Ubuntu 24.04, no network — can build `laplace serve` and the server tests with
# -DLAPLACE_BOOST_ROOT=.carry/boost (scripts/device/server_tests.sh does).
#
# What it carries: the Boost headers serve/http/http_server.cpp includes, and every header they
# include in turn, exactly as the compiler finds them (`g++ -M`), copied from this machine's
# Debian libboost-dev (1.74) with their paths (.carry/boost/boost/asio/..., beast/..., ...):
# about 800 files, 5.5 MB. Asio and Beast are header-only, so nothing binary is carried.
# The closure is taken with this machine's GCC; the GPU machine's GCC 13 takes the same
# paths through Boost's configuration headers (the same compiler family, libstdc++, Linux).
#
# Needs: g++ and libboost-dev (scripts/setup.sh installs both).
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=.carry/boost
[ -f /usr/include/boost/beast/http/parser.hpp ] || { echo "no /usr/include/boost/beast: apt-get install libboost-dev" >&2; exit 1; }
rm -rf "$dest"
mkdir -p "$dest"
files=$(g++ -std=c++20 -M -I. -DBOOST_ERROR_CODE_HEADER_ONLY -DBOOST_ASIO_NO_DEPRECATED serve/http/http_server.cpp |
  tr ' \\' '\n\n' | grep '^/usr/include/boost/' | sort -u)
for f in $files; do
  rel=${f#/usr/include/}
  mkdir -p "$dest/$(dirname "$rel")"
  cp "$f" "$dest/$rel"
done
cp /usr/share/doc/libboost1.74-dev/copyright "$dest/LICENSE" 2>/dev/null || true
grep -h 'define BOOST_LIB_VERSION' /usr/include/boost/version.hpp > "$dest/VERSION"
echo "$(echo "$files" | wc -l) headers of Boost $(sed 's/.*"\(.*\)"/\1/' "$dest/VERSION") in $dest: $(du -sh "$dest" | cut -f1)"
