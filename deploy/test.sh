#!/usr/bin/env bash
# The README's second command: the whole test suite against local Postgres and Kafka
# (started if needed). Extra arguments go to `cargo test`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash deploy/local/services.sh up
cargo test --locked --all-targets --features failpoints "$@"
