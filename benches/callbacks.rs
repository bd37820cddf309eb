//! Benchmark: what a remote agent's tool callback costs. The binary serves a `backend: http`
//! agent whose service (here, in-process) calls `clock.now` back through the gateway many
//! times in a row over one keep-alive connection, timing each call; it then times as many
//! plain loopback round trips to an endpoint of its own that answers at once. The difference
//! is what the callback path adds to an HTTP round trip: token check, the run's queue, the
//! gateway (schema, policy, the call's records and events, committed), the answer. Compare it
//! with `--bench gateway`, the gateway's own cost in-process. It also prints the server's
//! CPU per callback (user and system time, over the whole request).
//!
//! `cargo bench --bench callbacks` (SQLite; `STABLE_HARNESS_BENCH_DATABASE_URL` for PostgreSQL).
#![allow(clippy::print_stdout, clippy::unwrap_used, clippy::expect_used)]

#[path = "support/server.rs"]
mod server;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Json;
use axum::extract::State;
use serde_json::{Value, json};

const CALLS: usize = 2_000;
const WARMUP: usize = 100;

#[derive(Clone, Default)]
struct Measured {
    callbacks: Arc<Mutex<Vec<Duration>>>,
    baseline: Arc<Mutex<Vec<Duration>>>,
    url: Arc<Mutex<String>>,
}

async fn run(State(measured): State<Measured>, Json(run): Json<Value>) -> Json<Value> {
    let callback = &run["callback"];
    let (url, token) = (
        callback["url"].as_str().unwrap().to_owned(),
        callback["token"].as_str().unwrap().to_owned(),
    );
    let client = reqwest::Client::new();
    let own = measured.url.lock().unwrap().clone();
    let mut callbacks = Vec::with_capacity(CALLS);
    let mut baseline = Vec::with_capacity(CALLS);
    for round in 0..WARMUP + CALLS {
        let started = Instant::now();
        let answer: Value = client
            .post(format!("{url}/tools/clock.now"))
            .bearer_auth(&token)
            .json(&json!({ "arguments": {} }))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let took = started.elapsed();
        assert_eq!(answer["status"], "completed", "{answer}");
        let started = Instant::now();
        let _: Value = client
            .post(format!("{own}/echo"))
            .json(&json!({ "arguments": {} }))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if round >= WARMUP {
            callbacks.push(took);
            baseline.push(started.elapsed());
        }
    }
    *measured.callbacks.lock().unwrap() = callbacks;
    *measured.baseline.lock().unwrap() = baseline;
    Json(json!({ "output": "done" }))
}

async fn echo(Json(body): Json<Value>) -> Json<Value> {
    Json(json!({ "callId": "x", "status": "completed", "result": body }))
}

fn percentile(sorted: &[Duration], q: f64) -> f64 {
    sorted[((sorted.len() as f64 * q) as usize).min(sorted.len() - 1)].as_secs_f64() * 1000.0
}

fn main() {
    stable_harness::app::install_crypto_provider();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let measured = Measured::default();
        let service = axum::Router::new()
            .route("/run", axum::routing::post(run))
            .route("/echo", axum::routing::post(echo))
            .with_state(measured.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let service_url = format!("http://{}", listener.local_addr().unwrap());
        *measured.url.lock().unwrap() = service_url.clone();
        tokio::spawn(async move { axum::serve(listener, service).await.unwrap() });

        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("config");
        std::fs::create_dir_all(&config).unwrap();
        std::fs::write(
            config.join("workspace.yaml"),
            format!(
                "apiVersion: stable-harness/v1\nkind: Runtime\nmetadata: {{ name: bench }}\nspec:\n  defaultAgent: remote\n---\napiVersion: stable-harness/v1\nkind: ToolCatalog\nmetadata: {{ name: tools }}\nspec:\n  tools:\n    - {{ id: clock.now, builtin: clock.now }}\n---\napiVersion: stable-harness/v1\nkind: Agent\nmetadata: {{ name: remote }}\nspec:\n  backend: http\n  endpoint: {{ url: \"{service_url}/run\", timeout: 600s }}\n  tools: [clock.now]\n  timeout: 600s\n"
            ),
        )
        .unwrap();
        let (server, base) = server::start(&server::this_build(), dir.path(), &[]);
        let cpu_before = server::cpu_seconds(server.id());
        let view: Value = reqwest::Client::new()
            .post(format!("{base}/runtime/requests"))
            .json(&json!({ "input": { "text": "go" }, "wait": true }))
            .timeout(Duration::from_secs(600))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(view["status"], "completed", "{view}");
        // The server's CPU over the request, its calls (the warm-up's too) and its end: a
        // steadier figure than the added time, which the machine's wake-ups move.
        let cpu_per_call = (server::cpu_seconds(server.id()) - cpu_before) * 1000.0
            / (WARMUP + CALLS) as f64;
        let mut callbacks = measured.callbacks.lock().unwrap().clone();
        let mut baseline = measured.baseline.lock().unwrap().clone();
        callbacks.sort();
        baseline.sort();
        println!(
            "callbacks: {CALLS} sequential `clock.now` calls from a remote agent's service, one keep-alive connection ({})",
            if server::store_args().is_empty() { "SQLite" } else { "PostgreSQL" }
        );
        println!("{:<32} {:>10} {:>10}", "", "p50 ms", "p99 ms");
        let row = |name: &str, sorted: &[Duration]| {
            println!(
                "{name:<32} {:>10.3} {:>10.3}",
                percentile(sorted, 0.50),
                percentile(sorted, 0.99)
            );
        };
        row("tool callback", &callbacks);
        row("plain loopback round trip", &baseline);
        println!(
            "added by the callback path       p50 {:+.3} ms   p99 {:+.3} ms",
            percentile(&callbacks, 0.50) - percentile(&baseline, 0.50),
            percentile(&callbacks, 0.99) - percentile(&baseline, 0.99)
        );
        println!("server CPU per callback           {cpu_per_call:.3} ms");
        server::stop(server);
    });
}
