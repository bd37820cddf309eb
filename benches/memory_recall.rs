//! Memory recall with 100,000 active records in one namespace: what runs before every run of
//! an agent with memory (`read-before-plan`). 500 questions, each a handful of words from the
//! records' vocabulary plus common words, asked one after another through the store's
//! full-text search for the top 5; p50 and p99. Also the same with no searchable word (the
//! most recent records).
//!
//! `cargo bench --bench memory_recall` measures the embedded SQLite store;
//! `STABLE_HARNESS_BENCH_DATABASE_URL=postgres://... cargo bench --bench memory_recall` an
//! empty PostgreSQL database. `STABLE_HARNESS_BENCH_MEMORIES` changes the count.
#![allow(clippy::print_stdout, clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use chrono::Utc;
use serde_json::json;
use stable_harness::memory::{content_hash, near_hash, search_words};
use stable_harness::store::{MemoryRecord, MemoryStatus, OpenOptions};

const ASKS: usize = 500;
const NAMESPACE: &str = "agent/support";

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(run());
}

/// A vocabulary of 4,000 made-up words (consonant-vowel syllables), the same every run.
fn vocabulary() -> Vec<String> {
    let (consonants, vowels) = ("bdfgklmnprstvz", "aeiou");
    let mut rng = fastrand::Rng::with_seed(7);
    (0..4_000)
        .map(|_| {
            (0..rng.usize(2..4))
                .map(|_| {
                    let c = consonants.as_bytes()[rng.usize(..consonants.len())] as char;
                    let v = vowels.as_bytes()[rng.usize(..vowels.len())] as char;
                    format!("{c}{v}")
                })
                .collect()
        })
        .collect()
}

fn sentence(rng: &mut fastrand::Rng, words: &[String], length: usize) -> String {
    (0..length)
        .map(|_| words[rng.usize(..words.len())].as_str())
        .collect::<Vec<_>>()
        .join(" ")
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    let index = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[index].as_secs_f64() * 1000.0
}

async fn run() {
    let count: usize = std::env::var("STABLE_HARNESS_BENCH_MEMORIES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(100_000);
    let url = std::env::var("STABLE_HARNESS_BENCH_DATABASE_URL").ok();
    let dir = tempfile::tempdir().unwrap();
    let store = stable_harness::store::open(url.as_deref(), dir.path(), &OpenOptions::default())
        .await
        .unwrap();
    let words = vocabulary();
    let mut rng = fastrand::Rng::with_seed(11);
    let filled = Instant::now();
    for chunk in 0..count.div_ceil(1_000) {
        let records: Vec<MemoryRecord> = (chunk * 1_000..((chunk + 1) * 1_000).min(count))
            .map(|index| {
                let content = format!("{} {index}", sentence(&mut rng, &words, 12));
                let at = Utc::now() - chrono::Duration::minutes(rng.i64(0..200_000));
                MemoryRecord {
                    id: stable_harness::runtime::new_id("mem"),
                    namespace: NAMESPACE.into(),
                    scope: String::new(),
                    owner: "bench".into(),
                    content_hash: content_hash(&content),
                    near_hash: near_hash(&content),
                    content,
                    metadata: json!({}),
                    status: MemoryStatus::Active,
                    source_request_id: None,
                    source_run_id: None,
                    decided_by: None,
                    created_at: at,
                    updated_at: at,
                }
            })
            .collect();
        store.import_memories(&records).await.unwrap();
    }
    println!(
        "memory_recall: stored {count} records in {:.1} s ({})",
        filled.elapsed().as_secs_f64(),
        if url.is_some() {
            "PostgreSQL"
        } else {
            "SQLite"
        }
    );
    let mut timings = Vec::with_capacity(ASKS);
    let mut recalled = 0;
    for _ in 0..ASKS {
        let question = format!(
            "what do we know about the {} and {} of {}?",
            sentence(&mut rng, &words, 2),
            sentence(&mut rng, &words, 1),
            sentence(&mut rng, &words, 2)
        );
        let asked = Instant::now();
        let found = store
            .recall_memories(NAMESPACE, "", &search_words(&question), 5)
            .await
            .unwrap();
        timings.push(asked.elapsed());
        recalled += found.len();
    }
    timings.sort();
    println!(
        "memory_recall: {ASKS} questions, top 5 of {count}: p50 {:.2} ms, p99 {:.2} ms ({:.1} records per answer)",
        percentile(&timings, 0.5),
        percentile(&timings, 0.99),
        recalled as f64 / ASKS as f64
    );
    let mut timings = Vec::with_capacity(ASKS);
    for _ in 0..ASKS {
        let asked = Instant::now();
        store.recall_memories(NAMESPACE, "", &[], 5).await.unwrap();
        timings.push(asked.elapsed());
    }
    timings.sort();
    println!(
        "memory_recall: no searchable word, the 5 most recent: p50 {:.2} ms, p99 {:.2} ms",
        percentile(&timings, 0.5),
        percentile(&timings, 0.99)
    );
}
