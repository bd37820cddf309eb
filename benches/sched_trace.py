"""The scheduler's events as `perf script -F comm,pid,tid,cpu,time,event,trace` prints them,
read for `benches/sched_waits.py` and `benches/tail_waits.py`."""

import re
from collections.abc import Iterable, Iterator

EVENT = re.compile(r"^\s*(.+?)\s+(\d+)/(\d+)\s+\[(\d+)\]\s+([\d.]+):\s+sched:(\w+):\s*(.*)$")
FIELD = re.compile(r"(\w+)=(\S+)")

# (the recording thread's name, its process, its thread, its CPU, the time in s, the event's
# name without `sched:`, the event's fields: a switch's `prev_*` and `next_*` alike)
Event = tuple[str, int, int, int, float, str, dict[str, str]]


def sched_events(lines: Iterable[str]) -> Iterator[Event]:
    """Each scheduler event among `lines`; other lines are passed over."""
    for line in lines:
        match = EVENT.match(line)
        if match:
            comm, pid, tid, cpu, stamp, event, rest = match.groups()
            yield comm, int(pid), int(tid), int(cpu), float(stamp), event, dict(FIELD.findall(rest))
