#!/usr/bin/env bash
# Builds stable-harness with profile-guided optimisation (PGO): an instrumented release build
# serves the load benchmark's phases (the request path users take: chat and responses, JSON
# and streamed, `wait`, budgets, an upstream over HTTPS; PostgreSQL too when
# STABLE_HARNESS_BENCH_DATABASE_URL names a throwaway database to train on), and the compiler
# then lays out and inlines the whole program by the counts it gathered. The same source and
# the same guarantees; measured in docs/profiling.md ("The fifty-fifth pass"): 11-23% less
# CPU per request.
#
#   bash deploy/pgo-build.sh           # -> target/pgo/use/release/stable-harness
#   bash deploy/pgo-build.sh --check   # only checks that llvm-profdata reads rustc's profiles
#
# Needs `llvm-profdata` from an LLVM that reads the raw profiles of this toolchain's LLVM
# (LLVM 19 or later for rustc 1.95; on Debian bookworm: `apt-get install llvm-19`), found as
# $LLVM_PROFDATA, or else the newest llvm-profdata installed. Three release builds on 2 cores
# take about 35 minutes: the load generator, the instrumented server and the final one.
set -euo pipefail
cd "$(dirname "$0")/.."

find_profdata() {
  if [ -n "${LLVM_PROFDATA:-}" ]; then
    echo "$LLVM_PROFDATA"
    return
  fi
  local candidate
  for candidate in $(ls -d /usr/lib/llvm-*/bin/llvm-profdata 2>/dev/null | sort -t- -k2 -n -r) \
    "$(command -v llvm-profdata || true)"; do
    if [ -x "$candidate" ]; then
      echo "$candidate"
      return
    fi
  done
  echo "pgo-build: no llvm-profdata found; install LLVM 19 or later (Debian: apt-get install llvm-19) or set LLVM_PROFDATA" >&2
  exit 1
}

# rustc's raw profile format follows its LLVM; an older llvm-profdata refuses it. Checked on a
# program of three lines before half an hour of builds rather than after.
check_profdata() {
  local profdata="$1"
  probe="$(mktemp -d)"
  trap 'rm -rf "$probe"' EXIT
  printf 'fn main() { let n = std::env::args().count(); if n > 3 { println!("{n}"); } }\n' > "$probe/probe.rs"
  rustc -O -Cprofile-generate="$probe/raw" "$probe/probe.rs" -o "$probe/probe"
  "$probe/probe"
  if ! "$profdata" merge -o "$probe/probe.profdata" "$probe"/raw/*.profraw 2> "$probe/err"; then
    echo "pgo-build: $profdata cannot read the profiles of $(rustc --version) ($(rustc -vV | sed -n 's/^LLVM version: /LLVM /p')):" >&2
    cat "$probe/err" >&2
    echo "pgo-build: install a newer LLVM or set LLVM_PROFDATA" >&2
    exit 1
  fi
  echo "pgo-build: $profdata reads $(rustc --version)'s profiles"
}

profdata="$(find_profdata)"
check_profdata "$profdata"
if [ "${1:-}" = "--check" ]; then
  exit 0
fi

out="${PGO_DIR:-target/pgo}"
# Absolute: the instrumented server writes its profile from the benchmark's directory.
mkdir -p "$out"
out="$(cd "$out" && pwd)"

echo "== the load generator (release)"
cargo bench --locked --bench load --no-run

echo "== the instrumented server"
RUSTFLAGS="${RUSTFLAGS:-} -Cprofile-generate=$out/build-profiles" \
  cargo build --release --locked --bin stable-harness --target-dir "$out/generate"

echo "== training: the load benchmark's phases against the instrumented server"
rm -rf "$out/profiles"
export LLVM_PROFILE_FILE="$out/profiles/server-%m.profraw"
export STABLE_HARNESS_BENCH_SERVER="$out/generate/release/stable-harness"
export STABLE_HARNESS_BENCH_SECONDS=2
if [ -n "${STABLE_HARNESS_BENCH_DATABASE_URL:-}" ]; then
  cargo bench --locked --bench load
  unset STABLE_HARNESS_BENCH_DATABASE_URL
fi
cargo bench --locked --bench load
STABLE_HARNESS_BENCH_BUDGETS=1 STABLE_HARNESS_BENCH_UPSTREAM=https-h2 cargo bench --locked --bench load
unset LLVM_PROFILE_FILE STABLE_HARNESS_BENCH_SERVER

"$profdata" merge -o "$out/stable-harness.profdata" "$out"/profiles/*.profraw

echo "== the server built by the profile"
RUSTFLAGS="${RUSTFLAGS:-} -Cprofile-use=$out/stable-harness.profdata" \
  cargo build --release --locked --bin stable-harness --target-dir "$out/use"

echo "pgo-build: $out/use/release/stable-harness"
echo "pgo-build: measure it beside the plain build with"
echo "  STABLE_HARNESS_BENCH_SERVER=$out/use/release/stable-harness STABLE_HARNESS_BENCH_BEFORE=target/release/stable-harness cargo bench --bench load"
