//! The `Store` interface and its implementations (SPEC section 8): sessions, messages (a
//! tree), requests, runs, events (gapless `seq` per request), approvals and artifacts; memory
//! records ([`MemoryStore`]) and the spend ledger ([`SpendStore`]) beside them.
//!
//! The store keeps what it is given: the runtime makes ids, timestamps and sequence numbers.
//! Every write is a [`WriteOp`]; a batch of them is applied in one transaction, which is how
//! the runtime's journal groups a streaming run's events into few commits. Migrations live in
//! `migrations/<database>/` and run when a store is opened.

/// Every column of `requests` but `input` (see [`RequestInput`]), in either store's SQL.
/// Defined before the stores' modules, which use it.
macro_rules! request_columns_but_input {
    () => {
        "id, session_id, agent_id, protocol, owner, status, output, error, usage, metadata, \
         created_at, updated_at"
    };
}

/// Every column of `runs` but `state` (the run's conversation after its last step: the whole
/// transcript with its tools' results, which no view shows), in either store's SQL.
macro_rules! run_columns_but_state {
    () => {
        "id, request_id, attempt, status, error, created_at, updated_at, started_at, ended_at, \
         lease_holder, lease_expires_at, cancel_requested_by"
    };
}

mod conditions;
mod event_rows;
mod folds;
mod model;
pub mod named_input;
mod postgres;
mod postgres_memory;
mod postgres_spend;
pub mod retention;
pub mod spend;
mod sqlite;
mod sqlite_memory;
mod sqlite_readers;
mod sqlite_spend;
mod sqlite_wal_vfs;
mod sqlite_writer;
mod stored_time;
#[cfg(test)]
pub(crate) mod test_records;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use chrono::{DateTime, Utc};

pub use model::*;
pub use named_input::{
    INPUT_DIGEST, InputHolder, LEADING, LEADING_DIGEST, LEADING_OF, NamedInput, PREFIX_LEN,
    PREFIX_OF,
};

/// Whether a read of requests reads each one's `input`: the whole transcript it brought,
/// its largest column by far once a conversation grows. An export needs it; no view shows
/// it, so a listing that serves views leaves it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestInput {
    Read,
    /// Left `Null`, not read.
    Skipped,
}

impl RequestInput {
    /// The columns of `requests` a read selects, in either store's SQL.
    fn columns(self) -> &'static str {
        match self {
            RequestInput::Read => "*",
            RequestInput::Skipped => request_columns_but_input!(),
        }
    }
}

/// A request as its view shows it (see [`Store::request_in_full`]).
#[derive(Debug, Clone, PartialEq)]
pub struct RequestInFull {
    /// The request without its input: `input` is `Null`, not read. No view shows it, and it
    /// is the request's largest column (the whole transcript), which every `wait` and every
    /// view would otherwise read and parse only to drop.
    pub request: RequestRecord,
    /// Oldest first, each without its `state` (`None`, not read): no view shows it, and a run
    /// that called tools holds its whole conversation there.
    pub runs: Vec<RunRecord>,
    /// Of every run, run by run, oldest first.
    pub approvals: Vec<ApprovalRecord>,
    /// What the budgets were charged for the request's calls.
    pub charged: spend::UsageTotals,
}
pub use postgres::PostgresStore;
pub use spend::SpendStore;
pub use sqlite::SqliteStore;

/// Why a store operation failed. Never caused by client input: the layers above validate.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    #[error("migration failed: {0}")]
    Migration(#[from] sqlx::migrate::MigrateError),
    #[error("stored data is unreadable: {0}")]
    Corrupt(String),
    #[error("unsupported store url `{0}`: use sqlite://PATH or postgres://USER@HOST/DB")]
    UnsupportedUrl(String),
    /// The operation does not exist on this store.
    #[error("{0}")]
    Unsupported(String),
    #[error("store writer: {0}")]
    Writer(String),
    /// A read of the embedded store's own connections failed (not one through sqlx).
    #[error("store reader: {0}")]
    Reader(String),
    /// The database cannot write for now (busy, I/O error, full disk): worth retrying.
    #[error("the store cannot write for now: {0}")]
    Unavailable(String),
    /// A conditional write found the state changed (an approval decided already).
    #[error("{0}")]
    Conflict(String),
    /// A run's write from an instance that no longer holds its lease (another took it over).
    #[error("{0}")]
    LeaseLost(String),
    #[error("cannot lock the store with {path}: {source}")]
    Lock {
        path: String,
        source: std::io::Error,
    },
    /// Another process holds the store.
    #[error(
        "the store {0} is in use by another stable-harness process (one process owns a store's runs); stop it first or use another store"
    )]
    InUse(String),
    /// A file of the store's maintenance (archive, backup) cannot be written.
    #[error("cannot write {path}: {source}")]
    Archive {
        path: String,
        source: std::io::Error,
    },
    #[error("cannot create the store folder {path}: {source}")]
    Folder {
        path: String,
        source: std::io::Error,
    },
}

impl StoreError {
    /// Whether the same write may succeed if tried again later (the disk frees up, a lock is
    /// released), as opposed to a write the store will always refuse.
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Unavailable(_)
            | Self::Database(sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut) => true,
            Self::Database(sqlx::Error::Database(error)) => error
                .code()
                .is_some_and(|code| is_transient_sqlstate(&code)),
            _ => false,
        }
    }

    /// Whether the write lost a race with another transaction (a deadlock, a serialization
    /// failure): the database is fine, so trying again at once is right, with nobody told
    /// that writes fail.
    pub fn is_contention(&self) -> bool {
        match self {
            Self::Database(sqlx::Error::Database(error)) => error
                .code()
                .is_some_and(|code| matches!(&*code, "40001" | "40P01")),
            _ => false,
        }
    }
}

/// The writer lane of `request` among `lanes` (see [`Store::writer_lanes`]): the journal
/// queues a request's writes there, and a store that keeps per-lane state (PostgreSQL's
/// pending charges) files the request's under the same lane. FNV-1a over the id's bytes:
/// the same on every call and every instance, and spread over the ids' random part.
pub fn lane_of(request: &str, lanes: usize) -> usize {
    if lanes <= 1 {
        return 0;
    }
    let hash = request
        .bytes()
        .fold(0xcbf2_9ce4_8422_2325_u64, |hash, byte| {
            (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3)
        });
    // `lanes` fits in u64 and the remainder is below it: both conversions are exact.
    (hash % lanes as u64) as usize
}

/// PostgreSQL conditions that pass by themselves: connection trouble (but not a protocol
/// violation), insufficient resources (a full disk, too many connections), the server
/// shutting down, serialization failures, deadlocks, lock and statement timeouts.
fn is_transient_sqlstate(code: &str) -> bool {
    (code.starts_with("08") && code != "08P01")
        || code.starts_with("53")
        || code.starts_with("57P")
        || matches!(code, "40001" | "40P01" | "55P03" | "57014")
}

/// How often whoever waits on a store other instances share (a follower, an approval waiter)
/// reads it when no announcement came: a lost notification costs this much latency.
pub const SHARED_POLL: std::time::Duration = std::time::Duration::from_secs(2);

/// The memory records of a store (issue 12). They are written outside runs' transactions: a
/// write is keyed by its content, so writing it again (a re-run call, an import) merges
/// instead of adding.
#[async_trait::async_trait]
pub trait MemoryStore: Send + Sync {
    /// Stores `record`, or merges it into the record of the same namespace, scope and content
    /// (whose `updated_at` moves; its status and id stay). Returns the stored record and
    /// whether it was merged.
    async fn put_memory(&self, record: &MemoryRecord) -> Result<(MemoryRecord, bool), StoreError>;
    /// Stores all of `records` in one transaction, each merged like [`MemoryStore::put_memory`];
    /// returns how many were merged into records that existed.
    async fn import_memories(&self, records: &[MemoryRecord]) -> Result<u64, StoreError>;
    async fn memory(&self, id: &str) -> Result<Option<MemoryRecord>, StoreError>;
    /// Newest first by id, filtered; `filter.words` narrows to records containing any of
    /// them.
    async fn memories(
        &self,
        filter: &MemoryFilter,
        page: &PageRequest,
    ) -> Result<Page<MemoryRecord>, StoreError>;
    /// The `limit` active records of a namespace and scope that best match any of `words`,
    /// by full-text relevance weighed by recency (a month-old record counts half); without
    /// words, the most recent ones.
    async fn recall_memories(
        &self,
        namespace: &str,
        scope: &str,
        words: &[String],
        limit: i64,
    ) -> Result<Vec<MemoryRecord>, StoreError>;
    /// Moves a record from one of `from` to `to` (an operator's decision).
    async fn set_memory_status(
        &self,
        id: &str,
        from: &[MemoryStatus],
        to: MemoryStatus,
        by: &str,
        at: DateTime<Utc>,
    ) -> Result<MemoryTransition, StoreError>;
    /// Deletes a record; false when there was none.
    async fn delete_memory(&self, id: &str) -> Result<bool, StoreError>;
    /// Archives active records that have a newer active near-duplicate, and active records
    /// not updated since `expire_before`; within `namespace` when given.
    async fn compact_memories(
        &self,
        namespace: Option<&str>,
        expire_before: Option<DateTime<Utc>>,
        at: DateTime<Utc>,
    ) -> Result<CompactReport, StoreError>;
}

/// One store, whatever the database behind it.
#[async_trait::async_trait]
pub trait Store: MemoryStore + SpendStore + Send + Sync + 'static {
    /// Applies every op in order, in one transaction: all or nothing. Returns the `seq` the
    /// store gave each [`WriteOp::AppendEvent`], in order: a request's events are numbered
    /// after its last stored one, whoever writes them. A batch is applied once per `batch_id`:
    /// tried again with the same id after it committed (its reply lost with a connection), it
    /// returns the numbers it got instead of applying anything. Only the runtime's journal
    /// writes, giving each batch one id for all its tries.
    async fn apply_batch(&self, batch_id: &str, ops: &[WriteOp]) -> Result<Vec<i64>, StoreError>;
    /// [`Store::apply_batch`] taking the batch and handing it back with the outcome: a
    /// store that writes on another thread takes it there without copying it. `lane` is the
    /// journal's writer lane the batch comes from (below [`Store::writer_lanes`]): every
    /// request the batch writes for is [`lane_of`] it.
    async fn apply_owned(
        &self,
        _lane: usize,
        batch_id: &str,
        ops: Vec<WriteOp>,
    ) -> (Vec<WriteOp>, Result<Vec<i64>, StoreError>) {
        let applied = self.apply_batch(batch_id, &ops).await;
        (ops, applied)
    }
    /// How many batches the journal may apply at once, each from a lane of its own that
    /// holds a share of the requests ([`lane_of`]): a request's writes stay in order, and
    /// batches of different requests overlap. One on a store with one writer.
    fn writer_lanes(&self) -> usize {
        1
    }
    /// Where the journal should run: a store that writes on a thread of its own with a runtime
    /// there (the embedded store's writer thread) saves each batch two thread wake-ups.
    /// `None`: the caller's runtime.
    fn writer_runtime(&self) -> Option<tokio::runtime::Handle> {
        None
    }
    /// [`Store::apply_batch`] under a new id.
    async fn apply(&self, ops: &[WriteOp]) -> Result<Vec<i64>, StoreError> {
        self.apply_batch(&new_batch_id(), ops).await
    }
    async fn request(&self, id: &str) -> Result<Option<RequestRecord>, StoreError>;
    /// A request (without its input: see [`RequestInFull`]) with its runs, their approvals
    /// and what its calls were charged: what a request's view shows. Read in one hop where
    /// the store can: the embedded store on its writer's connection; PostgreSQL in one
    /// statement (one snapshot) on a backend it keeps for such reads.
    async fn request_in_full(&self, id: &str) -> Result<Option<RequestInFull>, StoreError>;
    /// The views of the stored requests among `ids` (distinct), in no given order, each as
    /// [`Store::request_in_full`] reads it: for a commit of the journal's writer lane `lane`
    /// that ended requests whose views are awaited. The embedded store reads them in one hop
    /// to its writer's connection; PostgreSQL in one statement on the lane's own backend,
    /// free between the lane's batches (the lane's next commit waits on this read: never on
    /// a reader backend or a pooled connection that other reads hold).
    async fn requests_in_full(
        &self,
        lane: usize,
        ids: &[&str],
    ) -> Result<Vec<RequestInFull>, StoreError>;
    /// Newest first; `page.cursor` is the id of the last request of the previous page. Each
    /// request's `input` is read or left `Null` as `input` says.
    // Lists page newest first with `id < COALESCE(cursor, '~')`: a constant bound lets the
    // index seek straight to a deep page (`'~'` sorts after every character of the ids we
    // make). Sessions, whose ids clients may choose, use `cursor IS NULL OR id < cursor`.
    async fn requests(
        &self,
        filter: &RequestFilter,
        page: &PageRequest,
        input: RequestInput,
    ) -> Result<Page<RequestRecord>, StoreError>;
    async fn run(&self, id: &str) -> Result<Option<RunRecord>, StoreError>;
    /// The runs of a request, oldest first.
    async fn runs_of(&self, request_id: &str) -> Result<Vec<RunRecord>, StoreError>;
    /// The runs of several requests (a page of a list) in one read, by request then attempt,
    /// as views show them: each without its `state` (`None`, not read).
    async fn runs_of_requests(&self, request_ids: &[String]) -> Result<Vec<RunRecord>, StoreError>;
    /// Runs in any of `statuses`, oldest first.
    async fn runs_with_status(&self, statuses: &[RunStatus]) -> Result<Vec<RunRecord>, StoreError>;

    // Leases (SPEC section 8): a live run is executed by the holder of its lease only.

    /// The identity this store handle holds leases as (one per process).
    fn holder(&self) -> &str;
    /// Takes up to `limit` live runs nobody holds or whose lease expired, oldest first, and
    /// leases them to this holder. Concurrent claimers, here or on other instances, never get
    /// the same run.
    async fn claim_runs(&self, limit: i64) -> Result<Vec<RunRecord>, StoreError>;
    /// Extends this holder's leases on those of `runs` that are live and still its own;
    /// returns their ids. (A run claimed but not started here is left to expire.)
    async fn renew_leases(&self, runs: &[String]) -> Result<Vec<String>, StoreError>;
    /// Gives every lease this holder has back (graceful shutdown), so another instance may
    /// claim the runs at once; returns how many.
    async fn release_leases(&self) -> Result<u64, StoreError>;
    /// Takes the lease of one live run that no instance holds (none, or expired), for this
    /// holder; `None` when the run ended or someone else holds it.
    async fn claim_run(&self, run_id: &str) -> Result<Option<RunRecord>, StoreError>;
    /// Asks whoever executes a live run to stop it (an operator's cancel): the mark is stored
    /// with the run and, on a shared store, announced to the other instances
    /// ([`StoreChange::CancelRequested`]). `by` is who asked. Returns false when the run has
    /// ended already.
    async fn request_cancel(&self, run_id: &str, by: &str) -> Result<bool, StoreError>;
    /// Those of `runs` asked to stop (see [`Store::request_cancel`]), with who asked.
    async fn cancels_requested(&self, runs: &[String])
    -> Result<Vec<(String, String)>, StoreError>;
    /// What other instances commit, for a store several instances share (`None`: only this
    /// process writes to it).
    fn changes(&self) -> Option<tokio::sync::broadcast::Receiver<StoreChange>> {
        None
    }
    /// Whether other instances may write to this store.
    fn is_shared(&self) -> bool {
        false
    }

    /// Events of a request with `seq > after`, in order, at most `limit`.
    async fn events(
        &self,
        request_id: &str,
        after: i64,
        limit: i64,
    ) -> Result<Vec<EventRecord>, StoreError>;
    /// Events of one run with `seq > after`, in order, at most `limit`.
    async fn run_events(
        &self,
        run_id: &str,
        after: i64,
        limit: i64,
    ) -> Result<Vec<EventRecord>, StoreError>;
    /// The event of a request with the highest `seq`, if it has any: its last row of events
    /// read once (its `seq` is the request's highest).
    async fn last_event(&self, request_id: &str) -> Result<Option<EventRecord>, StoreError>;
    /// A request and its last event ([`Store::last_event`]), read together (the embedded
    /// store reads both in one hop to a reader): the request first, so the event is at least
    /// as new as the request's status. Whoever asks checks the owner before using either.
    async fn request_and_last_event(
        &self,
        id: &str,
    ) -> Result<Option<(RequestRecord, Option<EventRecord>)>, StoreError> {
        let Some(request) = self.request(id).await? else {
            return Ok(None);
        };
        Ok(Some((request, self.last_event(id).await?)))
    }
    async fn session(&self, id: &str) -> Result<Option<SessionRecord>, StoreError>;
    /// The messages of a session, oldest first.
    async fn messages(&self, session_id: &str) -> Result<Vec<MessageRecord>, StoreError>;
    async fn message(&self, id: &str) -> Result<Option<MessageRecord>, StoreError>;
    /// The newest message request `request_id` brought into session `session_id` (an
    /// assistant message is its answer, not its own): where its answer hangs. Its messages are
    /// stamped when it was (`since`), so only what the session took on since is read, not the
    /// whole session.
    async fn request_last_message(
        &self,
        session_id: &str,
        request_id: &str,
        since: DateTime<Utc>,
    ) -> Result<Option<String>, StoreError>;
    /// The newest answers (`assistant` messages) of session `session_id`, newest first, at
    /// most `limit`, by the session's index: where a client's transcript that leaves the
    /// session's newest path may continue another of the session's conversations.
    async fn newest_answers(
        &self,
        session_id: &str,
        limit: u32,
    ) -> Result<Vec<MessageRecord>, StoreError>;
    /// The newest leaf of a session (a message with no child in it): the one its next request
    /// continues from. Asked as a leaf, not as the newest message, since instances' clocks
    /// may disagree and a child could be stamped before its parent.
    async fn session_head(&self, session_id: &str) -> Result<Option<String>, StoreError>;
    /// The path from the root of a message tree to `leaf`, root first: a session's history.
    /// It crosses into the session a fork branched from.
    async fn message_path(&self, leaf: &str) -> Result<Vec<MessageRecord>, StoreError> {
        Ok(self.message_path_below(leaf, None).await?.messages)
    }
    /// The path to `leaf` as [`Store::message_path`], or only its part below `known` when the
    /// path passes through it (whoever asks holds the path to `known` already).
    async fn message_path_below(
        &self,
        leaf: &str,
        known: Option<&str>,
    ) -> Result<PathBelow, StoreError>;
    /// The session's head ([`Store::session_head`]) and the path to it, as
    /// [`Store::message_path_below`] reads it; `None` when the session holds no message. One
    /// read where the store can (the embedded store: one hop to a reader, one snapshot).
    async fn session_path_below(
        &self,
        session_id: &str,
        known: Option<&str>,
    ) -> Result<Option<(String, PathBelow)>, StoreError> {
        let Some(head) = self.session_head(session_id).await? else {
            return Ok(None);
        };
        let path = self.message_path_below(&head, known).await?;
        Ok(Some((head, path)))
    }
    /// The session, and with it (one read where the store can) what
    /// [`Store::session_path_below`] reads: for a request that continues the session.
    async fn session_and_path(
        &self,
        session_id: &str,
        known: Option<&str>,
    ) -> Result<Option<(SessionRecord, Option<(String, PathBelow)>)>, StoreError> {
        let Some(session) = self.session(session_id).await? else {
            return Ok(None);
        };
        let path = self.session_path_below(session_id, known).await?;
        Ok(Some((session, path)))
    }
    /// Sessions newest first.
    async fn sessions(
        &self,
        filter: &SessionFilter,
        page: &PageRequest,
    ) -> Result<Page<SessionRecord>, StoreError>;
    async fn approval(&self, id: &str) -> Result<Option<ApprovalRecord>, StoreError>;
    /// Newest first, optionally only those in `status`; `page.cursor` as for requests.
    async fn approvals(
        &self,
        status: Option<ApprovalStatus>,
        page: &PageRequest,
    ) -> Result<Page<ApprovalRecord>, StoreError>;
    /// How many approvals are pending.
    async fn count_pending_approvals(&self) -> Result<u64, StoreError>;
    /// The approvals of one run, oldest first.
    async fn approvals_of_run(&self, run_id: &str) -> Result<Vec<ApprovalRecord>, StoreError>;
    /// The recorded tool calls of one run (started ones included).
    async fn tool_calls_of_run(&self, run_id: &str) -> Result<Vec<ToolCallRecord>, StoreError>;
    /// The calls of client tools with one of the model call `ids` (the ids the client was
    /// given for the calls it runs) in requests `owner` owns.
    async fn client_calls(
        &self,
        ids: &[String],
        owner: &str,
    ) -> Result<Vec<ClientCallRecord>, StoreError>;
    /// Completes a call handed to the client with the result it reported. `false`: it was not
    /// waiting on the client (completed already, or no such call).
    async fn complete_client_call(
        &self,
        run_id: &str,
        call_key: &str,
        result: &serde_json::Value,
        at: chrono::DateTime<chrono::Utc>,
    ) -> Result<bool, StoreError>;
    /// The newest request of `owner` and `agent` whose input's transcript has `digest`
    /// ([`INPUT_DIGEST`]), read from the index alone: a chat turn with no session looks up
    /// the request its transcript continues.
    async fn input_holder(
        &self,
        owner: &str,
        agent: &str,
        digest: &str,
    ) -> Result<Option<InputHolder>, StoreError>;
    /// Cheap liveness check for `/readyz`.
    async fn ping(&self) -> Result<(), StoreError>;

    // Maintenance (retention, backup): see [`retention`].

    /// Sessions `filter` lets go, in id order after `after`, at most `limit`.
    async fn prunable_sessions(
        &self,
        filter: &PruneFilter,
        after: Option<&str>,
        limit: i64,
    ) -> Result<Vec<String>, StoreError>;
    /// What the sessions own, counted (a dry run's report).
    async fn count_owned(&self, sessions: &[String]) -> Result<PruneCounts, StoreError>;
    /// How many requests each of the sessions holds, in the order given (an archive reads
    /// sessions in groups of a bounded number of requests).
    async fn requests_per_session(&self, sessions: &[String]) -> Result<Vec<u64>, StoreError>;
    /// Every row an archive keeps of the sessions (a prune's export), each table read in one
    /// statement for all of them, from one snapshot.
    async fn archive_rows(&self, sessions: &[String]) -> Result<ArchiveRows, StoreError>;
    /// Deletes those of the sessions `filter` still lets go — judged again in the deleting
    /// transaction, so a session continued meanwhile stays — with every request, run, event,
    /// tool call, approval, artifact and message they own, in one transaction.
    async fn delete_sessions(
        &self,
        filter: &PruneFilter,
        sessions: &[String],
    ) -> Result<PruneCounts, StoreError>;
    /// Gives up to `max_pages` free pages back to the filesystem; returns the bytes given back.
    async fn reclaim_space(&self, max_pages: i64) -> Result<u64, StoreError>;
    /// Writes a consistent snapshot of the whole store to the new file `path` while serving;
    /// returns its size.
    async fn backup_to(&self, path: &Path) -> Result<u64, StoreError>;
    async fn stats(&self) -> Result<StoreStats, StoreError>;
    async fn record_maintenance(&self, record: &MaintenanceRecord) -> Result<(), StoreError>;

    /// The newest maintenance passes first.
    async fn maintenance(&self, limit: i64) -> Result<Vec<MaintenanceRecord>, StoreError>;
    /// Where the data lives, for the startup line (never includes credentials).
    fn describe(&self) -> String;
}

/// How a store is opened, from the workspace's `store` settings.
#[derive(Debug, Clone, Copy)]
pub struct OpenOptions {
    /// `store.maxSize`: past it, writes wait as on a full disk.
    pub max_bytes: Option<u64>,
    /// `store.leaseDuration`: how long a run stays leased without a renewal.
    pub lease: std::time::Duration,
}

impl Default for OpenOptions {
    fn default() -> Self {
        Self {
            max_bytes: None,
            lease: std::time::Duration::from_secs(30),
        }
    }
}

/// A new batch id (time-ordered).
pub fn new_batch_id() -> String {
    crate::ids::time_ordered().simple().to_string()
}

/// A new lease holder identity: one per opened store, so per process.
fn new_holder() -> String {
    crate::ids::prefixed("ins")
}

/// Opens (creating and migrating) the store `url` names, or the embedded SQLite file of the
/// workspace at `workspace_root` when there is no url.
pub async fn open(
    url: Option<&str>,
    workspace_root: &Path,
    options: &OpenOptions,
) -> Result<Arc<dyn Store>, StoreError> {
    if let Some(url) = url
        && is_postgres(url)
    {
        if options.max_bytes.is_some() {
            return Err(StoreError::Unsupported(
                "`store.maxSize` caps the embedded store; size a PostgreSQL database with its own quotas".into(),
            ));
        }
        return Ok(Arc::new(PostgresStore::connect(url, options.lease).await?));
    }
    let path = sqlite_path(url, workspace_root)?;
    Ok(Arc::new(SqliteStore::open_file_with(&path, options).await?))
}

/// Whether `url` names a PostgreSQL database.
pub fn is_postgres(url: &str) -> bool {
    url.starts_with("postgres://") || url.starts_with("postgresql://")
}

/// The SQLite file `url` names (relative paths are under the workspace), or the workspace's
/// embedded store when there is no url.
pub fn sqlite_path(url: Option<&str>, workspace_root: &Path) -> Result<PathBuf, StoreError> {
    match url {
        None => Ok(workspace_root.join(".stable-harness").join("state.db")),
        Some(url) if url.starts_with("sqlite:") => {
            let path = url
                .trim_start_matches("sqlite://")
                .trim_start_matches("sqlite:");
            let path = Path::new(path);
            Ok(if path.is_absolute() {
                path.to_path_buf()
            } else {
                workspace_root.join(path)
            })
        }
        Some(other) => Err(StoreError::UnsupportedUrl(redact_url(other))),
    }
}

/// What the sessions a prune takes own, table by table, children first (so every foreign key
/// holds at each statement's end): each table's name and the `FROM`-clause of its rows, for a
/// count or a delete. `in_sessions` is how the store's SQL names the set of session ids
/// (`IN (...)` or `= ANY($1)`).
pub(crate) fn owned_by_sessions(in_sessions: &str) -> [(&'static str, String); 8] {
    let of_requests = format!("(SELECT id FROM requests WHERE session_id {in_sessions})");
    [
        (
            "events",
            format!("events WHERE request_id IN {of_requests}"),
        ),
        (
            "tool_calls",
            format!(
                "tool_calls WHERE run_id IN (SELECT u.id FROM runs u JOIN requests r ON r.id = u.request_id WHERE r.session_id {in_sessions})"
            ),
        ),
        (
            "approvals",
            format!("approvals WHERE request_id IN {of_requests}"),
        ),
        (
            "artifacts",
            format!("artifacts WHERE request_id IN {of_requests}"),
        ),
        ("runs", format!("runs WHERE request_id IN {of_requests}")),
        (
            "messages",
            format!("messages WHERE session_id {in_sessions}"),
        ),
        (
            "requests",
            format!("requests WHERE session_id {in_sessions}"),
        ),
        ("sessions", format!("sessions WHERE id {in_sessions}")),
    ]
}

/// The statements that read an archive's rows ([`Store::archive_rows`]), in the order of
/// [`ArchiveRows`]' fields: sessions, messages, requests, runs, events, tool calls and
/// approvals, each every column of what [`owned_by_sessions`] names, in the order its
/// archive line keeps. `event_rows` is the store's select of rows of events with their
/// request's session and agent (joined as `r`), up to its `WHERE`.
pub(crate) fn archive_selects(in_sessions: &str, event_rows: &str) -> [String; 7] {
    let [
        _,
        tool_calls,
        approvals,
        _,
        runs,
        messages,
        requests,
        sessions,
    ] = owned_by_sessions(in_sessions);
    let select =
        |(_, rows): (&str, String), order: &str| format!("SELECT * FROM {rows} ORDER BY {order}");
    [
        select(sessions, "id"),
        select(messages, "created_at, id"),
        select(requests, "id DESC"),
        select(runs, "request_id, attempt"),
        format!("{event_rows} r.session_id {in_sessions} ORDER BY e.request_id, e.seq"),
        select(tool_calls, "run_id, call_key"),
        select(approvals, "run_id, id"),
    ]
}

/// How a store reads each kind of an archive's records from its rows ([`archive_from_rows`]).
pub(crate) struct ArchiveReaders<R> {
    pub session: fn(&R) -> Result<SessionRecord, StoreError>,
    pub message: fn(&R) -> Result<MessageRecord, StoreError>,
    pub request: fn(&R) -> Result<RequestRecord, StoreError>,
    pub run: fn(&R) -> Result<RunRecord, StoreError>,
    /// A row of events holds several ([`event_rows::EventRows`]).
    pub events: fn(&R) -> Result<Vec<EventRecord>, StoreError>,
    pub tool_call: fn(&R) -> Result<ToolCallRecord, StoreError>,
    pub approval: fn(&R) -> Result<ApprovalRecord, StoreError>,
}

/// An archive's records from the rows [`archive_selects`]' statements read, in their order.
pub(crate) fn archive_from_rows<R>(
    rows: &[Vec<R>; 7],
    read: &ArchiveReaders<R>,
) -> Result<ArchiveRows, StoreError> {
    fn all<R, T>(rows: &[R], read: fn(&R) -> Result<T, StoreError>) -> Result<Vec<T>, StoreError> {
        rows.iter().map(read).collect()
    }
    let [
        sessions,
        messages,
        requests,
        runs,
        events,
        tool_calls,
        approvals,
    ] = rows;
    Ok(ArchiveRows {
        sessions: all(sessions, read.session)?,
        messages: all(messages, read.message)?,
        requests: all(requests, read.request)?,
        runs: all(runs, read.run)?,
        events: event_rows::EventRows::EVERY.keep(events, read.events)?,
        tool_calls: all(tool_calls, read.tool_call)?,
        approvals: all(approvals, read.approval)?,
    })
}

/// How many requests each session of a set holds (`Store::requests_per_session`), sessions
/// without requests left out.
pub(crate) fn requests_per_session_sql(in_sessions: &str) -> String {
    format!(
        "SELECT session_id, COUNT(*) FROM requests WHERE session_id {in_sessions} GROUP BY session_id"
    )
}

/// The requests per session (`counted`: a session's id and its count, sessions without
/// requests left out) in the order of `sessions`.
pub(crate) fn counts_in_order(sessions: &[String], counted: Vec<(String, i64)>) -> Vec<u64> {
    let counted: std::collections::HashMap<String, i64> = counted.into_iter().collect();
    sessions
        .iter()
        .map(|id| {
            counted
                .get(id)
                .map_or(0, |&n| u64::try_from(n).unwrap_or(0))
        })
        .collect()
}

/// A message path read by [`Store::message_path_below`].
#[derive(Debug, Clone, PartialEq)]
pub struct PathBelow {
    /// Root first; below the known message when `below_known`.
    pub messages: Vec<MessageRecord>,
    /// The path passed through the known message: `messages` are what comes after it.
    pub below_known: bool,
}

/// A message path ([`Store::message_path`]) walked up from its leaf one session at a time:
/// a session's messages are read newest first in pages (by the session's index: several
/// times faster than a recursive read stepping through parents), and the path taken through
/// them by parent id; where it leaves the session (a fork's origin) the next session is
/// read. A session's other branches are read and passed over, only as far back as the path
/// reaches: the first page is small (64) and each next one twice as large, up to 1,024, so
/// that a short history in a session of many branches (a `/v1` session's turns) costs a few
/// dozen rows and a long one a few reads.
pub(crate) struct PathWalk {
    /// Leaf first.
    path: Vec<MessageRecord>,
    /// The message to take next; `None` once the path is whole.
    next: Option<String>,
    /// The session being read: its messages read and not taken, and the oldest of them, where
    /// its next page starts (`None` once all of it was read).
    loaded: crate::ids::IdMap<String, MessageRecord>,
    older_than: Option<PageEnd>,
    /// Sessions met: parent links that loop back into one end the walk (within a session,
    /// a message taken leaves `loaded`, and pages never read a message twice).
    sessions_read: std::collections::HashSet<String>,
    /// The next read's size, and the most a read takes.
    page: i64,
    most: i64,
    /// Where the walk stops short of the root (the path above it is known to whoever asks),
    /// and whether it did.
    known: Option<String>,
    reached_known: bool,
}

/// Where a session's next page starts: its session, the time and the id of the oldest
/// message read.
struct PageEnd {
    session: String,
    created_at: DateTime<Utc>,
    id: String,
}

/// What a [`PathWalk`] reads next: newest first, at most [`PathWalk::page`] messages.
pub(crate) enum PathRead<'a> {
    /// The newest messages of the session `message` belongs to.
    SessionOf { message: &'a str },
    /// The messages of `session` older than `created_at` and `id` (in the order of the
    /// session's index, `(created_at, id)`).
    Older {
        session: &'a str,
        created_at: &'a DateTime<Utc>,
        id: &'a str,
    },
}

impl PathWalk {
    /// The walk up from `leaf`, to the root or to `known` if the path passes through it.
    pub(crate) fn from_leaf(leaf: &str, known: Option<&str>) -> Self {
        Self::in_pages_of(leaf, known, 64, 1024)
    }

    fn in_pages_of(leaf: &str, known: Option<&str>, page: i64, most: i64) -> Self {
        let reached_known = known == Some(leaf);
        Self {
            path: Vec::new(),
            next: (!reached_known).then(|| leaf.to_owned()),
            loaded: crate::ids::IdMap::default(),
            older_than: None,
            sessions_read: std::collections::HashSet::new(),
            page,
            most,
            known: known.map(str::to_owned),
            reached_known,
        }
    }

    /// The most messages a read returns (its `LIMIT`).
    pub(crate) fn page(&self) -> i64 {
        self.page
    }

    /// The read the walk needs next; `None` once the path is whole.
    pub(crate) fn next_read(&self) -> Option<PathRead<'_>> {
        let next = self.next.as_deref()?;
        Some(match &self.older_than {
            Some(end) => PathRead::Older {
                session: &end.session,
                created_at: &end.created_at,
                id: &end.id,
            },
            None => PathRead::SessionOf { message: next },
        })
    }

    /// Walks on through `page`, the messages [`Self::next_read`] asked for.
    pub(crate) fn walk(&mut self, page: Vec<MessageRecord>) {
        if self.older_than.is_none() {
            // A new session: none (the message does not exist), or one read before, which
            // only parent links that loop could lead back to, ends the walk.
            match page.first() {
                Some(first) if self.sessions_read.insert(first.session_id.clone()) => {
                    self.loaded.clear();
                }
                _ => {
                    self.next = None;
                    return;
                }
            }
        }
        let full = i64::try_from(page.len()).is_ok_and(|read| read >= self.page);
        if full {
            self.page = self.page.saturating_mul(2).min(self.most);
        }
        self.older_than = page.last().filter(|_| full).map(|oldest| PageEnd {
            session: oldest.session_id.clone(),
            created_at: oldest.created_at,
            id: oldest.id.clone(),
        });
        self.loaded.extend(
            page.into_iter()
                .map(|message| (message.id.clone(), message)),
        );
        while let Some(id) = self.next.take() {
            let Some(message) = self.loaded.remove(&id) else {
                self.next = Some(id);
                break;
            };
            self.next = message.parent_id.clone();
            self.path.push(message);
            if self.next.is_some() && self.next == self.known {
                self.next = None;
                self.reached_known = true;
            }
        }
        // Once the session is read whole (`older_than` is `None`), a parent not in it is in
        // another: the next read is that parent's session.
    }

    /// The path, root first (below the known message if the walk reached it).
    pub(crate) fn into_path(mut self) -> PathBelow {
        self.path.reverse();
        PathBelow {
            messages: self.path,
            below_known: self.reached_known,
        }
    }
}

/// Readies the path of a new backup: an error when it exists (a backup never overwrites);
/// its folder is created when missing.
pub(crate) fn prepare_new_file(path: &Path) -> Result<(), StoreError> {
    if path.exists() {
        return Err(StoreError::Archive {
            path: path.display().to_string(),
            source: std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                "the file exists; a backup never overwrites",
            ),
        });
    }
    match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => {
            std::fs::create_dir_all(parent).map_err(|source| StoreError::Archive {
                path: parent.display().to_string(),
                source,
            })
        }
        _ => Ok(()),
    }
}

/// A URL without its password (in the authority or a `password=` query pair), for messages
/// and logs.
pub fn redact_url(url: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, Some(query)),
        None => (url, None),
    };
    let base = match (base.find("://"), base.rfind('@')) {
        (Some(scheme_end), Some(at)) if at > scheme_end => {
            let credentials = &base[scheme_end + 3..at];
            match credentials.split_once(':') {
                Some((user, _)) => format!("{}{user}:***{}", &base[..scheme_end + 3], &base[at..]),
                None => base.to_owned(),
            }
        }
        _ => base.to_owned(),
    };
    match query {
        None => base,
        Some(query) => {
            let pairs: Vec<String> = query
                .split('&')
                .map(|pair| match pair.split_once('=') {
                    Some((key, _)) if key.eq_ignore_ascii_case("password") => format!("{key}=***"),
                    _ => pair.to_owned(),
                })
                .collect();
            format!("{base}?{}", pairs.join("&"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{MessageRecord, PathBelow, PathRead, PathWalk, lane_of, redact_url};

    #[test]
    fn a_url_loses_its_password_wherever_it_is() {
        assert_eq!(
            redact_url("postgres://app:s3cret@db:5432/harness"),
            "postgres://app:***@db:5432/harness"
        );
        assert_eq!(
            redact_url("postgres://app@db/harness?sslmode=require&password=s3cret"),
            "postgres://app@db/harness?sslmode=require&password=***"
        );
        assert_eq!(redact_url("sqlite://state.db"), "sqlite://state.db");
    }

    #[test]
    fn a_request_keeps_its_lane_and_requests_spread_over_the_lanes() {
        for lanes in [0, 1] {
            assert_eq!(lane_of("req_anything", lanes), 0);
        }
        let ids: Vec<String> = (0..400).map(|_| crate::runtime::new_id("req")).collect();
        for lanes in [2, 3] {
            let mut counts = vec![0; lanes];
            for id in &ids {
                let lane = lane_of(id, lanes);
                assert_eq!(lane, lane_of(&id.clone(), lanes), "the same on every call");
                counts[lane] += 1;
            }
            // 400 random ids: each lane gets far more than a few.
            assert!(
                counts.iter().all(|count| *count > 400 / lanes / 2),
                "{counts:?}"
            );
        }
    }

    fn message(id: &str, session: &str, parent: Option<&str>) -> MessageRecord {
        MessageRecord {
            id: id.into(),
            session_id: session.into(),
            parent_id: parent.map(str::to_owned),
            request_id: None,
            role: "user".into(),
            content: serde_json::json!({ "role": "user", "content": id }),
            created_at: chrono::Utc::now(),
        }
    }

    /// A session `a` with a branch, and `b` forked from it at `a2`.
    fn forked_table() -> Vec<MessageRecord> {
        vec![
            message("a1", "a", None),
            message("a2", "a", Some("a1")),
            message("a3", "a", Some("a2")),
            message("a2-sibling", "a", Some("a1")),
            message("b1", "b", Some("a2")),
            message("b2", "b", Some("b1")),
        ]
    }

    /// The ids of the path a walk makes in pages of `page`, reading from `table` as the
    /// stores' statements do, and how many reads it made.
    fn walked(leaf: &str, table: &[MessageRecord], page: i64) -> (Vec<String>, usize) {
        let (path, reads) = walked_below(leaf, None, table, page);
        (path.messages.into_iter().map(|m| m.id).collect(), reads)
    }

    /// The path a walk to `known` makes (as [`walked`]).
    fn walked_below(
        leaf: &str,
        known: Option<&str>,
        table: &[MessageRecord],
        page: i64,
    ) -> (PathBelow, usize) {
        let mut walk = PathWalk::in_pages_of(leaf, known, page, page);
        let mut reads = 0;
        while let Some(read) = walk.next_read() {
            reads += 1;
            assert!(reads < 100, "the walk ends");
            let mut rows: Vec<MessageRecord> = match read {
                PathRead::SessionOf { message } => {
                    let session = table
                        .iter()
                        .find(|m| m.id == message)
                        .map(|m| &m.session_id);
                    table
                        .iter()
                        .filter(|m| Some(&m.session_id) == session)
                        .cloned()
                        .collect()
                }
                PathRead::Older {
                    session,
                    created_at,
                    id,
                } => table
                    .iter()
                    .filter(|m| {
                        m.session_id == session && (m.created_at, m.id.as_str()) < (*created_at, id)
                    })
                    .cloned()
                    .collect(),
            };
            rows.sort_by(|a, b| (b.created_at, &b.id).cmp(&(a.created_at, &a.id)));
            rows.truncate(usize::try_from(walk.page()).unwrap());
            walk.walk(rows);
        }
        (walk.into_path(), reads)
    }

    #[test]
    fn a_path_is_walked_root_first_across_a_fork_and_pages_and_ends_at_a_loop() {
        let mut table = forked_table();
        let ids = |ids: &[&str]| ids.iter().map(|id| (*id).to_owned()).collect::<Vec<_>>();
        for page in [1, 2, 3, 1000] {
            assert_eq!(walked("a3", &table, page).0, ids(&["a1", "a2", "a3"]));
            assert_eq!(walked("b2", &table, page).0, ids(&["a1", "a2", "b1", "b2"]));
            assert_eq!(walked("none", &table, page), (Vec::new(), 1));
        }
        // One read a session while pages hold it whole; the pages it takes otherwise.
        assert_eq!(walked("b2", &table, 1000).1, 2);
        assert_eq!(walked("b2", &table, 2).1, 4);
        // A long conversation, with a sibling of every tenth message, and a child stamped
        // before its parent (another instance's clock lagging): read in pages of 7.
        let start = chrono::Utc::now();
        let mut long = Vec::new();
        for n in 0..100_i64 {
            let mut m = message(
                &format!("c{n:03}"),
                "c",
                (n > 0).then(|| format!("c{:03}", n - 1)).as_deref(),
            );
            m.created_at = start + chrono::Duration::milliseconds(if n == 50 { 48 } else { n });
            long.push(m);
            if n % 10 == 0 {
                long.push(message(
                    &format!("c{n:03}-sibling"),
                    "c",
                    Some(&format!("c{n:03}")),
                ));
            }
        }
        table.extend(long);
        let (path, reads) = walked("c099", &table, 7);
        assert_eq!(
            path,
            (0..100).map(|n| format!("c{n:03}")).collect::<Vec<_>>()
        );
        assert!(reads >= 110 / 7, "{reads} reads");
        // The pages a walk reads grow: a short history of a session of many branches costs
        // one small read, a long one a few.
        let mut walk = PathWalk::from_leaf("c099", None);
        let mut sizes = Vec::new();
        while walk.next_read().is_some() {
            sizes.push(walk.page());
            walk.walk(vec![
                message("filler", "f", None);
                usize::try_from(walk.page()).unwrap()
            ]);
            if sizes.len() > 6 {
                break;
            }
        }
        assert_eq!(sizes, [64, 128, 256, 512, 1024, 1024, 1024]);
        // Parent links that loop (no store lets them be written) end the walk.
        let looped = vec![
            message("x1", "x", Some("x2")),
            message("x2", "x", Some("x1")),
        ];
        assert_eq!(walked("x2", &looped, 1).0, ids(&["x1", "x2"]));
        let across = vec![
            message("p1", "p", Some("q1")),
            message("q1", "q", Some("p1")),
        ];
        assert_eq!(walked("p1", &across, 1000).0, ids(&["q1", "p1"]));
    }

    #[test]
    fn a_walk_to_a_known_message_stops_below_it_and_else_goes_to_the_root() {
        let table = forked_table();
        let below = |leaf: &str, known: &str, page: i64| {
            let (path, reads) = walked_below(leaf, Some(known), &table, page);
            let ids: Vec<String> = path.messages.into_iter().map(|m| m.id).collect();
            (ids, path.below_known, reads)
        };
        for page in [1, 2, 1000] {
            assert_eq!(below("a3", "a1", page).0, ["a2", "a3"]);
            assert!(below("a3", "a1", page).1);
            // Across a fork, and the leaf itself known: nothing below it, nothing read.
            assert_eq!(below("b2", "a2", page).0, ["b1", "b2"]);
            assert_eq!(below("a3", "a3", page), (Vec::new(), true, 0));
            // A known message off the path: the whole path, as if none were known.
            assert_eq!(below("a3", "a2-sibling", page).0, ["a1", "a2", "a3"]);
            assert!(!below("a3", "a2-sibling", page).1);
        }
        // Reached in the first page, the walk reads no further.
        assert_eq!(below("b2", "b1", 1000).2, 1);
        assert_eq!(walked("b2", &table, 1000).1, 2);
    }
}
