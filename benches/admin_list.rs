//! `GET /admin/requests` over HTTP with 100,000 stored requests: the first page, a deep page
//! (a cursor 90% of the way down) and a filtered page, each asked 300 times one after another;
//! p50 and p99 per page.
//!
//! `cargo bench --bench admin_list` measures the embedded SQLite store;
//! `STABLE_HARNESS_BENCH_DATABASE_URL=postgres://... cargo bench --bench admin_list` an empty
//! PostgreSQL database. `STABLE_HARNESS_BENCH_REQUESTS` changes the count.
#![allow(clippy::print_stdout, clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::Utc;
use serde_json::json;
use stable_harness::app::{Application, ServerConfig};
use stable_harness::store::{RequestRecord, RunRecord, RunStatus, SessionRecord, WriteOp};

const ASKS: usize = 300;
const ADMIN_KEY: &str = "bench-admin-key";

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
    let count: usize = std::env::var("STABLE_HARNESS_BENCH_REQUESTS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(100_000);
    let url = std::env::var("STABLE_HARNESS_BENCH_DATABASE_URL").ok();
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("config")).unwrap();
    std::fs::write(
        dir.path().join("config/workspace.yaml"),
        "apiVersion: stable-harness/v1\nkind: Runtime\nmetadata: { name: bench }\nspec:\n  defaultAgent: greeter\n---\napiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: greeter }\nspec:\n  backend: scripted\n  script: [{ reply: hi }]\n",
    )
    .unwrap();
    let workspace = Arc::new(stable_harness::workspace::load(dir.path()).unwrap());
    let app = Application::build(ServerConfig {
        workspace,
        host: "127.0.0.1".into(),
        port: 0,
        database_url: url.clone(),
        api_keys: vec!["bench-client-key".into()],
        admin_keys: vec![ADMIN_KEY.into()],
        insecure_open_surfaces: false,
        metrics_public: false,
        watch: false,
    })
    .await
    .unwrap();
    let store = Arc::clone(app.runtime().store());
    let filled = Instant::now();
    let mut ids = Vec::with_capacity(count);
    let owners = ["alice", "bob", "carol", "dave"];
    for chunk in 0..count.div_ceil(1_000) {
        let mut ops = Vec::new();
        for index in chunk * 1_000..((chunk + 1) * 1_000).min(count) {
            let now = Utc::now();
            let request = stable_harness::runtime::new_id("req");
            let session = stable_harness::runtime::new_id("ses");
            let owner = owners[index % owners.len()].to_owned();
            ops.push(WriteOp::TouchSession(SessionRecord {
                id: session.clone(),
                agent_id: "greeter".into(),
                owner: owner.clone(),
                metadata: json!({}),
                created_at: now,
                updated_at: now,
            }));
            ops.push(WriteOp::InsertRequest(RequestRecord {
                id: request.clone(),
                session_id: session,
                agent_id: "greeter".into(),
                protocol: "runtime".into(),
                owner,
                status: RunStatus::Completed,
                input: json!({ "messages": [{ "role": "user", "content": "hello" }] }),
                output: Some("hi".into()),
                error: None,
                usage: None,
                metadata: json!({}),
                created_at: now,
                updated_at: now,
            }));
            ops.push(WriteOp::InsertRun(RunRecord {
                id: stable_harness::runtime::new_id("run"),
                request_id: request.clone(),
                attempt: 1,
                status: RunStatus::Completed,
                state: None,
                error: None,
                created_at: now,
                updated_at: now,
                started_at: Some(now),
                ended_at: Some(now),
                lease: None,
                cancel_requested_by: None,
            }));
            ids.push(request);
        }
        store.apply(&ops).await.unwrap();
    }
    println!(
        "admin_list: stored {count} requests in {:.1} s",
        filled.elapsed().as_secs_f64()
    );
    let base = format!("http://{}", app.address());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(app.run_until(async move {
        let _ = stopped.await;
    }));
    let http = reqwest::Client::new();
    // Ids sort by creation and lists run newest first: a cursor at the 10th percentile of
    // creation is 90% of the way down the list.
    let deep = &ids[count / 10];
    let store_name = if url.is_some() { "postgres" } else { "sqlite" };
    for (name, query) in [
        ("first page", "limit=50".to_owned()),
        ("deep page", format!("limit=50&cursor={deep}")),
        (
            "owner filter, deep",
            format!("limit=50&owner=carol&cursor={deep}"),
        ),
        ("status filter", "limit=50&status=completed".to_owned()),
    ] {
        let url = format!("{base}/admin/requests?{query}");
        let mut took = Vec::with_capacity(ASKS);
        for _ in 0..ASKS {
            let started = Instant::now();
            let response = http.get(&url).bearer_auth(ADMIN_KEY).send().await.unwrap();
            assert_eq!(response.status(), 200);
            let page: serde_json::Value = response.json().await.unwrap();
            assert_eq!(page["data"].as_array().unwrap().len(), 50);
            took.push(started.elapsed());
        }
        took.sort();
        let at = |q: f64| took[((took.len() as f64 * q) as usize).min(took.len() - 1)];
        println!(
            "admin_list: {store_name} {count} requests, {name}: p50 {:.2} ms, p99 {:.2} ms",
            ms(at(0.5)),
            ms(at(0.99))
        );
    }
    let _ = stop.send(());
    let _ = server.await;
}

fn ms(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1000.0
}
