//! Benchmark: the tool gateway's own cost per allowed call — allow-list, argument parsing and
//! JSON Schema validation, policy (five rules, none matching, then the default), redaction,
//! the started/completed events, and the call's two commit points — its `started` record
//! (with the idempotency key) before it runs and its result before it is returned — with
//! the cheapest tool there is (`clock.now`) so that the tool itself is noise.
//!
//! `cargo bench --bench gateway` prints the mean and percentiles per call, measured against
//! the embedded SQLite store through the journal, as in the server.
#![allow(clippy::print_stdout, clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::Utc;
use serde_json::{Value, json};
use stable_harness::gateway::{ApprovalWaiters, RunHost, RunScope, ToolCall, ToolGateway};
use stable_harness::runtime::{EventHub, Journal};
use stable_harness::store::{
    ApprovalDecision, ApprovalRecord, EventRecord, RequestRecord, RunRecord, RunStatus,
    SessionRecord, WriteOp,
};

const CALLS: usize = 20_000;
const WARMUP: usize = 1_000;

/// The runtime's side, as the server has it: events and records go to the journal.
struct JournalHost {
    journal: Journal,
}

#[async_trait::async_trait]
impl RunHost for JournalHost {
    async fn emit(&self, event_type: &str, data: Value) {
        let event = event(event_type, data);
        self.journal
            .write(Some("req_bench"), WriteOp::AppendEvent(event))
            .await
            .unwrap();
    }

    async fn commit(&self, ops: Vec<WriteOp>) -> Result<(), String> {
        self.journal
            .commit(Some("req_bench"), ops)
            .await
            .map_err(|e| e.to_string())
    }

    async fn commit_with_event(
        &self,
        mut ops: Vec<WriteOp>,
        event_type: &str,
        data: Value,
    ) -> Result<(), String> {
        ops.push(WriteOp::AppendEvent(event(event_type, data)));
        self.commit(ops).await
    }

    async fn decide(
        &self,
        _approval: &ApprovalRecord,
        _decision: ApprovalDecision,
    ) -> Result<bool, String> {
        Err("the benchmark asks for no approval".to_owned())
    }

    async fn set_waiting(&self, _waiting: bool) {}

    async fn delegate(&self, agent: &str, _input: &str, _call_id: &str) -> Result<Value, String> {
        Err(format!(
            "the benchmark has no agent `{agent}` to delegate to"
        ))
    }

    async fn remember(
        &self,
        _content: &str,
        _metadata: Value,
    ) -> Result<Value, (&'static str, String)> {
        Err(("memory_disabled", "the benchmark has no memory".to_owned()))
    }
}

/// An event of the benchmark's run.
fn event(event_type: &str, data: Value) -> EventRecord {
    EventRecord {
        id: stable_harness::runtime::new_id("evt"),
        request_id: "req_bench".into(),
        run_id: "run_bench".into(),
        session_id: "ses_bench".into(),
        agent_id: "bench".into(),
        seq: 0,
        event_type: event_type.to_owned(),
        at: Utc::now(),
        data,
    }
}

fn workspace(dir: &std::path::Path) {
    let write = |path: &str, text: &str| {
        let path = dir.join(path);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    };
    write(
        "config/runtime.yaml",
        "apiVersion: stable-harness/v1\nkind: Runtime\nmetadata: { name: bench }\nspec:\n  governance:\n    default: allow\n    rules:\n      - { name: r1, match: { tools: [\"files.*\"] }, decision: deny }\n      - { name: r2, match: { risk: [high] }, decision: needs_approval }\n      - { name: r3, match: { agents: [nobody] }, decision: deny }\n      - { name: r4, match: { labels: { tier: vip } }, decision: needs_approval }\n      - { name: r5, match: { tools: [\"*.delete\"], risk: [medium] }, decision: deny }\n",
    );
    write(
        "config/tools.yaml",
        "apiVersion: stable-harness/v1\nkind: ToolCatalog\nmetadata: { name: tools }\nspec:\n  tools:\n    - id: clock.now\n      builtin: clock.now\n      inputSchema: { type: object, properties: { timezone: { type: string, maxLength: 64 }, precise: { type: boolean } }, required: [timezone], additionalProperties: false }\n    - { id: files.delete, risk: medium, builtin: clock.now }\n",
    );
    write(
        "config/agent.yaml",
        "apiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: bench }\nspec:\n  backend: scripted\n  tools: [clock.now]\n  script: [{ reply: unused }]\n---\napiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: nobody }\nspec:\n  backend: scripted\n  script: [{ reply: unused }]\n",
    );
}

fn main() {
    stable_harness::app::install_crypto_provider();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(bench());
}

async fn bench() {
    let dir = tempfile::tempdir().unwrap();
    workspace(dir.path());
    let compiled = Arc::new(stable_harness::workspace::load(dir.path()).unwrap());
    let store = stable_harness::store::open(None, dir.path(), &Default::default())
        .await
        .unwrap();
    let now = Utc::now();
    store
        .apply(&[
            WriteOp::TouchSession(SessionRecord {
                id: "ses_bench".into(),
                agent_id: "bench".into(),
                owner: "bench".into(),
                metadata: json!({}),
                created_at: now,
                updated_at: now,
            }),
            WriteOp::InsertRequest(RequestRecord {
                id: "req_bench".into(),
                session_id: "ses_bench".into(),
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
            WriteOp::InsertRun(RunRecord {
                id: "run_bench".into(),
                request_id: "req_bench".into(),
                attempt: 1,
                status: RunStatus::Running,
                state: None,
                error: None,
                created_at: now,
                updated_at: now,
                started_at: Some(now),
                ended_at: None,
                lease: None,
                cancel_requested_by: None,
            }),
        ])
        .await
        .unwrap();
    let tracker = tokio_util::task::TaskTracker::new();
    let redactor = stable_harness::redact::Redactor::from_workspace(&compiled);
    let journal = Journal::start(
        Arc::clone(&store),
        Arc::new(EventHub::default()),
        redactor.clone(),
        &tracker,
    );
    let host = JournalHost {
        journal: journal.clone(),
    };
    let gateway = ToolGateway::new(
        Arc::clone(&compiled),
        Arc::clone(&store),
        reqwest::Client::new(),
        Arc::new(ApprovalWaiters::default()),
        redactor,
    );
    let agent = compiled.agent("bench").unwrap();
    let scope = RunScope::new(
        "req_bench".into(),
        "run_bench".into(),
        "ses_bench".into(),
        agent,
        json!({ "team": "bench" }),
        &host,
        tokio_util::sync::CancellationToken::new(),
    );
    let mut samples = Vec::with_capacity(CALLS);
    for index in 0..WARMUP + CALLS {
        let call = ToolCall {
            key: format!("t{index}.0"),
            id: "call_0".into(),
            tool_id: "clock.now".into(),
            arguments: Value::String(r#"{"timezone":"UTC","precise":true}"#.into()),
        };
        let started = Instant::now();
        let result = gateway.call(&scope, call).await;
        let elapsed = started.elapsed();
        assert_eq!(result.outcome, stable_harness::gateway::Outcome::Completed);
        if index >= WARMUP {
            samples.push(elapsed);
        }
    }
    journal.flush().await.unwrap();
    let total: Duration = samples.iter().sum();
    samples.sort();
    let at = |q: f64| samples[((samples.len() as f64 - 1.0) * q) as usize];
    println!(
        "gateway: {CALLS} allowed calls of clock.now (validation + policy of 5 rules + redaction + 2 events + started and result commits): mean {:.1} µs, p50 {:.1} µs, p99 {:.1} µs, max {:.1} µs",
        micros(total / CALLS as u32),
        micros(at(0.5)),
        micros(at(0.99)),
        micros(samples[samples.len() - 1]),
    );
}

fn micros(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1e6
}
