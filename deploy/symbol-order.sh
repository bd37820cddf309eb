#!/usr/bin/env bash
# Writes deploy/symbol-order.txt: the functions of the release binary that the request path
# runs, hottest first, then those only the start runs. `build.rs` hands the file to the linker
# (LLD's --symbol-ordering-file) for release builds, which lays those functions out first and
# together: the code a started server touches fits in fewer pages, so it maps fewer of the
# binary's pages (idle RSS 25.9-26.4 -> 17.9-18.2 MiB) and the request path's code sits
# together (docs/profiling.md, the seventieth pass).
#
#   bash deploy/symbol-order.sh
#
# Needs valgrind (callgrind counts every function run, in every thread). It builds the release
# binary, runs its start on the example workspace under callgrind, then the load benchmark's
# warm-up (chat and Responses, JSON and streamed, `wait`) and a tool call between two model
# calls against it, also under callgrind. About 15 minutes on 2 cores, most of it the build.
#
# Regenerate it after changes that rename or add many functions, and after adding or removing
# a dependency or changing the features of one (cargo then gives every function of the crate
# a new hash): names the binary no longer has are skipped by the linker, so a stale file costs
# only the layout of that code, but that is all of it: turning off three of sqlx's SQLite
# features left the file's names for our own code unmatched and idle RSS 18.2 -> 24.8 MiB
# (the seventy-fourth pass).
# Measure idle RSS before keeping a new file (each binary read whole into the page cache
# first, starts alternated): two runs of this script on the same code gave files whose builds
# idled 0.7 MiB apart, one better and one worse than the file they replaced
# (docs/profiling.md, the seventy-third pass).
set -euo pipefail
cd "$(dirname "$0")/.."

command -v valgrind > /dev/null || {
  echo "symbol-order: valgrind is needed (Debian: apt-get install valgrind)" >&2
  exit 1
}

# Code moved onto huge pages is anonymous memory, which callgrind's names would miss.
export STABLE_HARNESS_HUGE_TEXT=off
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# Two builds: a benchmark's binary is built with its dev-dependencies' features on shared
# crates, which changes the hash in every Rust function's name. The file lists the names of
# both; the linker skips those the binary it links does not define. The benchmark's first,
# since both leave their binary at target/release/stable-harness.
load="$(cargo bench --locked --bench load --no-run 2>&1 | grep -o 'target/release/deps/load-[0-9a-f]*' | head -1)"
cp target/release/stable-harness "$work/bench-binary"
cargo build --release --locked
binary="$PWD/target/release/stable-harness"

# 1. The start alone, on the example workspace: until it serves, then 2 s idle.
cp -r workspace-example "$work/workspace"
valgrind --tool=callgrind --demangle=no --callgrind-out-file="$work/start.out" \
  "$binary" start -w "$work/workspace" --port 0 > "$work/start.log" 2> /dev/null &
started=$!
until grep -q "http://" "$work/start.log" 2> /dev/null; do sleep 0.5; done
sleep 2
kill -TERM "$started"
wait "$started" || true

# 2. The request path: the benchmark starts the binary through this wrapper.
cat > "$work/server" << EOF
#!/bin/sh
exec valgrind --tool=callgrind --demangle=no --callgrind-out-file="$work/requests.%p.out" "$binary" "\$@"
EOF
chmod +x "$work/server"
STABLE_HARNESS_BENCH_SERVER="$work/server" STABLE_HARNESS_BENCH_ONLY=tool:1 \
  STABLE_HARNESS_BENCH_SECONDS=2 "$load" --bench > "$work/load.log"

functions() {
  nm --defined-only "$1" | awk 'NF == 3 && ($2 == "t" || $2 == "T") { print $3 }'
}
functions "$binary" > "$work/text"
functions "$work/bench-binary" > "$work/bench-text"
python3 - "$work/text" "$work/bench-text" "$work/start.out" "$work"/requests.*.out \
  > deploy/symbol-order.txt << 'EOF'
"""Each callgrind file's functions by their own instructions (Ir), kept if the binary defines
them: the request path's, most first, then the start's that the request path did not run;
then the same functions as the benchmark's build names them."""
import collections
import re
import sys

text = set(open(sys.argv[1]).read().split())
# A Rust name without its hash (`17h` and 16 hex digits before the closing `E`).
HASH = re.compile(r"17h[0-9a-f]{16}E$")
bench_names = collections.defaultdict(list)
for name in open(sys.argv[2]).read().split():
    bench_names[HASH.sub("", name)].append(name)


def self_cost(path):
    names, cost, current, skip = {}, collections.Counter(), None, False
    for line in open(path):
        line = line.rstrip("\n")
        named = re.match(r"^(c?fn)=\((\d+)\)(?: (.*))?$", line)
        if named:
            kind, number, name = named.groups()
            if name:
                names[number] = name
            if kind == "fn":
                current = names.get(number)
            continue
        if line.startswith("calls="):
            skip = True  # the next line is the call's inclusive cost, not this function's
            continue
        if not line or not (line[0].isdigit() or line[0] in "+-*"):
            continue  # a file, an object or a header line
        if skip:
            skip = False
            continue
        fields = line.split()
        if current and len(fields) > 1:
            cost[current] += int(fields[1])
    return cost


requests = collections.Counter()
for path in sys.argv[4:]:
    requests.update(self_cost(path))
start = self_cost(sys.argv[3])
ordered, seen = [], set()
for cost in (requests, start):
    for name, _ in cost.most_common():
        if name in text and name not in seen:
            seen.add(name)
            ordered.append(name)
for name in ordered:
    print(name)
for name in ordered:
    # Only a name the benchmark's build defines once (monomorphized copies share a path).
    twins = bench_names.get(HASH.sub("", name), [])
    if len(twins) == 1 and twins[0] != name:
        print(twins[0])
EOF
echo "symbol-order: $(wc -l < deploy/symbol-order.txt) functions in deploy/symbol-order.txt"
