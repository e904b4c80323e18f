#!/usr/bin/env bash
# Prepares .carry/httplib/ (ignored by git) so that a machine without cpp-httplib — the
# GPU machine: Ubuntu 24.04, no network — can build `laplace serve` and the server tests
# with -DLAPLACE_HTTPLIB_ROOT=.carry/httplib (scripts/device_serve_check.sh does).
#
# What it carries: Debian 12's own cpp-httplib source (0.11.4+ds-1+deb12u1, with Debian's
# CVE-2023-26130 patch), split the way Debian builds it into httplib.h + httplib.cc
# (the header is byte-identical to this machine's /usr/include/httplib.h). It is compiled
# there without OpenSSL/zlib/brotli (plain HTTP on 127.0.0.1 is all the server needs), so
# nothing binary and no library that Ubuntu might lack (libbrotli*) is carried. ~350 KB.
#
# Needs: apt-get (Debian 12 sources; only the source package is fetched, through apt
# with a private sources list, the system's apt configuration untouched), python3.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.carry/httplib
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/lists/partial"
printf '%s\n' 'deb-src http://deb.debian.org/debian bookworm main' \
  'deb-src http://deb.debian.org/debian-security bookworm-security main' > "$work/src.list"
apt_opts=(-o "Dir::Etc::SourceList=$work/src.list" -o Dir::Etc::SourceParts=/nonexistent
  -o "Dir::State::Lists=$work/lists" -o APT::Sandbox::User=root)
apt-get "${apt_opts[@]}" update -qq
(cd "$work" && apt-get "${apt_opts[@]}" source --download-only cpp-httplib=0.11.4+ds-1+deb12u1 -qq)
(cd "$work" && tar xf cpp-httplib_0.11.4+ds.orig.tar.xz && tar xf cpp-httplib_0.11.4+ds-1+deb12u1.debian.tar.xz)
src=$(echo "$work"/yhirose-cpp-httplib-*)
while read -r p; do
  [ -n "$p" ] && patch -d "$src" -p1 -s < "$work/debian/patches/$p"
done < "$work/debian/patches/series"
(cd "$src" && python3 ./split.py -o "$work/split" > /dev/null)
mkdir -p "$dest"
cp "$work/split/httplib.h" "$work/split/httplib.cc" "$dest/"
cp "$src/LICENSE" "$dest/LICENSE"
echo "cpp-httplib 0.11.4+ds-1+deb12u1 (Debian 12 source, split like Debian's libcpp-httplib)" > "$dest/VERSION"
if [ -f /usr/include/httplib.h ] && ! cmp -s "$dest/httplib.h" /usr/include/httplib.h; then
  echo "note: $dest/httplib.h differs from /usr/include/httplib.h (another Debian revision?)" >&2
fi
du -sh "$dest"
