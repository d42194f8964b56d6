#!/usr/bin/env bash
# The README's first command: local Postgres and Kafka (started if needed), a release build,
# the schema, the demo downstream in the background, then the relay in the foreground.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
config=${IDEM_CONFIG:-deploy/idem.example.toml}
state=${IDEM_LOCAL_DIR:-$HOME/.cache/idem-local}

bash deploy/local/services.sh up
cargo build --release --locked --bin idem
bin=target/release/idem
"$bin" migrate --config "$config"

# The demo downstream the example tools point at; stopped with the relay.
mkdir -p "$state"
if ! (exec 3<>/dev/tcp/127.0.0.1/8787) 2>/dev/null; then
  "$bin" fake-downstream --listen 127.0.0.1:8787 >>"$state/fake-downstream.log" 2>&1 &
  downstream=$!
  echo "$downstream" > "$state/fake-downstream.pid"
  trap 'kill "$downstream" 2>/dev/null || true; rm -f "$state/fake-downstream.pid"' EXIT
fi

echo "relay starting: metrics on http://127.0.0.1:9464/metrics, readiness on /readyz (Ctrl-C stops it)" >&2
"$bin" relay --config "$config"
