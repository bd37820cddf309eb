//! Records for unit tests of the store and its writers: a session, a request, a run and an
//! event as the runtime writes them, with the fields tests rarely care about filled in. A
//! test changes the fields it is about on the record it gets.

use chrono::Utc;
use serde_json::{Value, json};

use super::{EventRecord, RequestRecord, RunRecord, RunStatus, SessionRecord, WriteOp};

/// Session `id`, of agent `a` and owner `o`.
pub fn session(id: &str) -> SessionRecord {
    let now = Utc::now();
    SessionRecord {
        id: id.into(),
        agent_id: "a".into(),
        owner: "o".into(),
        metadata: json!({}),
        created_at: now,
        updated_at: now,
    }
}

/// Request `id` in `session`, running, of agent `a` and owner `o`.
pub fn request(id: &str, session: &str) -> RequestRecord {
    let now = Utc::now();
    RequestRecord {
        id: id.into(),
        session_id: session.into(),
        agent_id: "a".into(),
        protocol: "test".into(),
        owner: "o".into(),
        status: RunStatus::Running,
        input: json!({}),
        output: None,
        error: None,
        usage: None,
        metadata: json!({}),
        created_at: now,
        updated_at: now,
    }
}

/// Run `id` of `request`, first attempt, running, not started or leased yet.
pub fn run(id: &str, request: &str) -> RunRecord {
    RunRecord::new(id.into(), request.into(), 1, RunStatus::Running, Utc::now())
}

/// An event of `event_type` with `data`, of `request` and `run` (numbered by the store).
pub fn event(request: &str, run: &str, event_type: &str, data: Value) -> WriteOp {
    WriteOp::AppendEvent(EventRecord {
        id: crate::runtime::new_id("evt"),
        request_id: request.into(),
        run_id: run.into(),
        session_id: format!("ses_{request}").into(),
        agent_id: "a".into(),
        seq: 0,
        event_type: event_type.into(),
        at: Utc::now(),
        data,
    })
}
