#!/usr/bin/env python3
"""What the slowest requests of a fixed-rate phase waited on: whose CPU their threads queued for.

Joins the load benchmark's per-request times (`STABLE_HARNESS_BENCH_LATENCIES=FILE`) with a
scheduler trace of the whole machine over the same seconds, and prints, for the slowest
1% of the requests and for all of them: the wake-ups of the server's and the load
generator's threads during a request, the time those threads spent woken but not yet
running, and, for each request's longest such wait, which thread held the CPU meanwhile.

    STABLE_HARNESS_BENCH_ONLY=chat@200 STABLE_HARNESS_BENCH_SECONDS=20 \\
    STABLE_HARNESS_BENCH_LATENCIES=/tmp/lat.tsv cargo bench --bench load &
    # once it printed `server pid PID`:
    perf record -k CLOCK_MONOTONIC -a -e sched:sched_switch -e sched:sched_wakeup \\
        -o sched.data -- sleep 18
    python3 -c 'import time; print(time.clock_gettime(time.CLOCK_REALTIME) - \\
        time.clock_gettime(time.CLOCK_MONOTONIC))' > offset
    perf script -F comm,pid,tid,cpu,time,event,trace -i sched.data | \\
        python3 benches/tail_waits.py --server PID --load BENCH_PID \\
        --latencies /tmp/lat.tsv --offset "$(cat offset)"

The benchmark stamps a request with the wall clock; the kernel cannot stamp trace events
with it (only with clocks safe in an interrupt), so the trace takes the monotonic clock and
`--offset` (wall minus monotonic, constant while nothing steps the clock) joins the two.
docs/profiling.md, the sixty-third pass, has what it found.
"""

import argparse
import bisect
import collections
import re
import sys

from sched_trace import sched_events

# A waiter that starts running this long after its wake-up counts as having waited.
WAITED_S = 0.0003


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", required=True, type=int, help="the server's process id")
    parser.add_argument("--load", required=True, type=int, help="the benchmark's process id")
    parser.add_argument("--latencies", required=True, help="STABLE_HARNESS_BENCH_LATENCIES's file")
    parser.add_argument("--offset", required=True, type=float, help="wall minus monotonic, in s")
    args = parser.parse_args()

    process_of: dict[int, int] = {}
    name_of: dict[int, str] = {}
    woken: dict[int, float] = {}
    on_cpu: dict[int, tuple[int, float]] = {}  # CPU -> (thread, since)
    held: dict[int, list[tuple[float, float, int]]] = collections.defaultdict(list)
    waits: list[tuple[float, float, int, int]] = []  # (woken, running, thread, CPU)
    for comm, pid, tid, cpu, stamp, event, fields in sched_events(sys.stdin):
        process_of[tid] = pid
        name_of.setdefault(tid, comm)
        if event == "sched_wakeup":
            woken.setdefault(int(fields["pid"]), stamp)
        elif event == "sched_switch":
            thread = int(fields["next_pid"])
            name_of[thread] = fields["next_comm"]
            if cpu in on_cpu:
                before, since = on_cpu[cpu]
                held[cpu].append((since, stamp, before))
            on_cpu[cpu] = (thread, stamp)
            if thread in woken:
                waits.append((woken.pop(thread), stamp, thread, cpu))
    if not waits:
        sys.exit("no scheduler events on standard input")

    ours = {args.server, args.load}
    waits = sorted(w for w in waits if process_of.get(w[2]) in ours)
    wait_starts = [w[0] for w in waits]
    traced_from, traced_to = wait_starts[0] + 0.01, wait_starts[-1] - 0.01
    requests = []
    with open(args.latencies, encoding="utf-8") as lines:
        for line in lines:
            _surface, sent, _first, end = line.rstrip("\n").split("\t")
            start, took = int(sent) / 1e6 - args.offset, int(end) / 1e6
            if traced_from < start and start + took < traced_to:
                requests.append((start, took))
    if not requests:
        sys.exit("no request of the latencies file lies inside the trace")
    ordered = sorted(took for _, took in requests)
    p50, p99 = ordered[len(ordered) // 2], ordered[int(len(ordered) * 0.99)]

    def kind(thread: int) -> str:
        name = re.sub(r"[-/:]\d.*$", "", name_of.get(thread, str(thread)))
        if thread == 0:
            return "idle (the CPU halted)"
        owner = process_of.get(thread)
        if owner == args.server:
            return f"server: {name}"
        if owner == args.load:
            return f"load generator: {name}"
        return f"other: {name}"

    # A CPU's turns follow each other in time: the first that overlaps a wait is found by
    # bisection, not by reading every turn of the trace again for each request.
    turn_starts = {cpu: [since for since, _, _ in turns] for cpu, turns in held.items()}

    def holder(cpu: int, start: float, end: float) -> str:
        shares: collections.Counter = collections.Counter()
        turns = held[cpu]
        first = max(bisect.bisect_right(turn_starts.get(cpu, []), start) - 1, 0)
        for since, until, thread in turns[first:]:
            if since >= end:
                break
            if until > start:
                shares[kind(thread)] += min(until, end) - max(since, start)
        return shares.most_common(1)[0][0] if shares else "unknown"

    def report(label: str, group: list[tuple[float, float]]) -> None:
        wakeups = waited = 0.0
        holders: collections.Counter = collections.Counter()
        for start, took in group:
            inside = waits[bisect.bisect_left(wait_starts, start) : bisect.bisect_right(wait_starts, start + took)]
            wakeups += len(inside)
            waited += sum(running - woke for woke, running, _, _ in inside)
            worst = max(inside, key=lambda w: w[1] - w[0], default=None)
            if worst and worst[1] - worst[0] >= WAITED_S:
                holders[holder(worst[3], worst[0], worst[1])] += 1
        count = len(group)
        print(
            f"{label}: {count} requests, {wakeups / count:.1f} wake-ups and "
            f"{waited / count * 1e3:.3f} ms woken but not running a request; "
            f"{sum(holders.values())} waited {WAITED_S * 1e3:.1f} ms or more at once, "
            "the CPU then held by:"
        )
        for who, times in holders.most_common():
            print(f"    {who:40} {times:6} ({times / count:.1%})")

    print(f"{len(requests)} requests inside the trace, p50 {p50 * 1e3:.3f} ms, p99 {p99 * 1e3:.3f} ms")
    report("the slowest 1%", [r for r in requests if r[1] >= p99])
    report("all", requests)


if __name__ == "__main__":
    main()
