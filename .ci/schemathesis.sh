#!/usr/bin/env bash
# Schemathesis (from PyPI, in a venv made here) against the live server: it generates requests
# from /openapi.json for every operation of each surface, with that surface's key, and checks
# that no response is a 5xx and every documented response matches its schema. Bounded: a few
# examples per operation and a time budget per surface. Usage: .ci/schemathesis.sh BINARY
set -euo pipefail
cd "$(dirname "$0")/.."
binary="${1:-target/debug/stable-harness}"
venv="${STABLE_HARNESS_CI_VENV:-.ci/venv}"
if [ ! -x "$venv/bin/st" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet "schemathesis==4.32.5"
fi

work="$(mktemp -d)"
server_pid=""
cleanup() {
  if [ -n "$server_pid" ]; then kill "$server_pid" 2>/dev/null || true; wait "$server_pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

# A workspace whose agents need no upstream: every accepted request can complete.
mkdir -p "$work/ws/config"
cat > "$work/ws/config/workspace.yaml" <<'YAML'
apiVersion: stable-harness/v1
kind: Runtime
metadata: { name: schemathesis }
spec:
  defaultAgent: greeter
---
apiVersion: stable-harness/v1
kind: Agent
metadata: { name: greeter }
spec:
  backend: scripted
  script: [{ reply: "Hello {{input}}" }]
YAML

client_key="schemathesis-client-key"
admin_key="schemathesis-admin-key"
STABLE_HARNESS_LOG=warn "$binary" start -w "$work/ws" --port 0 \
  --api-key "$client_key" --admin-key "$admin_key" > "$work/server.out" 2> "$work/server.err" &
server_pid=$!
base=""
for _ in $(seq 1 100); do
  base="$(grep -o 'http://[0-9.:]*' "$work/server.out" | head -1 || true)"
  if [ -n "$base" ] && "$venv/bin/python" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=1)' "$base/readyz" >/dev/null 2>&1; then break; fi
  sleep 0.1
done
if [ -z "$base" ]; then echo "the server did not start:"; cat "$work/server.err"; exit 1; fi
echo "server at $base"

run() {
  local name="$1"; shift
  echo "== schemathesis: $name"
  "$venv/bin/st" run "$base/openapi.json" \
    --checks not_a_server_error,response_schema_conformance \
    --max-examples "${STABLE_HARNESS_SCHEMATHESIS_EXAMPLES:-8}" \
    --max-time "${STABLE_HARNESS_SCHEMATHESIS_SECONDS:-60}" \
    --workers 2 --seed 1 --generation-database none --no-color \
    --request-timeout 30 --report-dir "$work/report" "$@"
}
run "client surfaces" --include-path-regex '^/(v1|runtime)/' -H "Authorization: Bearer $client_key"
run "admin surface" --include-path-regex '^/(admin/|metrics)' -H "Authorization: Bearer $admin_key"
run "open endpoints" --include-path-regex '^/(healthz|readyz)$' --max-time 15
if grep -q "panicked" "$work/server.err"; then
  echo "the server panicked:"; cat "$work/server.err"; exit 1
fi
