#!/usr/bin/env python3
"""Two server builds alternated on PostgreSQL, each round on a fresh database, with
PostgreSQL's own CPU per request beside the benchmark's figures.

Usage: pg_alternate.py --load LOAD_BENCH --admin-url URL [--phase chat:1] [--rounds 8]
                       [--seconds 6] BEFORE_BINARY AFTER_BINARY

LOAD_BENCH is the load benchmark's executable (`cargo bench --bench load --no-run` prints
it). It starts the server at the path it was built beside (`target/release/stable-harness`),
so each round copies its build there first. URL names a database of a local PostgreSQL
server from which the benchmark's database (`pg_alternate`) is dropped and created again
each round: a store that grows from round to round would favour whichever build ran first.
PostgreSQL's CPU is read from `/proc` for every process of the server's user, over the
phase's middle (from 3 s in to 1 s before its end): the server must run on this machine.
docs/profiling.md, the forty-first pass.
"""

import argparse
import os
import pwd
import re
import shutil
import statistics
import subprocess
import sys
import time
import urllib.parse

DATABASE = "pg_alternate"
FIGURES = {"p50": r"p50 ms ([\d.]+)", "req/s": r"req/s ([\d.]+)",
           "server CPU ms": r"CPU ms/request ([\d.]+)", "sleeps": r"sleeps/request ([\d.]+)"}


def postgres_ticks(user):
    """CPU ticks (user + system) of every process of `user`."""
    uid = pwd.getpwnam(user).pw_uid
    ticks = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}").st_uid != uid:
                continue
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            continue
    return ticks


def fresh_database(admin_url):
    for sql in (f"DROP DATABASE IF EXISTS {DATABASE} WITH (FORCE)", f"CREATE DATABASE {DATABASE}"):
        subprocess.run(["psql", admin_url, "-qAtc", sql], check=True, capture_output=True)


def copy_when_free(source, target):
    """Copies `source` over `target`; the last round's server may still be exiting, and its
    file is busy until it has."""
    for _ in range(100):
        try:
            shutil.copyfile(source, target)
            return
        except OSError:
            time.sleep(0.2)
    sys.exit(f"could not copy {source} to {target}")


def one_round(args, binary, server_path, database_url, user):
    copy_when_free(binary, server_path)
    fresh_database(args.admin_url)
    env = dict(os.environ, STABLE_HARNESS_BENCH_DATABASE_URL=database_url,
               STABLE_HARNESS_BENCH_SECONDS=str(args.seconds),
               STABLE_HARNESS_BENCH_ONLY=args.phase)
    bench = subprocess.Popen([args.load, "--bench"], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    time.sleep(3)
    before, started = postgres_ticks(user), time.monotonic()
    time.sleep(max(args.seconds - 4, 1))
    after, ended = postgres_ticks(user), time.monotonic()
    output = bench.communicate()[0]
    median = next((line for line in output.splitlines() if line.startswith("median")), None)
    if median is None:
        sys.exit(f"the benchmark printed no median:\n{output}")
    figures = {name: float(re.search(pattern, median).group(1)) for name, pattern in FIGURES.items()}
    per_second = os.sysconf("SC_CLK_TCK")
    busy_ms = (after - before) * 1000 / per_second
    figures["PostgreSQL CPU ms"] = busy_ms / (figures["req/s"] * (ended - started))
    return figures


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--load", required=True)
    parser.add_argument("--admin-url", required=True)
    parser.add_argument("--phase", default="chat:1")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--seconds", type=int, default=6)
    parser.add_argument("--postgres-user", default="postgres")
    parser.add_argument("before")
    parser.add_argument("after")
    args = parser.parse_args()
    server_path = os.path.join(os.path.dirname(os.path.dirname(args.load)), "stable-harness")
    database_url = urllib.parse.urlunsplit(
        urllib.parse.urlsplit(args.admin_url)._replace(path="/" + DATABASE))
    kept = shutil.copyfile(server_path, server_path + ".pg_alternate") if os.path.exists(server_path) else None
    rounds = {"before": [], "after": []}
    try:
        for number in range(1, args.rounds + 1):
            for name in ("before", "after"):
                figures = one_round(args, getattr(args, name), server_path, database_url,
                                    args.postgres_user)
                rounds[name].append(figures)
                print(f"round {number} {name}: " +
                      ", ".join(f"{key} {value:.3f}" for key, value in figures.items()), flush=True)
    finally:
        if kept:
            copy_when_free(kept, server_path)
            os.remove(kept)
    lower_is_better = {"req/s": False}
    for key in rounds["before"][0]:
        before = [r[key] for r in rounds["before"]]
        after = [r[key] for r in rounds["after"]]
        better = sum((a < b) == lower_is_better.get(key, True) for a, b in zip(after, before))
        print(f"{key}: median {statistics.median(before):.3f} -> {statistics.median(after):.3f} "
              f"(after better in {better} of {len(before)} rounds)")


if __name__ == "__main__":
    main()
