//! Benchmark: what spend control adds to one request on the hot path — admission (budgets
//! with room? rate limits), the reservation before its model call, and the settlement after
//! it (the ledger record and the counters, written in one transaction) — on the embedded
//! store, as the server runs it.
//!
//! Three configurations, each measured per request (one model call): the ledger alone (no
//! budget or limit matches), two budgets (per key per day in tokens, the workspace per month
//! in cost) and one rate limit (requests and tokens per minute), and the same over the
//! PostgreSQL database `STABLE_HARNESS_BENCH_DATABASE_URL` names, when set.
//!
//! `cargo bench --bench spend [-- REQUESTS]` prints mean, p50 and p99 in microseconds.
#![allow(clippy::print_stdout, clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::Utc;
use stable_harness::spend::{Payer, Spend};
use stable_harness::store::spend::{Amount, UsageRecord};
use stable_harness::store::{OpenOptions, Store};
use stable_harness::workspace::CompiledWorkspace;

const WARMUP: usize = 500;

fn workspace(dir: &std::path::Path, spend: &str) -> CompiledWorkspace {
    let write = |path: &str, text: &str| {
        let path = dir.join(path);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    };
    write(
        "config/runtime/workspace.yaml",
        &format!(
            "apiVersion: stable-harness/v1\nkind: Runtime\nmetadata: {{ name: bench }}\nspec:\n  defaultAgent: assistant\n{spend}"
        ),
    );
    write(
        "config/agents/assistant.yaml",
        "apiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: assistant }\nspec:\n  backend: openai\n  model: main\n",
    );
    write(
        "config/catalogs/models.yaml",
        "apiVersion: stable-harness/v1\nkind: ModelCatalog\nmetadata: { name: models }\nspec:\n  models:\n    - { id: main, provider: openai-compatible, baseUrl: \"http://127.0.0.1:9/v1\", upstreamModel: m, maxOutputTokens: 1000, pricing: { inputPerMTok: 0.15, outputPerMTok: 0.6 } }\n",
    );
    stable_harness::workspace::load(dir).unwrap()
}

const BUDGETS: &str = "  budgets:\n    - { name: per-key-daily, scope: apiKey, maxTokens: 100000000000, window: calendarDay }\n    - { name: monthly-cost, scope: workspace, maxCost: 1000000000, window: calendarMonth }\n  rateLimits:\n    - { name: per-key, scope: apiKey, requestsPerMinute: 100000000, tokensPerMinute: 1000000000000 }\n";

async fn measure(
    label: &str,
    store: Arc<dyn Store>,
    workspace: &CompiledWorkspace,
    requests: usize,
) {
    let spend = Spend::new(Arc::clone(&store));
    let labels = Default::default();
    let payer = Payer {
        key: "key-0123456789ab",
        key_labels: &labels,
        agent: "assistant",
        session: "ses_bench",
    };
    let mut took = Vec::with_capacity(requests);
    for i in 0..WARMUP + requests {
        let started = Instant::now();
        spend.admit(workspace, &payer, true).await.unwrap();
        let hold = spend
            .reserve(
                workspace,
                &payer,
                "run_bench",
                Amount {
                    tokens: 1_100,
                    cost_nanos: 615_000,
                },
            )
            .await
            .unwrap();
        let record = UsageRecord {
            id: format!("use_{label}_{i}"),
            at: Utc::now(),
            request_id: format!("req_{i}"),
            run_id: "run_bench".into(),
            owner: payer.key.to_owned(),
            agent_id: payer.agent.to_owned(),
            session_id: payer.session.to_owned(),
            model: "main".into(),
            source: "model".into(),
            prompt_tokens: 100,
            completion_tokens: 200,
            cost_nanos: Some(135_000),
            estimated: false,
        };
        spend
            .settle(workspace, &payer, hold, &record)
            .await
            .unwrap();
        if i >= WARMUP {
            took.push(started.elapsed());
        }
    }
    took.sort();
    let mean = took.iter().sum::<Duration>() / took.len() as u32;
    let at = |q: f64| took[((took.len() as f64 * q) as usize).min(took.len() - 1)];
    println!(
        "{label:<42} mean {:>7.1} µs   p50 {:>7.1} µs   p99 {:>7.1} µs",
        mean.as_secs_f64() * 1e6,
        at(0.50).as_secs_f64() * 1e6,
        at(0.99).as_secs_f64() * 1e6,
    );
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    stable_harness::app::install_crypto_provider();
    let requests: usize = std::env::args()
        .skip(1)
        .find_map(|arg| arg.parse().ok())
        .unwrap_or(10_000);
    println!("spend accounting per request (admit + reserve + settle), {requests} requests");
    for (label, spend) in [
        ("sqlite: ledger only", ""),
        ("sqlite: 2 budgets + 1 rate limit", BUDGETS),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let workspace = workspace(dir.path(), spend);
        let store: Arc<dyn Store> = Arc::new(
            stable_harness::store::SqliteStore::open_file_with(
                &dir.path().join("state.db"),
                &OpenOptions::default(),
            )
            .await
            .unwrap(),
        );
        measure(label, store, &workspace, requests).await;
    }
    if let Ok(url) = std::env::var("STABLE_HARNESS_BENCH_DATABASE_URL") {
        let dir = tempfile::tempdir().unwrap();
        let workspace = workspace(dir.path(), BUDGETS);
        let store = stable_harness::store::open(Some(&url), dir.path(), &OpenOptions::default())
            .await
            .unwrap();
        measure(
            "postgres: 2 budgets + 1 rate limit",
            store,
            &workspace,
            requests / 10,
        )
        .await;
    }
}
