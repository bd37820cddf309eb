//! The soak (issue 9): the real binary serves a fixed rate of `/v1/chat/completions` against
//! the loopback upstream for a while, and the store and the process must stay bounded: every
//! request answered, the write-ahead log under 64 MiB at every sample, and the database grown
//! by no more than the per-request footprint. It prints a table per window: requests, errors,
//! p50/p99, RSS and the process's own memory (`RssAnon`: RSS without the binary's mapped
//! pages), WAL, `-shm` and database size; and the bytes stored per request.
//!
//! Sizes come from the environment: `STABLE_HARNESS_SOAK_SECONDS` (default 20),
//! `STABLE_HARNESS_SOAK_RATE` (requests per second, default 100) and
//! `STABLE_HARNESS_SOAK_WINDOWS` (table rows, default 5). The full soak of the README is
//! `STABLE_HARNESS_SOAK_SECONDS=600 STABLE_HARNESS_SOAK_RATE=200 STABLE_HARNESS_SOAK_WINDOWS=10
//! cargo test --release --test suite soak -- --nocapture`. Latency and RSS are reported, never
//! asserted: a test has no timing thresholds.

#![allow(clippy::print_stdout)] // the soak reports its table on stdout (`--nocapture`)

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::json;

use crate::api::upstream::{MockUpstream, Reply};
use crate::api::{CLIENT_KEY, ServerProcess, api_workspace};
use crate::helpers::{store_path, store_rows};

/// The WAL (and its index) must stay under this at every sample.
const WAL_LIMIT: u64 = 64 * 1024 * 1024;
/// How often the files and the RSS are sampled.
const SAMPLE_EVERY: Duration = Duration::from_millis(250);
/// Most bytes a simple request may add to the database (the footprint, with room for the
/// b-tree's slack); a regression past it means something new is stored per request.
const MAX_BYTES_PER_REQUEST: u64 = 6 * 1024;

#[derive(Debug, Clone, Copy)]
struct Sizes {
    seconds: u64,
    rate: u64,
    windows: u64,
}

impl Sizes {
    fn from_env() -> Self {
        let number = |name: &str, default: u64| {
            std::env::var(name).ok().map_or(default, |v| {
                v.trim()
                    .parse::<u64>()
                    .unwrap_or_else(|e| panic!("{name}={v:?}: {e}"))
                    .max(1)
            })
        };
        Self {
            seconds: number("STABLE_HARNESS_SOAK_SECONDS", 20),
            rate: number("STABLE_HARNESS_SOAK_RATE", 100),
            windows: number("STABLE_HARNESS_SOAK_WINDOWS", 5),
        }
    }
}

/// One answered (or failed) request: when it was sent, from the start, and how long it took.
struct Outcome {
    sent: Duration,
    latency: Duration,
    ok: bool,
}

/// One sample of the process and the store's files.
#[derive(Debug, Clone, Copy, Default)]
struct Sample {
    at: Duration,
    rss: u64,
    /// The process's own memory (`RssAnon`): RSS without the binary's mapped pages, which
    /// follow the page cache rather than what the server holds.
    own: u64,
    wal: u64,
    shm: u64,
    db: u64,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_and_the_process_stay_bounded_under_a_fixed_rate() {
    let sizes = Sizes::from_env();
    println!("soak: {sizes:?}");
    let upstream = MockUpstream::start().await;
    // Hours at full size: a record of every call would grow this process without end.
    upstream.stop_recording();
    upstream.set_default(Reply::Text("A short answer from a fast upstream".into()));
    let workspace = api_workspace(&upstream, "  limits: { maxConcurrentRuns: 512 }\n");
    let server = ServerProcess::start(workspace.path(), &[("STABLE_HARNESS_LOG", "error")]);
    let db = store_path(workspace.path());
    stable_harness::app::install_crypto_provider();
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(256)
        .build()
        .unwrap();
    let url = server.url("/v1/chat/completions");
    let send = {
        let (client, url) = (client.clone(), url.clone());
        move |index: u64| {
            let (client, url) = (client.clone(), url.clone());
            async move {
                let response = client
                    .post(&url)
                    .bearer_auth(CLIENT_KEY)
                    .json(&json!({ "model": "assistant",
                        "messages": [{ "role": "user", "content": format!("Hello number {index}") }] }))
                    .send()
                    .await;
                match response {
                    Ok(response) if response.status().is_success() => {
                        response.bytes().await.is_ok()
                    }
                    _ => false,
                }
            }
        }
    };
    // Warm up (connections, pages), then take the baseline the footprint is measured from.
    for index in 0..20 {
        assert!(send(index).await, "warm-up request {index} failed");
    }
    let baseline = sample(&server, &db, Duration::ZERO);
    let requests_before = count_requests(&db);
    let live_before = live_bytes(&db);

    let started = Instant::now();
    let duration = Duration::from_secs(sizes.seconds);
    let samples = Arc::new(Mutex::new(Vec::new()));
    let sampler = {
        let samples = Arc::clone(&samples);
        let pid = server.pid();
        let db = db.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(SAMPLE_EVERY);
            while started.elapsed() < duration {
                tick.tick().await;
                let at = started.elapsed();
                samples.lock().unwrap().push(sample_pid(pid, &db, at));
            }
        })
    };
    let outcomes = Arc::new(Mutex::new(Vec::new()));
    let mut interval = tokio::time::interval(Duration::from_secs(1) / sizes.rate as u32);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut handles = Vec::new();
    let mut index = 0u64;
    while started.elapsed() < duration {
        interval.tick().await;
        index += 1;
        let (send, outcomes) = (send.clone(), Arc::clone(&outcomes));
        handles.push(tokio::spawn(async move {
            let sent = started.elapsed();
            let ok = send(index).await;
            outcomes.lock().unwrap().push(Outcome {
                sent,
                latency: started.elapsed() - sent,
                ok,
            });
        }));
    }
    for handle in handles {
        handle.await.unwrap();
    }
    sampler.await.unwrap();
    let outcomes = std::mem::take(&mut *outcomes.lock().unwrap());
    let samples = std::mem::take(&mut *samples.lock().unwrap());

    print_table(&sizes, &outcomes, &samples, &baseline);
    let errors = outcomes.iter().filter(|o| !o.ok).count();
    let sent = outcomes.len() as u64;

    // The footprint: live pages (free pages are space the database reuses) per request, once
    // the server stopped and its WAL is folded in.
    server.terminate();
    let requests_after = count_requests(&db);
    assert_eq!(
        requests_after - requests_before,
        sent,
        "every request sent is stored"
    );
    let live_after = live_bytes(&db);
    let per_request = live_after.saturating_sub(live_before) / sent.max(1);
    println!(
        "stored: {sent} requests, {:.1} MiB live data, {per_request} bytes per request",
        live_after as f64 / MIB
    );

    assert_eq!(errors, 0, "{errors} of {sent} requests failed");
    let peak_wal = samples.iter().map(|s| s.wal).max().unwrap_or(0);
    let peak_shm = samples.iter().map(|s| s.shm).max().unwrap_or(0);
    assert!(
        peak_wal < WAL_LIMIT,
        "the WAL reached {peak_wal} bytes (limit {WAL_LIMIT})"
    );
    assert!(
        peak_shm < WAL_LIMIT / 64,
        "the WAL index reached {peak_shm} bytes"
    );
    assert!(
        per_request <= MAX_BYTES_PER_REQUEST,
        "a simple request stores {per_request} bytes (at most {MAX_BYTES_PER_REQUEST} expected)"
    );
}

const MIB: f64 = 1024.0 * 1024.0;

fn print_table(sizes: &Sizes, outcomes: &[Outcome], samples: &[Sample], baseline: &Sample) {
    let window = Duration::from_secs(sizes.seconds).as_secs_f64() / sizes.windows as f64;
    println!(
        "{:>8} {:>9} {:>7} {:>8} {:>8} {:>8} {:>8} {:>9} {:>9} {:>8}",
        "window",
        "requests",
        "errors",
        "p50 ms",
        "p99 ms",
        "RSS MiB",
        "own MiB",
        "WAL MiB",
        "shm KiB",
        "db MiB"
    );
    println!(
        "{:>8} {:>9} {:>7} {:>8} {:>8} {:>8.1} {:>8.1} {:>9.1} {:>9.0} {:>8.1}",
        "start",
        "",
        "",
        "",
        "",
        baseline.rss as f64 / MIB,
        baseline.own as f64 / MIB,
        baseline.wal as f64 / MIB,
        baseline.shm as f64 / 1024.0,
        baseline.db as f64 / MIB
    );
    for row in 0..sizes.windows {
        let (from, to) = (window * row as f64, window * (row + 1) as f64);
        let inside = |at: Duration| at.as_secs_f64() >= from && at.as_secs_f64() < to;
        let mut latencies: Vec<Duration> = outcomes
            .iter()
            .filter(|o| inside(o.sent))
            .map(|o| o.latency)
            .collect();
        latencies.sort();
        let errors = outcomes.iter().filter(|o| inside(o.sent) && !o.ok).count();
        let quantile = |q: f64| {
            latencies
                .get(((latencies.len() as f64 * q) as usize).min(latencies.len().saturating_sub(1)))
                .map_or(0.0, |d| d.as_secs_f64() * 1000.0)
        };
        let in_window: Vec<&Sample> = samples.iter().filter(|s| inside(s.at)).collect();
        let peak = |pick: fn(&Sample) -> u64| in_window.iter().map(|s| pick(s)).max().unwrap_or(0);
        let last = in_window.last().copied().copied().unwrap_or_default();
        println!(
            "{:>7.0}s {:>9} {:>7} {:>8.2} {:>8.2} {:>8.1} {:>8.1} {:>9.1} {:>9.0} {:>8.1}",
            to,
            latencies.len(),
            errors,
            quantile(0.50),
            quantile(0.99),
            last.rss as f64 / MIB,
            last.own as f64 / MIB,
            peak(|s| s.wal) as f64 / MIB,
            peak(|s| s.shm) as f64 / 1024.0,
            last.db as f64 / MIB
        );
    }
    println!(
        "(RSS, own and db: last sample of the window; WAL and shm: peak of the window; own: RssAnon)"
    );
}

fn sample(server: &ServerProcess, db: &Path, at: Duration) -> Sample {
    sample_pid(server.pid(), db, at)
}

fn sample_pid(pid: u32, db: &Path, at: Duration) -> Sample {
    // Read once for both fields: one sample, one view of the process.
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    Sample {
        at,
        rss: status_kib(&status, "VmRSS:").saturating_mul(1024),
        own: status_kib(&status, "RssAnon:").saturating_mul(1024),
        wal: file_size(&with_suffix(db, "-wal")),
        shm: file_size(&with_suffix(db, "-shm")),
        db: file_size(db),
    }
}

fn with_suffix(db: &Path, suffix: &str) -> PathBuf {
    let mut name = db.as_os_str().to_owned();
    name.push(suffix);
    PathBuf::from(name)
}

fn file_size(path: &Path) -> u64 {
    std::fs::metadata(path).map_or(0, |m| m.len())
}

/// A field of a `/proc/PID/status` text given in KiB (`VmRSS:`, `RssAnon:`), 0 when absent.
fn status_kib(status: &str, field: &str) -> u64 {
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next().and_then(|n| n.parse().ok()))
        .unwrap_or(0)
}

fn count_requests(db: &Path) -> u64 {
    store_rows(db, "SELECT COUNT(*) AS n FROM requests")[0]["n"]
        .as_u64()
        .unwrap()
}

/// Bytes in use in the database (pages not on the free list), WAL included: read through
/// SQLite, which sees the WAL's committed pages.
fn live_bytes(db: &Path) -> u64 {
    let row = &store_rows(
        db,
        "SELECT (SELECT page_count FROM pragma_page_count) - (SELECT freelist_count FROM pragma_freelist_count) AS pages,
                (SELECT page_size FROM pragma_page_size) AS size",
    )[0];
    row["pages"].as_u64().unwrap() * row["size"].as_u64().unwrap()
}
