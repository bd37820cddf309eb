#!/usr/bin/env python3
"""Where the server's CPU goes, by part of the request path.

Reads `perf script` output of a profile taken with DWARF call stacks (see
docs/profiling.md) and puts each sample in the bucket of the innermost frame that names
one of the parts below; kernel and allocator time is shown inside each bucket.

    perf script -i /tmp/perf.data | python3 benches/perf_buckets.py
"""
import collections
import sys

# (bucket, substrings of a frame): the first frame from the leaf up that matches decides.
BUCKETS = [
    ("serde_json parse", ["serde_json::de::"]),
    ("serde_json serialize", ["serde_json::ser::", "Value as core::fmt::Display"]),
    ("Value drop/clone", ["drop_in_place<serde_json::value::Value",
                          "<serde_json::value::Value as core::clone::Clone",
                          "btree::map::IntoIter<alloc::string::String,serde_json",
                          "BTreeMap<K,V,A>::insert", "VacantEntry"]),
    ("format!/fmt", ["core::fmt::write", "alloc::fmt::format"]),
    ("metrics", ["metrics::", "metrics_util", "metrics_exporter"]),
    ("tracing", ["tracing::", "tracing_subscriber", "tracing_core"]),
    ("sqlite: commit (WAL frames)", ["pagerWalFrames"]),
    ("sqlite: statements", ["sqlite3_step", "sqlite3_prepare", "sqlite3VdbeExec"]),
    ("journal: redaction", ["redact::"]),
    ("journal: other (publish, held)", ["runtime::journal::", "runtime::hub::"]),
    ("sqlite writer other", ["sqlite_writer::"]),
    ("sqlx", ["sqlx_core", "sqlx_sqlite", "sqlx::"]),
    ("upstream client (reqwest/hyper client)", ["reqwest::", "hyper_util::client", "hyper::client"]),
    ("adapter: SSE decode + chunk parse", ["adapters::sse", "OpenAiAdapter::read_stream"]),
    ("adapter: other", ["adapters::openai"]),
    ("run: events/record/narration", ["RunEvents::record", "RunEvents::event", "narration::", "EventSink"]),
    ("run: other", ["runtime::run::"]),
    ("submit", ["Runtime::submit", "submit_inner"]),
    ("http handler", ["http::v1::", "http::responses", "http::runtime_api", "http::views"]),
    ("http server (hyper/axum/tower)", ["hyper::proto::h1", "axum::", "hyper_util::server", "tower_http::", "tower::"]),
    ("tokio runtime, I/O driver, parking", ["tokio::runtime"]),
]
ALLOCATOR = ("malloc", "free", "realloc", "consolidate", "unlink_chunk")


def bucket_of(stack):
    for frame in stack:
        for name, patterns in BUCKETS:
            if any(p in frame for p in patterns):
                return name
    return "other"


def main():
    counts = collections.Counter()
    kinds = collections.Counter()
    threads = collections.Counter()
    stack, thread = [], None

    def flush():
        if thread is None:
            return
        name = bucket_of(stack)
        counts[name] += 1
        threads[thread] += 1
        leaf = stack[0] if stack else ""
        if "[kernel" in leaf:
            kinds[(name, "kernel")] += 1
        elif "libc" in leaf and any(a in leaf for a in ALLOCATOR):
            kinds[(name, "malloc")] += 1

    for line in sys.stdin:
        if not line.strip():
            flush()
            stack, thread = [], None
        elif not line.startswith((" ", "\t")):
            thread, stack = line.split()[0], []
        else:
            stack.append(line.strip())
    flush()
    total = sum(counts.values()) or 1
    print("samples", total, "by thread:", dict(threads))
    for name, count in counts.most_common():
        inside = ", ".join(f"{k} {kinds[(name, k)] * 100 / total:.1f}%"
                           for k in ("kernel", "malloc") if kinds[(name, k)])
        print(f"{count * 100 / total:5.1f}%  {name}" + (f"  ({inside})" if inside else ""))


if __name__ == "__main__":
    main()
