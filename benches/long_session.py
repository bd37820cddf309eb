#!/usr/bin/env python3
"""A conversation that grows turn by turn, against one or more server builds in turn.

Usage: long_session.py [--turns 400] [--every 50] [--bytes 500] [--conversations 1]
                       [--surface responses|chat|session] [--in-session [each|one]]
                       [--instructions-each-turn] [--instructions BYTES] [--retries K]
                       [--tools] [--whole-input] [--database-url postgres://...]
                       BINARY [BINARY...]

What a turn costs as its conversation grows, and what the store keeps for it. Each build
starts on a fresh store, with large_input.py's loopback upstream (a 7-word answer, sent at
once), and holds one conversation of `--turns` turns, each a user message of `--bytes`
bytes of made-up words (no two turns alike), one at a time:

- `responses`: each turn continues the one before by `previous_response_id` (the Agents
  SDK's stateful way): the server holds the conversation; with `--instructions BYTES`,
  each turn sends the same `instructions` of that size, as an Agents SDK agent sends its
  own (with `--surface chat`, the same system message of that size leads each turn's
  transcript, as a chat app's prompt does);
- `chat`: each turn posts the whole transcript to `/v1/chat/completions` (the client holds
  it, as a stateless client does), with `--in-session` naming the conversation's session
  (`x-stable-harness-session-id`), as a client grouping its requests does, or with
  `--in-session one` one session for all the conversations (as one `user` with several chats
  open), and sending each answer back as the OpenAI SDK does (`refusal: null` included);
  `--instructions-each-turn` starts each turn's transcript with a system message of its own
  (an app writing the time into its instructions);
- `session`: each turn posts its message alone to `/runtime/requests` with `wait` and the
  conversation's `sessionId`: the server holds it as a session's message tree; with
  `--retries K`, every `--every` turns one more turn the upstream refuses, retried K times
  by an operator (`POST /admin/requests/{id}/retry`), as a run recovered after a crash
  starts: from what the store holds of it.

With `--tools` the agent has a tool (the builtin `clock.now`) and the upstream calls it once
a turn before it answers: each turn is two model calls, a tool call and the run's two
checkpoints (its transcript before the tool runs and after), and adds four messages.

Every `--every` turns it prints the turns' median latency, the server's CPU a turn (user and
system, from `/proc`) and of it the embedded store's reader threads', the server's resident
memory, and the bytes the store holds: the embedded store's database file (its WAL apart, whose file keeps the size of its
largest stretch) or the PostgreSQL database's size. docs/profiling.md, the seventy-seventh to
eighty-first passes.
"""

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import threading
import time

from large_input import (ADMIN_KEY, REFUSED, ThreadingServer, Upstream, cpu_seconds, start_server,
                         stat_cpu_seconds, stop_server, workspace)


def thread_cpu_seconds(pid, name):
    """The CPU (user and system) of the server's threads called `name` so far."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            if open(f"/proc/{pid}/task/{task}/comm").read().strip() == name:
                total += stat_cpu_seconds(f"/proc/{pid}/task/{task}/stat")
        except FileNotFoundError:
            continue  # a thread that ended meanwhile
    return total


def store_bytes(root, database_url):
    """What the store holds now: the embedded store's database file and its WAL (bounded,
    and started over by the checkpointer), or the PostgreSQL database's size and 0."""
    if database_url:
        size = subprocess.run(["psql", database_url, "-tAc", "SELECT pg_database_size(current_database())"],
                              check=True, capture_output=True, text=True).stdout
        return int(size), 0
    state = os.path.join(root, ".stable-harness")
    sizes = {name: os.path.getsize(os.path.join(state, name)) for name in os.listdir(state)}
    return (sum(size for name, size in sizes.items() if name.endswith(".db")),
            sum(size for name, size in sizes.items() if name.endswith(".db-wal")))


# The embedded store's reader threads, which read a session's history.
READER = "sqlite-reader"


def rss_mib(pid):
    """The server's resident memory (`VmRSS`), in MiB."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def turn_texts(size):
    """Each turn's message: `size` bytes of made-up words, different every turn (a store that
    compresses, PostgreSQL's, is not handed text it shrinks to nothing), the same every run."""
    rng = random.Random(16)
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    words = ["".join(rng.choice(letters[:12 + length]) for _ in range(length))
             for length in (rng.randint(2, 9) for _ in range(4096))]
    turn = 0
    while True:
        turn += 1
        text = f"{turn:>9}"
        while len(text) < size:
            text += " " + rng.choice(words)
        yield text[:size]


def one_build(binary, root, args):
    server, connection, database = start_server(binary, root, args.database_url)
    try:
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {ADMIN_KEY}"}

        def call(method, path, body=None, session=None, expect=200):
            started = time.perf_counter()
            sent = dict(headers, **({"x-stable-harness-session-id": session} if session else {}))
            connection.request(method, path, body if body is None else json.dumps(body).encode(), sent)
            response = connection.getresponse()
            answer = response.read()
            if response.status != expect:
                raise SystemExit(f"{binary}: {response.status} {answer[:300]!r}")
            return time.perf_counter() - started, json.loads(answer)

        def post(path, body, session=None):
            return call("POST", path, body, session)

        def retried(session, text):
            """A turn the upstream refuses, then retried `--retries` times by an operator: the
            retry's own latency (it answers once the run's start is read from the store) and
            the server's CPU a retry, its failing run included."""
            _, failed = post("/runtime/requests", {
                "input": {"messages": [{"role": "user", "content": f"{REFUSED} {text}"}]},
                "sessionId": session, "wait": True})
            if failed["status"] != "failed":
                raise SystemExit(f"{binary}: a refused turn ended {failed['status']}")
            request = failed["requestId"]
            took = []
            cpu_before = cpu_seconds(server.pid)
            for attempt in range(2, args.retries + 2):
                took.append(call("POST", f"/admin/requests/{request}/retry", {}, expect=202)[0])
                while True:
                    view = call("GET", f"/admin/requests/{request}")[1]
                    if len(view["runs"]) >= attempt and view["status"] == "failed":
                        break
                    time.sleep(0.001)
            return (statistics.median(took) * 1000,
                    (cpu_seconds(server.pid) - cpu_before) / args.retries * 1000)

        texts = turn_texts(args.bytes)
        # The same instructions every turn, as an Agents SDK agent sends its own.
        instructions = next(turn_texts(args.instructions)) if args.instructions else None
        # Each conversation's state: its transcript (chat), its last response (responses),
        # its session (session); turns go to the conversations in turn.
        transcripts = [[] for _ in range(args.conversations)]
        previous = [None] * args.conversations
        sessions = [None] * args.conversations
        latencies = []
        before = cpu_seconds(server.pid)
        read_before = thread_cpu_seconds(server.pid, READER)
        rows = []
        for turn in range(1, args.turns + 1):
            text = next(texts)
            one = (turn - 1) % args.conversations
            if args.surface == "responses" and args.whole_input:
                # The whole conversation as input items every turn, the answers' output items
                # among them, and no `previous_response_id`: the Agents SDK's loop.
                items = transcripts[one]
                items.append({"role": "user", "content": text})
                body = {"model": "assistant", "input": items}
                if instructions:
                    body["instructions"] = instructions
                took, answer = post("/v1/responses", body)
                items.extend(answer["output"])
            elif args.surface == "responses":
                body = {"model": "assistant", "input": text}
                if instructions:
                    body["instructions"] = instructions
                if previous[one]:
                    body["previous_response_id"] = previous[one]
                took, answer = post("/v1/responses", body)
                previous[one] = answer["id"]
            elif args.surface == "chat":
                transcript = transcripts[one]
                transcript.append({"role": "user", "content": text})
                leading = ([{"role": "system", "content": f"Now: turn {turn}."}] if args.instructions_each_turn
                           else [{"role": "system", "content": instructions}] if instructions else [])
                sent = leading + transcript
                took, answer = post("/v1/chat/completions", {"model": "assistant", "messages": sent},
                                    (args.in_session == "one" and "conversations")
                                    or (args.in_session == "each" and f"conversation-{one}") or None)
                transcript.append(answer["choices"][0]["message"])
            else:
                body = {"input": {"messages": [{"role": "user", "content": text}]}, "wait": True}
                if sessions[one]:
                    body["sessionId"] = sessions[one]
                took, answer = post("/runtime/requests", body)
                sessions[one] = answer["sessionId"]
                if answer.get("status") != "completed":
                    raise SystemExit(f"{binary}: turn {turn} ended {answer.get('status')}")
            latencies.append(took)
            if turn % args.every == 0:
                after = cpu_seconds(server.pid)
                read = thread_cpu_seconds(server.pid, READER) - read_before
                time.sleep(0.3)  # the writer's last commits and a checkpoint settle
                held = store_bytes(root, database[1] if database else None)
                rows.append((turn, statistics.median(latencies) * 1000,
                             (after - before) / len(latencies) * 1000, held))
                print(f"  turns {turn - args.every + 1}-{turn}: p50 {rows[-1][1]:.3f} ms, "
                      f"CPU {rows[-1][2]:.3f} ms/turn (readers {read / len(latencies) * 1000:.3f}), "
                      f"store {held[0] / 1e6:.1f} MB" + (f" (WAL {held[1] / 1e6:.1f} MB)" if not database else "")
                      + f", RSS {rss_mib(server.pid):.1f} MiB",
                      flush=True)
                if args.retries:
                    retry_p50, retry_cpu = retried(sessions[one], next(texts))
                    print(f"    a retry: p50 {retry_p50:.3f} ms, CPU {retry_cpu:.3f} ms (its run's included)",
                          flush=True)
                latencies = []
                before = cpu_seconds(server.pid)
                read_before = thread_cpu_seconds(server.pid, READER)
        return rows
    finally:
        stop_server(server, database, args.database_url)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=400)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--bytes", type=int, default=500)
    parser.add_argument("--conversations", type=int, default=1,
                        help="hold this many conversations, their turns one after another in turn")
    parser.add_argument("--surface", choices=["responses", "chat", "session"], default="responses")
    parser.add_argument("--in-session", nargs="?", const="each", choices=["each", "one"],
                        help="chat: name each conversation's session (x-stable-harness-session-id),"
                             " or with `one` one session for them all")
    parser.add_argument("--instructions-each-turn", action="store_true",
                        help="chat: start each turn's transcript with a system message of its own")
    parser.add_argument("--instructions", type=int, default=0, metavar="BYTES",
                        help="responses and chat: send instructions of this many bytes every turn, the same each turn")
    parser.add_argument("--retries", type=int, default=0,
                        help="session: every `--every` turns, a turn the upstream refuses, then"
                             " retried this many times by an operator")
    parser.add_argument("--tools", action="store_true",
                        help="the agent has a tool the upstream calls once a turn before it answers")
    parser.add_argument("--whole-input", action="store_true",
                        help="responses: send the whole conversation as input items every turn, "
                             "no previous_response_id (the Agents SDK's loop)")
    parser.add_argument("--database-url")
    parser.add_argument("binaries", nargs="+")
    args = parser.parse_args()
    if args.retries and args.surface != "session":
        parser.error("--retries needs --surface session")
    if args.instructions and args.surface not in ("responses", "chat"):
        parser.error("--instructions needs --surface responses or chat")
    if args.instructions and args.instructions_each_turn:
        parser.error("--instructions and --instructions-each-turn are two kinds of leading message: one of them")

    upstream = ThreadingServer(("127.0.0.1", 0), Upstream)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    root = workspace(f"http://127.0.0.1:{upstream.server_port}/v1", args.tools, False)
    try:
        for binary in args.binaries:
            print(f"{binary}, {args.surface}"
                  f"{' in ' + args.in_session + ' session' if args.in_session else ''},"
                  f" {args.turns} turns of {args.bytes} bytes"
                  f" in {args.conversations} conversation(s):", flush=True)
            one_build(binary, root, args)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
