#!/usr/bin/env bash
# What building idem for its tests needs from Debian's packages, installed when missing
# (idempotent): cmake (librdkafka is built with it), zlib, and, unless OPENSSL_NO_VENDOR=0,
# the system's OpenSSL with pkg-config to find it.
#
# The tests link the system's OpenSSL (`OPENSSL_NO_VENDOR=1`, which `deploy/test.sh` and CI set)
# instead of building the vendored copy a release links: on this project's 2-core machine that
# build took four of the suite's minutes, and it is the same OpenSSL 3 API either way.
set -euo pipefail
packages=(cmake zlib1g-dev)
[ "${OPENSSL_NO_VENDOR:-0}" = 0 ] || packages+=(pkg-config libssl-dev)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null ||
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; }
