#!/usr/bin/env python3
"""Where a request's threads wait for a CPU, from the kernel's scheduler trace.

Reads `perf script` output of a `perf sched record` on standard input and prints, per
thread name of the server and of the load generator (whose process also runs the
benchmark's upstream), per request:

- how often a thread was woken, and how many of those wake-ups found the target CPU idle
  (halted: on this virtual machine the hypervisor must bring it back);
- the mean time from a wake-up to the thread's switch-in, onto an idle CPU and onto a busy
  one (over the wake-ups whose switch-in the trace recorded);
- the CPU time it ran (the scheduler's own `sched_stat_runtime` accounting).

    perf sched record -a -o sched.data -- sleep 3      # while one benchmark phase runs
    perf script -F comm,pid,tid,cpu,time,event,trace -i sched.data | \
        python3 benches/sched_waits.py --server PID --load PID --rate REQ_PER_S

The requests in the window are the phase's rate times the trace's span: pass the rate the
phase printed. The trace's own cost slows a closed loop, so its figures per request are then
lower bounds.

Why not `perf sched timehist`: this kernel records only about half of the switches out of
the idle task, and timehist counts a CPU's idle time as run time of the thread that ran
before it. Here an idle CPU is the idle task switched in, until any event shows a thread
running on that CPU again.
"""

import argparse
import collections
import sys

from sched_trace import sched_events


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", required=True, type=int, help="the server's process id")
    parser.add_argument("--load", required=True, type=int, help="the load generator's process id")
    parser.add_argument("--rate", required=True, type=float, help="requests per second")
    args = parser.parse_args()

    process_of: dict[int, int] = {}
    name_of: dict[int, str] = {}
    running: dict[int, int] = {}  # CPU -> thread id; 0 is the idle task
    woken: dict[int, tuple[float, bool]] = {}  # thread id -> (when, onto an idle CPU)
    counts: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    first = last = None

    def ran_now(thread: int, stamp: float, switched_in: bool) -> None:
        wake = woken.pop(thread, None)
        if wake is not None and switched_in:
            when, idle = wake
            bucket = "idle" if idle else "queued"
            counts[thread][f"delay {bucket}"] += (stamp - when) * 1e6
            counts[thread][f"timed {bucket}"] += 1

    for comm, pid, tid, cpu, stamp, event, fields in sched_events(sys.stdin):
        process_of[tid] = pid
        first = stamp if first is None else first
        last = stamp
        running[cpu] = tid  # whoever an event is recorded by runs there, the idle task too
        if tid != 0:
            name_of.setdefault(tid, comm)
            ran_now(tid, stamp, switched_in=False)
        if event == "sched_switch":
            next_tid = int(fields["next_pid"])
            running[cpu] = next_tid
            if next_tid != 0:
                name_of[next_tid] = fields["next_comm"]
                ran_now(next_tid, stamp, switched_in=True)
        elif event == "sched_waking":
            wakee, target = int(fields["pid"]), int(fields["target_cpu"])
            idle = running.get(target) == 0
            name_of.setdefault(wakee, fields["comm"])
            woken[wakee] = (stamp, idle)
            counts[wakee]["woken"] += 1
            counts[wakee]["onto idle"] += idle
        elif event == "sched_stat_runtime":
            counts[int(fields["pid"])]["ran"] += int(fields["runtime"]) / 1000

    if first is None or last <= first:
        sys.exit("no scheduler events on standard input")
    requests = args.rate * (last - first)
    groups: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for tid, thread_counts in counts.items():
        process = process_of.get(tid, tid)
        if process == args.server or tid == args.server:
            group = f"server {name_of.get(tid, tid)}"
        elif process == args.load or tid == args.load:
            group = f"load generator {name_of.get(tid, tid)}"
        else:
            group = "anything else"
        groups[group].update(thread_counts)
        if group.startswith("server"):
            groups["the server, all threads"].update(thread_counts)

    def mean(total: collections.Counter, bucket: str) -> str:
        timed = total[f"timed {bucket}"]
        return f"{total[f'delay {bucket}'] / timed:.1f}" if timed else "-"

    print(f"{requests:.0f} requests in {last - first:.3f} s")
    print(
        f"{'thread':34} {'woken/req':>9} {'onto idle/req':>13} {'µs to run, idle':>15} "
        f"{'µs to run, busy':>15} {'ran µs/req':>10}"
    )
    for group, total in sorted(groups.items(), key=lambda item: -item[1]["ran"]):
        print(
            f"{group:34} {total['woken'] / requests:9.2f} {total['onto idle'] / requests:13.2f} "
            f"{mean(total, 'idle'):>15} {mean(total, 'queued'):>15} "
            f"{total['ran'] / requests:10.1f}"
        )

if __name__ == "__main__":
    main()
