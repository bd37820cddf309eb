//! Metrics (issue 11): what this instance did, as Prometheus text at `GET /metrics`.
//!
//! Most figures are read off the journal as it commits — every stored event passes it once —
//! so they count what was durably recorded, never what was merely attempted: requests ended
//! by agent and status, model calls (latency, tokens) by model, tool calls by tool and
//! decision, events appended by type, journal batch sizes and commit latency, store errors,
//! tokens and cost charged by key, agent and model. Budget and rate-limit refusals are
//! counted where they happen (an admission refusal stores nothing).
//! Run durations are measured by the run itself; approvals pending are read from the store
//! when scraped. Counters are this process's since it started.

use std::cell::RefCell;
use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::OnceLock;
use std::thread::LocalKey;
use std::time::Duration;

use metrics::{Counter, Gauge, Histogram, counter, gauge, histogram};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use serde_json::Value;

use crate::runtime::events;
use crate::store::EventRecord;

static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();

/// Seconds buckets of the latency histograms (runs, model calls, commits).
const SECONDS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];
/// Buckets of journal batch sizes (ops per transaction).
const BATCH_OPS: &[f64] = &[1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0];

/// How often the recorder's upkeep folds the histograms' recorded samples into their
/// buckets. The recorder holds each sample until then (or until a scrape renders it): a
/// server nobody scraped grew by ~80 bytes a request, without end (docs/profiling.md, the
/// thirty-fourth pass). The exporter's own default interval.
const UPKEEP_EVERY: Duration = Duration::from_secs(5);

/// The name of the thread running the recorder's upkeep.
const UPKEEP_THREAD: &str = "metrics-upkeep";

/// Runs the recorder's upkeep every [`UPKEEP_EVERY`] for the rest of the process, on a
/// thread of its own: the recorder is the process's, and outlives any server's runtime.
fn keep_up(handle: PrometheusHandle) {
    let started = std::thread::Builder::new()
        .name(UPKEEP_THREAD.to_owned())
        .spawn(move || {
            loop {
                std::thread::sleep(UPKEEP_EVERY);
                handle.run_upkeep();
            }
        });
    if let Err(error) = started {
        tracing::warn!(%error, "no metrics upkeep thread: histograms are folded only when scraped");
    }
}

/// Installs the process's recorder (once; every server in the process shares it).
fn handle() -> Option<&'static PrometheusHandle> {
    HANDLE
        .get_or_init(|| {
            let builder = PrometheusBuilder::new()
                .set_buckets_for_metric(
                    metrics_exporter_prometheus::Matcher::Suffix("_seconds".into()),
                    SECONDS,
                )
                .and_then(|b| {
                    b.set_buckets_for_metric(
                        metrics_exporter_prometheus::Matcher::Full(
                            "stable_harness_journal_batch_ops".into(),
                        ),
                        BATCH_OPS,
                    )
                });
            match builder.map(PrometheusBuilder::install_recorder) {
                Ok(Ok(handle)) => {
                    describe();
                    keep_up(handle.clone());
                    Some(handle)
                }
                // Another recorder was installed first (an embedding program's): ours stays off.
                _ => None,
            }
        })
        .as_ref()
}

/// Turns recording on (at server start).
pub fn install() {
    let _ = handle();
}

/// The metrics as Prometheus text.
pub fn render() -> String {
    handle().map(PrometheusHandle::render).unwrap_or_default()
}

fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram};
    describe_counter!(
        "stable_harness_requests_total",
        "Requests ended, by agent and status"
    );
    describe_histogram!(
        "stable_harness_run_duration_seconds",
        metrics::Unit::Seconds,
        "Wall time of runs, from start to end, by agent and status"
    );
    describe_histogram!(
        "stable_harness_model_call_duration_seconds",
        metrics::Unit::Seconds,
        "Latency of model calls, by model"
    );
    describe_counter!(
        "stable_harness_model_tokens_total",
        "Tokens of model calls, by model and kind (prompt, completion)"
    );
    describe_counter!(
        "stable_harness_tool_calls_total",
        "Tool calls, by tool and decision (allow, deny, needs_approval)"
    );
    describe_gauge!(
        "stable_harness_approvals_pending",
        "Approvals waiting on a decision (read from the store when scraped)"
    );
    describe_gauge!(
        "stable_harness_kept_histories",
        "Session history paths kept in memory (read when scraped)"
    );
    describe_counter!(
        "stable_harness_histories_not_kept_total",
        "Session history paths read and not kept in memory, by why (too_long, no_room): their next turn reads them whole"
    );
    describe_gauge!(
        "stable_harness_kept_history_bytes",
        "Estimated memory of the session history paths kept, within limits.keptHistoryBytes (read when scraped)"
    );
    describe_counter!(
        "stable_harness_transcript_digests_total",
        "Digests of chat transcripts with no session, by how taken (carried: from the turn before's kept state, hashing only what the turn adds; whole)"
    );
    describe_gauge!(
        "stable_harness_carried_digests",
        "Conversations a turn of which is kept for their next: with no session, its transcript digest state (a chat's messages too); a chat in a session, its messages (read when scraped)"
    );
    describe_gauge!(
        "stable_harness_carried_digest_bytes",
        "Estimated memory they hold (the transcript's text; a chat turn's messages as sent and as parsed), within limits.keptHistoryBytes (read when scraped)"
    );
    describe_counter!(
        "stable_harness_chat_transcripts_total",
        "Chat Completions turns, with no session or in one, by how their transcript was read (carried: the turn before's sent messages carried on as parsed, only those after them parsed; parsed: whole)"
    );
    describe_counter!(
        "stable_harness_session_transcript_matches_total",
        "Chat turns in a session matched with the session's newest path, by how (carried: only the messages after those carried on from the turn before, whose end the path passes through, compared; whole)"
    );
    describe_counter!(
        "stable_harness_events_appended_total",
        "Events committed to the store, by type"
    );
    describe_histogram!(
        "stable_harness_journal_batch_ops",
        "Write operations per journal transaction"
    );
    describe_histogram!(
        "stable_harness_journal_commit_duration_seconds",
        metrics::Unit::Seconds,
        "Time to commit one journal transaction"
    );
    describe_counter!(
        "stable_harness_store_errors_total",
        "Store failures, by kind (transient: retried; rejected: refused)"
    );
    describe_counter!(
        "stable_harness_usage_tokens_total",
        "Tokens charged to budgets, by key, agent, model and kind (prompt, completion)"
    );
    describe_gauge!(
        "stable_harness_usage_cost_total",
        "Cost charged (in the currency of pricing), by key, agent and model; only grows"
    );
    describe_counter!(
        "stable_harness_budget_refusals_total",
        "Budget refusals, by budget and where (admission, call)"
    );
    describe_counter!(
        "stable_harness_rate_limited_total",
        "Requests refused by a rate limit, by limit"
    );
    describe_counter!(
        "stable_harness_workspace_reloads_total",
        "Workspace reloads, by result (applied, refused)"
    );
}

/// Handles a thread keeps, by the hash of their name and label values (see [`kept`]).
type Kept<H> = RefCell<HashMap<u64, KeptHandle<H>, foldhash::fast::RandomState>>;

/// A kept handle and what it was looked up by: a hash alone could name another's.
struct KeptHandle<H> {
    name: &'static str,
    values: Box<[Box<str>]>,
    handle: H,
}

thread_local! {
    static COUNTERS: Kept<Counter> = RefCell::default();
    static HISTOGRAMS: Kept<Histogram> = RefCell::default();
    static GAUGES: Kept<Gauge> = RefCell::default();
}

/// Most handles of one kind kept by a thread. Label values come from the workspace (agents,
/// models, keys, tools); past this many, handles are looked up each time, as without keeping.
const KEPT_HANDLES: usize = 1024;

/// Updates the handle of the metric `name` with these label values. Looking one up in the
/// registry allocates its labels, hashes them and takes a lock (~2,500 instructions, a few
/// times per request: docs/profiling.md, the nineteenth pass), so each thread looks a handle
/// up once and keeps it, found again without allocating. Kept only once the recorder is
/// installed: before, the registry hands out handles that record nothing.
fn kept<H>(
    kind: &'static LocalKey<Kept<H>>,
    name: &'static str,
    values: &[&str],
    register: impl FnOnce() -> H,
    update: impl FnOnce(&H),
) {
    if !matches!(HANDLE.get(), Some(Some(_))) {
        return update(&register());
    }
    kind.with(|kept| {
        let mut kept = kept.borrow_mut();
        // The name is hashed by where it is: every name is a constant, so its address is
        // all but always one (and were it two, the handle would be kept twice). Its text
        // is compared below. `str`'s hash ends each value with a marker: no two lists of
        // values hash as one list does by construction, and the comparison below settles
        // a true collision.
        let hash = kept
            .hasher()
            .hash_one((name.as_ptr() as usize, name.len(), values));
        if let Some(found) = kept.get(&hash) {
            if (std::ptr::eq(found.name, name) || found.name == name)
                && found.values.len() == values.len()
                && found
                    .values
                    .iter()
                    .zip(values)
                    .all(|(kept, value)| **kept == **value)
            {
                // Used where it is kept: cloning a handle and dropping it are two atomic
                // operations more per use.
                return update(&found.handle);
            }
            // Another metric's hash: looked up each time.
            return update(&register());
        }
        let handle = register();
        update(&handle);
        if kept.len() < KEPT_HANDLES {
            let values = values.iter().map(|value| Box::from(*value)).collect();
            kept.insert(
                hash,
                KeptHandle {
                    name,
                    values,
                    handle,
                },
            );
        }
    })
}

/// A journal transaction committed `ops` operations in `took`.
pub fn journal_committed(ops: usize, took: Duration) {
    const OPS: &str = "stable_harness_journal_batch_ops";
    const TOOK: &str = "stable_harness_journal_commit_duration_seconds";
    kept(
        &HISTOGRAMS,
        OPS,
        &[],
        || histogram!(OPS),
        |handle| handle.record(ops as f64),
    );
    kept(
        &HISTOGRAMS,
        TOOK,
        &[],
        || histogram!(TOOK),
        |handle| handle.record(took.as_secs_f64()),
    );
}

/// The store failed a write: `transient` ones are retried.
pub fn store_error(transient: bool) {
    let kind = if transient { "transient" } else { "rejected" };
    counter!("stable_harness_store_errors_total", "kind" => kind).increment(1);
}

/// An event was committed: it counts, and some carry figures.
pub fn event_committed(event: &EventRecord) {
    event_appended(&event.event_type);
    let data = &event.data;
    let text = |key: &str| data.get(key).and_then(Value::as_str).unwrap_or("");
    match event.event_type.as_str() {
        events::MODEL_CALL_COMPLETED => {
            let model = text("model");
            if let Some(ms) = data.get("latencyMs").and_then(Value::as_f64) {
                const NAME: &str = "stable_harness_model_call_duration_seconds";
                kept(
                    &HISTOGRAMS,
                    NAME,
                    &[model],
                    || histogram!(NAME, "model" => model.to_owned()),
                    |handle| handle.record(ms / 1000.0),
                );
            }
            for (field, kind) in [
                ("prompt_tokens", "prompt"),
                ("completion_tokens", "completion"),
            ] {
                if let Some(tokens) = data
                    .get("usage")
                    .and_then(|usage| usage.get(field))
                    .and_then(Value::as_u64)
                {
                    const NAME: &str = "stable_harness_model_tokens_total";
                    kept(
                        &COUNTERS,
                        NAME,
                        &[model, kind],
                        || counter!(NAME, "model" => model.to_owned(), "kind" => kind),
                        |handle| handle.increment(tokens),
                    );
                }
            }
        }
        events::USAGE_RECORDED => {
            let (key, model, agent) = (text("key"), text("model"), &*event.agent_id);
            for (field, kind) in [
                ("promptTokens", "prompt"),
                ("completionTokens", "completion"),
            ] {
                if let Some(tokens) = data.get(field).and_then(Value::as_u64) {
                    const NAME: &str = "stable_harness_usage_tokens_total";
                    kept(
                        &COUNTERS,
                        NAME,
                        &[key, agent, model, kind],
                        || counter!(NAME, "key" => key.to_owned(), "agent" => agent.to_owned(), "model" => model.to_owned(), "kind" => kind),
                        |handle| handle.increment(tokens),
                    );
                }
            }
            if let Some(cost) = data.get("cost").and_then(Value::as_f64) {
                const NAME: &str = "stable_harness_usage_cost_total";
                kept(
                    &GAUGES,
                    NAME,
                    &[key, agent, model],
                    || gauge!(NAME, "key" => key.to_owned(), "agent" => agent.to_owned(), "model" => model.to_owned()),
                    |handle| handle.increment(cost),
                );
            }
        }
        events::TOOL_DIRECT_COMPLETED => tool_call(text("toolId"), "allow"),
        // A tool the agent was not offered may be any name a model made up: one label for all.
        events::TOOL_DENIED
            if data.get("rule").and_then(Value::as_str) == Some("tool_not_allowed") =>
        {
            tool_call("not_offered", "deny");
        }
        events::TOOL_DENIED => tool_call(text("toolId"), "deny"),
        events::APPROVAL_REQUESTED => {
            let tool = data
                .pointer("/approval/toolId")
                .and_then(Value::as_str)
                .unwrap_or("");
            tool_call(tool, "needs_approval");
        }
        events::REQUEST_COMPLETED | events::REQUEST_FAILED | events::REQUEST_CANCELLED => {
            const NAME: &str = "stable_harness_requests_total";
            let status = event.event_type.rsplit('.').next().unwrap_or("");
            let agent = &*event.agent_id;
            kept(
                &COUNTERS,
                NAME,
                &[agent, status],
                || counter!(NAME, "agent" => agent.to_owned(), "status" => status.to_owned()),
                |handle| handle.increment(1),
            );
        }
        _ => {}
    }
}

/// Counts an appended event of type `kind` (every event passes here, on the journal's thread).
fn event_appended(kind: &str) {
    const NAME: &str = "stable_harness_events_appended_total";
    kept(
        &COUNTERS,
        NAME,
        &[kind],
        || counter!(NAME, "type" => kind.to_owned()),
        |handle| handle.increment(1),
    );
}

fn tool_call(tool: &str, decision: &'static str) {
    const NAME: &str = "stable_harness_tool_calls_total";
    kept(
        &COUNTERS,
        NAME,
        &[tool, decision],
        || counter!(NAME, "tool" => tool.to_owned(), "decision" => decision),
        |handle| handle.increment(1),
    );
}

/// A run ended with `status` after `took`.
pub fn run_ended(agent: &str, status: &str, took: Duration) {
    const NAME: &str = "stable_harness_run_duration_seconds";
    kept(
        &HISTOGRAMS,
        NAME,
        &[agent, status],
        || histogram!(NAME, "agent" => agent.to_owned(), "status" => status.to_owned()),
        |handle| handle.record(took.as_secs_f64()),
    );
}

/// A session's history path that was read and not kept: `too_long` (past half of
/// `limits.keptHistoryBytes`) or `no_room` (the kept paths all in use). Its next turn reads
/// it whole again.
pub fn history_not_kept(why: &'static str) {
    counter!("stable_harness_histories_not_kept_total", "why" => why).increment(1);
}

/// A chat transcript's digest taken: `carried` on from the state kept after the turn before
/// (only what the turn adds hashed), or `whole`.
pub fn transcript_digest(how: &'static str) {
    counter!("stable_harness_transcript_digests_total", "how" => how).increment(1);
}

/// A chat turn (with no session or in one): its messages `carried` on from the turn before's
/// (only those after them parsed), or `parsed` whole.
pub fn chat_transcript(how: &'static str) {
    counter!("stable_harness_chat_transcripts_total", "how" => how).increment(1);
}

/// A chat turn in a session matched with the session's newest path: only what follows the
/// messages it `carried` on compared, or the `whole`.
pub fn session_transcript_match(how: &'static str) {
    counter!("stable_harness_session_transcript_matches_total", "how" => how).increment(1);
}

/// The transcript digest states kept in memory and the memory kept with them, now.
pub fn carried_digests(count: usize, bytes: usize) {
    gauge!("stable_harness_carried_digests").set(count as f64);
    gauge!("stable_harness_carried_digest_bytes").set(bytes as f64);
}

/// The session history paths kept in memory and their estimated size, now.
pub fn kept_histories(paths: usize, bytes: usize) {
    gauge!("stable_harness_kept_histories").set(paths as f64);
    gauge!("stable_harness_kept_history_bytes").set(bytes as f64);
}

/// The approvals pending, as the store counts them now.
pub fn approvals_pending(count: u64) {
    gauge!("stable_harness_approvals_pending").set(count as f64);
}

/// A reload was applied or refused.
pub fn workspace_reloaded(applied: bool) {
    let result = if applied { "applied" } else { "refused" };
    counter!("stable_harness_workspace_reloads_total", "result" => result).increment(1);
}

/// A budget refused a request at admission or a model call.
pub fn budget_refused(budget: &str, at: &'static str) {
    counter!("stable_harness_budget_refusals_total", "budget" => budget.to_owned(), "at" => at)
        .increment(1);
}

/// A rate limit refused a request.
pub fn rate_limited(limit: &str) {
    counter!("stable_harness_rate_limited_total", "limit" => limit.to_owned()).increment(1);
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    #[test]
    fn kept_handles_count_under_their_own_labels() {
        super::install();
        let runs = [
            ("kept_a", "completed", 3),
            ("kept_a", "failed", 1),
            ("kept_b", "completed", 2),
            // The same characters, split another way.
            ("kept_", "acompleted", 4),
        ];
        for (agent, status, times) in runs {
            for _ in 0..times {
                super::run_ended(agent, status, Duration::from_millis(5));
            }
        }
        let text = super::render();
        for (agent, status, times) in runs {
            let line = format!(
                "stable_harness_run_duration_seconds_count{{agent=\"{agent}\",status=\"{status}\"}} {times}"
            );
            assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
        }
    }

    #[test]
    fn the_recorder_is_kept_up_without_a_scrape() {
        super::install();
        // Histogram samples are held by the recorder until its upkeep folds them into their
        // buckets: without a thread running it, a server nobody scrapes grows without end.
        let threads = std::fs::read_dir("/proc/self/task").map_or_else(
            |error| panic!("the process's threads: {error}"),
            |tasks| {
                tasks
                    .filter_map(Result::ok)
                    .filter_map(|task| std::fs::read_to_string(task.path().join("comm")).ok())
                    .filter(|name| name.trim_end() == super::UPKEEP_THREAD)
                    .count()
            },
        );
        assert_eq!(threads, 1, "one {} thread", super::UPKEEP_THREAD);
    }

    #[test]
    fn a_name_at_another_address_counts_under_its_text() {
        super::install();
        // Kept handles are found by the name's address first: the same text elsewhere must
        // still count into the same metric, and a name that only shares a prefix must not.
        const NAME: &str = "stable_harness_kept_elsewhere_total";
        let elsewhere: &'static str = Box::leak(NAME.to_owned().into_boxed_str());
        let prefix: &'static str = &NAME[..NAME.len() - "_total".len()];
        for (name, times) in [(NAME, 2), (elsewhere, 3), (NAME, 1), (prefix, 4)] {
            for _ in 0..times {
                super::kept(
                    &super::COUNTERS,
                    name,
                    &["x"],
                    || metrics::counter!(name, "value" => "x"),
                    |counter| counter.increment(1),
                );
            }
        }
        let text = super::render();
        for line in [
            "stable_harness_kept_elsewhere_total{value=\"x\"} 6",
            "stable_harness_kept_elsewhere{value=\"x\"} 4",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
        }
    }
}
