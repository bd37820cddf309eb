#!/usr/bin/env bash
# The official OpenAI Python SDK (Responses API) and the OpenAI Agents SDK, from PyPI in a venv
# made here, against the binary: tests/sdk starts a loopback upstream and the server itself.
# Usage: .ci/sdk.sh BINARY
set -euo pipefail
cd "$(dirname "$0")/.."
binary="$(realpath "${1:-target/debug/stable-harness}")"
venv="$(realpath -m "${STABLE_HARNESS_SDK_VENV:-.ci/venv-sdk}")"
if [ ! -x "$venv/bin/pytest" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet "openai==3.57.0" "openai-agents==0.24.0" "pytest==9.2.0"
fi
cd tests/sdk
STABLE_HARNESS_BIN="$binary" "$venv/bin/pytest" -q -p no:cacheprovider
