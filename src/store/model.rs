//! What the store keeps: records and the status vocabulary of SPEC section 4.

use std::sync::Arc;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Run status (a request's status is its latest run's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum RunStatus {
    Queued,
    Running,
    WaitingApproval,
    Completed,
    Failed,
    Cancelled,
}

impl RunStatus {
    pub const ALL: [RunStatus; 6] = [
        Self::Queued,
        Self::Running,
        Self::WaitingApproval,
        Self::Completed,
        Self::Failed,
        Self::Cancelled,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Queued => "queued",
            Self::Running => "running",
            Self::WaitingApproval => "waiting_approval",
            Self::Completed => "completed",
            Self::Failed => "failed",
            Self::Cancelled => "cancelled",
        }
    }

    pub fn parse(text: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|status| status.as_str() == text)
    }

    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Completed | Self::Failed | Self::Cancelled)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SessionRecord {
    pub id: String,
    pub agent_id: String,
    /// The client key identity that created it (SPEC section 4, ownership).
    pub owner: String,
    pub metadata: Value,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct MessageRecord {
    pub id: String,
    pub session_id: String,
    pub parent_id: Option<String>,
    pub request_id: Option<String>,
    pub role: String,
    /// The message as OpenAI-style JSON (`{"role", "content", ...}`).
    pub content: Value,
    pub created_at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RequestRecord {
    pub id: String,
    pub session_id: String,
    pub agent_id: String,
    /// Which surface submitted it: `v1`, `runtime` or `cli`.
    pub protocol: String,
    /// The client key identity that submitted it; only it (and admin keys) may see it.
    pub owner: String,
    pub status: RunStatus,
    /// The transcript the run starts from.
    pub input: Value,
    pub output: Option<String>,
    pub error: Option<Value>,
    pub usage: Option<Value>,
    pub metadata: Value,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RunRecord {
    pub id: String,
    pub request_id: String,
    pub attempt: i64,
    pub status: RunStatus,
    /// The conversation after the last persisted step.
    pub state: Option<Value>,
    pub error: Option<Value>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    pub started_at: Option<DateTime<Utc>>,
    pub ended_at: Option<DateTime<Utc>>,
    /// Who executes the live run, and until when (SPEC section 8). Set by the store: a new run
    /// is leased to the instance that inserts it, whatever the record says.
    pub lease: Option<Lease>,
    /// Who asked the run to stop ([`super::Store::request_cancel`]); whoever holds it ends it
    /// as cancelled. Set by the store only: an inserted run's value is not read.
    #[serde(default)]
    pub cancel_requested_by: Option<String>,
}

impl RunRecord {
    /// A new run as it is inserted, at `at`: no conversation state, error, start or end yet
    /// (the store sets its lease and reads no cancellation on insert). Callers add what theirs
    /// has (a workflow node's state, a start when it takes a slot at once).
    pub fn new(
        id: String,
        request_id: String,
        attempt: i64,
        status: RunStatus,
        at: DateTime<Utc>,
    ) -> Self {
        Self {
            id,
            request_id,
            attempt,
            status,
            state: None,
            error: None,
            created_at: at,
            updated_at: at,
            started_at: None,
            ended_at: None,
            lease: None,
            cancel_requested_by: None,
        }
    }
}

/// A live run's lease: the instance holding it and when it expires unless renewed.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Lease {
    pub holder: String,
    pub expires_at: DateTime<Utc>,
}

impl Lease {
    /// The lease stored as a run's two columns (a run holds one only with both).
    pub fn from_columns(holder: Option<String>, expires_at: Option<DateTime<Utc>>) -> Option<Self> {
        Some(Self {
            holder: holder?,
            expires_at: expires_at?,
        })
    }
}

/// What another instance changed in a shared store, as its notifications tell.
#[derive(Debug, Clone, PartialEq)]
pub enum StoreChange {
    /// Events `first..=last` of a request were committed by another instance.
    Events {
        request_id: String,
        first: i64,
        last: i64,
    },
    /// An operator asked to stop a run (whichever instance holds it stops it).
    CancelRequested { run_id: String, by: String },
    /// Notifications may have been missed (the listening connection was lost): whoever waits
    /// on the store should read it again.
    Resync,
}

/// One immutable event (SPEC section 7).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct EventRecord {
    pub id: String,
    // The ids an event shares with its request's other events: shared, not copied per
    // event (docs/profiling.md, the thirty-second pass).
    #[schema(value_type = String)]
    pub request_id: Arc<str>,
    #[schema(value_type = String)]
    pub run_id: Arc<str>,
    #[schema(value_type = String)]
    pub session_id: Arc<str>,
    #[schema(value_type = String)]
    pub agent_id: Arc<str>,
    pub seq: i64,
    #[serde(rename = "type")]
    pub event_type: String,
    // Written as chrono's serde writes it, without its general formatter (every event served).
    #[serde(serialize_with = "crate::time::serialize")]
    pub at: DateTime<Utc>,
    #[schema(value_type = Object)]
    pub data: Value,
}

/// Approval status (SPEC section 4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ApprovalStatus {
    Pending,
    Approved,
    Denied,
    Expired,
    Cancelled,
}

impl ApprovalStatus {
    pub const ALL: [ApprovalStatus; 5] = [
        Self::Pending,
        Self::Approved,
        Self::Denied,
        Self::Expired,
        Self::Cancelled,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Approved => "approved",
            Self::Denied => "denied",
            Self::Expired => "expired",
            Self::Cancelled => "cancelled",
        }
    }

    pub fn parse(text: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|status| status.as_str() == text)
    }
}

/// Why a human is asked about a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ApprovalKind {
    /// The policy decided `needs_approval`.
    Policy,
    /// The call started before a crash and its outcome is unknown: running it again is the
    /// operator's decision (a high-risk tool, or `onInterrupted: ask`).
    Interrupted,
}

impl ApprovalKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Policy => "policy",
            Self::Interrupted => "interrupted",
        }
    }

    pub fn parse(text: &str) -> Option<Self> {
        [Self::Policy, Self::Interrupted]
            .into_iter()
            .find(|kind| kind.as_str() == text)
    }
}

/// A human decision about one tool call, pending or taken.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ApprovalRecord {
    pub id: String,
    pub request_id: String,
    pub run_id: String,
    pub session_id: String,
    pub agent_id: String,
    /// The call's place in its run: model turn and position (`t3.0`).
    pub call_key: String,
    pub kind: ApprovalKind,
    /// For an `interrupted` approval, the execution of the call it concerns (the number of
    /// times the call had started); 0 for a policy approval.
    pub execution: i64,
    /// The id the model gave the call (informative only: models reuse ids).
    pub tool_call_id: String,
    pub tool_id: String,
    /// The call's arguments, secrets redacted.
    #[schema(value_type = Object)]
    pub arguments: Value,
    /// The governance rule that asked for the approval (`None`: the default decision).
    pub rule: Option<String>,
    pub status: ApprovalStatus,
    pub reason: Option<String>,
    pub decided_by: Option<String>,
    pub created_at: DateTime<Utc>,
    pub expires_at: Option<DateTime<Utc>>,
    pub decided_at: Option<DateTime<Utc>>,
}

/// A decision about a pending approval.
#[derive(Debug, Clone)]
pub struct ApprovalDecision {
    pub id: String,
    pub status: ApprovalStatus,
    pub reason: Option<String>,
    pub decided_by: String,
    pub at: DateTime<Utc>,
}

/// A tool call's record: written as `started` (with its idempotency key) before the tool
/// runs, then with its result; a call with a result is never run again.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ToolCallRecord {
    pub run_id: String,
    /// The call's place in its run: model turn and position (`t3.0`).
    pub call_key: String,
    /// The id the model gave the call (informative only).
    pub model_call_id: String,
    pub request_id: String,
    pub tool_id: String,
    pub arguments: Value,
    /// Sent with every execution of this call (`Idempotency-Key`, ...): the same after a crash.
    pub idempotency_key: String,
    /// How many times the call was started.
    pub executions: i64,
    /// `started` (no result yet), `completed`, `failed`, `denied`, `not_allowed`,
    /// `invalid_arguments`, `cancelled`.
    pub outcome: String,
    /// What the model was given.
    pub result: Value,
    pub duration_ms: i64,
    pub recorded_at: DateTime<Utc>,
}

/// A write, applied in order within one transaction by [`super::Store::apply`].
#[derive(Debug, Clone)]
pub enum WriteOp {
    /// Creates the session unless it exists (then only `updated_at` moves).
    TouchSession(SessionRecord),
    InsertMessage(MessageRecord),
    InsertRequest(RequestRecord),
    UpdateRequest {
        id: String,
        status: RunStatus,
        output: Option<String>,
        error: Option<Value>,
        usage: Option<Value>,
        at: DateTime<Utc>,
    },
    /// Inserts a run leased to this store's holder (the record's `lease` is not read).
    InsertRun(RunRecord),
    /// Moves a run to `status`; `state` (when given) is the conversation after its last step.
    /// Fenced: refused with [`super::StoreError::LeaseLost`] unless this store's holder holds
    /// the run's lease. An ended run keeps no lease.
    UpdateRun {
        id: String,
        status: RunStatus,
        error: Option<Value>,
        state: Option<Value>,
        at: DateTime<Utc>,
    },
    /// Appends an event; the store numbers it after its request's last one (`seq` is not
    /// read) and [`super::Store::apply`] returns the number.
    AppendEvent(EventRecord),
    /// Fenced like [`WriteOp::UpdateRun`]: only the run's holder asks for an approval.
    InsertApproval(ApprovalRecord),
    /// Moves a pending approval to its decision. Conditional: when the approval is not
    /// pending, the whole group it belongs to is refused with [`super::StoreError::Conflict`].
    DecideApproval(ApprovalDecision),
    /// Records that a call is about to run (outcome `started`); a record that exists only
    /// counts one more execution. Fenced like [`WriteOp::UpdateRun`]: a tool runs only for
    /// its run's holder.
    StartToolCall(ToolCallRecord),
    /// Inserts or replaces the result of a tool call. Fenced like [`WriteOp::UpdateRun`].
    RecordToolCall(ToolCallRecord),
}

#[derive(Debug, Clone, Default)]
pub struct RequestFilter {
    pub status: Option<RunStatus>,
    pub owner: Option<String>,
    pub agent_id: Option<String>,
    pub session_id: Option<String>,
    /// Created at or after this instant.
    pub created_from: Option<DateTime<Utc>>,
    /// Created before this instant.
    pub created_before: Option<DateTime<Utc>>,
}

#[derive(Debug, Clone, Default)]
pub struct SessionFilter {
    pub owner: Option<String>,
    pub agent_id: Option<String>,
}

#[derive(Debug, Clone)]
pub struct PageRequest {
    pub limit: i64,
    pub cursor: Option<String>,
}

#[derive(Debug, Clone)]
pub struct Page<T> {
    pub items: Vec<T>,
    pub next_cursor: Option<String>,
}

impl<T> Page<T> {
    /// A page from `limit + 1` fetched rows: the extra row only says that more follow.
    pub fn from_overfetch(mut items: Vec<T>, limit: i64, cursor_of: impl Fn(&T) -> String) -> Self {
        let next_cursor = if items.len() as i64 > limit {
            items.truncate(limit.max(0) as usize);
            items.last().map(cursor_of)
        } else {
            None
        };
        Self { items, next_cursor }
    }
}

/// What a prune may remove: sessions idle past their window whose every request ended past
/// it, with nothing pending, outside the newest `min_keep` (SPEC: a live session's history is
/// never pruned, so a session goes whole or not at all). Cutoffs are RFC 3339 UTC timestamps
/// as the store writes them.
#[derive(Debug, Clone)]
pub struct PruneFilter {
    /// Cutoff of agents without their own window (`None`: keep theirs forever).
    pub default_cutoff: Option<String>,
    /// Cutoff per agent with its own window.
    pub agent_cutoffs: std::collections::BTreeMap<String, String>,
    /// The newest ended requests kept whatever their age.
    pub min_keep: u64,
}

/// What a prune archives of a group of sessions, each table read once for the whole group
/// (`Store::archive_rows`); the retention pass sorts the rows into one line per session.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ArchiveRows {
    pub sessions: Vec<SessionRecord>,
    /// In the order a session's messages are read (`created_at`, then id).
    pub messages: Vec<MessageRecord>,
    /// With their input; newest first (id descending), as the admin listing pages them.
    pub requests: Vec<RequestRecord>,
    /// With their state; by attempt.
    pub runs: Vec<RunRecord>,
    /// By number.
    pub events: Vec<EventRecord>,
    /// By call key (the turn and position of the call in its run).
    pub tool_calls: Vec<ToolCallRecord>,
    /// By id.
    pub approvals: Vec<ApprovalRecord>,
}

/// Rows removed (or that a dry run would remove), by table.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct PruneCounts {
    pub sessions: u64,
    pub requests: u64,
    pub runs: u64,
    pub events: u64,
    pub tool_calls: u64,
    pub approvals: u64,
    pub artifacts: u64,
    pub messages: u64,
}

impl PruneCounts {
    /// Counts in the order of [`super::owned_by_sessions`]'s tables.
    pub fn from_owned(
        [
            events,
            tool_calls,
            approvals,
            artifacts,
            runs,
            messages,
            requests,
            sessions,
        ]: [u64; 8],
    ) -> Self {
        Self {
            sessions,
            requests,
            runs,
            events,
            tool_calls,
            approvals,
            artifacts,
            messages,
        }
    }

    pub fn add(&mut self, other: &Self) {
        self.sessions += other.sessions;
        self.requests += other.requests;
        self.runs += other.runs;
        self.events += other.events;
        self.tool_calls += other.tool_calls;
        self.approvals += other.approvals;
        self.artifacts += other.artifacts;
        self.messages += other.messages;
    }
}

/// The store's size on disk and what it holds, for operators.
#[derive(Debug, Clone, Default, PartialEq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct StoreStats {
    pub database_bytes: u64,
    /// The write-ahead log (SQLite).
    pub wal_bytes: u64,
    /// Space inside the database that is free for reuse (not yet given back).
    pub free_bytes: u64,
    pub requests: u64,
    pub sessions: u64,
}

/// One maintenance pass (a prune or a backup), as recorded in the store.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct MaintenanceRecord {
    pub id: String,
    /// `prune` or `backup`.
    pub operation: String,
    /// `completed` or `failed`.
    pub status: String,
    pub started_at: DateTime<Utc>,
    pub ended_at: DateTime<Utc>,
    /// What the pass did (counts, sizes, file) or why it failed.
    #[schema(value_type = Object)]
    pub report: Value,
}

/// Where a memory record is in its lifecycle (issue 12).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum MemoryStatus {
    /// Proposed; waits for an operator (`memory.write.requireApproval`). Never recalled.
    Pending,
    /// Recalled.
    Active,
    /// Refused by an operator. Never recalled; a duplicate proposal merges into it.
    Rejected,
    /// Set aside by compaction (a near-duplicate, or older than `memory.ttl`). Never recalled.
    Archived,
}

impl MemoryStatus {
    pub const ALL: [MemoryStatus; 4] =
        [Self::Pending, Self::Active, Self::Rejected, Self::Archived];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Active => "active",
            Self::Rejected => "rejected",
            Self::Archived => "archived",
        }
    }

    pub fn parse(text: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|status| status.as_str() == text)
    }
}

/// One thing an agent remembers, in one namespace.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct MemoryRecord {
    pub id: String,
    /// As templated from the request's context (`agent/support`, `user/ada`, ...).
    pub namespace: String,
    /// The key identity a `user/` or `session/` namespace belongs to; empty where the
    /// namespace is shared (`agent/`).
    pub scope: String,
    /// The key identity that wrote the record.
    pub owner: String,
    pub content: String,
    #[schema(value_type = Object)]
    pub metadata: Value,
    pub status: MemoryStatus,
    /// SHA-256 of the content: exact duplicates in a namespace are one record.
    pub content_hash: String,
    /// SHA-256 of the content normalized (case, punctuation, spacing): compaction merges
    /// records that share it.
    pub near_hash: String,
    pub source_request_id: Option<String>,
    pub source_run_id: Option<String>,
    pub decided_by: Option<String>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

#[derive(Debug, Clone, Default)]
pub struct MemoryFilter {
    pub namespace: Option<String>,
    pub status: Option<MemoryStatus>,
    pub owner: Option<String>,
    /// Words the content must contain one of (full-text search).
    pub words: Vec<String>,
}

/// What a conditional status change found.
#[derive(Debug, Clone, PartialEq)]
pub enum MemoryTransition {
    Changed(Box<MemoryRecord>),
    /// The record is in another status than the change expects.
    Refused(MemoryStatus),
    NotFound,
}

/// What a compaction pass did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct CompactReport {
    /// Active records archived because a newer near-duplicate stays.
    pub merged: u64,
    /// Active records archived because they were not updated within `memory.ttl`.
    pub expired: u64,
}

/// A call of a client tool, found by the id the client was given.
#[derive(Debug, Clone, PartialEq)]
pub struct ClientCallRecord {
    pub call: ToolCallRecord,
    /// Whether its run also called server tools (whose results the client never saw).
    pub server_calls: bool,
}
