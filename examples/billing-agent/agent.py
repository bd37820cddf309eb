#!/usr/bin/env python3
"""A reference agent service for stable-harness's `http` backend (protocol
`stable-harness.agent/v1`), in the Python standard library only.

For each run it is posted, it streams a `progress` event, calls the agent's tools back through
the gateway with the run's callback token, then streams its answer as `delta` events and ends
with `final`. It answers billing questions the simple way: it reports the date the gateway's
`clock.now` tool gives, and what the tools it was asked to call returned.

What a run may ask of it, in the request's `metadata` (for demos and tests):
- `callTools`: a list of `{tool, arguments}` to call back in order (default: `clock.now` when
  the agent has it). Each call carries an `Idempotency-Key` made of the run id and its place,
  so a run resumed after a crash gets the recorded result instead of a second execution.
- `fail503`: answer the first N posts of a request with 503 (the runtime retries).
- `pauseSeconds`: wait this long after the callbacks, before answering.

Usage: agent.py [--port 9100] [--key-env BILLING_AGENT_KEY]. With the key's variable set,
posts without `Authorization: Bearer <key>` get 401. `GET /last` returns the callback of the
newest run (for tests that replay a token after its run ended).
"""

import argparse
import hmac
import json
import os
import sys
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PROTOCOL = "stable-harness.agent/v1"
attempts = {}
last_callback = {}


def call_back(callback, tool, arguments, key):
    """Calls a tool through the gateway; waits (polling) while an operator decides."""
    request = urllib.request.Request(
        f"{callback['url']}/tools/{tool}",
        data=json.dumps({"arguments": arguments}).encode(),
        method="POST",
        headers={"authorization": f"Bearer {callback['token']}", "content-type": "application/json",
                 "idempotency-key": key},
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            answer = json.loads(response.read())
            status = response.status
    except urllib.error.HTTPError as error:
        return {"status": "error", "error": {"code": f"http_{error.code}", "message": error.read().decode()[:200]}}
    while status == 202:
        time.sleep(0.2)
        poll = urllib.request.Request(
            f"{callback['url']}/calls/{answer['callId']}",
            headers={"authorization": f"Bearer {callback['token']}"},
        )
        with urllib.request.urlopen(poll, timeout=30) as response:
            answer = json.loads(response.read())
            status = response.status
    return answer


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def reply_json(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/last":
            self.reply_json(200, last_callback)
        else:
            self.reply_json(404, {"error": "not found"})

    def event(self, body):
        data = f"data: {json.dumps(body)}\n\n".encode()
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def do_POST(self):
        key = os.environ.get(self.server.key_env or "", "")
        given = self.headers.get("authorization", "")
        if key and not hmac.compare_digest(given, f"Bearer {key}"):
            self.reply_json(401, {"error": "unauthorized"})
            return
        run = json.loads(self.rfile.read(int(self.headers.get("content-length", "0"))) or b"{}")
        if run.get("protocol") != PROTOCOL:
            self.reply_json(400, {"error": f"expected protocol {PROTOCOL}"})
            return
        metadata = run.get("metadata") or {}
        request_id = run.get("requestId")
        attempts[request_id] = attempts.get(request_id, 0) + 1
        if attempts[request_id] <= int(metadata.get("fail503", 0)):
            self.reply_json(503, {"error": "warming up"})
            return
        callback = run.get("callback")
        if callback:
            last_callback.clear()
            last_callback.update(callback, runId=run.get("runId"))
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        self.event({"type": "progress", "message": "Looking at your billing question"})
        names = [tool["function"]["name"] for tool in run.get("tools", [])]
        calls = metadata.get("callTools")
        if calls is None:
            calls = [{"tool": "clock.now", "arguments": {}}] if "clock.now" in names else []
        lines = []
        for place, call in enumerate(calls):
            if not callback:
                lines.append(f"{call['tool']}: no callback (the run has no server to call back)")
                continue
            answer = call_back(callback, call["tool"], call.get("arguments", {}), f"{run['runId']}.{place}")
            if answer.get("status") == "completed":
                lines.append(f"{call['tool']}: {json.dumps(answer.get('result'))}")
            else:
                lines.append(f"{call['tool']} {answer.get('status')}: {answer.get('error', {}).get('message', '')}")
        time.sleep(float(metadata.get("pauseSeconds", 0)))
        question = next((m.get("content") for m in reversed(run.get("messages", [])) if m.get("role") == "user"), "")
        text = f"Billing desk: you asked {json.dumps(question)}."
        if lines:
            text += " " + " ".join(lines)
        words = text.split(" ")
        for place, word in enumerate(words):
            self.event({"type": "delta", "text": word if place == len(words) - 1 else word + " "})
        # What the run cost, charged to the workspace's budgets (this service calls no model:
        # it reports a word count; a real one reports its model's usage and, if priced, cost).
        prompt, completion = len(question.split()), len(words)
        self.event({"type": "final", "output": "", "usage": {
            "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}})
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=9100)
    parser.add_argument("--key-env", default="BILLING_AGENT_KEY")
    args = parser.parse_args()
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    server.key_env = args.key_env
    print(f"billing agent listening on http://127.0.0.1:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
