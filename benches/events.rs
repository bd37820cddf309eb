//! Events appended per second through the runtime's journal, on either store.
//!
//! `cargo bench --bench events` measures the embedded SQLite store;
//! `STABLE_HARNESS_BENCH_DATABASE_URL=postgres://... cargo bench --bench events` a PostgreSQL
//! database (empty, or made for the bench: it writes 32 requests' worth of rows). 32 writers,
//! each a request of its own, append events as a streaming run does (fire and forget, then a
//! commit at the end), and the journal batches them into transactions.
#![allow(clippy::print_stdout, clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::Utc;
use serde_json::json;
use stable_harness::store::{EventRecord, RequestRecord, RunStatus, SessionRecord, WriteOp};

const WRITERS: usize = 32;
const EVENTS_PER_WRITER: usize = 2_000;

fn main() {
    stable_harness::app::install_crypto_provider();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(run());
}

async fn run() {
    let dir = tempfile::tempdir().unwrap();
    let url = std::env::var("STABLE_HARNESS_BENCH_DATABASE_URL").ok();
    let store = stable_harness::store::open(url.as_deref(), dir.path(), &Default::default())
        .await
        .unwrap();
    let tracker = tokio_util::task::TaskTracker::new();
    let journal = stable_harness::runtime::Journal::start(
        Arc::clone(&store),
        Arc::new(stable_harness::runtime::EventHub::default()),
        stable_harness::redact::Redactor::default(),
        &tracker,
    );
    let prefix = stable_harness::runtime::new_id("bench");
    for writer in 0..WRITERS {
        journal
            .commit(None, request_ops(&format!("{prefix}_{writer}")))
            .await
            .unwrap();
    }
    let started = Instant::now();
    let mut writers = Vec::new();
    for writer in 0..WRITERS {
        let journal = journal.clone();
        let request = format!("{prefix}_{writer}");
        writers.push(tokio::spawn(async move {
            for index in 0..EVENTS_PER_WRITER {
                let op = WriteOp::AppendEvent(EventRecord {
                    id: stable_harness::runtime::new_id("evt"),
                    request_id: request.as_str().into(),
                    run_id: format!("{request}_run").into(),
                    session_id: "".into(),
                    agent_id: "".into(),
                    seq: 0,
                    event_type: "runtime.model.call.completed".into(),
                    at: Utc::now(),
                    data: json!({ "model": "main", "latencyMs": index, "usage": { "total_tokens": 18 } }),
                });
                journal.write(Some(&request), op).await.unwrap();
            }
            journal.commit(Some(&request), Vec::new()).await.unwrap();
        }));
    }
    for writer in writers {
        writer.await.unwrap();
    }
    let elapsed = started.elapsed();
    let total = WRITERS * EVENTS_PER_WRITER;
    println!(
        "events: {} on {}: {total} events from {WRITERS} writers in {:.2} s = {:.0} events/s",
        if url.is_some() {
            "PostgreSQL"
        } else {
            "SQLite"
        },
        store.describe(),
        elapsed.as_secs_f64(),
        total as f64 / elapsed.as_secs_f64().max(f64::EPSILON)
    );
    // Give the store's background work a moment before the process ends.
    tokio::time::sleep(Duration::from_millis(100)).await;
}

fn request_ops(id: &str) -> Vec<WriteOp> {
    let now = Utc::now();
    vec![
        WriteOp::TouchSession(SessionRecord {
            id: format!("{id}_ses"),
            agent_id: "bench".into(),
            owner: "bench".into(),
            metadata: json!({}),
            created_at: now,
            updated_at: now,
        }),
        WriteOp::InsertRequest(RequestRecord {
            id: id.into(),
            session_id: format!("{id}_ses"),
            agent_id: "bench".into(),
            protocol: "bench".into(),
            owner: "bench".into(),
            status: RunStatus::Running,
            input: json!({}),
            output: None,
            error: None,
            usage: None,
            metadata: json!({}),
            created_at: now,
            updated_at: now,
        }),
    ]
}
