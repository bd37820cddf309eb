//! Store maintenance: retention (pruning ended requests in small batches, archiving them
//! first when asked, giving the space back) and online backup. Both work through the
//! [`Store`] interface, so every store behaves the same; each pass is recorded in the store
//! ([`MaintenanceRecord`]) and logged.
//!
//! What a prune never removes: a session with a live run, a pending approval or a request
//! still inside its window (a live session's history stays whole), and the newest
//! `minKeep` ended requests. Each batch is one short transaction on the writer, between the
//! runtime's own writes, so the write path never stalls behind a pass.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::{Value, json};

use super::{
    ApprovalRecord, ArchiveRows, EventRecord, LEADING, LEADING_OF, MaintenanceRecord,
    MessageRecord, NamedInput, PREFIX_LEN, PREFIX_OF, PruneCounts, PruneFilter, RequestRecord,
    RunRecord, SessionRecord, Store, StoreError, ToolCallRecord, named_input,
};

/// Sessions removed per transaction.
const BATCH: i64 = 200;
/// Free pages given back to the filesystem per step (4 MiB with 4 KiB pages).
const RECLAIM_STEP: i64 = 1_024;

/// What is kept and for how long (from the workspace's `store.retention` and agents).
#[derive(Debug, Clone, Default)]
pub struct RetentionPolicy {
    /// The window of agents without their own (`None`: they keep everything).
    pub default_window: Option<Duration>,
    pub agent_windows: BTreeMap<String, Duration>,
    pub min_keep: u64,
    /// Pruned sessions are written here as JSON Lines first.
    pub archive_dir: Option<PathBuf>,
}

impl RetentionPolicy {
    /// Whether any window is set: without one, nothing is ever pruned.
    pub fn is_active(&self) -> bool {
        self.default_window.is_some() || !self.agent_windows.is_empty()
    }

    /// The cutoffs as of `now`.
    pub fn filter(&self, now: DateTime<Utc>) -> PruneFilter {
        let cutoff = |window: &Duration| {
            let window = chrono::Duration::from_std(*window).unwrap_or(chrono::Duration::MAX);
            now.checked_sub_signed(window)
                .unwrap_or(DateTime::<Utc>::MIN_UTC)
                .to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
        };
        PruneFilter {
            default_cutoff: self.default_window.as_ref().map(cutoff),
            agent_cutoffs: self
                .agent_windows
                .iter()
                .map(|(agent, window)| (agent.clone(), cutoff(window)))
                .collect(),
            min_keep: self.min_keep,
        }
    }
}

/// What a pruning pass removed (or, dry, would remove).
#[derive(Debug, Clone, Default, PartialEq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct PruneReport {
    pub dry_run: bool,
    pub removed: PruneCounts,
    /// Sessions written to the archive before they were removed.
    pub archived_sessions: u64,
    pub archive_file: Option<String>,
    /// Space given back to the filesystem.
    pub reclaimed_bytes: u64,
    pub took_ms: u64,
}

/// An online backup.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct BackupReport {
    pub file: String,
    pub bytes: u64,
    pub took_ms: u64,
}

/// One pruning pass under `policy`: batch by batch until nothing more may go, then the
/// space is given back. Recorded in the store and logged, whether it succeeds or fails.
pub async fn prune(
    store: &dyn Store,
    policy: &RetentionPolicy,
    dry_run: bool,
) -> Result<PruneReport, StoreError> {
    let started_at = Utc::now();
    let started = Instant::now();
    let result = prune_batches(store, policy, dry_run, started_at).await;
    let result = result.map(|mut report| {
        report.took_ms = started.elapsed().as_millis() as u64;
        report
    });
    if dry_run {
        return result;
    }
    match &result {
        Ok(report) => tracing::info!(
            event = "runtime.store.maintenance.completed",
            operation = "prune",
            sessions = report.removed.sessions,
            requests = report.removed.requests,
            events = report.removed.events,
            archived = report.archived_sessions,
            reclaimed_bytes = report.reclaimed_bytes,
            took_ms = report.took_ms,
            "retention pass"
        ),
        Err(error) => tracing::error!(
            event = "runtime.store.maintenance.failed",
            operation = "prune",
            %error,
            "retention pass failed"
        ),
    }
    record(store, "prune", started_at, &result).await;
    result
}

async fn prune_batches(
    store: &dyn Store,
    policy: &RetentionPolicy,
    dry_run: bool,
    now: DateTime<Utc>,
) -> Result<PruneReport, StoreError> {
    let mut report = PruneReport {
        dry_run,
        ..PruneReport::default()
    };
    if !policy.is_active() {
        return Ok(report);
    }
    let filter = policy.filter(now);
    let archive = match (&policy.archive_dir, dry_run) {
        (Some(dir), false) => Some(dir.join(format!("sessions-{}.jsonl", now.format("%Y-%m-%d")))),
        _ => None,
    };
    let mut after: Option<String> = None;
    loop {
        let batch = store
            .prunable_sessions(&filter, after.as_deref(), BATCH)
            .await?;
        let Some(last) = batch.last().cloned() else {
            break;
        };
        if dry_run {
            report.removed.add(&store.count_owned(&batch).await?);
        } else {
            if let Some(file) = &archive {
                write_archive(store, &batch, file).await?;
                report.archived_sessions += batch.len() as u64;
                report.archive_file = Some(file.display().to_string());
            }
            report
                .removed
                .add(&store.delete_sessions(&filter, &batch).await?);
        }
        after = Some(last);
    }
    if !dry_run && report.removed.sessions > 0 {
        loop {
            let freed = store.reclaim_space(RECLAIM_STEP).await?;
            report.reclaimed_bytes += freed;
            if freed == 0 {
                break;
            }
        }
    }
    Ok(report)
}

/// Appends one JSON line per session (its messages and its requests, each with runs, events,
/// tool calls and approvals), synced to disk before the sessions are deleted. At least once:
/// a session continued between listing and deleting stays in the store and may be archived
/// again by a later pass. The sessions are read in groups of at most [`ARCHIVE_REQUESTS`]
/// requests (a session with more alone, whole, as its line needs), each table in one
/// statement for the group: a statement per table and request took ~0.36 ms a session
/// (docs/profiling.md, the forty-sixth pass). Each line is written whole, through a buffer.
async fn write_archive(
    store: &dyn Store,
    sessions: &[String],
    file: &Path,
) -> Result<(), StoreError> {
    let archive_error = |source: std::io::Error| StoreError::Archive {
        path: file.display().to_string(),
        source,
    };
    if let Some(parent) = file.parent() {
        std::fs::create_dir_all(parent).map_err(archive_error)?;
    }
    let mut out = std::io::BufWriter::new(
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(file)
            .map_err(archive_error)?,
    );
    let requests = store.requests_per_session(sessions).await?;
    let mut last_holder = None;
    let mut line = Vec::new();
    for group in groups(sessions, &requests, ARCHIVE_REQUESTS) {
        let mut rows = store.archive_rows(group).await?;
        with_whole_transcripts(store, &mut rows.requests, &mut last_holder).await?;
        for session in archived_sessions(group, &rows) {
            line.clear();
            serde_json::to_writer(&mut line, &session)
                .map_err(|error| archive_error(error.into()))?;
            line.push(b'\n');
            out.write_all(&line).map_err(archive_error)?;
        }
    }
    let out = out
        .into_inner()
        .map_err(|error| archive_error(error.into_error()))?;
    out.sync_all().map_err(archive_error)
}

/// Each request that names another's for its transcript's first messages ([`PREFIX_OF`])
/// given its whole transcript (and its leading messages, when it names them there), so that
/// an archive's line stands alone. The named request is
/// still in the store (a prune keeps it while a request of another session names it); the
/// last one read is kept for the next request that names it (a conversation's turns name
/// the same one), never more than one, whatever their size. One that is not there (an
/// instance from before the prune kept it took it) leaves the request archived as stored,
/// with a warning: the pass goes on.
async fn with_whole_transcripts(
    store: &dyn Store,
    requests: &mut [RequestRecord],
    last_holder: &mut Option<(String, Option<RequestRecord>)>,
) -> Result<(), StoreError> {
    for request in requests {
        let Some(holder) = NamedInput::of(&request.input).prefix_of.map(str::to_owned) else {
            continue;
        };
        let held = match last_holder {
            Some((id, held)) if *id == holder => held,
            _ => {
                let read = store.request(&holder).await?;
                &mut last_holder.insert((holder, read)).1
            }
        };
        let messages = match named_input::joined_messages(request, held.as_ref()) {
            Ok(messages) => messages,
            Err(error) => {
                tracing::warn!(request_id = %request.id, %error, "archived as stored");
                continue;
            }
        };
        // Its leading messages too, when it names them there.
        let leading = if named_input::names_leading_with_prefix(request) {
            match named_input::joined_leading(request, held.as_ref()) {
                Ok(leading) => Some(leading.clone()),
                Err(error) => {
                    tracing::warn!(request_id = %request.id, %error, "archived naming its leading messages");
                    None
                }
            }
        } else {
            None
        };
        if let Some(input) = request.input.as_object_mut() {
            input.remove(PREFIX_OF);
            input.remove(PREFIX_LEN);
            input.insert("messages".into(), Value::Array(messages));
            if let Some(leading) = leading {
                input.remove(LEADING_OF);
                input.insert(LEADING.into(), Value::Array(leading));
            }
        }
    }
    Ok(())
}

/// Requests an archive holds in memory at once, unless one session has more.
const ARCHIVE_REQUESTS: u64 = 256;

/// `sessions` cut, in order, into runs whose `requests` (per session) add up to at most
/// `most`; a session with more than `most` is a group of its own.
fn groups<'a>(sessions: &'a [String], requests: &[u64], most: u64) -> Vec<&'a [String]> {
    let mut groups = Vec::new();
    let (mut start, mut held) = (0, 0u64);
    for (index, &count) in requests.iter().enumerate().take(sessions.len()) {
        if index > start && held.saturating_add(count) > most {
            groups.push(&sessions[start..index]);
            (start, held) = (index, 0);
        }
        held = held.saturating_add(count);
    }
    if start < sessions.len() {
        groups.push(&sessions[start..]);
    }
    groups
}

/// One session as its archive line: the session (`null` when it is gone), its messages and
/// its requests, each with what it owns.
#[derive(Serialize)]
struct ArchivedSession<'a> {
    messages: Vec<&'a MessageRecord>,
    requests: Vec<ArchivedRequest<'a>>,
    session: Option<&'a SessionRecord>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ArchivedRequest<'a> {
    approvals: Vec<&'a ApprovalRecord>,
    events: Vec<&'a EventRecord>,
    request: &'a RequestRecord,
    runs: Vec<&'a RunRecord>,
    tool_calls: Vec<&'a ToolCallRecord>,
}

/// The rows of a group of sessions, sorted into a line per session in the order of
/// `sessions`; each part keeps the order the store read it in.
fn archived_sessions<'a>(sessions: &[String], rows: &'a ArchiveRows) -> Vec<ArchivedSession<'a>> {
    fn by<T>(items: &[T], key: impl Fn(&T) -> &str) -> HashMap<&str, Vec<&T>> {
        let mut grouped: HashMap<&str, Vec<&T>> = HashMap::new();
        for item in items {
            grouped.entry(key(item)).or_default().push(item);
        }
        grouped
    }
    /// What `owned` holds of each of `runs`, run by run.
    fn of_runs<'a, T>(runs: &[&RunRecord], owned: &HashMap<&str, Vec<&'a T>>) -> Vec<&'a T> {
        runs.iter()
            .flat_map(|run| owned.get(run.id.as_str()).into_iter().flatten().copied())
            .collect()
    }
    let session_of: HashMap<&str, &SessionRecord> =
        rows.sessions.iter().map(|s| (s.id.as_str(), s)).collect();
    let mut messages = by(&rows.messages, |m| &m.session_id);
    let mut requests = by(&rows.requests, |r| &r.session_id);
    let mut runs = by(&rows.runs, |r| &r.request_id);
    let mut events = by(&rows.events, |e| &e.request_id);
    let tool_calls = by(&rows.tool_calls, |c| &c.run_id);
    let approvals = by(&rows.approvals, |a| &a.run_id);
    sessions
        .iter()
        .map(|id| ArchivedSession {
            messages: messages.remove(id.as_str()).unwrap_or_default(),
            requests: requests
                .remove(id.as_str())
                .unwrap_or_default()
                .into_iter()
                .map(|request| {
                    let runs = runs.remove(request.id.as_str()).unwrap_or_default();
                    ArchivedRequest {
                        approvals: of_runs(&runs, &approvals),
                        events: events.remove(request.id.as_str()).unwrap_or_default(),
                        request,
                        tool_calls: of_runs(&runs, &tool_calls),
                        runs,
                    }
                })
                .collect(),
            session: session_of.get(id.as_str()).copied(),
        })
        .collect()
}

/// Copies a consistent snapshot of the store to the new file `file` while it serves.
pub async fn backup(store: &dyn Store, file: &Path) -> Result<BackupReport, StoreError> {
    let started_at = Utc::now();
    let started = Instant::now();
    let result = async {
        super::prepare_new_file(file)?;
        let bytes = store.backup_to(file).await?;
        Ok(BackupReport {
            file: file.display().to_string(),
            bytes,
            took_ms: started.elapsed().as_millis() as u64,
        })
    }
    .await;
    match &result {
        Ok(report) => tracing::info!(
            event = "runtime.store.maintenance.completed",
            operation = "backup",
            file = %report.file,
            bytes = report.bytes,
            took_ms = report.took_ms,
            "backup written"
        ),
        Err(error) => tracing::error!(
            event = "runtime.store.maintenance.failed",
            operation = "backup",
            %error,
            "backup failed"
        ),
    }
    record(store, "backup", started_at, &result).await;
    result
}

/// Records a maintenance pass; a failure to record is logged, never the pass's failure.
pub(crate) async fn record<T: Serialize, E: std::fmt::Display>(
    store: &dyn Store,
    operation: &str,
    started_at: DateTime<Utc>,
    result: &Result<T, E>,
) {
    let (status, report) = match result {
        // A report is an object (the documented shape), whatever the pass returned.
        Ok(report) => (
            "completed",
            match serde_json::to_value(report) {
                Ok(Value::Object(report)) => Value::Object(report),
                Ok(other) => json!({ "result": other }),
                Err(_) => json!({}),
            },
        ),
        Err(error) => ("failed", json!({ "error": error.to_string() })),
    };
    let record = MaintenanceRecord {
        id: crate::runtime::new_id("mnt"),
        operation: operation.to_owned(),
        status: status.to_owned(),
        started_at,
        ended_at: Utc::now(),
        report,
    };
    if let Err(error) = store.record_maintenance(&record).await {
        tracing::warn!(%error, operation, "cannot record a maintenance pass");
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use chrono::{Duration as Age, Utc};

    use super::*;
    use crate::store::{RunStatus, SqliteStore, WriteOp, test_records};

    fn session_and_request(
        session: &str,
        request: &str,
        status: RunStatus,
        age: Age,
    ) -> Vec<WriteOp> {
        let at = Utc::now() - age;
        let mut session = test_records::session(session);
        (session.created_at, session.updated_at) = (at, at);
        let mut request = test_records::request(request, &session.id);
        (request.status, request.created_at, request.updated_at) = (status, at, at);
        vec![
            WriteOp::TouchSession(session),
            WriteOp::InsertRequest(request),
        ]
    }

    #[test]
    fn archive_groups_hold_at_most_their_requests_and_a_larger_session_alone() {
        let sessions: Vec<String> = (0..6).map(|n| format!("ses_{n}")).collect();
        let cut = |requests: &[u64], most: u64| -> Vec<usize> {
            groups(&sessions, requests, most)
                .iter()
                .map(|group| group.len())
                .collect()
        };
        assert_eq!(cut(&[1, 1, 1, 1, 1, 1], 256), [6]);
        assert_eq!(cut(&[2, 2, 2, 2, 2, 2], 4), [2, 2, 2]);
        assert_eq!(cut(&[1, 9, 1, 1, 0, 5], 4), [1, 1, 3, 1]);
        assert_eq!(cut(&[0, 0, 0, 0, 0, 0], 0), [6]);
        assert_eq!(cut(&[u64::MAX, 1, u64::MAX, 0, 0, 1], 4), [1, 1, 1, 3]);
        assert!(groups(&[], &[], 4).is_empty());
    }

    #[tokio::test]
    async fn a_session_continued_after_it_was_listed_is_not_deleted() {
        let (_dir, store) = SqliteStore::in_temporary_folder().await;
        let store: Arc<dyn Store> = Arc::new(store);
        store
            .apply(&session_and_request(
                "ses_old",
                "req_1",
                RunStatus::Completed,
                Age::hours(2),
            ))
            .await
            .unwrap();
        store
            .apply(&session_and_request(
                "ses_gone",
                "req_2",
                RunStatus::Completed,
                Age::hours(2),
            ))
            .await
            .unwrap();
        let policy = RetentionPolicy {
            default_window: Some(Duration::from_secs(3_600)),
            min_keep: 0,
            ..RetentionPolicy::default()
        };
        let filter = policy.filter(Utc::now());
        let listed = store.prunable_sessions(&filter, None, 10).await.unwrap();
        assert_eq!(listed, ["ses_gone", "ses_old"]);

        // A client continues one of them before the delete runs.
        store
            .apply(&session_and_request(
                "ses_old",
                "req_3",
                RunStatus::Running,
                Age::zero(),
            ))
            .await
            .unwrap();
        let removed = store.delete_sessions(&filter, &listed).await.unwrap();
        assert_eq!((removed.sessions, removed.requests), (1, 1));
        assert!(store.session("ses_old").await.unwrap().is_some());
        assert!(store.request("req_1").await.unwrap().is_some());
        assert!(store.session("ses_gone").await.unwrap().is_none());
    }

    /// A pruned request naming another for its transcript's first messages (and its leading
    /// messages) is archived with its whole transcript and its leading messages; one whose
    /// named request is gone (an older instance's prune took it) is archived as stored, and
    /// the pass goes on.
    #[tokio::test]
    async fn an_archive_writes_a_named_transcript_whole_or_as_stored_when_its_holder_is_gone() {
        let (dir, store) = SqliteStore::in_temporary_folder().await;
        let store: Arc<dyn Store> = Arc::new(store);
        let rules = json!([{ "role": "system", "content": "Be brief." }]);
        let holder_input = json!({ "messages": [{ "role": "user", "content": "hi" }],
            "inputDigest": "d1", "leading": rules, "leadingDigest": "l1" });
        let naming = |holder: &str| {
            json!({ "messages": [{ "role": "user", "content": "more" }],
                    "prefixOf": holder, "prefixLen": 1, "leadingOf": holder, "leadingDigest": "l1" })
        };
        for (session, request, input) in [
            ("ses_1", "req_1", holder_input),
            ("ses_2", "req_2", naming("req_1")),
            ("ses_3", "req_3", naming("req_gone")),
        ] {
            let mut ops =
                session_and_request(session, request, RunStatus::Completed, Age::hours(2));
            if let WriteOp::InsertRequest(record) = &mut ops[1] {
                record.input = input;
            }
            store.apply(&ops).await.unwrap();
        }
        let policy = RetentionPolicy {
            default_window: Some(Duration::from_secs(3_600)),
            min_keep: 0,
            archive_dir: Some(dir.path().join("archive")),
            ..RetentionPolicy::default()
        };
        let report = prune(store.as_ref(), &policy, false).await.unwrap();
        // ses_1 stays while req_2 was there when it was listed.
        assert_eq!(report.removed.sessions, 2, "{report:?}");
        let file = report.archive_file.unwrap();
        let mut archived = BTreeMap::new();
        for line in std::fs::read_to_string(file).unwrap().lines() {
            let session: Value = serde_json::from_str(line).unwrap();
            let request = &session["requests"][0]["request"];
            archived.insert(
                request["id"].as_str().unwrap().to_owned(),
                request["input"].clone(),
            );
        }
        assert_eq!(
            archived["req_2"],
            json!({ "messages": [{ "role": "user", "content": "hi" }, { "role": "user", "content": "more" }],
                    "leading": rules, "leadingDigest": "l1" })
        );
        assert_eq!(archived["req_3"], naming("req_gone"));
        // The next pass takes what req_2 named.
        let report = prune(store.as_ref(), &policy, false).await.unwrap();
        assert_eq!(report.removed.sessions, 1, "{report:?}");
    }
}
