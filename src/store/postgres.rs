//! The PostgreSQL store: the same [`Store`] behaviour as the embedded one, on a server
//! database (`postgres://` URLs) that several instances share.
//!
//! A batch is one transaction and one round trip: the ops go as one JSON array to the
//! `stable_harness_apply` function (`migrations/postgres`), its inserts gathered by kind
//! ahead of its other ops (`batch_json`), which it applies as this instance, numbering the
//! events after their request's last ones and announcing them with `NOTIFY`. A run's
//! consecutive events in a batch go as one row of `events` (`event_rows`).
//! Each batch is recorded under the id its writer gives all its tries, for a
//! minute: a try after a connection died with the commit's reply gets the numbers back
//! instead of applying the batch a second time (which would refuse it as a duplicate, or
//! report its own decision as a conflict). Migrations run at
//! open under sqlx's advisory lock, so instances starting together migrate once.
//!
//! Runs are owned through leases (SPEC section 8): a run is leased to the instance that
//! inserts it; [`Store::claim_runs`] takes runs whose lease expired with
//! `FOR UPDATE SKIP LOCKED`; only the holder may change a run or start one of its tool calls
//! (the function refuses others with SQLSTATE SH410, reported as [`StoreError::LeaseLost`]).
//! Lease times are the database's clock, so instances' clocks never have to agree.
//!
//! A listener connection follows the `stable_harness_events` channel and hands other
//! instances' appends to the runtime as [`StoreChange`]s; when it loses its connection it
//! says so ([`StoreChange::Resync`]) and reconnects.
//!
//! PostgreSQL text cannot hold U+0000, which clients may send; it is stored as U+FFFD.

use std::collections::BTreeMap;
use std::collections::hash_map::Entry;
use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, SubsecRound, Utc};
use serde_json::Value;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgListener, PgPool, PgPoolOptions, PgRow};
use sqlx::{Connection, Row};
use tokio::sync::broadcast;
use tokio_util::sync::{CancellationToken, DropGuard};

use super::conditions::{self, Conditions, Dialect};
use super::event_rows::{
    EventRows, LaterEvent, StoredLaterEvent, count_owned_sql, may_join, unpack,
};
use super::folds::{Folds, RequestRow, RunRow};
use super::postgres_spend::{
    PendingCharges, flush_idle_charges, usage_sums, usage_totals_from_row,
};
use super::stored_time;
use super::{
    ApprovalKind, ApprovalRecord, ApprovalStatus, ArchiveRows, ClientCallRecord, EventRecord,
    InputHolder, Lease, MaintenanceRecord, MessageRecord, Page, PageRequest, PathBelow, PathRead,
    PathWalk, PruneCounts, PruneFilter, RequestFilter, RequestInFull, RequestInput, RequestRecord,
    RunRecord, RunStatus, SessionFilter, SessionRecord, Store, StoreChange, StoreError, StoreStats,
    ToolCallRecord, WriteOp, redact_url,
};
use crate::ids::IdMap;
use crate::time::TimeText;

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("migrations/postgres");

/// The channel on which `stable_harness_apply` announces appended events.
const EVENTS_CHANNEL: &str = "stable_harness_events";
/// Changes buffered for the runtime; one that falls behind is told to read the store again.
const CHANGES_CAPACITY: usize = 4_096;
/// Batches the journal applies at once ([`Store::writer_lanes`]), each in a backend of its
/// own: one batch at a time left PostgreSQL one CPU's worth of work at most (a third of
/// this 2-core machine idle at 32 clients; docs/profiling.md, the thirty-seventh pass).
/// Not three, measured with PostgreSQL on the same two cores: two lanes nearly saturate
/// them, and a third only adds contention between the lanes' transactions (2,962 -> 2,774
/// req/s at c=32, the seventy-fifth pass); a database on cores of its own was not measured.
const WRITER_LANES: usize = 2;
/// Backends kept for the reads on a request's answer path, outside the pool: a request's view
/// (after `wait`), and what a continued conversation reads before it is submitted (the
/// previous response, the session, its newest message and the path to it). The pool pings a
/// connection when it is taken and again when it is returned, two round trips more than the
/// read's one (docs/profiling.md, the thirty-ninth pass). A read finding them all busy takes
/// a pooled connection.
const READER_BACKENDS: usize = 2;
/// How a writer lane's backend and a reader backend show in `pg_stat_activity`.
const LANE_BACKEND_NAME: &str = "stable-harness writer lane";
const READER_BACKEND_NAME: &str = "stable-harness reader";
/// Set on each backend the store keeps. Every statement such a backend runs finds its rows
/// by key, so the plan made once for any value is as good as one made for each; left to
/// choose, PostgreSQL planned some of them again at every execution (a request's view, the
/// lock of a batch's requests, a charge's reservation let go): 0.2 ms of the 1.9 ms of
/// PostgreSQL's CPU a chat request took (docs/profiling.md, the forty-first pass).
const GENERIC_PLANS: &str = "SET plan_cache_mode = force_generic_plan";
/// How long a read waits for a pooled connection, or a writer lane for its backend to open.
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, Clone)]
pub struct PostgresStore {
    url: String,
    pub(super) pool: PgPool,
    holder: String,
    pub(super) lease_ms: i64,
    changes: broadcast::Sender<StoreChange>,
    /// Settled calls' charges waiting for this instance's next batch, per writer lane (a
    /// charge waits in its request's lane, for a batch of that lane).
    pub(super) charges: Arc<[Arc<PendingCharges>]>,
    /// Each writer lane's backend, opened at its first batch and kept while it works. A pooled
    /// connection costs two more round trips per batch: sqlx pings it when it is acquired and
    /// again when it is returned (docs/profiling.md, the thirty-eighth pass).
    lane_backends: Arc<[tokio::sync::Mutex<Option<PgConnection>>]>,
    /// Backends kept for reads on a request's answer path ([`READER_BACKENDS`]), each opened
    /// at its first read and kept as a lane's is.
    reader_backends: Arc<[tokio::sync::Mutex<Option<PgConnection>>]>,
    /// Stops the listener and each lane's lone writer of idle charges when the last handle
    /// of the store is dropped.
    _listening: Arc<DropGuard>,
}

impl PostgresStore {
    /// Connects, migrates and starts listening for other instances' events; runs are leased
    /// for `lease`.
    pub async fn connect(url: &str, lease: Duration) -> Result<Self, StoreError> {
        let options = PgConnectOptions::from_str(url)?;
        let pool = PgPoolOptions::new()
            .max_connections(16)
            .min_connections(1)
            .acquire_timeout(ACQUIRE_TIMEOUT)
            .connect_with(options)
            .await?;
        MIGRATOR.run(&pool).await?;
        let holder = super::new_holder();
        let (changes, _) = broadcast::channel(CHANGES_CAPACITY);
        let stop = CancellationToken::new();
        let mut listener = PgListener::connect_with(&pool).await?;
        listener.listen(EVENTS_CHANNEL).await?;
        tokio::spawn(listen(
            listener,
            holder.clone(),
            changes.clone(),
            stop.clone(),
        ));
        let charges: Arc<[Arc<PendingCharges>]> = (0..WRITER_LANES)
            .map(|_| Arc::new(PendingCharges::default()))
            .collect();
        for lane in charges.iter() {
            tokio::spawn(flush_idle_charges(
                pool.clone(),
                Arc::clone(lane),
                stop.clone(),
            ));
        }
        Ok(Self {
            url: redact_url(url),
            pool,
            holder,
            lease_ms: i64::try_from(lease.as_millis()).unwrap_or(i64::MAX),
            changes,
            charges,
            lane_backends: (0..WRITER_LANES)
                .map(|_| tokio::sync::Mutex::default())
                .collect(),
            reader_backends: (0..READER_BACKENDS)
                .map(|_| tokio::sync::Mutex::default())
                .collect(),
            _listening: Arc::new(stop.drop_guard()),
        })
    }
}

/// Forwards other instances' announcements (`holder request first last`, or `holder cancel
/// run by`) until `stop`.
async fn listen(
    mut listener: PgListener,
    holder: String,
    changes: broadcast::Sender<StoreChange>,
    stop: CancellationToken,
) {
    loop {
        let received = tokio::select! {
            () = stop.cancelled() => return,
            received = listener.try_recv() => received,
        };
        match received {
            Ok(Some(notification)) => {
                let mut fields = notification.payload().split(' ');
                let (Some(from), Some(second), Some(third)) =
                    (fields.next(), fields.next(), fields.next())
                else {
                    continue;
                };
                if second == "cancel" {
                    // Every instance hears it, the asker included: the holder acts on it.
                    let by: Vec<&str> = fields.collect();
                    let _ = changes.send(StoreChange::CancelRequested {
                        run_id: third.to_owned(),
                        by: by.join(" "),
                    });
                    continue;
                }
                let (request_id, first, Some(last)) = (second, third, fields.next()) else {
                    continue;
                };
                if from == holder {
                    continue;
                }
                if let (Ok(first), Ok(last)) = (first.parse(), last.parse()) {
                    let _ = changes.send(StoreChange::Events {
                        request_id: request_id.to_owned(),
                        first,
                        last,
                    });
                }
            }
            // The connection was lost: anything announced meanwhile is missed. The next call
            // reconnects and listens again.
            Ok(None) => {
                let _ = changes.send(StoreChange::Resync);
            }
            Err(error) => {
                tracing::debug!(%error, "the store's listener cannot reach the database");
                let _ = changes.send(StoreChange::Resync);
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
            }
        }
    }
}

/// Text as PostgreSQL can hold it. Also applied to keys a read binds: no stored key holds
/// U+0000, so one that does matches nothing instead of failing.
pub(super) fn text(value: &str) -> String {
    value.replace('\0', "\u{FFFD}")
}

/// JSON as PostgreSQL can hold it (no U+0000 in any string).
pub(super) fn json(value: &Value) -> Value {
    let mut value = value.clone();
    scrub(&mut value);
    value
}

/// Makes `value` storable in place: only strings and keys holding U+0000 are rewritten.
fn scrub(value: &mut Value) {
    match value {
        Value::String(s) if s.contains('\0') => *s = text(s),
        Value::Array(items) => items.iter_mut().for_each(scrub),
        Value::Object(map) if map.keys().any(|key| key.contains('\0')) => {
            *map = std::mem::take(map)
                .into_iter()
                .map(|(key, mut item)| {
                    scrub(&mut item);
                    (text(&key), item)
                })
                .collect();
        }
        Value::Object(map) => map.values_mut().for_each(scrub),
        _ => {}
    }
}

fn parse_status(text: &str) -> Result<RunStatus, StoreError> {
    RunStatus::parse(text).ok_or_else(|| StoreError::Corrupt(format!("unknown status `{text}`")))
}

fn request_from_row(row: &PgRow) -> Result<RequestRecord, StoreError> {
    Ok(RequestRecord {
        input: row.try_get("input")?,
        ..request_without_input(row)?
    })
}

/// A request's record from a row without its `input` (left `Null`): as a view reads it.
fn request_without_input(row: &PgRow) -> Result<RequestRecord, StoreError> {
    Ok(RequestRecord {
        id: row.try_get("id")?,
        session_id: row.try_get("session_id")?,
        agent_id: row.try_get("agent_id")?,
        protocol: row.try_get("protocol")?,
        owner: row.try_get("owner")?,
        status: parse_status(&row.try_get::<String, _>("status")?)?,
        input: Value::Null,
        output: row.try_get("output")?,
        error: row.try_get("error")?,
        usage: row.try_get("usage")?,
        metadata: row.try_get("metadata")?,
        created_at: row.try_get("created_at")?,
        updated_at: row.try_get("updated_at")?,
    })
}

/// A stored record's columns by name: a row as the driver returns it, or the same row as
/// PostgreSQL's `json_agg` writes it (a request's view reads its runs and approvals that way,
/// in the statement that reads the request: one snapshot, one round trip). Both map to a
/// record through one function.
trait Fields {
    fn field<T>(&self, name: &str) -> Result<T, StoreError>
    where
        T: for<'r> sqlx::Decode<'r, sqlx::Postgres>
            + sqlx::Type<sqlx::Postgres>
            + serde::de::DeserializeOwned;
}

impl Fields for PgRow {
    fn field<T>(&self, name: &str) -> Result<T, StoreError>
    where
        T: for<'r> sqlx::Decode<'r, sqlx::Postgres>
            + sqlx::Type<sqlx::Postgres>
            + serde::de::DeserializeOwned,
    {
        Ok(self.try_get(name)?)
    }
}

/// A row as `json_agg` writes it: SQL `NULL` is JSON `null` (a stored JSON column never holds
/// `null` itself: the batch function stores it as SQL `NULL`), a time is RFC 3339 text in the
/// session's time zone, read back as the same instant.
impl Fields for serde_json::Map<String, Value> {
    fn field<T>(&self, name: &str) -> Result<T, StoreError>
    where
        T: for<'r> sqlx::Decode<'r, sqlx::Postgres>
            + sqlx::Type<sqlx::Postgres>
            + serde::de::DeserializeOwned,
    {
        T::deserialize(self.get(name).unwrap_or(&Value::Null))
            .map_err(|error| StoreError::Corrupt(format!("column `{name}`: {error}")))
    }
}

/// The statement of the views of the requests whose id is `$matching` (`= $1`, `= ANY($1)`):
/// each request with its charges' sums and, as `json_agg` writes their rows, its runs and
/// their approvals, in one statement and so from one snapshot. The runs, approvals and
/// charges are matched to `r.id` in the default collation: ids are `"C"` in `requests` and
/// default in the columns that reference them, whose indexes serve only the default (in
/// `"C"`, every subquery was a sequential scan).
macro_rules! views_of_requests {
    ($matching:literal) => {
        concat!(
            // Every column of the request but `input`, which no view shows
            // ([`RequestInFull`]).
            "SELECT ",
            request_columns_but_input!(),
            ", u.*, ",
            // Each run without its `state`, which no view shows.
            "(SELECT json_agg(x ORDER BY x.attempt) FROM (SELECT ",
            run_columns_but_state!(),
            " FROM runs WHERE request_id = r.id COLLATE \"default\") x) AS view_runs, ",
            "(SELECT json_agg(a ORDER BY x.attempt, a.id) ",
            "FROM approvals a JOIN runs x ON x.id = a.run_id ",
            "WHERE a.request_id = r.id COLLATE \"default\") AS view_approvals ",
            "FROM requests r, LATERAL (SELECT ",
            usage_sums!(),
            " FROM usage_records WHERE request_id = r.id COLLATE \"default\") u ",
            "WHERE r.id ",
            $matching
        )
    };
}

/// A request's view from a row of `views_of_requests!`.
fn view_from_row(row: &PgRow) -> Result<RequestInFull, StoreError> {
    Ok(RequestInFull {
        request: request_without_input(row)?,
        runs: aggregated(row, "view_runs", run_without_state)?,
        approvals: aggregated(row, "view_approvals", approval_from_row)?,
        // The sums' columns are named as `usage_totals` names them; none is a request's.
        charged: usage_totals_from_row(row, String::new())?,
    })
}

/// The records in `column`, a `json_agg` of rows (`NULL` when it aggregated none), each
/// mapped by `map`.
fn aggregated<T>(
    row: &PgRow,
    column: &str,
    map: impl Fn(&serde_json::Map<String, Value>) -> Result<T, StoreError>,
) -> Result<Vec<T>, StoreError> {
    let rows: Option<sqlx::types::Json<Vec<serde_json::Map<String, Value>>>> =
        row.try_get(column)?;
    rows.map_or(Ok(Vec::new()), |rows| rows.0.iter().map(map).collect())
}

fn run_from_row(row: &impl Fields) -> Result<RunRecord, StoreError> {
    Ok(RunRecord {
        state: row.field("state")?,
        ..run_without_state(row)?
    })
}

/// A run's record from a row without its `state` (left `None`): as a view reads it.
fn run_without_state(row: &impl Fields) -> Result<RunRecord, StoreError> {
    Ok(RunRecord {
        id: row.field("id")?,
        request_id: row.field("request_id")?,
        attempt: row.field("attempt")?,
        status: parse_status(&row.field::<String>("status")?)?,
        state: None,
        error: row.field("error")?,
        created_at: row.field("created_at")?,
        updated_at: row.field("updated_at")?,
        started_at: row.field("started_at")?,
        ended_at: row.field("ended_at")?,
        lease: Lease::from_columns(row.field("lease_holder")?, row.field("lease_expires_at")?),
        cancel_requested_by: row.field("cancel_requested_by")?,
    })
}

fn session_from_row(row: &PgRow) -> Result<SessionRecord, StoreError> {
    Ok(SessionRecord {
        id: row.try_get("id")?,
        agent_id: row.try_get("agent_id")?,
        owner: row.try_get("owner")?,
        metadata: row.try_get("metadata")?,
        created_at: row.try_get("created_at")?,
        updated_at: row.try_get("updated_at")?,
    })
}

fn message_from_row(row: &PgRow) -> Result<MessageRecord, StoreError> {
    Ok(MessageRecord {
        id: row.try_get("id")?,
        session_id: row.try_get("session_id")?,
        parent_id: row.try_get("parent_id")?,
        request_id: row.try_get("request_id")?,
        role: row.try_get("role")?,
        content: row.try_get("content")?,
        created_at: row.try_get("created_at")?,
    })
}

/// The events one row of `events` holds: its first, then those in `more`, numbered on
/// (migration 0010; see `event_rows`).
fn events_from_row(row: &PgRow) -> Result<Vec<EventRecord>, StoreError> {
    let first = EventRecord {
        id: row.try_get("id")?,
        request_id: row.try_get("request_id")?,
        run_id: row.try_get("run_id")?,
        session_id: row.try_get("session_id")?,
        agent_id: row.try_get("agent_id")?,
        seq: row.try_get("seq")?,
        event_type: row.try_get("type")?,
        at: row.try_get("at")?,
        data: row.try_get("data")?,
    };
    let Some(sqlx::types::Json(later)) =
        row.try_get::<Option<sqlx::types::Json<Vec<StoredLaterEvent>>>, _>("more")?
    else {
        return Ok(vec![first]);
    };
    unpack(first, later, stored_time::parse)
}

fn approval_from_row(row: &impl Fields) -> Result<ApprovalRecord, StoreError> {
    let status: String = row.field("status")?;
    let kind: String = row.field("kind")?;
    Ok(ApprovalRecord {
        id: row.field("id")?,
        request_id: row.field("request_id")?,
        run_id: row.field("run_id")?,
        session_id: row.field("session_id")?,
        agent_id: row.field("agent_id")?,
        call_key: row.field("call_key")?,
        execution: row.field("execution")?,
        kind: ApprovalKind::parse(&kind)
            .ok_or_else(|| StoreError::Corrupt(format!("unknown approval kind `{kind}`")))?,
        tool_call_id: row.field("tool_call_id")?,
        tool_id: row.field("tool_id")?,
        arguments: row.field("arguments")?,
        rule: row.field("rule")?,
        status: ApprovalStatus::parse(&status)
            .ok_or_else(|| StoreError::Corrupt(format!("unknown approval status `{status}`")))?,
        reason: row.field("reason")?,
        decided_by: row.field("decided_by")?,
        created_at: row.field("created_at")?,
        expires_at: row.field("expires_at")?,
        decided_at: row.field("decided_at")?,
    })
}

/// Rows of events with the session and agent of their request (events do not repeat them),
/// from the row that may hold the event after the cursor: the caller binds `$2` and `$3`
/// through [`EventRows`].
const EVENT_SELECT: &str =
    "SELECT e.id, e.request_id, e.run_id, r.session_id, r.agent_id, e.seq, e.type,
            e.at, e.data, e.more
     FROM events e JOIN requests r ON r.id = e.request_id";

/// [`Store::input_holder`]'s read, through the digest's index (migration 0016). The naming
/// members are read from the found request's input, which PostgreSQL decompresses whole to
/// read them (a few hundred microseconds for a holder of a megabyte, once a turn), and
/// again for each reference to it: the inner query's one, without its messages, is the
/// outer's three.
const INPUT_HOLDER: &str = "SELECT id, updated_at, named ->> 'prefixOf' AS prefix_of,
        (named ->> 'prefixLen')::bigint AS prefix_len, named ->> 'leadingDigest' AS leading_digest
     FROM (SELECT id, updated_at, input - 'messages' AS named FROM requests
           WHERE input ? 'inputDigest' AND input ->> 'inputDigest' = $1
               AND owner = $2 AND agent_id = $3
           ORDER BY id DESC LIMIT 1) found";

/// The sessions a prune may remove; the same conditions as the embedded store's
/// (`$1`: per-agent cutoffs, a JSON object; `$2`: everyone else's or NULL; `$3`: minKeep;
/// `$4`: after this id (`after`); `$5`: limit; `$6`: only among these ids (`among`)).
fn prunable_sessions(after: bool, among: bool) -> String {
    let conditions = Conditions::new(Dialect::Postgres)
        .compare(after, "s.id", ">", 4, "text")
        .filter(among, "s.id = ANY($6)", 6, "text[]");
    format!(
        "
WITH kept AS (
    SELECT id FROM requests WHERE status IN ('completed', 'failed', 'cancelled')
    ORDER BY id DESC LIMIT $3
)
SELECT s.id FROM sessions s
WHERE {conditions}
  AND s.updated_at < COALESCE(($1::jsonb ->> s.agent_id)::timestamptz, $2::timestamptz, '-infinity')
  AND NOT EXISTS (SELECT 1 FROM sessions f WHERE f.metadata -> 'forkedFrom' ->> 'sessionId' = s.id)
  AND NOT EXISTS (
    SELECT 1 FROM requests r WHERE r.session_id = s.id AND (
        r.status NOT IN ('completed', 'failed', 'cancelled')
        OR r.updated_at >= COALESCE(($1::jsonb ->> r.agent_id)::timestamptz, $2::timestamptz, 'infinity')
        OR r.id IN (SELECT id FROM kept)
        OR EXISTS (SELECT 1 FROM approvals a WHERE a.request_id = r.id AND a.status = 'pending')
        OR EXISTS (SELECT 1 FROM runs u WHERE u.request_id = r.id
                   AND u.status NOT IN ('completed', 'failed', 'cancelled'))
        OR EXISTS (SELECT 1 FROM requests n WHERE n.input ? 'prefixOf'
                   AND n.input ->> 'prefixOf' = r.id COLLATE \"default\" AND n.session_id <> s.id)))
ORDER BY s.id LIMIT $5"
    )
}

/// How this store's SQL names the set of session ids a prune counts or deletes.
const IN_SESSIONS: &str = "= ANY($1)";

fn agent_cutoffs(cutoffs: &BTreeMap<String, String>) -> Value {
    Value::Object(
        cutoffs
            .iter()
            .map(|(agent, cutoff)| (agent.clone(), Value::String(cutoff.clone())))
            .collect(),
    )
}

/// A batch's ops as `stable_harness_apply` reads them (see `migrations/postgres`): first the
/// inserts of its sessions, requests, runs and messages, each kind in one op of rows that the
/// function writes in one statement (migration 0014), then its other ops in order, then its
/// events in one `append_events` op ([`EventJson`]). An insert needs only the rows it names
/// (its session, its request), which come before it, and no op removes a row, so a batch
/// that commits leaves the rows its ops in order would. A batch refused is refused for the
/// same reason: the ids of sessions, requests and messages are this instance's own, so their
/// inserts fail only when something else fails too; a run's insert can meet another
/// instance's run of the same attempt (one that took the run over when this instance lost
/// its lease), so a run inserted after one of the batch's conditional ops (a run's update
/// or an approval or tool call, fenced to the lease; a decision) stays there, and the
/// batch is refused for the lost lease, as in order. An insert the batch's updates fold
/// into is written as they leave its row (`folds`); a session touched twice is sent once,
/// as the two touches leave it.
///
/// Serialized from the records themselves, as the events are: building each op as a
/// `Value` copied its input, content and metadata, and wrote its times through chrono's
/// formatter (~14% of the server's instructions for a chat request on this store; see
/// docs/profiling.md, the thirty-eighth pass).
fn batch_json(ops: &[WriteOp]) -> Vec<OpJson<'_>> {
    let mut folds = Folds::plan(ops);
    let mut sessions: Vec<SessionJson<'_>> = Vec::new();
    let mut session_rows: IdMap<&str, usize> = IdMap::default();
    let mut requests = Vec::new();
    let mut runs = Vec::new();
    let mut messages = Vec::new();
    let mut others = Vec::new();
    let mut events = Vec::new();
    // Whether an op that may be refused (fenced to a run's lease, or a decision) came yet.
    let mut conditional_before = false;
    for (index, op) in ops.iter().enumerate() {
        if folds.is_folded(index) {
            continue;
        }
        match op {
            WriteOp::TouchSession(session) => {
                // Its first touch inserts it, each later one sets `updated_at`.
                match session_rows.entry(session.id.as_str()) {
                    Entry::Occupied(row) => sessions[*row.get()].updated_at = session.updated_at,
                    Entry::Vacant(row) => {
                        row.insert(sessions.len());
                        sessions.push(SessionJson::of(session));
                    }
                }
            }
            WriteOp::InsertRequest(request) => {
                let row = folds
                    .take_request(index)
                    .unwrap_or_else(|| RequestRow::inserted(request));
                requests.push(RequestJson::of(request, row));
            }
            WriteOp::InsertRun(run) => {
                let row = folds
                    .take_run(index)
                    .unwrap_or_else(|| RunRow::inserted(run));
                let row = RunJson::of(run, row);
                if conditional_before {
                    others.push(OpJson::InsertRuns { rows: vec![row] });
                } else {
                    runs.push(row);
                }
            }
            WriteOp::InsertMessage(message) => messages.push(MessageJson::of(message)),
            WriteOp::AppendEvent(event) => add_event(&mut events, event),
            op => {
                conditional_before |= !matches!(op, WriteOp::UpdateRequest { .. });
                others.extend(op_json(op));
            }
        }
    }
    let mut batch = Vec::with_capacity(others.len().saturating_add(5));
    if !sessions.is_empty() {
        batch.push(OpJson::TouchSessions { rows: sessions });
    }
    if !requests.is_empty() {
        batch.push(OpJson::InsertRequests { rows: requests });
    }
    if !runs.is_empty() {
        batch.push(OpJson::InsertRuns { rows: runs });
    }
    if !messages.is_empty() {
        batch.push(OpJson::InsertMessages { rows: messages });
    }
    batch.append(&mut others);
    if !events.is_empty() {
        batch.push(OpJson::AppendEvents { events });
    }
    batch
}

/// One of a batch's ops other than the inserts and events [`batch_json`] gathers into rows
/// (`None` for those), as `stable_harness_apply` reads it: a `None` field is a JSON null,
/// which the function reads as SQL NULL.
fn op_json(op: &WriteOp) -> Option<OpJson<'_>> {
    Some(match op {
        WriteOp::UpdateRequest {
            id,
            status,
            output,
            error,
            usage,
            at,
        } => OpJson::UpdateRequest {
            id: Storable(id),
            status: status.as_str(),
            output: output.as_deref().map(Storable),
            error: error.as_ref().map(Storable),
            usage: usage.as_ref().map(Storable),
            at: *at,
        },
        WriteOp::UpdateRun {
            id,
            status,
            error,
            state,
            at,
        } => OpJson::UpdateRun {
            id: Storable(id),
            status: status.as_str(),
            error: error.as_ref().map(Storable),
            state: state.as_ref().map(Storable),
            at: *at,
        },
        WriteOp::InsertApproval(approval) => OpJson::InsertApproval {
            id: Storable(&approval.id),
            request_id: Storable(&approval.request_id),
            run_id: Storable(&approval.run_id),
            session_id: Storable(&approval.session_id),
            agent_id: Storable(&approval.agent_id),
            tool_call_id: Storable(&approval.tool_call_id),
            tool_id: Storable(&approval.tool_id),
            arguments: Storable(&approval.arguments),
            rule: approval.rule.as_deref().map(Storable),
            status: approval.status.as_str(),
            reason: approval.reason.as_deref().map(Storable),
            decided_by: approval.decided_by.as_deref().map(Storable),
            created_at: approval.created_at,
            expires_at: approval.expires_at,
            decided_at: approval.decided_at,
            call_key: Storable(&approval.call_key),
            kind: approval.kind.as_str(),
            execution: approval.execution,
        },
        WriteOp::DecideApproval(decision) => OpJson::DecideApproval {
            id: Storable(&decision.id),
            status: decision.status.as_str(),
            reason: decision.reason.as_deref().map(Storable),
            decided_by: Storable(&decision.decided_by),
            at: decision.at,
        },
        WriteOp::StartToolCall(call) => OpJson::StartToolCall(ToolCallJson::of(call)),
        WriteOp::RecordToolCall(call) => OpJson::RecordToolCall(ToolCallJson::of(call)),
        // Gathered into rows by `batch_json`.
        WriteOp::TouchSession(_)
        | WriteOp::InsertRequest(_)
        | WriteOp::InsertRun(_)
        | WriteOp::InsertMessage(_)
        | WriteOp::AppendEvent(_) => return None,
    })
}

/// An op of a batch as `stable_harness_apply` reads it: its kind in `op`, its fields by
/// name (see [`op_json`]). Times are written as chrono writes them (RFC 3339, `Z`), which
/// PostgreSQL reads into `timestamptz`.
#[derive(serde::Serialize)]
#[serde(tag = "op", rename_all = "snake_case")]
enum OpJson<'a> {
    TouchSessions {
        rows: Vec<SessionJson<'a>>,
    },
    InsertRequests {
        rows: Vec<RequestJson<'a>>,
    },
    InsertRuns {
        rows: Vec<RunJson<'a>>,
    },
    InsertMessages {
        rows: Vec<MessageJson<'a>>,
    },
    UpdateRequest {
        id: Storable<'a, str>,
        status: &'static str,
        output: Option<Storable<'a, str>>,
        error: Option<Storable<'a, Value>>,
        usage: Option<Storable<'a, Value>>,
        #[serde(serialize_with = "crate::time::serialize")]
        at: DateTime<Utc>,
    },
    UpdateRun {
        id: Storable<'a, str>,
        status: &'static str,
        error: Option<Storable<'a, Value>>,
        state: Option<Storable<'a, Value>>,
        #[serde(serialize_with = "crate::time::serialize")]
        at: DateTime<Utc>,
    },
    InsertApproval {
        id: Storable<'a, str>,
        request_id: Storable<'a, str>,
        run_id: Storable<'a, str>,
        session_id: Storable<'a, str>,
        agent_id: Storable<'a, str>,
        tool_call_id: Storable<'a, str>,
        tool_id: Storable<'a, str>,
        arguments: Storable<'a, Value>,
        rule: Option<Storable<'a, str>>,
        status: &'static str,
        reason: Option<Storable<'a, str>>,
        decided_by: Option<Storable<'a, str>>,
        #[serde(serialize_with = "crate::time::serialize")]
        created_at: DateTime<Utc>,
        #[serde(serialize_with = "crate::time::serialize_optional")]
        expires_at: Option<DateTime<Utc>>,
        #[serde(serialize_with = "crate::time::serialize_optional")]
        decided_at: Option<DateTime<Utc>>,
        call_key: Storable<'a, str>,
        kind: &'static str,
        execution: i64,
    },
    DecideApproval {
        id: Storable<'a, str>,
        status: &'static str,
        reason: Option<Storable<'a, str>>,
        decided_by: Storable<'a, str>,
        #[serde(serialize_with = "crate::time::serialize")]
        at: DateTime<Utc>,
    },
    StartToolCall(ToolCallJson<'a>),
    RecordToolCall(ToolCallJson<'a>),
    /// Rows of events: a batch's events, after its other ops ([`add_event`]).
    AppendEvents {
        events: Vec<EventJson<'a>>,
    },
}

/// A session as `touch_sessions` reads it: inserted, or its `updated_at` set if it exists.
#[derive(serde::Serialize)]
struct SessionJson<'a> {
    id: Storable<'a, str>,
    agent_id: Storable<'a, str>,
    owner: Storable<'a, str>,
    metadata: Storable<'a, Value>,
    #[serde(serialize_with = "crate::time::serialize")]
    created_at: DateTime<Utc>,
    #[serde(serialize_with = "crate::time::serialize")]
    updated_at: DateTime<Utc>,
}

impl<'a> SessionJson<'a> {
    fn of(session: &'a SessionRecord) -> Self {
        Self {
            id: Storable(&session.id),
            agent_id: Storable(&session.agent_id),
            owner: Storable(&session.owner),
            metadata: Storable(&session.metadata),
            created_at: session.created_at,
            updated_at: session.updated_at,
        }
    }
}

/// A message as `insert_messages` reads it.
#[derive(serde::Serialize)]
struct MessageJson<'a> {
    id: Storable<'a, str>,
    session_id: Storable<'a, str>,
    parent_id: Option<Storable<'a, str>>,
    request_id: Option<Storable<'a, str>>,
    role: Storable<'a, str>,
    content: Storable<'a, Value>,
    #[serde(serialize_with = "crate::time::serialize")]
    created_at: DateTime<Utc>,
}

impl<'a> MessageJson<'a> {
    fn of(message: &'a MessageRecord) -> Self {
        Self {
            id: Storable(&message.id),
            session_id: Storable(&message.session_id),
            parent_id: message.parent_id.as_deref().map(Storable),
            request_id: message.request_id.as_deref().map(Storable),
            role: Storable(&message.role),
            content: Storable(&message.content),
            created_at: message.created_at,
        }
    }
}

/// A request as `insert_requests` reads it, as the batch's updates of it leave its `row`.
#[derive(serde::Serialize)]
struct RequestJson<'a> {
    id: Storable<'a, str>,
    session_id: Storable<'a, str>,
    agent_id: Storable<'a, str>,
    protocol: Storable<'a, str>,
    status: &'static str,
    input: Storable<'a, Value>,
    output: Option<Storable<'a, str>>,
    error: Option<Storable<'a, Value>>,
    usage: Option<Storable<'a, Value>>,
    metadata: Storable<'a, Value>,
    #[serde(serialize_with = "crate::time::serialize")]
    created_at: DateTime<Utc>,
    #[serde(serialize_with = "crate::time::serialize")]
    updated_at: DateTime<Utc>,
    owner: Storable<'a, str>,
}

impl<'a> RequestJson<'a> {
    fn of(request: &'a RequestRecord, row: RequestRow<'a>) -> Self {
        Self {
            id: Storable(&request.id),
            session_id: Storable(&request.session_id),
            agent_id: Storable(&request.agent_id),
            protocol: Storable(&request.protocol),
            status: row.status.as_str(),
            input: Storable(&request.input),
            output: row.output.map(Storable),
            error: row.error.map(Storable),
            usage: row.usage.map(Storable),
            metadata: Storable(&request.metadata),
            created_at: request.created_at,
            updated_at: row.updated_at,
            owner: Storable(&request.owner),
        }
    }
}

/// A run as `insert_runs` reads it, as the batch's updates of it leave its `row`; a run the
/// batch ended is inserted without a lease (`leased`).
#[derive(serde::Serialize)]
struct RunJson<'a> {
    id: Storable<'a, str>,
    request_id: Storable<'a, str>,
    attempt: i64,
    status: &'static str,
    state: Option<Storable<'a, Value>>,
    error: Option<Storable<'a, Value>>,
    #[serde(serialize_with = "crate::time::serialize")]
    created_at: DateTime<Utc>,
    #[serde(serialize_with = "crate::time::serialize")]
    updated_at: DateTime<Utc>,
    #[serde(serialize_with = "crate::time::serialize_optional")]
    started_at: Option<DateTime<Utc>>,
    #[serde(serialize_with = "crate::time::serialize_optional")]
    ended_at: Option<DateTime<Utc>>,
    leased: bool,
}

impl<'a> RunJson<'a> {
    fn of(run: &'a RunRecord, row: RunRow<'a>) -> Self {
        Self {
            id: Storable(&run.id),
            request_id: Storable(&run.request_id),
            attempt: run.attempt,
            status: row.status.as_str(),
            state: row.state.map(Storable),
            error: row.error.map(Storable),
            created_at: run.created_at,
            updated_at: row.updated_at,
            started_at: row.started_at,
            ended_at: row.ended_at,
            leased: row.leased,
        }
    }
}

/// A tool call's start or record, as `stable_harness_apply` reads either.
#[derive(serde::Serialize)]
struct ToolCallJson<'a> {
    run_id: Storable<'a, str>,
    call_key: Storable<'a, str>,
    model_call_id: Storable<'a, str>,
    request_id: Storable<'a, str>,
    tool_id: Storable<'a, str>,
    arguments: Storable<'a, Value>,
    idempotency_key: Storable<'a, str>,
    outcome: Storable<'a, str>,
    result: Storable<'a, Value>,
    duration_ms: i64,
    #[serde(serialize_with = "crate::time::serialize")]
    recorded_at: DateTime<Utc>,
}

impl<'a> ToolCallJson<'a> {
    fn of(call: &'a ToolCallRecord) -> Self {
        Self {
            run_id: Storable(&call.run_id),
            call_key: Storable(&call.call_key),
            model_call_id: Storable(&call.model_call_id),
            request_id: Storable(&call.request_id),
            tool_id: Storable(&call.tool_id),
            arguments: Storable(&call.arguments),
            idempotency_key: Storable(&call.idempotency_key),
            outcome: Storable(&call.outcome),
            result: Storable(&call.result),
            duration_ms: call.duration_ms,
            recorded_at: call.recorded_at,
        }
    }
}

/// A row of events as `append_events` reads it (the function numbers it): its first event,
/// and in `more` the same run's events after it (migration 0010; see `event_rows`).
/// Serialized from the records themselves: a batch's events are most of its JSON, and
/// building them as `Value`s copied every event's data (108,000 of a chat request's 784,000
/// instructions here; see docs/profiling.md, the fourteenth pass).
#[derive(serde::Serialize)]
struct EventJson<'a> {
    id: Storable<'a, str>,
    request_id: Storable<'a, str>,
    run_id: Storable<'a, str>,
    #[serde(rename = "type")]
    event_type: Storable<'a, str>,
    #[serde(serialize_with = "crate::time::serialize")]
    at: DateTime<Utc>,
    data: Storable<'a, Value>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    more: Vec<LaterEvent<Storable<'a, str>, TimeText, Storable<'a, Value>>>,
    /// About how many bytes of data the row holds (not sent).
    #[serde(skip)]
    bytes: usize,
}

/// About how many bytes of data a row of events may hold. With the later events' ids, types
/// and times, a row of six or seven events is 2.2-2.6 KB, past the ~2 KB at which
/// PostgreSQL compresses a row's values (with LZ4 where it can, migration `0013`); a row
/// much larger would be moved out of line, which costs more than the rows saved.
const ROW_BYTES: usize = 1_536;

impl<'a> EventJson<'a> {
    fn of(event: &'a EventRecord, bytes: usize) -> Self {
        Self {
            id: Storable(&event.id),
            request_id: Storable(&event.request_id),
            run_id: Storable(&event.run_id),
            event_type: Storable(&event.event_type),
            at: event.at,
            data: Storable(&event.data),
            more: Vec::new(),
            bytes,
        }
    }
}

/// Adds `event` to a batch's rows of events: to the last row when that is of the same run
/// and has room, else as a new row.
fn add_event<'a>(rows: &mut Vec<EventJson<'a>>, event: &'a EventRecord) {
    let bytes = json_bytes_within(&event.data, ROW_BYTES);
    if let Some(row) = rows.last_mut()
        && may_join(row.request_id.0, row.run_id.0, 1 + row.more.len(), event)
        && let Some(bytes) = bytes.filter(|b| row.bytes.saturating_add(*b) <= ROW_BYTES)
    {
        row.more.push(LaterEvent {
            id: Storable(&event.id),
            event_type: Storable(&event.event_type),
            // Rounded to the microsecond, as the `at` column rounds the row's first event's.
            at: stored_time::text(&event.at.round_subsecs(6)),
            data: Storable(&event.data),
        });
        row.bytes += bytes;
        return;
    }
    rows.push(EventJson::of(event, bytes.unwrap_or(ROW_BYTES)));
}

/// About how many bytes `value` takes as JSON, if no more than `budget`: the walk stops
/// once past it, so an event's large data costs no more than a small one's.
fn json_bytes_within(value: &Value, budget: usize) -> Option<usize> {
    fn walk(value: &Value, left: &mut usize) -> bool {
        let own = match value {
            Value::String(text) => text.len() + 2,
            Value::Array(items) => items.len() + 2,
            Value::Object(map) => map.len() * 2 + 2,
            // Numbers, booleans and null: a few bytes each.
            _ => 8,
        };
        spend(left, own)
            && match value {
                Value::Array(items) => items.iter().all(|item| walk(item, left)),
                Value::Object(map) => map
                    .iter()
                    .all(|(key, item)| spend(left, key.len() + 2) && walk(item, left)),
                _ => true,
            }
    }
    /// Takes `bytes` from what is `left`, if there are that many.
    fn spend(left: &mut usize, bytes: usize) -> bool {
        left.checked_sub(bytes).map(|rest| *left = rest).is_some()
    }
    let mut left = budget;
    walk(value, &mut left).then(|| budget - left)
}

/// A string or JSON value serialized as PostgreSQL can store it, as [`scrub`] leaves it
/// (U+0000 in a string or key becomes U+FFFD), without copying what needs no change.
pub(super) struct Storable<'a, T: ?Sized>(pub(super) &'a T);

impl serde::Serialize for Storable<'_, str> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        if self.0.contains('\0') {
            serializer.serialize_str(&text(self.0))
        } else {
            serializer.serialize_str(self.0)
        }
    }
}

impl serde::Serialize for Storable<'_, Value> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self.0 {
            Value::String(string) => Storable(string.as_str()).serialize(serializer),
            Value::Array(items) => serializer.collect_seq(items.iter().map(Storable)),
            Value::Object(map) => serializer.collect_map(
                map.iter()
                    .map(|(key, item)| (Storable(key.as_str()), Storable(item))),
            ),
            other => other.serialize(serializer),
        }
    }
}

impl PostgresStore {
    /// The charges waiting in writer lane `lane` (see [`Store::writer_lanes`]).
    pub(super) fn pending_charges(&self, lane: usize) -> &PendingCharges {
        debug_assert!(
            lane < self.charges.len(),
            "lane {lane} of {}",
            self.charges.len()
        );
        // At least one lane (`WRITER_LANES`); a lane past them is the last one's.
        &self.charges[lane.min(self.charges.len() - 1)]
    }

    /// The rows of `query`, run on writer lane `lane`'s backend, opened first if the lane has
    /// none. The backend is taken from its slot while the query runs and put back only after
    /// an answer from the database (its refusal included): one the query's future was dropped
    /// on, or whose connection failed, is closed, and the lane's next use opens another.
    async fn on_lane_backend(
        &self,
        lane: usize,
        query: sqlx::query::Query<'_, sqlx::Postgres, sqlx::postgres::PgArguments>,
    ) -> Result<Vec<PgRow>, sqlx::Error> {
        // At least one lane (`WRITER_LANES`); a lane past them is the last one's.
        let slot = &self.lane_backends[lane.min(self.lane_backends.len() - 1)];
        let mut slot = slot.lock().await;
        let (mut backend, _) = self.kept_or_opened(&mut slot, LANE_BACKEND_NAME).await?;
        let answered = query.fetch_all(&mut backend).await;
        keep_if_usable(&mut slot, backend, &answered);
        answered
    }

    /// The rows of the read `query` makes, on a kept reader backend, or on one of the pool's
    /// when every reader backend is busy. A kept backend the database ended since its last
    /// read is closed and the read made once more on a new one: the pool's ping when a
    /// connection is taken would have found it ended first (a read is safe to make twice).
    async fn on_reader_backend<'q>(
        &self,
        query: impl Fn() -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>,
    ) -> Result<Vec<PgRow>, sqlx::Error> {
        let Some(mut slot) = self
            .reader_backends
            .iter()
            .find_map(|slot| slot.try_lock().ok())
        else {
            return query().fetch_all(&self.pool).await;
        };
        let (mut backend, kept) = self.kept_or_opened(&mut slot, READER_BACKEND_NAME).await?;
        let mut answered = query().fetch_all(&mut backend).await;
        if kept && !backend_usable(&answered) {
            drop(backend);
            backend = self.open_backend(READER_BACKEND_NAME).await?;
            answered = query().fetch_all(&mut backend).await;
        }
        keep_if_usable(&mut slot, backend, &answered);
        answered
    }

    /// The backend kept in `slot`, taken out of it while it serves (and whether it was kept),
    /// or a new one named `application_name` if the slot holds none.
    async fn kept_or_opened(
        &self,
        slot: &mut Option<PgConnection>,
        application_name: &str,
    ) -> Result<(PgConnection, bool), sqlx::Error> {
        match slot.take() {
            Some(backend) => Ok((backend, true)),
            None => Ok((self.open_backend(application_name).await?, false)),
        }
    }

    /// A backend of the store's own, outside the pool, opened within [`ACQUIRE_TIMEOUT`] (as
    /// long as a read waits for a pooled connection). It shows in `pg_stat_activity` as
    /// `application_name`, unless the URL names the instance's connections itself, and plans
    /// its statements once ([`GENERIC_PLANS`]).
    async fn open_backend(&self, application_name: &str) -> Result<PgConnection, sqlx::Error> {
        // The pool's options, not a copy kept here: their `Debug` shows the password.
        let options = self.pool.connect_options();
        let named;
        let options = match options.get_application_name() {
            Some(_) => &*options,
            None => {
                named = (*options).clone().application_name(application_name);
                &named
            }
        };
        let opened = async {
            let mut backend = PgConnection::connect_with(options).await?;
            sqlx::raw_sql(GENERIC_PLANS).execute(&mut backend).await?;
            Ok(backend)
        };
        tokio::time::timeout(ACQUIRE_TIMEOUT, opened)
            .await
            .map_err(|_| sqlx::Error::PoolTimedOut)?
    }

    /// [`Store::apply_batch`] for a batch of the journal's writer lane `lane`, with the
    /// charges waiting in that lane; on the lane's own backend when `on_lane_backend` (the
    /// journal's batches), else on one of the pool's (a writer outside the journal, which
    /// may apply several batches at once).
    async fn apply_in_lane(
        &self,
        lane: usize,
        batch_id: &str,
        ops: &[WriteOp],
        on_lane_backend: bool,
    ) -> Result<Vec<i64>, StoreError> {
        // One round trip: the batch's inserts by kind, its other ops in order, then its events
        // in one insert (see `batch_json`). Each value is made storable as it is serialized,
        // without a walk of its own.
        let batch = batch_json(ops);
        // The charges settled since the last batch commit with this one (see
        // `postgres_spend::PendingCharges`): same transaction, same round trip.
        // A lane's own charges only (its requests'): batches of two lanes overlap, and a
        // request's end must not commit before its charge, which only its lane carries.
        let pending = self.pending_charges(lane);
        let _writing = pending.writing.lock().await;
        let charges = pending.take();
        // The sessions the batch touches, when it touches two or more, locked first and in
        // id order (as a prune locks them): the batch function touches them in the order of
        // their first touch in the batch, so two batches (two lanes', two instances') touching
        // the same two sessions would otherwise deadlock. A batch touching one holds no other
        // session while it waits for that one: the common request's batch (at concurrency 1)
        // is left as it was.
        let mut sessions: Vec<&str> = ops
            .iter()
            .filter_map(|op| match op {
                WriteOp::TouchSession(session) => Some(session.id.as_str()),
                _ => None,
            })
            .collect();
        sessions.sort_unstable();
        sessions.dedup();
        if sessions.len() < 2 {
            sessions.clear();
        }
        let query = match (charges.is_empty(), sessions.is_empty()) {
            (true, true) => "SELECT stable_harness_apply($1, $2, $3, $4)",
            (false, true) => {
                "SELECT stable_harness_apply($1, $2, $3, $4), stable_harness_record_usage($5)"
            }
            (true, false) => concat!(
                "WITH locked AS (SELECT 1 FROM sessions WHERE id = ANY($5) ORDER BY id ",
                "FOR NO KEY UPDATE) SELECT stable_harness_apply($1, $2, $3, $4) ",
                "FROM (SELECT count(*) FROM locked) sessions_locked"
            ),
            (false, false) => concat!(
                "WITH locked AS (SELECT 1 FROM sessions WHERE id = ANY($6) ORDER BY id ",
                "FOR NO KEY UPDATE) SELECT stable_harness_apply($1, $2, $3, $4), ",
                "stable_harness_record_usage($5) FROM (SELECT count(*) FROM locked) sessions_locked"
            ),
        };
        let applied = sqlx::query(query)
            .bind(sqlx::types::Json(&batch))
            .bind(&self.holder)
            .bind(self.lease_ms)
            .bind(batch_id);
        let applied = if charges.is_empty() {
            applied
        } else {
            applied.bind(sqlx::types::Json(&charges))
        };
        let applied = if sessions.is_empty() {
            applied
        } else {
            applied.bind(sessions)
        };
        let applied = if on_lane_backend {
            self.on_lane_backend(lane, applied)
                .await
                .and_then(|rows| rows.into_iter().next().ok_or(sqlx::Error::RowNotFound))
        } else {
            applied.fetch_one(&self.pool).await
        };
        let applied = match applied {
            Ok(row) => row.try_get::<Vec<i64>, _>(0).map_err(StoreError::from),
            Err(sqlx::Error::Database(error)) if error.code().as_deref() == Some("SH409") => {
                Err(StoreError::Conflict(error.message().to_owned()))
            }
            Err(sqlx::Error::Database(error)) if error.code().as_deref() == Some("SH410") => {
                Err(StoreError::LeaseLost(error.message().to_owned()))
            }
            Err(error) => Err(error.into()),
        };
        if let Err(error) = &applied {
            pending.after_failed_batch(&self.pool, charges, error).await;
        }
        applied
    }
}

/// Whether a kept backend may serve again after `answered`: after an answer, or a statement
/// refused; not after the connection was lost or the backend told to end (SQLSTATE classes
/// `08` and `57P`).
fn backend_usable<T>(answered: &Result<T, sqlx::Error>) -> bool {
    match answered {
        Ok(_) => true,
        Err(sqlx::Error::Database(error)) => error
            .code()
            .is_none_or(|code| !(code.starts_with("08") || code.starts_with("57P"))),
        Err(_) => false,
    }
}

/// Puts `backend` back in its slot if it may serve again after `answered`; else it is closed
/// as it drops, and the slot's next user opens another.
fn keep_if_usable<T>(
    slot: &mut Option<PgConnection>,
    backend: PgConnection,
    answered: &Result<T, sqlx::Error>,
) {
    if backend_usable(answered) {
        *slot = Some(backend);
    }
}

#[async_trait::async_trait]
impl Store for PostgresStore {
    async fn apply_batch(&self, batch_id: &str, ops: &[WriteOp]) -> Result<Vec<i64>, StoreError> {
        self.apply_in_lane(0, batch_id, ops, false).await
    }

    async fn apply_owned(
        &self,
        lane: usize,
        batch_id: &str,
        ops: Vec<WriteOp>,
    ) -> (Vec<WriteOp>, Result<Vec<i64>, StoreError>) {
        let applied = self.apply_in_lane(lane, batch_id, &ops, true).await;
        (ops, applied)
    }

    fn writer_lanes(&self) -> usize {
        WRITER_LANES
    }

    /// One statement, on a kept reader backend: the request with what it was charged, its
    /// runs and their approvals, all from the one snapshot the statement reads (a view never
    /// shows an ended request with a run still live), the runs and approvals as `json_agg`
    /// writes their rows.
    // The approvals run by run (in the runs' order), then by id: as `approvals_of_run` for
    // each run. `json`, not `jsonb`: the rows are written out as text at once, where
    // `jsonb_agg(to_jsonb(..))` built a binary value first (a read 0.28 -> 0.23 ms, pgbench).
    async fn request_in_full(&self, id: &str) -> Result<Option<RequestInFull>, StoreError> {
        let id = text(id);
        let rows = self
            .on_reader_backend(|| sqlx::query(views_of_requests!("= $1")).bind(&id))
            .await?;
        rows.first().map(view_from_row).transpose()
    }

    /// One statement, one snapshot, however many requests, on the lane's own backend: a
    /// commit that ends several awaited requests reads their views in one round trip, not one
    /// each. A lone id keeps the statement of one (as a prepared statement, `= ANY($1)` with
    /// one element measured 0.43-0.49 ms a read against 0.24-0.27 ms: the fortieth pass).
    async fn requests_in_full(
        &self,
        lane: usize,
        ids: &[&str],
    ) -> Result<Vec<RequestInFull>, StoreError> {
        let query = if let [id] = ids {
            sqlx::query(views_of_requests!("= $1")).bind(text(id))
        } else {
            let ids: Vec<String> = ids.iter().map(|id| text(id)).collect();
            sqlx::query(views_of_requests!("= ANY($1)")).bind(ids)
        };
        let rows = self.on_lane_backend(lane, query).await?;
        rows.iter().map(view_from_row).collect()
    }

    async fn request(&self, id: &str) -> Result<Option<RequestRecord>, StoreError> {
        let id = text(id);
        let row = self
            .on_reader_backend(|| sqlx::query("SELECT * FROM requests WHERE id = $1").bind(&id))
            .await?
            .pop();
        row.as_ref().map(request_from_row).transpose()
    }

    async fn requests(
        &self,
        filter: &RequestFilter,
        page: &PageRequest,
        input: RequestInput,
    ) -> Result<Page<RequestRecord>, StoreError> {
        let conditions = conditions::of_requests(filter, Dialect::Postgres);
        let from_row = match input {
            RequestInput::Read => request_from_row,
            RequestInput::Skipped => request_without_input,
        };
        let columns = input.columns();
        let sql =
            format!("SELECT {columns} FROM requests WHERE {conditions} ORDER BY id DESC LIMIT $5");
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(filter.status.map(RunStatus::as_str))
            .bind(filter.agent_id.as_deref().map(text))
            .bind(filter.session_id.as_deref().map(text))
            .bind(page.cursor.as_deref().map(text))
            .bind(page.limit + 1)
            .bind(filter.owner.as_deref().map(text))
            .bind(filter.created_from)
            .bind(filter.created_before)
            .fetch_all(&self.pool)
            .await?;
        let items = rows.iter().map(from_row).collect::<Result<Vec<_>, _>>()?;
        Ok(Page::from_overfetch(items, page.limit, |r| r.id.clone()))
    }

    async fn run(&self, id: &str) -> Result<Option<RunRecord>, StoreError> {
        let row = sqlx::query("SELECT * FROM runs WHERE id = $1")
            .bind(text(id))
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(run_from_row).transpose()
    }

    async fn runs_of(&self, request_id: &str) -> Result<Vec<RunRecord>, StoreError> {
        let rows = sqlx::query("SELECT * FROM runs WHERE request_id = $1 ORDER BY attempt")
            .bind(text(request_id))
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(run_from_row).collect()
    }

    async fn runs_of_requests(&self, request_ids: &[String]) -> Result<Vec<RunRecord>, StoreError> {
        if request_ids.is_empty() {
            return Ok(Vec::new());
        }
        let ids: Vec<String> = request_ids.iter().map(|id| text(id)).collect();
        let rows = sqlx::query(concat!(
            "SELECT ",
            run_columns_but_state!(),
            " FROM runs WHERE request_id = ANY($1) ORDER BY request_id, attempt"
        ))
        .bind(ids)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(run_without_state).collect()
    }

    async fn runs_with_status(&self, statuses: &[RunStatus]) -> Result<Vec<RunRecord>, StoreError> {
        let wanted: Vec<&str> = statuses.iter().map(|s| s.as_str()).collect();
        let rows = sqlx::query("SELECT * FROM runs WHERE status = ANY($1) ORDER BY created_at")
            .bind(wanted)
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(run_from_row).collect()
    }

    fn holder(&self) -> &str {
        &self.holder
    }

    async fn claim_runs(&self, limit: i64) -> Result<Vec<RunRecord>, StoreError> {
        let rows = sqlx::query(
            "UPDATE runs SET lease_holder = $1, lease_expires_at = now() + $2 * interval '1 millisecond'
             WHERE id IN (SELECT id FROM runs
                          WHERE status IN ('queued', 'running', 'waiting_approval')
                            AND (lease_holder IS NULL OR lease_expires_at < now())
                          ORDER BY id LIMIT $3 FOR UPDATE SKIP LOCKED)
             RETURNING *",
        )
        .bind(&self.holder)
        .bind(self.lease_ms)
        .bind(limit)
        .fetch_all(&self.pool)
        .await?;
        let mut runs = rows
            .iter()
            .map(run_from_row)
            .collect::<Result<Vec<_>, _>>()?;
        runs.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(runs)
    }

    async fn renew_leases(&self, runs: &[String]) -> Result<Vec<String>, StoreError> {
        // Batches are tried again within seconds; a failed clean-up waits for the next pass.
        let _ = sqlx::query(
            "DELETE FROM applied_batches WHERE id < lpad(to_hex(
                 (extract(epoch FROM now() - interval '1 minute') * 1000)::bigint), 12, '0')",
        )
        .execute(&self.pool)
        .await;
        Ok(sqlx::query_scalar(
            "UPDATE runs SET lease_expires_at = now() + $2 * interval '1 millisecond'
             WHERE lease_holder = $1 AND status IN ('queued', 'running', 'waiting_approval')
               AND id = ANY($3)
             RETURNING id",
        )
        .bind(&self.holder)
        .bind(self.lease_ms)
        .bind(runs)
        .fetch_all(&self.pool)
        .await?)
    }

    async fn release_leases(&self) -> Result<u64, StoreError> {
        // Only a live run holds a lease: the status reads `runs_by_status` instead of every
        // run ever stored.
        Ok(sqlx::query(
            "UPDATE runs SET lease_holder = NULL, lease_expires_at = NULL
             WHERE lease_holder = $1 AND status IN ('queued', 'running', 'waiting_approval')",
        )
        .bind(&self.holder)
        .execute(&self.pool)
        .await?
        .rows_affected())
    }

    async fn claim_run(&self, run_id: &str) -> Result<Option<RunRecord>, StoreError> {
        let row = sqlx::query(
            "UPDATE runs SET lease_holder = $1, lease_expires_at = now() + $2 * interval '1 millisecond'
             WHERE id = $3 AND status IN ('queued', 'running', 'waiting_approval')
               AND (lease_holder IS NULL OR lease_expires_at < now())
             RETURNING *",
        )
        .bind(&self.holder)
        .bind(self.lease_ms)
        .bind(text(run_id))
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(run_from_row).transpose()
    }

    async fn request_cancel(&self, run_id: &str, by: &str) -> Result<bool, StoreError> {
        // The mark and its announcement commit together: whoever hears it finds the mark.
        let marked = sqlx::query(
            "WITH marked AS (
                 UPDATE runs SET cancel_requested_by = COALESCE(cancel_requested_by, $3)
                  WHERE id = $1 AND status IN ('queued', 'running', 'waiting_approval')
                 RETURNING id)
             SELECT pg_notify('stable_harness_events', $2 || ' cancel ' || id || ' ' || $3)
               FROM marked",
        )
        .bind(text(run_id))
        .bind(&self.holder)
        .bind(text(by))
        .fetch_optional(&self.pool)
        .await?;
        Ok(marked.is_some())
    }

    async fn cancels_requested(
        &self,
        runs: &[String],
    ) -> Result<Vec<(String, String)>, StoreError> {
        if runs.is_empty() {
            return Ok(Vec::new());
        }
        Ok(sqlx::query_as(
            "SELECT id, cancel_requested_by FROM runs WHERE id = ANY($1)
               AND cancel_requested_by IS NOT NULL
               AND status IN ('queued', 'running', 'waiting_approval')",
        )
        .bind(runs)
        .fetch_all(&self.pool)
        .await?)
    }

    fn changes(&self) -> Option<broadcast::Receiver<StoreChange>> {
        Some(self.changes.subscribe())
    }

    fn is_shared(&self) -> bool {
        true
    }

    async fn events(
        &self,
        request_id: &str,
        after: i64,
        limit: i64,
    ) -> Result<Vec<EventRecord>, StoreError> {
        let sql = format!(
            "{EVENT_SELECT} WHERE e.request_id = $1 AND e.seq > $2 ORDER BY e.seq LIMIT $3"
        );
        let read = EventRows { after, limit };
        let request_id = text(request_id);
        let rows = self
            .on_reader_backend(|| {
                sqlx::query(sqlx::AssertSqlSafe(sql.as_str()))
                    .bind(&request_id)
                    .bind(read.lowest_first_seq())
                    .bind(read.rows())
            })
            .await?;
        read.keep(&rows, events_from_row)
    }

    async fn run_events(
        &self,
        run_id: &str,
        after: i64,
        limit: i64,
    ) -> Result<Vec<EventRecord>, StoreError> {
        let sql = format!(
            "{EVENT_SELECT} WHERE e.request_id = (SELECT request_id FROM runs WHERE id = $1)
             AND e.run_id = $1 AND e.seq > $2 ORDER BY e.seq LIMIT $3"
        );
        // A row holds one run's events, so the run is a condition on rows.
        let read = EventRows { after, limit };
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(text(run_id))
            .bind(read.lowest_first_seq())
            .bind(read.rows())
            .fetch_all(&self.pool)
            .await?;
        read.keep(&rows, events_from_row)
    }

    async fn last_event(&self, request_id: &str) -> Result<Option<EventRecord>, StoreError> {
        let sql = format!("{EVENT_SELECT} WHERE e.request_id = $1 ORDER BY e.seq DESC LIMIT 1");
        let request_id = text(request_id);
        let rows = self
            .on_reader_backend(|| sqlx::query(sqlx::AssertSqlSafe(sql.as_str())).bind(&request_id))
            .await?;
        Ok(rows
            .first()
            .map(events_from_row)
            .transpose()?
            .and_then(|mut events| events.pop()))
    }

    async fn session(&self, id: &str) -> Result<Option<SessionRecord>, StoreError> {
        let id = text(id);
        let row = self
            .on_reader_backend(|| sqlx::query("SELECT * FROM sessions WHERE id = $1").bind(&id))
            .await?
            .pop();
        row.as_ref().map(session_from_row).transpose()
    }

    async fn messages(&self, session_id: &str) -> Result<Vec<MessageRecord>, StoreError> {
        let rows =
            sqlx::query("SELECT * FROM messages WHERE session_id = $1 ORDER BY created_at, id")
                .bind(text(session_id))
                .fetch_all(&self.pool)
                .await?;
        rows.iter().map(message_from_row).collect()
    }

    async fn message(&self, id: &str) -> Result<Option<MessageRecord>, StoreError> {
        let row = sqlx::query("SELECT * FROM messages WHERE id = $1")
            .bind(text(id))
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(message_from_row).transpose()
    }

    async fn newest_answers(
        &self,
        session_id: &str,
        limit: u32,
    ) -> Result<Vec<MessageRecord>, StoreError> {
        let session = text(session_id);
        let rows = self
            .on_reader_backend(|| {
                sqlx::query(
                    "SELECT * FROM messages WHERE session_id = $1 AND role = 'assistant'
                      ORDER BY created_at DESC, id DESC LIMIT $2",
                )
                .bind(&session)
                .bind(i64::from(limit))
            })
            .await?;
        rows.iter().map(message_from_row).collect()
    }

    async fn request_last_message(
        &self,
        session_id: &str,
        request_id: &str,
        since: DateTime<Utc>,
    ) -> Result<Option<String>, StoreError> {
        // A range of the session's index from the request's stamp on, newest first.
        let row = sqlx::query(
            "SELECT id FROM messages
              WHERE session_id = $1 AND created_at >= $2 AND request_id = $3
                AND role <> 'assistant'
              ORDER BY created_at DESC, id DESC LIMIT 1",
        )
        .bind(text(session_id))
        .bind(since)
        .bind(text(request_id))
        .fetch_optional(&self.pool)
        .await?;
        Ok(row.map(|row| row.try_get("id")).transpose()?)
    }

    async fn session_head(&self, session_id: &str) -> Result<Option<String>, StoreError> {
        let session_id = text(session_id);
        let row = self
            .on_reader_backend(|| {
                sqlx::query(
                    "SELECT id FROM messages m WHERE session_id = $1
                       AND NOT EXISTS (SELECT 1 FROM messages c
                                        WHERE c.parent_id = m.id AND c.session_id = m.session_id)
                     ORDER BY created_at DESC, id DESC LIMIT 1",
                )
                .bind(&session_id)
            })
            .await?
            .pop();
        Ok(row.map(|row| row.try_get("id")).transpose()?)
    }

    async fn message_path_below(
        &self,
        leaf: &str,
        known: Option<&str>,
    ) -> Result<PathBelow, StoreError> {
        let mut walk = PathWalk::from_leaf(leaf, known);
        while let Some(next) = walk.next_read() {
            let page = walk.page();
            // A page of a session's messages, newest first by the session's index
            // ([`PathWalk`]).
            let rows = match next {
                PathRead::SessionOf { message } => {
                    let message = text(message);
                    self.on_reader_backend(|| {
                        sqlx::query(
                            "SELECT * FROM messages WHERE session_id =
                               (SELECT session_id FROM messages WHERE id = $1::text COLLATE \"C\")
                             ORDER BY created_at DESC, id DESC LIMIT $2",
                        )
                        .bind(&message)
                        .bind(page)
                    })
                    .await?
                }
                PathRead::Older {
                    session,
                    created_at,
                    id,
                } => {
                    let (session, created_at, id) = (text(session), *created_at, text(id));
                    self.on_reader_backend(|| {
                        sqlx::query(
                            "SELECT * FROM messages
                              WHERE session_id = $1 AND (created_at, id) < ($2, $3::text COLLATE \"C\")
                              ORDER BY created_at DESC, id DESC LIMIT $4",
                        )
                        .bind(&session)
                        .bind(created_at)
                        .bind(&id)
                        .bind(page)
                    })
                    .await?
                }
            };
            let messages = rows
                .iter()
                .map(message_from_row)
                .collect::<Result<Vec<_>, StoreError>>()?;
            walk.walk(messages);
        }
        Ok(walk.into_path())
    }

    async fn sessions(
        &self,
        filter: &SessionFilter,
        page: &PageRequest,
    ) -> Result<Page<SessionRecord>, StoreError> {
        let conditions = conditions::of_sessions(filter, page.cursor.is_some(), Dialect::Postgres);
        let sql = format!("SELECT * FROM sessions WHERE {conditions} ORDER BY id DESC LIMIT $4");
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(filter.agent_id.as_deref().map(text))
            .bind(filter.owner.as_deref().map(text))
            .bind(page.cursor.as_deref().map(text))
            .bind(page.limit + 1)
            .fetch_all(&self.pool)
            .await?;
        let items = rows
            .iter()
            .map(session_from_row)
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Page::from_overfetch(items, page.limit, |s| s.id.clone()))
    }

    async fn approval(&self, id: &str) -> Result<Option<ApprovalRecord>, StoreError> {
        let row = sqlx::query("SELECT * FROM approvals WHERE id = $1")
            .bind(text(id))
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(approval_from_row).transpose()
    }

    async fn approvals(
        &self,
        status: Option<ApprovalStatus>,
        page: &PageRequest,
    ) -> Result<Page<ApprovalRecord>, StoreError> {
        let conditions = conditions::of_approvals(status.is_some(), Dialect::Postgres);
        let sql = format!("SELECT * FROM approvals WHERE {conditions} ORDER BY id DESC LIMIT $3");
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(status.map(ApprovalStatus::as_str))
            .bind(page.cursor.as_deref().map(text))
            .bind(page.limit + 1)
            .fetch_all(&self.pool)
            .await?;
        let items = rows
            .iter()
            .map(approval_from_row)
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Page::from_overfetch(items, page.limit, |a| a.id.clone()))
    }

    async fn count_pending_approvals(&self) -> Result<u64, StoreError> {
        let count: i64 =
            sqlx::query_scalar("SELECT COUNT(*) FROM approvals WHERE status = 'pending'")
                .fetch_one(&self.pool)
                .await?;
        Ok(count.max(0) as u64)
    }

    async fn approvals_of_run(&self, run_id: &str) -> Result<Vec<ApprovalRecord>, StoreError> {
        let rows = sqlx::query("SELECT * FROM approvals WHERE run_id = $1 ORDER BY id")
            .bind(text(run_id))
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(approval_from_row).collect()
    }

    async fn tool_calls_of_run(&self, run_id: &str) -> Result<Vec<ToolCallRecord>, StoreError> {
        let rows = sqlx::query("SELECT * FROM tool_calls WHERE run_id = $1")
            .bind(text(run_id))
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(tool_call_from_row).collect()
    }

    async fn client_calls(
        &self,
        ids: &[String],
        owner: &str,
    ) -> Result<Vec<ClientCallRecord>, StoreError> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let rows = sqlx::query(
            "SELECT t.*, EXISTS (SELECT 1 FROM tool_calls s WHERE s.run_id = t.run_id
                 AND s.tool_id NOT LIKE 'client.%') AS server_calls
             FROM tool_calls t JOIN requests r ON r.id = t.request_id
             WHERE t.tool_id LIKE 'client.%' AND t.model_call_id = ANY($1) AND r.owner = $2",
        )
        .bind(ids.iter().map(|id| text(id)).collect::<Vec<_>>())
        .bind(text(owner))
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|row| {
                Ok(ClientCallRecord {
                    call: tool_call_from_row(row)?,
                    server_calls: row.try_get("server_calls")?,
                })
            })
            .collect()
    }

    async fn complete_client_call(
        &self,
        run_id: &str,
        call_key: &str,
        result: &Value,
        at: chrono::DateTime<chrono::Utc>,
    ) -> Result<bool, StoreError> {
        let changed = sqlx::query(
            "UPDATE tool_calls SET outcome = 'completed', result = $3, recorded_at = $4
             WHERE run_id = $1 AND call_key = $2 AND outcome = 'client'",
        )
        .bind(text(run_id))
        .bind(text(call_key))
        .bind(result)
        .bind(at)
        .execute(&self.pool)
        .await?
        .rows_affected();
        Ok(changed == 1)
    }

    async fn input_holder(
        &self,
        owner: &str,
        agent: &str,
        digest: &str,
    ) -> Result<Option<InputHolder>, StoreError> {
        let (digest, owner, agent) = (text(digest), text(owner), text(agent));
        let row = self
            .on_reader_backend(|| {
                sqlx::query(INPUT_HOLDER)
                    .bind(&digest)
                    .bind(&owner)
                    .bind(&agent)
            })
            .await?
            .pop();
        row.map(|row| {
            Ok(InputHolder {
                request_id: row.try_get("id")?,
                updated_at: row.try_get("updated_at")?,
                prefix_of: row.try_get("prefix_of")?,
                prefix_len: row.try_get("prefix_len")?,
                leading_digest: row.try_get("leading_digest")?,
            })
        })
        .transpose()
    }

    async fn ping(&self) -> Result<(), StoreError> {
        sqlx::query("SELECT 1").execute(&self.pool).await?;
        Ok(())
    }

    async fn prunable_sessions(
        &self,
        filter: &PruneFilter,
        after: Option<&str>,
        limit: i64,
    ) -> Result<Vec<String>, StoreError> {
        let sql = prunable_sessions(after.is_some(), false);
        let ids: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
            .bind(agent_cutoffs(&filter.agent_cutoffs))
            .bind(&filter.default_cutoff)
            .bind(i64::try_from(filter.min_keep).unwrap_or(i64::MAX))
            .bind(after)
            .bind(limit)
            .bind(None::<Vec<String>>)
            .fetch_all(&self.pool)
            .await?;
        Ok(ids)
    }

    async fn count_owned(&self, sessions: &[String]) -> Result<PruneCounts, StoreError> {
        let mut counts = [0; 8];
        for (count, (table, rows)) in counts.iter_mut().zip(super::owned_by_sessions(IN_SESSIONS)) {
            let sql = count_owned_sql(table, &rows, "jsonb_array_length");
            let n: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
                .bind(sessions)
                .fetch_one(&self.pool)
                .await?;
            *count = n.max(0) as u64;
        }
        Ok(PruneCounts::from_owned(counts))
    }

    async fn requests_per_session(&self, sessions: &[String]) -> Result<Vec<u64>, StoreError> {
        let counted: Vec<(String, i64)> = sqlx::query_as(sqlx::AssertSqlSafe(
            super::requests_per_session_sql(IN_SESSIONS),
        ))
        .bind(sessions)
        .fetch_all(&self.pool)
        .await?;
        Ok(super::counts_in_order(sessions, counted))
    }

    async fn archive_rows(&self, sessions: &[String]) -> Result<ArchiveRows, StoreError> {
        // One snapshot for every table, as the embedded store's read transaction gives.
        let mut tx = self.pool.begin().await?;
        sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            .execute(&mut *tx)
            .await?;
        let mut rows: [Vec<PgRow>; 7] = Default::default();
        let selects = super::archive_selects(IN_SESSIONS, &format!("{EVENT_SELECT} WHERE"));
        for (sql, read) in selects.into_iter().zip(&mut rows) {
            *read = sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(sessions)
                .fetch_all(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        super::archive_from_rows(
            &rows,
            &super::ArchiveReaders {
                session: session_from_row,
                message: message_from_row,
                request: request_from_row,
                run: run_from_row,
                events: events_from_row,
                tool_call: tool_call_from_row,
                approval: approval_from_row,
            },
        )
    }

    async fn delete_sessions(
        &self,
        filter: &PruneFilter,
        sessions: &[String],
    ) -> Result<PruneCounts, StoreError> {
        let mut tx = self.pool.begin().await?;
        // Judged again, with the sessions locked: one continued meanwhile stays.
        let locked: Vec<String> =
            sqlx::query_scalar("SELECT id FROM sessions WHERE id = ANY($1) ORDER BY id FOR UPDATE")
                .bind(sessions)
                .fetch_all(&mut *tx)
                .await?;
        let still: Vec<String> =
            sqlx::query_scalar(sqlx::AssertSqlSafe(prunable_sessions(false, true)))
                .bind(agent_cutoffs(&filter.agent_cutoffs))
                .bind(&filter.default_cutoff)
                .bind(i64::try_from(filter.min_keep).unwrap_or(i64::MAX))
                .bind(None::<String>)
                .bind(i64::try_from(locked.len()).unwrap_or(i64::MAX))
                .bind(&locked)
                .fetch_all(&mut *tx)
                .await?;
        let mut counts = [0; 8];
        for (count, (table, rows)) in counts.iter_mut().zip(super::owned_by_sessions(IN_SESSIONS)) {
            // Counted as they are deleted (a row of events may hold several).
            let sql = format!(
                "WITH deleted AS (DELETE FROM {rows} RETURNING *) {}",
                count_owned_sql(table, "deleted", "jsonb_array_length")
            );
            let n: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
                .bind(&still)
                .fetch_one(&mut *tx)
                .await?;
            *count = n.max(0) as u64;
        }
        tx.commit().await?;
        Ok(PruneCounts::from_owned(counts))
    }

    async fn reclaim_space(&self, _max_pages: i64) -> Result<u64, StoreError> {
        // PostgreSQL's autovacuum makes deleted rows' space reusable; giving it back to the
        // filesystem takes `VACUUM FULL`, an operator's decision (it locks the tables).
        Ok(0)
    }

    async fn backup_to(&self, _path: &Path) -> Result<u64, StoreError> {
        Err(StoreError::Unsupported(
            "back a PostgreSQL store up with pg_dump (or the database's own backups)".into(),
        ))
    }

    async fn stats(&self) -> Result<StoreStats, StoreError> {
        let row = sqlx::query(
            "SELECT pg_database_size(current_database())::bigint AS size,
                    (SELECT COUNT(*) FROM requests) AS requests,
                    (SELECT COUNT(*) FROM sessions) AS sessions",
        )
        .fetch_one(&self.pool)
        .await?;
        let number = |name: &str| -> Result<u64, StoreError> {
            Ok(row.try_get::<i64, _>(name)?.max(0) as u64)
        };
        Ok(StoreStats {
            database_bytes: number("size")?,
            wal_bytes: 0,
            free_bytes: 0,
            requests: number("requests")?,
            sessions: number("sessions")?,
        })
    }

    async fn record_maintenance(&self, record: &MaintenanceRecord) -> Result<(), StoreError> {
        let mut tx = self.pool.begin().await?;
        sqlx::query(
            "INSERT INTO maintenance (id, operation, status, started_at, ended_at, report)
             VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .bind(&record.id)
        .bind(&record.operation)
        .bind(&record.status)
        .bind(record.started_at)
        .bind(record.ended_at)
        .bind(json(&record.report))
        .execute(&mut *tx)
        .await?;
        sqlx::query(
            "DELETE FROM maintenance WHERE id NOT IN (SELECT id FROM maintenance ORDER BY id DESC LIMIT 1000)",
        )
        .execute(&mut *tx)
        .await?;
        Ok(tx.commit().await?)
    }

    async fn maintenance(&self, limit: i64) -> Result<Vec<MaintenanceRecord>, StoreError> {
        let rows = sqlx::query("SELECT * FROM maintenance ORDER BY id DESC LIMIT $1")
            .bind(limit)
            .fetch_all(&self.pool)
            .await?;
        rows.iter()
            .map(|row| {
                Ok(MaintenanceRecord {
                    id: row.try_get("id")?,
                    operation: row.try_get("operation")?,
                    status: row.try_get("status")?,
                    started_at: row.try_get("started_at")?,
                    ended_at: row.try_get("ended_at")?,
                    report: row.try_get("report")?,
                })
            })
            .collect()
    }

    fn describe(&self) -> String {
        format!("postgres {}", self.url)
    }
}

fn tool_call_from_row(row: &sqlx::postgres::PgRow) -> Result<ToolCallRecord, StoreError> {
    Ok(ToolCallRecord {
        run_id: row.try_get("run_id")?,
        call_key: row.try_get("call_key")?,
        model_call_id: row.try_get("model_call_id")?,
        request_id: row.try_get("request_id")?,
        tool_id: row.try_get("tool_id")?,
        arguments: row.try_get("arguments")?,
        idempotency_key: row.try_get("idempotency_key")?,
        executions: row.try_get("executions")?,
        outcome: row.try_get("outcome")?,
        result: row.try_get("result")?,
        duration_ms: row.try_get("duration_ms")?,
        recorded_at: row.try_get("recorded_at")?,
    })
}

#[cfg(test)]
mod tests {
    use super::super::ApprovalDecision;
    use super::super::event_rows::EVENTS_PER_ROW;
    use super::*;
    use chrono::TimeZone;
    use serde_json::json;

    /// Every op kind, with U+0000 in its strings, keys and values, absent and present
    /// options, and times of each sub-second precision, is sent as the batch function has
    /// always read it: the JSON it was built as field by field (`json!`, chrono's time text),
    /// made storable. Fails when a field is renamed, dropped, written as another type, or
    /// left unscrubbed.
    #[test]
    fn every_op_is_sent_as_the_batch_function_reads_it() {
        let at = |nanos: u32| Utc.timestamp_opt(1_764_470_000, nanos).unwrap();
        let (whole, millis, micros, nanos) =
            (at(0), at(123_000_000), at(123_456_000), at(123_456_789));
        let odd = "a\0b";
        let data = json!({ "k\0": ["v\0", 1, null, true, { "deep": "x\0" }] });
        let mut session = super::super::test_records::session(odd);
        (session.metadata, session.created_at, session.updated_at) = (data.clone(), whole, nanos);
        let message = MessageRecord {
            id: "msg\0".into(),
            session_id: odd.into(),
            parent_id: None,
            request_id: Some(odd.into()),
            role: "user".into(),
            content: data.clone(),
            created_at: millis,
        };
        let mut request = super::super::test_records::request(odd, odd);
        (request.input, request.output, request.usage) = (
            data.clone(),
            Some("out\0".into()),
            Some(json!({ "tokens": 3 })),
        );
        (request.created_at, request.updated_at) = (micros, nanos);
        let mut run = super::super::test_records::run(odd, odd);
        (run.state, run.started_at, run.updated_at) = (Some(data.clone()), Some(millis), micros);
        let approval = ApprovalRecord {
            id: "apr".into(),
            request_id: odd.into(),
            run_id: odd.into(),
            session_id: odd.into(),
            agent_id: "a".into(),
            call_key: "key\0".into(),
            kind: ApprovalKind::Interrupted,
            execution: 2,
            tool_call_id: "call".into(),
            tool_id: "t".into(),
            arguments: data.clone(),
            rule: Some("rule\0".into()),
            status: ApprovalStatus::Pending,
            reason: None,
            decided_by: None,
            created_at: whole,
            expires_at: Some(nanos),
            decided_at: None,
        };
        let decision = ApprovalDecision {
            id: "apr".into(),
            status: ApprovalStatus::Denied,
            reason: Some("no\0".into()),
            decided_by: "op".into(),
            at: micros,
        };
        let call = ToolCallRecord {
            run_id: odd.into(),
            call_key: "key".into(),
            model_call_id: "m".into(),
            request_id: odd.into(),
            tool_id: "t".into(),
            arguments: data.clone(),
            idempotency_key: "idem\0".into(),
            executions: 1,
            outcome: "ok".into(),
            result: data.clone(),
            duration_ms: 7,
            recorded_at: millis,
        };
        let ops = vec![
            WriteOp::TouchSession(session.clone()),
            WriteOp::InsertMessage(message.clone()),
            WriteOp::InsertRequest(request.clone()),
            WriteOp::InsertRun(run.clone()),
            WriteOp::UpdateRequest {
                id: odd.into(),
                status: RunStatus::Failed,
                output: None,
                error: Some(data.clone()),
                usage: None,
                at: whole,
            },
            WriteOp::UpdateRun {
                id: odd.into(),
                status: RunStatus::Running,
                error: None,
                state: Some(data.clone()),
                at: nanos,
            },
            WriteOp::InsertApproval(approval.clone()),
            WriteOp::DecideApproval(decision.clone()),
            WriteOp::StartToolCall(call.clone()),
            WriteOp::RecordToolCall(call.clone()),
        ];
        let tool_call = |op: &str| {
            json!({ "op": op, "run_id": call.run_id, "call_key": call.call_key,
                "model_call_id": call.model_call_id, "request_id": call.request_id,
                "tool_id": call.tool_id, "arguments": call.arguments,
                "idempotency_key": call.idempotency_key, "outcome": call.outcome,
                "result": call.result, "duration_ms": call.duration_ms,
                "recorded_at": call.recorded_at })
        };
        // As each op was built before it was serialized from its record.
        let expected = [
            json!({ "op": "touch_session", "id": session.id, "agent_id": session.agent_id,
                "owner": session.owner, "metadata": session.metadata,
                "created_at": session.created_at, "updated_at": session.updated_at }),
            json!({ "op": "insert_message", "id": message.id, "session_id": message.session_id,
                "parent_id": message.parent_id, "request_id": message.request_id,
                "role": message.role, "content": message.content,
                "created_at": message.created_at }),
            json!({ "op": "insert_request", "id": request.id, "session_id": request.session_id,
                "agent_id": request.agent_id, "protocol": request.protocol,
                "status": request.status.as_str(), "input": request.input,
                "output": request.output, "error": request.error, "usage": request.usage,
                "metadata": request.metadata, "created_at": request.created_at,
                "updated_at": request.updated_at, "owner": request.owner }),
            json!({ "op": "insert_run", "id": run.id, "request_id": run.request_id,
                "attempt": run.attempt, "status": run.status.as_str(), "state": run.state,
                "error": run.error, "created_at": run.created_at,
                "updated_at": run.updated_at, "started_at": run.started_at,
                "ended_at": run.ended_at, "leased": true }),
            json!({ "op": "update_request", "id": odd, "status": "failed", "output": null,
                "error": data, "usage": null, "at": whole }),
            json!({ "op": "update_run", "id": odd, "status": "running", "error": null,
                "state": data, "at": nanos }),
            json!({ "op": "insert_approval", "id": approval.id,
                "request_id": approval.request_id, "run_id": approval.run_id,
                "session_id": approval.session_id, "agent_id": approval.agent_id,
                "tool_call_id": approval.tool_call_id, "tool_id": approval.tool_id,
                "arguments": approval.arguments, "rule": approval.rule,
                "status": approval.status.as_str(), "reason": approval.reason,
                "decided_by": approval.decided_by, "created_at": approval.created_at,
                "expires_at": approval.expires_at, "decided_at": approval.decided_at,
                "call_key": approval.call_key, "kind": approval.kind.as_str(),
                "execution": approval.execution }),
            json!({ "op": "decide_approval", "id": decision.id,
                "status": decision.status.as_str(), "reason": decision.reason,
                "decided_by": decision.decided_by, "at": decision.at }),
            tool_call("start_tool_call"),
            tool_call("record_tool_call"),
        ];
        // The inserts go as ops of rows: alone, an op of one row.
        let as_rows = |mut row: Value| match row["op"].as_str() {
            Some(kind @ ("touch_session" | "insert_message" | "insert_request" | "insert_run")) => {
                let kind = format!("{kind}s");
                row.as_object_mut().map(|fields| fields.remove("op"));
                json!({ "op": kind, "rows": [row] })
            }
            _ => row,
        };
        // Each op alone: no later update folds into an insert.
        for (op, expected) in ops.iter().zip(expected) {
            let sent = serde_json::to_value(batch_json(std::slice::from_ref(op))).unwrap();
            let [sent] = <[Value; 1]>::try_from(sent.as_array().unwrap().clone()).unwrap();
            assert_eq!(sent, json(&as_rows(expected)), "{op:?}");
            assert!(!sent.to_string().contains("\\u0000"), "{sent}");
        }
    }

    /// A batch of two requests' writes goes as the function's ops of rows, one per kind and
    /// in the order their rows need (sessions, requests, runs, messages), then the other ops
    /// in their order, then the events; a session touched twice once, with its first touch's
    /// fields and its last touch's time; a run inserted after an op that may be refused
    /// stays after it. Fails when a kind is sent row by row, the kinds come in another
    /// order, a touch is lost or sent twice, or such a run is moved ahead.
    #[test]
    fn a_batch_sends_its_inserts_by_kind_before_its_other_ops() {
        use super::super::test_records;
        let at = |second: i64| Utc.timestamp_opt(1_764_470_000 + second, 0).unwrap();
        let touch = |id: &str, agent: &str, second: i64| {
            let mut session = test_records::session(id);
            (session.agent_id, session.created_at, session.updated_at) =
                (agent.into(), at(second), at(second));
            WriteOp::TouchSession(session)
        };
        let message = |id: &str, session: &str, parent: Option<&str>| {
            WriteOp::InsertMessage(MessageRecord {
                id: id.into(),
                session_id: session.into(),
                parent_id: parent.map(str::to_owned),
                request_id: None,
                role: "user".into(),
                content: json!("hi"),
                created_at: at(0),
            })
        };
        let ops = [
            touch("ses_a", "first", 1),
            message("msg_a", "ses_a", None),
            WriteOp::InsertRequest(test_records::request("req_a", "ses_a")),
            WriteOp::InsertRun(test_records::run("run_a", "req_a")),
            test_records::event("req_a", "run_a", "t", json!({})),
            WriteOp::UpdateRequest {
                id: "req_old".into(),
                status: RunStatus::Failed,
                output: None,
                error: None,
                usage: None,
                at: at(2),
            },
            touch("ses_b", "b", 3),
            touch("ses_a", "second", 4),
            message("msg_b", "ses_a", Some("msg_a")),
            WriteOp::InsertRequest(test_records::request("req_b", "ses_a")),
            WriteOp::InsertRun(test_records::run("run_b", "req_b")),
            test_records::event("req_b", "run_b", "t", json!({})),
            // After an op that may be refused, a run stays in its place (another instance
            // may hold its attempt); a message, whose id is this instance's own, does not.
            WriteOp::UpdateRun {
                id: "run_old".into(),
                status: RunStatus::Completed,
                error: None,
                state: None,
                at: at(5),
            },
            WriteOp::InsertRun(test_records::run("run_c", "req_b")),
            message("msg_c", "ses_a", Some("msg_b")),
        ];
        let sent = serde_json::to_value(batch_json(&ops)).unwrap();
        let kinds: Vec<&str> = sent
            .as_array()
            .unwrap()
            .iter()
            .map(|op| op["op"].as_str().unwrap())
            .collect();
        assert_eq!(
            kinds,
            [
                "touch_sessions",
                "insert_requests",
                "insert_runs",
                "insert_messages",
                "update_request",
                "update_run",
                "insert_runs",
                "append_events"
            ]
        );
        let ids = |op: usize| -> Vec<&str> {
            sent[op]["rows"]
                .as_array()
                .unwrap()
                .iter()
                .map(|row| row["id"].as_str().unwrap())
                .collect()
        };
        assert_eq!(ids(0), ["ses_a", "ses_b"]);
        assert_eq!(ids(1), ["req_a", "req_b"]);
        assert_eq!(ids(2), ["run_a", "run_b"]);
        assert_eq!(ids(3), ["msg_a", "msg_b", "msg_c"]);
        assert_eq!(ids(6), ["run_c"]);
        let ses_a = &sent[0]["rows"][0];
        assert_eq!(ses_a["agent_id"], "first");
        assert_eq!(ses_a["created_at"], json!(at(1)));
        assert_eq!(ses_a["updated_at"], json!(at(4)));
        assert_eq!(sent[7]["events"].as_array().unwrap().len(), 2);
    }

    fn event(run: &str, data: Value) -> EventRecord {
        EventRecord {
            id: format!("evt_{run}"),
            request_id: "req_a".into(),
            run_id: run.into(),
            session_id: "ses_a".into(),
            agent_id: "assistant".into(),
            seq: 0,
            event_type: "runtime.adapter.event".into(),
            at: Utc::now(),
            data,
        }
    }

    #[test]
    fn a_values_size_is_estimated_until_past_the_budget() {
        let small = json!({ "text": "hello", "n": [1, true, null] });
        let exact = serde_json::to_string(&small).unwrap().len();
        let estimate = json_bytes_within(&small, ROW_BYTES).unwrap();
        assert!(
            (exact..=exact * 2).contains(&estimate),
            "{estimate} for {exact}"
        );
        assert_eq!(json_bytes_within(&small, estimate), Some(estimate));
        assert_eq!(json_bytes_within(&small, estimate - 1), None);
        let big = json!({ "text": "x".repeat(ROW_BYTES) });
        assert_eq!(json_bytes_within(&big, ROW_BYTES), None);
    }

    #[test]
    fn a_runs_consecutive_events_share_rows_up_to_a_rows_bounds() {
        let small = |run| event(run, json!({ "delta": "a few words" }));
        // Twenty of one run: a full row, then the rest.
        let events: Vec<EventRecord> = (0..20).map(|_| small("run_a")).collect();
        let mut rows = Vec::new();
        events.iter().for_each(|e| add_event(&mut rows, e));
        let counts: Vec<usize> = rows.iter().map(|row| 1 + row.more.len()).collect();
        assert_eq!(counts, [EVENTS_PER_ROW, 20 - EVENTS_PER_ROW]);

        // Another run's event starts a row; a large event has one of its own.
        let events = [
            small("run_a"),
            small("run_b"),
            small("run_b"),
            event("run_b", json!({ "delta": "x".repeat(ROW_BYTES) })),
            small("run_b"),
            small("run_b"),
        ];
        let mut rows = Vec::new();
        events.iter().for_each(|e| add_event(&mut rows, e));
        let shape: Vec<(&str, usize)> = rows
            .iter()
            .map(|row| (row.run_id.0, 1 + row.more.len()))
            .collect();
        assert_eq!(
            shape,
            [("run_a", 1), ("run_b", 2), ("run_b", 1), ("run_b", 2)]
        );
    }
}
