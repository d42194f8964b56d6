#!/usr/bin/env bash
# The README's second command: the whole test suite against local Postgres and Kafka
# (started if needed). Extra arguments go to `cargo test`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash deploy/local/services.sh up
# promtool, for the alert rule tests.
if ! command -v promtool >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null ||
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }
fi
cargo test --locked --all-targets --features failpoints "$@"
