#!/usr/bin/env bash
# The README's second command: the whole test suite against local Postgres and Kafka
# (started if needed). Extra arguments go to `cargo test`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# The tests link the system's OpenSSL, not the vendored copy a release builds (four minutes of
# this suite on a 2-core machine); `OPENSSL_NO_VENDOR=0 bash deploy/test.sh` tests the latter.
export OPENSSL_NO_VENDOR=${OPENSSL_NO_VENDOR:-1}
bash deploy/local/build-deps.sh
bash deploy/local/services.sh up
# promtool, for the alert rule tests.
if ! command -v promtool >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null ||
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }
fi
# Chromium and its WebDriver, for the console's browser tests.
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null ||
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null; }
fi
# Each test makes its own schema; drop those earlier runs left, so the database stays small.
url=${IDEM_TEST_POSTGRES_URL:-postgres://idem:idem@127.0.0.1:5432/idem}
psql -qAt "$url" -c "select nspname from pg_namespace where nspname ~ '^(t|m|bench_idem|bench_naive)_[0-9a-f]+$'" |
  while read -r schema; do
    PGOPTIONS='-c client_min_messages=warning' psql -q "$url" -c "drop schema if exists \"$schema\" cascade"
  done
# And their topics (the same names, `.actions`, `.outcomes`, `.dlq` and variants).
bash deploy/local/services.sh prune-topics '(t|m|bench_idem|bench_naive|bench_dbos|bench_restate|roundtrip)_[0-9a-f]+(\..+)?'
# The Python venv: the client's tests, the MCP SDK for the MCP server's tests, selenium for the
# console's, and kubernetes-validate for the Helm chart's test.
py=${IDEM_LOCAL_DIR:-$HOME/.cache/idem-local}/venv-python
[ -x "$py/bin/python" ] || python3 -m venv "$py"
"$py/bin/pip" install -q --disable-pip-version-check -e "clients/python[test]" mcp==2.3.0 selenium==4.51.0 kubernetes-validate==1.37.0
# Helm, for tests/chart.rs (a Go module; built once into GOPATH/bin).
helm_bin=$(go env GOPATH)/bin/helm
[ -x "$helm_bin" ] || go install helm.sh/helm/v4/cmd/helm@v4.3.2
export IDEM_HELM=$helm_bin IDEM_KUBERNETES_VALIDATE=$py/bin/kubernetes-validate
cargo test --locked --all-targets --features failpoints "$@"
# The Python client (clients/python) against the relay binary just built.
IDEM_BIN="$PWD/target/debug/idem" "$py/bin/pytest" -q -p no:cacheprovider clients/python
# A smoke of the client's benchmark (benches/client_calls.py), so it keeps working.
IDEM_BIN="$PWD/target/debug/idem" "$py/bin/python" benches/client_calls.py --calls 3 --warmup 1 --linger 0,2
# The MCP server (`idem mcp` on stdio, `/mcp` over HTTP) with the official Python MCP SDK.
IDEM_BIN="$PWD/target/debug/idem" "$py/bin/pytest" -q -p no:cacheprovider tests/mcp
# The console (`/ui/`) in chromium, through WebDriver.
IDEM_BIN="$PWD/target/debug/idem" "$py/bin/pytest" -q -p no:cacheprovider tests/console
# The TypeScript client (clients/typescript), likewise.
(cd clients/typescript && npm ci --no-audit --no-fund --loglevel=error)
(cd examples/typescript && npm ci --no-audit --no-fund --loglevel=error)
(cd clients/typescript && IDEM_BIN="$PWD/../../target/debug/idem" npm test --silent)
