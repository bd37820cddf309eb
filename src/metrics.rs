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

use std::sync::OnceLock;
use std::time::Duration;

use metrics::{counter, gauge, histogram};
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

/// A journal transaction committed `ops` operations in `took`.
pub fn journal_committed(ops: usize, took: Duration) {
    histogram!("stable_harness_journal_batch_ops").record(ops as f64);
    histogram!("stable_harness_journal_commit_duration_seconds").record(took.as_secs_f64());
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
    let text = |key: &str| {
        data.get(key)
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned()
    };
    match event.event_type.as_str() {
        events::MODEL_CALL_COMPLETED => {
            let model = text("model");
            if let Some(ms) = data.get("latencyMs").and_then(Value::as_f64) {
                histogram!("stable_harness_model_call_duration_seconds", "model" => model.clone())
                    .record(ms / 1000.0);
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
                    counter!("stable_harness_model_tokens_total", "model" => model.clone(), "kind" => kind)
                        .increment(tokens);
                }
            }
        }
        events::USAGE_RECORDED => {
            let (key, model) = (text("key"), text("model"));
            let agent = event.agent_id.clone();
            for (field, kind) in [
                ("promptTokens", "prompt"),
                ("completionTokens", "completion"),
            ] {
                if let Some(tokens) = data.get(field).and_then(Value::as_u64) {
                    counter!("stable_harness_usage_tokens_total", "key" => key.clone(), "agent" => agent.clone(), "model" => model.clone(), "kind" => kind)
                        .increment(tokens);
                }
            }
            if let Some(cost) = data.get("cost").and_then(Value::as_f64) {
                gauge!("stable_harness_usage_cost_total", "key" => key, "agent" => agent, "model" => model)
                    .increment(cost);
            }
        }
        events::TOOL_DIRECT_COMPLETED => tool_call(text("toolId"), "allow"),
        // A tool the agent was not offered may be any name a model made up: one label for all.
        events::TOOL_DENIED
            if data.get("rule").and_then(Value::as_str) == Some("tool_not_allowed") =>
        {
            tool_call("not_offered".to_owned(), "deny");
        }
        events::TOOL_DENIED => tool_call(text("toolId"), "deny"),
        events::APPROVAL_REQUESTED => {
            let tool = data
                .pointer("/approval/toolId")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_owned();
            tool_call(tool, "needs_approval");
        }
        events::REQUEST_COMPLETED | events::REQUEST_FAILED | events::REQUEST_CANCELLED => {
            let status = event.event_type.rsplit('.').next().unwrap_or("").to_owned();
            counter!("stable_harness_requests_total", "agent" => event.agent_id.clone(), "status" => status)
                .increment(1);
        }
        _ => {}
    }
}

/// Counts an appended event of type `kind`. Every event passes here, on the journal's
/// thread: each type's counter is looked up in the registry once (which allocates its labels
/// and takes a lock), then kept. Kept only once the recorder is installed (before, the
/// registry hands out counters that record nothing), and for at most [`KEPT_TYPES`] types.
fn event_appended(kind: &str) {
    const KEPT_TYPES: usize = 256;
    thread_local! {
        static BY_TYPE: std::cell::RefCell<std::collections::HashMap<String, metrics::Counter>> =
            std::cell::RefCell::default();
    }
    let lookup = || counter!("stable_harness_events_appended_total", "type" => kind.to_owned());
    if !matches!(HANDLE.get(), Some(Some(_))) {
        lookup().increment(1);
        return;
    }
    BY_TYPE.with(|kept| {
        let mut kept = kept.borrow_mut();
        if let Some(counter) = kept.get(kind) {
            counter.increment(1);
            return;
        }
        let counter = lookup();
        counter.increment(1);
        if kept.len() < KEPT_TYPES {
            kept.insert(kind.to_owned(), counter);
        }
    });
}

fn tool_call(tool: String, decision: &'static str) {
    counter!("stable_harness_tool_calls_total", "tool" => tool, "decision" => decision)
        .increment(1);
}

/// A run ended with `status` after `took`.
pub fn run_ended(agent: &str, status: &str, took: Duration) {
    histogram!("stable_harness_run_duration_seconds", "agent" => agent.to_owned(), "status" => status.to_owned())
        .record(took.as_secs_f64());
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
