#!/usr/bin/env python3
"""Requests that carry a long conversation, against two or more server builds in turn.

Usage: large_input.py [--bytes 64000] [--requests 300] [--rounds 4]
                      [--surface wait|chat|chat-sse|responses|responses-sse|list|view]
                      [--stored 100] [--database-url postgres://...] [--tools] [--parked]
                      [--chunks 7] [--gap-ms 0] [--openai-chunks] BINARY [BINARY...]

The load benchmark's requests carry one short message; an agent's requests often carry a
long transcript, and what the server does per byte of it (parse, store, send upstream) only
shows there. Each round starts each build in turn on a fresh embedded store, with a
loopback upstream (this script, speaking Chat Completions: a streamed answer of `--chunks`
words, 7 by default, sent at once), sends 20 requests to warm it, then `--requests` more one
at a time, each with a conversation of `--bytes` bytes in 1,000-byte turns, to
`/runtime/requests` with `wait` or to `/v1/chat/completions`; it prints the server's CPU
(user and system, from `/proc`) per request and the median latency, then the medians over
the rounds. With `--surface list` it first stores `--stored` such requests (with `wait`, not
measured), then times `--requests` reads of the admin listing's first page (`GET
/admin/requests?limit=50`); with `--surface view`, reads of the last stored request's view
(`GET /runtime/requests/{id}`). With `--surface responses` the requests go to
`/v1/responses`; with `chat-sse` or `responses-sse` they stream (`/v1/chat/completions` or
`/v1/responses` with `stream: true`), and the script also prints the median time to the
first token (the first line that carries the upstream's first word). With `--gap-ms G` the
upstream sends its chunks G ms apart, as a model generates them, instead of at once: each
delta then commits alone. With `--openai-chunks` each chunk is laid out as OpenAI sends it
(compact, its `id`, `model`, `system_fingerprint`, `service_tier`, `logprobs` and
`obfuscation` fields, and `"usage": null` in every chunk but the last). A build may be a
wrapper script (the callgrind recipe of docs/profiling.md). docs/profiling.md, the
forty-third and forty-fourth passes; the other surfaces and `--chunks`, the forty-fifth;
`--gap-ms`, the forty-sixth; `--openai-chunks`, the fifty-first.

With `--tools` the agent has a tool (the builtin `clock.now`) and the upstream calls it once
per request before it answers: the run then stores its conversation, with the tool's result,
as its state after that step (docs/profiling.md, the forty-fourth pass). With `--parked` as
well, the tool needs an approval nobody gives, and the listing's requests are stored without
`wait`: their runs stay live, waiting, each holding its conversation as its state.

With `--database-url` each build runs on PostgreSQL instead, in a database made for it and
dropped after (the URL names a database the script may create others beside, with `psql`).
"""

import argparse
import http.client
import http.server
import json
import os
import shutil
import socket
import socketserver
import statistics
import subprocess
import tempfile
import threading
import time


# A message starting with this is refused by the upstream (400).
REFUSED = "[refused]"


class Upstream(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Words in an answer (`--chunks`), each a chunk of the stream.
    chunks = 7
    # Seconds between two chunks (`--gap-ms`); 0 sends the whole stream at once.
    gap = 0.0
    # Chunks laid out as OpenAI sends them (`--openai-chunks`).
    openai = False
    disable_nagle_algorithm = True

    def log_message(self, *args):
        pass

    def do_POST(self):
        asked = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        last = asked["messages"][-1].get("content")
        if isinstance(last, str) and last.startswith(REFUSED):
            # Refused as a bad request: the run fails, and is not tried again by itself.
            body = b'{"error":{"message":"refused","type":"invalid_request_error"}}'
            self.send_response(400)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        tools = asked.get("tools") or []
        if tools and asked["messages"][-1]["role"] != "tool":
            # A tool the request offers, called before any answer.
            call = {"index": 0, "id": "call_1", "type": "function",
                    "function": {"name": tools[0]["function"]["name"], "arguments": "{}"}}
            chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "tool_calls": [call]}}]},
                      {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}]
        else:
            chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
            chunks += [{"choices": [{"index": 0, "delta": {"content": f"tok{i} "}}]} for i in range(self.chunks)]
            chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
        chunks += [
            {"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": self.chunks,
                                         "total_tokens": 10 + self.chunks}},
        ]
        events = [b"data: " + self.shaped(chunk) + b"\n\n" for chunk in chunks]
        events.append(b"data: [DONE]\n\n")
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(sum(map(len, events))))
        self.end_headers()
        if not self.gap:
            self.wfile.write(b"".join(events))
            return
        for event in events:
            self.wfile.write(event)
            self.wfile.flush()
            time.sleep(self.gap)


    @classmethod
    def shaped(cls, chunk):
        """A chunk as sent: short fields around it, or (`--openai-chunks`) as OpenAI lays one
        out, compact, with the fields it adds to every chunk and `"usage": null` in all but the
        last (the call asks for usage)."""
        if not cls.openai:
            return json.dumps(dict(chunk, id="c1", object="chat.completion.chunk", created=1, model="m")).encode()
        choices = [dict(choice, logprobs=None, finish_reason=choice.get("finish_reason"))
                   for choice in chunk["choices"]]
        shaped = {"id": "chatcmpl-AbCdEf0123456789xyzABCDEFGHI", "object": "chat.completion.chunk",
                  "created": 1733000000, "model": "gpt-4o-mini-2024-07-18", "service_tier": "default",
                  "system_fingerprint": "fp_0ba0d124f1", "choices": choices,
                  "usage": chunk.get("usage"), "obfuscation": "Qx7bT"}
        return json.dumps(shaped, separators=(",", ":")).encode()


class ThreadingServer(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True


def workspace(upstream_url, tools, parked):
    root = tempfile.mkdtemp()
    files = {
        "config/runtime/workspace.yaml": "apiVersion: stable-harness/v1\nkind: Runtime\nmetadata: { name: bench }\nspec:\n  defaultAgent: assistant\n",
        "config/agents/assistant.yaml": "apiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: assistant }\nspec:\n  backend: openai\n  model: fast\n  instructions: Be brief.\n",
        "config/catalogs/models.yaml": "apiVersion: stable-harness/v1\nkind: ModelCatalog\nmetadata: { name: models }\nspec:\n  models:\n"
        f"    - {{ id: fast, provider: openai-compatible, baseUrl: \"{upstream_url}\", upstreamModel: bench-upstream, maxOutputTokens: 1000 }}\n",
    }
    if parked:
        files["config/runtime/workspace.yaml"] += "  governance: { default: needs_approval }\n"
    if tools:
        files["config/agents/assistant.yaml"] += "  tools: [clock.now]\n"
        files["config/catalogs/tools.yaml"] = (
            "apiVersion: stable-harness/v1\nkind: ToolCatalog\nmetadata: { name: tools }\nspec:\n  tools:\n"
            "    - { id: clock.now, description: The time., risk: low, timeout: 1s, builtin: clock.now,\n"
            "        inputSchema: { type: object, properties: {}, additionalProperties: false } }\n"
        )
    for path, text in files.items():
        os.makedirs(os.path.dirname(os.path.join(root, path)), exist_ok=True)
        with open(os.path.join(root, path), "w") as file:
            file.write(text)
    return root


def stat_cpu_seconds(stat):
    """The CPU (user and system) a `/proc/.../stat` file counts."""
    fields = open(stat).read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid):
    return stat_cpu_seconds(f"/proc/{pid}/stat")


ADMIN_KEY = "bench-admin-key"
# The upstream's first word, as a streamed answer carries it.
FIRST_TOKEN = b"tok0"


def fresh_database(admin_url):
    """A new, empty database beside the one `admin_url` names, and its URL."""
    name = f"large_input_{os.getpid()}_{time.monotonic_ns()}"
    subprocess.run(["psql", admin_url, "-qc", f"CREATE DATABASE {name}"], check=True)
    return name, admin_url.rsplit("/", 1)[0] + "/" + name


def start_server(binary, root, database_url=None):
    """Starts `binary` on a fresh store of the workspace `root` (or in a new database beside
    the one `database_url` names): the server, a keep-alive connection to it, and the
    database made (its name and URL; None on the embedded store)."""
    shutil.rmtree(os.path.join(root, ".stable-harness"), ignore_errors=True)
    database = fresh_database(database_url) if database_url else None
    store = ["--database-url", database[1]] if database else []
    server = subprocess.Popen(
        [binary, "start", "-w", root, "--port", "0", "--insecure-open-surfaces", *store],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        env=dict(os.environ, STABLE_HARNESS_LOG="error", STABLE_HARNESS_ADMIN_KEY=ADMIN_KEY),
    )
    try:
        line = server.stdout.readline().decode()
        base = next(word for word in line.split() if word.startswith("http://"))
        host, port = base[len("http://"):].rstrip("/").split(":")
        connection = http.client.HTTPConnection(host, int(port))
        connection.connect()
        connection.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except BaseException:
        stop_server(server, database, database_url)
        raise
    return server, connection, database


def stop_server(server, database, database_url):
    """Stops a server `start_server` started and drops the database made for it."""
    server.terminate()
    server.wait()
    if database:
        subprocess.run(["psql", database_url, "-qc", f"DROP DATABASE {database[0]}"], check=True)


def one_build(binary, root, requests, timed, stored=(), database_url=None):
    """Starts `binary` on a fresh store, sends each of `stored` (a path and a body) once,
    then the `timed` request (a method, a path and a body) 20 times to warm and `requests`
    times measured."""
    server, connection, database = start_server(binary, root, database_url)
    try:
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {ADMIN_KEY}"}

        def one(method, path, body):
            """The request's time, its answer, and the time to its first token (streamed)."""
            started = time.perf_counter()
            connection.request(method, path, body, headers)
            response = connection.getresponse()
            first = None
            if response.getheader("Content-Type", "").startswith("text/event-stream"):
                lines = []
                for line in response:
                    if first is None and FIRST_TOKEN in line:
                        first = time.perf_counter() - started
                    lines.append(line)
                answer = b"".join(lines)
            else:
                answer = response.read()
            if response.status not in (200, 202):
                raise SystemExit(f"{binary}: {response.status} {answer[:300]!r}")
            return time.perf_counter() - started, answer, first

        last = None
        for path, body in stored:
            last = json.loads(one("POST", path, body)[1])["requestId"]
        method, path, body = timed
        timed = (method, path.replace("{id}", last or ""), body)
        if stored:
            time.sleep(1)  # runs stored without `wait` reach their approval meanwhile
        for _ in range(20):
            one(*timed)
        before = cpu_seconds(server.pid)
        answers = [one(*timed) for _ in range(requests)]
        cpu = (cpu_seconds(server.pid) - before) / requests * 1000
        firsts = [answer[2] for answer in answers if answer[2] is not None]
        first = statistics.median(firsts) * 1000 if firsts else None
        return cpu, statistics.median(answer[0] for answer in answers) * 1000, first
    finally:
        stop_server(server, database, database_url)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bytes", type=int, default=64000)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--surface", choices=["wait", "chat", "chat-sse", "responses", "responses-sse", "list", "view"],
                        default="wait")
    parser.add_argument("--stored", type=int, default=100)
    parser.add_argument("--database-url")
    parser.add_argument("--tools", action="store_true")
    parser.add_argument("--parked", action="store_true")
    parser.add_argument("--chunks", type=int, default=7)
    parser.add_argument("--gap-ms", type=float, default=0.0)
    parser.add_argument("--openai-chunks", action="store_true")
    parser.add_argument("binaries", nargs="+")
    args = parser.parse_args()

    Upstream.chunks = args.chunks
    Upstream.gap = args.gap_ms / 1000
    Upstream.openai = args.openai_chunks
    upstream = ThreadingServer(("127.0.0.1", 0), Upstream)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    root = workspace(f"http://127.0.0.1:{upstream.server_port}/v1", args.tools, args.parked)
    turn = "x" * 990
    messages = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"{i:>9} {turn}"}
        for i in range(args.bytes // 1000)
    ]
    messages.append({"role": "user", "content": "Hello"})
    waited = ("/runtime/requests", json.dumps({"input": {"messages": messages}, "wait": True}).encode())
    stored = ()
    kept = ("/runtime/requests", json.dumps({"input": {"messages": messages}}).encode())
    if args.surface == "wait":
        timed = ("POST", *waited)
    elif args.surface in ("chat", "chat-sse"):
        timed = ("POST", "/v1/chat/completions",
                 json.dumps({"model": "assistant", "messages": messages,
                             "stream": args.surface == "chat-sse"}).encode())
    elif args.surface in ("responses", "responses-sse"):
        timed = ("POST", "/v1/responses",
                 json.dumps({"model": "assistant", "input": messages,
                             "stream": args.surface == "responses-sse"}).encode())
    else:
        listing = args.surface == "list"
        timed = ("GET", "/admin/requests?limit=50" if listing else "/runtime/requests/{id}", None)
        stored = [kept if args.parked else waited] * (args.stored if listing else 1)
    print(f"{args.surface}: a conversation of {len(waited[1])} bytes, {len(messages)} messages", flush=True)
    figures = {binary: [] for binary in args.binaries}
    try:
        for number in range(1, args.rounds + 1):
            for binary in args.binaries:
                cpu, p50, first = one_build(binary, root, args.requests, timed, stored, args.database_url)
                figures[binary].append((cpu, p50, first))
                print(f"round {number} {binary}: CPU {cpu:.3f} ms/request, p50 {p50:.3f} ms"
                      + (f", first token {first:.3f} ms" if first is not None else ""), flush=True)
        for binary, rows in figures.items():
            firsts = [r[2] for r in rows if r[2] is not None]
            print(f"median {binary}: CPU {statistics.median(r[0] for r in rows):.3f} ms/request, "
                  f"p50 {statistics.median(r[1] for r in rows):.3f} ms"
                  + (f", first token {statistics.median(firsts):.3f} ms" if firsts else ""))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
