#!/usr/bin/env bash
# Builds stable-harness with profile-guided optimisation (PGO): an instrumented release build
# serves the load benchmark's phases (the request path users take: chat and responses, JSON
# and streamed, `wait`, budgets, an upstream over HTTPS) and a remote agent's tool callbacks
# (the tool gateway's path), on PostgreSQL too when STABLE_HARNESS_BENCH_DATABASE_URL names a
# throwaway database to train on, and the compiler then lays out and inlines the whole
# program by the counts it gathered; where llvm-bolt is installed, BOLT then lays out the
# linked binary by a second training run. The same source and the same guarantees; measured
# in docs/profiling.md (the fifty-fifth and fifty-sixth passes): the compiler's profile
# 11-23% less CPU per request, BOLT 2-10% less again.
#
#   bash deploy/pgo-build.sh           # -> target/pgo/stable-harness
#   bash deploy/pgo-build.sh --check   # only checks that llvm-profdata reads rustc's profiles
#
# Needs `llvm-profdata` from an LLVM that reads the raw profiles of this toolchain's LLVM
# (LLVM 19 or later for rustc 1.95; on Debian bookworm: `apt-get install llvm-19`), found as
# $LLVM_PROFDATA, or else the newest llvm-profdata installed; BOLT as $LLVM_BOLT or beside it
# (`apt-get install bolt-19`). Three release builds on 2 cores take about 35 minutes: the load
# generators, the instrumented server and the final one; BOLT adds about 5.
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

# BOLT, beside llvm-profdata (Debian: the package bolt-19), lays out the linked binary again by
# a second training run: the whole of it, the C of SQLite and mimalloc included, which the
# compiler's profile does not reach. Without it the build stops at the compiler's profile.
bolt="${LLVM_BOLT:-$(dirname "$profdata")/llvm-bolt}"
merge_fdata="$(dirname "$bolt")/merge-fdata"
if [ -x "$bolt" ] && [ -x "$merge_fdata" ]; then
  relocs="-Clink-arg=-Wl,--emit-relocs"
else
  echo "pgo-build: no llvm-bolt beside $profdata (Debian: apt-get install bolt-19); the binary will not be laid out by BOLT"
  bolt=""
  relocs=""
fi

# The load benchmark's phases (2 s each) and the callbacks benchmark (2,100 tool calls through
# the gateway) against the store the environment names.
train_on_store() {
  cargo bench --locked --bench load
  cargo bench --locked --bench callbacks
}

# Both against the binary $1: on PostgreSQL when STABLE_HARNESS_BENCH_DATABASE_URL names a
# database, on the embedded store, and the load's phases again with budgets and an upstream
# over HTTPS (h2). A subshell, so that what it exports and unsets ends with it.
train() (
  export STABLE_HARNESS_BENCH_SERVER="$1" STABLE_HARNESS_BENCH_SECONDS=2
  if [ -n "${STABLE_HARNESS_BENCH_DATABASE_URL:-}" ]; then
    train_on_store
  fi
  unset STABLE_HARNESS_BENCH_DATABASE_URL
  train_on_store
  STABLE_HARNESS_BENCH_BUDGETS=1 STABLE_HARNESS_BENCH_UPSTREAM=https-h2 \
    cargo bench --locked --bench load
)

echo "== the load generators (release)"
cargo bench --locked --bench load --bench callbacks --no-run

echo "== the instrumented server"
RUSTFLAGS="${RUSTFLAGS:-} -Cprofile-generate=$out/build-profiles" \
  cargo build --release --locked --bin stable-harness --target-dir "$out/generate"

echo "== training: the load benchmark's phases and the callbacks against the instrumented server"
rm -rf "$out/profiles"
LLVM_PROFILE_FILE="$out/profiles/server-%m.profraw" train "$out/generate/release/stable-harness"
"$profdata" merge -o "$out/stable-harness.profdata" "$out"/profiles/*.profraw

echo "== the server built by the profile"
# Built afresh: cargo does not see a new profile behind the same flags.
rm -rf "$out/use"
RUSTFLAGS="${RUSTFLAGS:-} -Cprofile-use=$out/stable-harness.profdata $relocs" \
  cargo build --release --locked --bin stable-harness --target-dir "$out/use"

if [ -n "$bolt" ]; then
  echo "== training again: the same runs against the server instrumented by BOLT"
  rm -rf "$out/bolt-profiles"
  mkdir -p "$out/bolt-profiles"
  "$bolt" "$out/use/release/stable-harness" -instrument -o "$out/bolt-instrumented" \
    --instrumentation-file="$out/bolt-profiles/server.fdata" --instrumentation-file-append-pid
  train "$out/bolt-instrumented"
  "$merge_fdata" "$out"/bolt-profiles/*.fdata > "$out/stable-harness.fdata"
  echo "== the server laid out by BOLT"
  "$bolt" "$out/use/release/stable-harness" -o "$out/stable-harness" \
    -data="$out/stable-harness.fdata" -reorder-blocks=ext-tsp -reorder-functions=cdsort \
    -split-functions -split-all-cold -split-eh -icf=1 -use-gnu-stack
else
  cp "$out/use/release/stable-harness" "$out/stable-harness"
fi

echo "pgo-build: $out/stable-harness"
echo "pgo-build: measure it beside the plain build with"
echo "  STABLE_HARNESS_BENCH_SERVER=$out/stable-harness STABLE_HARNESS_BENCH_BEFORE=target/release/stable-harness cargo bench --bench load"
