//! Load benchmark: the `stable-harness` binary with the `openai` adapter in front of a fast
//! loopback upstream, against the same upstream called directly.
//!
//! `cargo bench --bench load` measures, through stable-harness and directly: requests per
//! second and p50/p99 latency at concurrency 1 and 32, and at a fixed 200 requests/second;
//! then prints the added latency, and the server's idle and loaded RSS. Every request is a
//! full run: request, run and every event persisted in the embedded SQLite store, or in the
//! PostgreSQL database `STABLE_HARNESS_BENCH_DATABASE_URL` names. With
//! `STABLE_HARNESS_BENCH_INSTANCES=N` (PostgreSQL only), N instances serve that database and
//! requests go to them in turn, as behind a load balancer. With `STABLE_HARNESS_BENCH_BUDGETS=1`
//! every request also passes two budgets and a rate limit (spend control on the hot path).
#![allow(clippy::print_stdout, clippy::unwrap_used, clippy::expect_used)]

#[path = "../tests/suite/api/upstream.rs"]
#[allow(dead_code)]
mod upstream;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde_json::json;

const PHASE: Duration = Duration::from_secs(5);
const RATE: u32 = 200;

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
    let upstream = upstream::MockUpstream::start().await;
    upstream.set_default(upstream::Reply::Text(
        "A short answer from a fast upstream".into(),
    ));
    let dir = tempfile::tempdir().unwrap();
    write_workspace(dir.path(), &upstream.url);

    // `STABLE_HARNESS_BENCH_DATABASE_URL=postgres://...` measures the PostgreSQL store.
    let store_args: Vec<String> = std::env::var("STABLE_HARNESS_BENCH_DATABASE_URL")
        .map(|url| vec!["--database-url".to_owned(), url])
        .unwrap_or_default();
    let instances: usize = std::env::var("STABLE_HARNESS_BENCH_INSTANCES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(1);
    let mut servers = Vec::new();
    let mut bases = Vec::new();
    for _ in 0..instances {
        let mut server = Command::new(env!("CARGO_BIN_EXE_stable-harness"))
            .args(["start", "-w", dir.path().to_str().unwrap(), "--port", "0"])
            .args(&store_args)
            .env("STABLE_HARNESS_LOG", "error")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(server.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        bases.push(
            line.split_whitespace()
                .find(|w| w.starts_with("http://"))
                .unwrap()
                .to_owned(),
        );
        servers.push(server);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let idle_rss = rss_kib(servers[0].id());

    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(64)
        .build()
        .unwrap();
    let harness = Target {
        name: "stable-harness",
        urls: Arc::new(
            bases
                .iter()
                .map(|base| format!("{base}/v1/chat/completions"))
                .collect(),
        ),
        next: Arc::default(),
        body: json!({ "model": "assistant", "messages": [{ "role": "user", "content": "Hello" }] }),
    };
    // The call stable-harness makes upstream: a streamed completion, read to the end.
    let direct = Target {
        name: "direct",
        urls: Arc::new(vec![format!("{}/chat/completions", upstream.url)]),
        next: Arc::default(),
        body: json!({ "model": "bench-upstream", "stream": true, "stream_options": { "include_usage": true },
                      "messages": [{ "role": "system", "content": "Be brief." }, { "role": "user", "content": "Hello" }] }),
    };
    // Warm both paths (connections, SQLite pages, allocator).
    for target in [&harness, &direct] {
        closed_loop(&client, target, 4, Duration::from_secs(1)).await;
    }

    println!(
        "load: {} s per phase; every stable-harness request persisted ({}; {instances} instance(s))",
        PHASE.as_secs(),
        if store_args.is_empty() {
            "SQLite, WAL"
        } else {
            "PostgreSQL"
        }
    );
    println!(
        "{:<34} {:>9} {:>10} {:>10}",
        "phase", "req/s", "p50 ms", "p99 ms"
    );
    let mut overheads = Vec::new();
    // The fixed rate runs before saturation, so it measures the steady state, not the
    // recovery from an overload.
    for phase in [
        Phase::Concurrency(1),
        Phase::Rate(RATE),
        Phase::Concurrency(32),
    ] {
        let mut results = Vec::new();
        for target in [&direct, &harness] {
            let stats = match phase {
                Phase::Concurrency(n) => closed_loop(&client, target, n, PHASE).await,
                Phase::Rate(rate) => open_loop(&client, target, rate, PHASE).await,
            };
            print_row(phase, target, &stats);
            results.push(stats);
        }
        overheads.push((
            phase.label(),
            results[1].p50 - results[0].p50,
            results[1].p99 - results[0].p99,
        ));
    }
    // Streaming: `/v1/chat/completions` and `/v1/responses` (its exact event sequence) side
    // by side, so the Responses surface's own cost is read off the same run.
    let streamed = |name, path: &str, body| Target {
        name,
        urls: Arc::new(bases.iter().map(|base| format!("{base}{path}")).collect()),
        next: Arc::default(),
        body,
    };
    let chat_stream = streamed(
        "chat SSE",
        "/v1/chat/completions",
        json!({ "model": "assistant", "stream": true, "messages": [{ "role": "user", "content": "Hello" }] }),
    );
    let responses_stream = streamed(
        "responses SSE",
        "/v1/responses",
        json!({ "model": "assistant", "stream": true, "input": "Hello" }),
    );
    for target in [&chat_stream, &responses_stream] {
        closed_loop(&client, target, 4, Duration::from_secs(1)).await;
    }
    let mut surface = Vec::new();
    for phase in [Phase::Concurrency(1), Phase::Concurrency(32)] {
        let mut results = Vec::new();
        for target in [&chat_stream, &responses_stream] {
            let Phase::Concurrency(n) = phase else {
                continue;
            };
            let stats = closed_loop(&client, target, n, PHASE).await;
            print_row(phase, target, &stats);
            results.push(stats);
        }
        surface.push((phase.label(), results.remove(0), results.remove(0)));
    }
    println!();
    for (label, p50, p99) in overheads {
        println!("added by stable-harness, {label:<20} p50 {p50:+.3} ms   p99 {p99:+.3} ms");
    }
    for (label, chat, responses) in surface {
        println!(
            "responses SSE over chat SSE, {label:<16} p50 {:+.1}%   p99 {:+.1}%   req/s {:+.1}%",
            (responses.p50 / chat.p50 - 1.0) * 100.0,
            (responses.p99 / chat.p99 - 1.0) * 100.0,
            (responses.rps / chat.rps - 1.0) * 100.0,
        );
    }
    let loaded_rss = rss_kib(servers[0].id());
    println!(
        "server RSS: idle {:.1} MiB, after load {:.1} MiB",
        idle_rss as f64 / 1024.0,
        loaded_rss as f64 / 1024.0
    );
    for mut server in servers {
        let _ = Command::new("kill")
            .args(["-TERM", &server.id().to_string()])
            .status();
        let _ = server.wait();
    }
}

fn print_row(phase: Phase, target: &Target, stats: &Stats) {
    println!(
        "{:<34} {:>9.0} {:>10.3} {:>10.3}",
        format!("{} {}", phase.label(), target.name),
        stats.rps,
        stats.p50,
        stats.p99
    );
}

#[derive(Clone)]
struct Target {
    name: &'static str,
    /// Taken in turn (several instances behind a balancer).
    urls: Arc<Vec<String>>,
    next: Arc<AtomicUsize>,
    body: serde_json::Value,
}

#[derive(Clone, Copy)]
enum Phase {
    Concurrency(usize),
    Rate(u32),
}

impl Phase {
    fn label(self) -> String {
        match self {
            Phase::Concurrency(n) => format!("concurrency {n}"),
            Phase::Rate(rate) => format!("fixed {rate} req/s"),
        }
    }
}

struct Stats {
    rps: f64,
    p50: f64,
    p99: f64,
}

async fn one(client: &reqwest::Client, target: &Target) -> Duration {
    let started = Instant::now();
    let url = &target.urls[target.next.fetch_add(1, Ordering::Relaxed) % target.urls.len()];
    let response = client.post(url).json(&target.body).send().await.unwrap();
    assert!(
        response.status().is_success(),
        "{} answered {}",
        target.name,
        response.status()
    );
    let _ = response.bytes().await.unwrap();
    started.elapsed()
}

async fn closed_loop(
    client: &reqwest::Client,
    target: &Target,
    workers: usize,
    duration: Duration,
) -> Stats {
    let started = Instant::now();
    let client = Arc::new(client.clone());
    let target = Arc::new(target.clone());
    let mut handles = Vec::new();
    for _ in 0..workers {
        let (client, target) = (Arc::clone(&client), Arc::clone(&target));
        handles.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            while started.elapsed() < duration {
                latencies.push(one(&client, &target).await);
            }
            latencies
        }));
    }
    let mut latencies = Vec::new();
    for handle in handles {
        latencies.extend(handle.await.unwrap());
    }
    stats(latencies, started.elapsed())
}

async fn open_loop(
    client: &reqwest::Client,
    target: &Target,
    rate: u32,
    duration: Duration,
) -> Stats {
    let started = Instant::now();
    let mut interval = tokio::time::interval(Duration::from_secs(1) / rate);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let client = Arc::new(client.clone());
    let target = Arc::new(target.clone());
    let mut handles = Vec::new();
    while started.elapsed() < duration {
        interval.tick().await;
        let (client, target) = (Arc::clone(&client), Arc::clone(&target));
        handles.push(tokio::spawn(async move { one(&client, &target).await }));
    }
    let mut latencies = Vec::new();
    for handle in handles {
        latencies.push(handle.await.unwrap());
    }
    stats(latencies, started.elapsed())
}

fn stats(mut latencies: Vec<Duration>, elapsed: Duration) -> Stats {
    latencies.sort();
    let at = |q: f64| {
        latencies[((latencies.len() as f64 * q) as usize).min(latencies.len() - 1)].as_secs_f64()
            * 1000.0
    };
    Stats {
        rps: latencies.len() as f64 / elapsed.as_secs_f64(),
        p50: at(0.50),
        p99: at(0.99),
    }
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.split_whitespace().next().and_then(|n| n.parse().ok()))
        })
        .unwrap_or(0)
}

fn write_workspace(root: &std::path::Path, upstream: &str) {
    let write = |path: &str, text: String| {
        let path = root.join(path);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    };
    // `STABLE_HARNESS_BENCH_BUDGETS=1`: every request also passes two budgets and a rate limit
    // (limits far above what the run spends), to measure spend control on the hot path.
    let spend = if std::env::var("STABLE_HARNESS_BENCH_BUDGETS").is_ok_and(|v| v == "1") {
        "  budgets:\n    - { name: per-key-daily, scope: apiKey, maxTokens: 100000000000, window: calendarDay }\n    - { name: monthly-cost, scope: workspace, maxCost: 1000000000, window: calendarMonth }\n  rateLimits:\n    - { name: per-key, scope: apiKey, requestsPerMinute: 100000000, tokensPerMinute: 1000000000000 }\n"
    } else {
        ""
    };
    write(
        "config/runtime/workspace.yaml",
        format!(
            "apiVersion: stable-harness/v1\nkind: Runtime\nmetadata: {{ name: bench }}\nspec:\n  defaultAgent: assistant\n  limits: {{ maxConcurrentRuns: 512 }}\n  progress: {{ narration: {{ enabled: true }} }}\n{spend}"
        ),
    );
    write(
        "config/agents/assistant.yaml",
        "apiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: assistant }\nspec:\n  backend: openai\n  model: fast\n  instructions: Be brief.\n".into(),
    );
    write(
        "config/catalogs/models.yaml",
        format!(
            "apiVersion: stable-harness/v1\nkind: ModelCatalog\nmetadata: {{ name: models }}\nspec:\n  models:\n    - {{ id: fast, provider: openai-compatible, baseUrl: \"{upstream}\", upstreamModel: bench-upstream, maxOutputTokens: 1000, pricing: {{ inputPerMTok: 0.15, outputPerMTok: 0.6 }} }}\n"
        ),
    );
}
