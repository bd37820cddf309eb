#!/usr/bin/env python3
"""A real full disk (issue 9): the store on a 4 MiB tmpfs, filled by a ballast file.

The suite's full-store test caps the database with `store.maxSize` (SQLite's SQLITE_FULL,
portable); this script checks the same behaviour against a filesystem that really runs out of
space (ENOSPC in the WAL and its index). It needs root (mount), so it is a manual check:

    cargo build --release && sudo python3 benches/full_disk.py target/release/stable-harness

It prints what it saw and exits 1 if anything acknowledged was lost, a submit while full was
not 503 `store_unavailable`, or the server did not recover by itself.
"""
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

BINARY = sys.argv[1] if len(sys.argv) > 1 else "target/release/stable-harness"
PORT = 18642
BASE = f"http://127.0.0.1:{PORT}"


def post(path, body, timeout=60):
    request = urllib.request.Request(
        BASE + path, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read()), response.headers.get("x-stable-harness-request-id")
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"null"), None


def ready():
    try:
        with urllib.request.urlopen(BASE + "/readyz", timeout=5) as response:
            return response.status == 200
    except urllib.error.HTTPError:
        return False


def main():
    mount = tempfile.mkdtemp(prefix="full-disk-")
    workspace = tempfile.mkdtemp(prefix="full-disk-ws-")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", mount], check=True)
    server = None
    failures = []
    try:
        shutil.copytree("workspace-example", workspace, dirs_exist_ok=True)
        shutil.rmtree(os.path.join(workspace, ".stable-harness"), ignore_errors=True)
        server = subprocess.Popen(
            [BINARY, "start", "-w", workspace, "--port", str(PORT), "--database-url", f"sqlite://{mount}/state.db"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env={**os.environ, "STABLE_HARNESS_LOG": "error"},
        )
        server.stdout.readline()
        with open(os.path.join(mount, "ballast"), "wb") as ballast:
            ballast.write(b"x" * 2_800_000)

        results = {}

        def greet(index):
            results[index] = post("/v1/chat/completions", {"model": "greeter", "messages": [
                {"role": "user", "content": f"{index} " + "g" * 4000}]})

        threads = []
        for index in range(2000):
            thread = threading.Thread(target=greet, args=(index,))
            thread.start()
            threads.append(thread)
            thread.join(0.3)
            if not ready():
                print(f"/readyz red after {index + 1} requests")
                break
        status, body, _ = post("/v1/chat/completions", {"model": "greeter", "messages": [{"role": "user", "content": "full"}]})
        print(f"a submit while full: {status} {body.get('error', {}).get('code') if isinstance(body, dict) else body}")
        if status != 503 or body["error"]["code"] != "store_unavailable":
            failures.append("a submit while full was not 503 store_unavailable")
        print(f"requests paused in flight: {sum(t.is_alive() for t in threads)}")

        os.remove(os.path.join(mount, "ballast"))
        freed = time.time()
        while not ready() and time.time() - freed < 30:
            time.sleep(0.05)
        if not ready():
            failures.append("the server did not recover by itself")
        print(f"/readyz green {time.time() - freed:.2f} s after the space came back")
        for thread in threads:
            thread.join(60)
        acknowledged = [rid for status, _, rid in results.values() if status == 200]
        print(f"answers: {sorted({status for status, _, _ in results.values()})}, {len(acknowledged)} acknowledged")
        server.terminate()
        server.wait(30)
        server = None
        connection = sqlite3.connect(f"{mount}/state.db")
        stored = {row[0] for row in connection.execute("SELECT id FROM requests WHERE status = 'completed'")}
        connection.close()
        lost = [rid for rid in acknowledged if rid not in stored]
        print(f"lost: {len(lost)}", flush=True)
        if lost:
            failures.append(f"{len(lost)} acknowledged requests lost")
    finally:
        if server is not None:
            server.kill()
        subprocess.run(["umount", mount], check=False)
        shutil.rmtree(workspace, ignore_errors=True)
    for failure in failures:
        print("FAILED:", failure)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
