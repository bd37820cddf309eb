"""The official OpenAI SDKs against the real binary: a loopback upstream that speaks Chat
Completions (scripted replies, tool calls, SSE) and serves an HTTP tool, a workspace pointing at
it, and `stable-harness start` on a random port. Run by `.ci/sdk.sh`, which installs the SDKs."""

import json
import os
import re
import subprocess
import tempfile
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

CLIENT_KEY = "sdk-client-key"
ADMIN_KEY = "sdk-admin-key"
# Where the server started by `base_url` keeps its embedded store, once it is started.
SERVER = {}



class Upstream:
    """Scripted replies, in order; every request body is kept."""

    def __init__(self):
        self.replies = []
        self.requests = []
        self.tool_calls = []
        self.lock = threading.Lock()

    def push(self, *replies):
        with self.lock:
            self.replies.extend(replies)

    def next_reply(self, body):
        with self.lock:
            self.requests.append(body)
            return self.replies.pop(0) if self.replies else {"text": "(no reply scripted)"}


def text_reply(text):
    return {"text": text}


def calls_reply(*calls):
    """A turn calling tools: (function name, arguments as JSON text)."""
    return {"tool_calls": list(calls)}


def handler_for(upstream):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def send_json(self, status, body):
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self.send_json(200, {"object": "list", "data": [{"id": "main-upstream", "object": "model"}]})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["content-length"])) or b"{}")
            if self.path.endswith("/weather"):
                upstream.tool_calls.append(body)
                self.send_json(200, {"city": body.get("city"), "temperature": 21})
                return
            reply = upstream.next_reply(body)
            usage = {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18}
            calls = [
                {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": args}}
                for i, (name, args) in enumerate(reply.get("tool_calls", []))
            ]
            finish = "tool_calls" if calls else "stop"
            if not body.get("stream"):
                message = {"role": "assistant", "content": reply.get("text")}
                if calls:
                    message["tool_calls"] = calls
                self.send_json(200, {
                    "id": "chatcmpl-up", "object": "chat.completion", "created": 0, "model": body.get("model"),
                    "choices": [{"index": 0, "message": message, "finish_reason": finish}], "usage": usage,
                })
                return
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.end_headers()

            def chunk(delta, finish_reason=None, with_usage=None):
                data = {"id": "chatcmpl-up", "object": "chat.completion.chunk", "created": 0,
                        "model": body.get("model"),
                        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}
                if with_usage:
                    data["choices"] = []
                    data["usage"] = with_usage
                self.wfile.write(f"data: {json.dumps(data)}\n\n".encode())

            chunk({"role": "assistant", "content": ""})
            for word in re.findall(r"\S+\s*", reply.get("text") or ""):
                chunk({"content": word})
            for index, call in enumerate(calls):
                chunk({"tool_calls": [{"index": index, "id": call["id"], "type": "function",
                                       "function": {"name": call["function"]["name"], "arguments": ""}}]})
                chunk({"tool_calls": [{"index": index, "function": {"arguments": call["function"]["arguments"]}}]})
            chunk({}, finish)
            chunk({}, with_usage=usage)
            self.wfile.write(b"data: [DONE]\n\n")

    return Handler


WORKSPACE = """apiVersion: stable-harness/v1
kind: Runtime
metadata: {{ name: sdk }}
spec:
  defaultAgent: coder
  governance:
    default: allow
  rateLimits:
    - {{ name: greeter-pace, scope: agent, match: {{ agents: [greeter] }}, requestsPerMinute: 60 }}
---
apiVersion: stable-harness/v1
kind: ModelCatalog
metadata: {{ name: models }}
spec:
  models:
    - {{ id: main, provider: openai-compatible, baseUrl: "{url}/v1", upstreamModel: main-upstream, timeout: 10s }}
---
apiVersion: stable-harness/v1
kind: ToolCatalog
metadata: {{ name: tools }}
spec:
  tools:
    - id: weather.lookup
      description: Current weather for a city.
      inputSchema: {{ type: object, properties: {{ city: {{ type: string }} }}, required: [city] }}
      risk: low
      http: {{ method: POST, url: "{url}/weather" }}
---
apiVersion: stable-harness/v1
kind: Agent
metadata: {{ name: coder }}
spec:
  backend: openai
  model: main
  instructions: You help with code.
  tools: [weather.lookup]
  clientTools: {{ enabled: true, risk: medium }}
---
apiVersion: stable-harness/v1
kind: Agent
metadata: {{ name: greeter }}
spec:
  backend: scripted
  script: [{{ reply: "Hello {{{{input}}}}" }}]
"""


@pytest.fixture(scope="session")
def upstream():
    state = Upstream()
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler_for(state))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    yield state
    server.shutdown()


@pytest.fixture(scope="session")
def base_url(upstream):
    binary = os.environ.get("STABLE_HARNESS_BIN", "target/debug/stable-harness")
    with tempfile.TemporaryDirectory() as work:
        os.makedirs(f"{work}/ws/config")
        with open(f"{work}/ws/config/workspace.yaml", "w") as f:
            f.write(WORKSPACE.format(url=upstream.url))
        out = open(f"{work}/server.out", "w+")
        server = subprocess.Popen(
            [binary, "start", "-w", f"{work}/ws", "--port", "0", "--api-key", CLIENT_KEY, "--admin-key", ADMIN_KEY],
            stdout=out, stderr=subprocess.PIPE, env={**os.environ, "STABLE_HARNESS_LOG": "warn"},
        )
        base = None
        for _ in range(200):
            out.seek(0)
            found = re.search(r"http://[0-9.:]+", out.read())
            if found:
                try:
                    urllib.request.urlopen(found.group(0) + "/readyz", timeout=1)
                    base = found.group(0)
                    break
                except OSError:
                    pass
            time.sleep(0.05)
        assert base, "the server did not start"
        SERVER["store"] = f"{work}/ws/.stable-harness/state.db"
        yield base
        server.terminate()
        server.wait(timeout=10)


def stored_input(request_id):
    """The input the server's embedded store holds for a request, read-only while it serves."""
    import sqlite3

    with sqlite3.connect(f"file:{SERVER['store']}?mode=ro", uri=True) as db:
        (text,) = db.execute("SELECT input FROM requests WHERE id = ?", (request_id,)).fetchone()
    return json.loads(text)


def admin(base_url, method, path, body=None):
    request = urllib.request.Request(
        base_url + path, method=method, data=json.dumps(body).encode() if body is not None else None,
        headers={"authorization": f"Bearer {ADMIN_KEY}", "content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())
