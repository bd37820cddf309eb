//! The embedded store's writer: one thread owning one SQLite connection, applying each batch of
//! writes as one transaction with cached prepared statements.
//!
//! Why not sqlx here: sqlx's SQLite driver runs every statement on the connection's worker
//! thread, so a batch of N statements costs N + 2 cross-thread round trips. Measured with
//! `benches/load.rs`, those hops were most of the latency stable-harness added to a request.
//! Here a batch costs one round trip, whatever its size. Reads and migrations stay on sqlx.
//!
//! The writer also keeps the write-ahead log bounded. SQLite reuses the WAL from its start
//! only when a checkpoint has copied every frame and then a write begins with no reader on
//! the old frames; a checkpoint on another connection never wins that race while writes keep
//! coming (the WAL grew by gigabytes under sustained load). So the bulk copying runs on the
//! store's checkpointer connection, off the request path (again while a pass met a commit or
//! two, so that mostly none are left); when that finds the WAL past [`CATCH_UP_BYTES`], it
//! asks the writer ([`SqliteWriter::catch_up`]) to copy the frames written since, if any,
//! between two transactions: no other write can slip in before the writer's
//! next one, which then starts the WAL over from its beginning. The writer makes that write
//! itself, at once, one page ([`restart_wal`]): the restart syncs the WAL's new header to the
//! disk, a cost of the catch-up rather than of the next request's commit.
//! `journal_size_limit` gives the file's space back after a restart. Should readers starve
//! the restart (a long backup read), the catch-up finds the WAL past [`STARVED_BYTES`] and
//! waits for them with a TRUNCATE checkpoint, for at most [`STARVED_WAIT`].

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use rusqlite::{Connection, PrepFlags, Statement, params};
use serde_json::Value;
use tokio::sync::{mpsc, oneshot};

use super::event_rows::{LaterEvent, may_join};
use super::folds::{Folds, RequestRow, RunRow};
use super::spend::{CounterDelta, UsageRecord};
use super::sqlite::LAST_SEQ;
use super::stored_time;
use super::{ApprovalDecision, StoreError, WriteOp};
use crate::ids::IdMap;
use crate::json::to_text;
use crate::threads::locked;
use crate::time::TimeText;

/// WAL size past which the writer is asked to catch up and restart the WAL (SQLite's own
/// default auto-checkpoint size: 1,000 pages of 4 KiB).
const CATCH_UP_BYTES: i64 = 4 * 1024 * 1024;
/// The WAL file is cut back to this size after each restart. Under the load benchmark (one
/// request at a time or 32) the file reached ~89 MB between two of the checkpointer's
/// passes; cut back to 64 MiB rather than 16, a restart gives back (and the next writes
/// allocate again) a fraction of what it did (docs/profiling.md, the fifth pass).
const WAL_SIZE_LIMIT: u64 = 64 * 1024 * 1024;
/// A WAL this long means restarts are being starved by readers.
const STARVED_BYTES: i64 = 128 * 1024 * 1024;
/// How long the writer waits on a busy database before reporting it unavailable.
const BUSY_TIMEOUT: Duration = Duration::from_millis(2_000);
/// How long the writer waits for readers to leave old WAL frames.
const STARVED_WAIT: Duration = Duration::from_millis(50);
/// Least time between two waits for readers.
const STARVED_RETRY: Duration = Duration::from_secs(5);

/// A batch and its numbers (or why it failed), handed back with the batch.
pub type Applied = (Vec<WriteOp>, Result<Vec<i64>, StoreError>);

enum Job {
    /// A batch goes to the writer and comes back with its outcome: never copied.
    Apply(Vec<WriteOp>, oneshot::Sender<Applied>),
    /// Take the charges waiting in [`Shared::charges`] now: too many wait, or the oldest
    /// has waited [`CHARGE_IDLE`] with no job to carry them (see [`PendingCharges`]).
    TakeCharges,
    /// Copy the WAL's last frames, then start the WAL over (see [`restart_wal`]).
    CatchUp,
    /// Maintenance on the writer's connection (pruning, reclaiming space), between writes.
    Maintain(Box<dyn FnOnce(&Connection) + Send>),
    /// A read on the writer's connection, between writes, after the pending charges of the
    /// requests it reads (see [`SqliteWriter::read`]), with the writer's kept statements.
    Read(Vec<String>, Box<dyn FnOnce(&mut Prepared<'_>) + Send>),
}

/// A settled call: its ledger record and its budget counters' increments.
pub type Charge = (UsageRecord, Vec<CounterDelta>);

/// Charges waiting for the writer's next transaction. A charge rides along with the next
/// batch (it costs no transaction, and no round trip, of its own). It is handed over without
/// a job of its own, so without waking the writer thread ([`SqliteWriter::charge`]): left in
/// [`Shared::charges`], it is taken by the writer before the next job it runs, and the job
/// that carries the run's next write (its usage event, which the journal commits within its
/// hold, and its end at the latest) is queued after the charge. Kept until a transaction
/// holding them commits; written alone once the oldest has waited [`CHARGE_IDLE`] with no
/// transaction to ride along with (the store's checkpointer, which ticks anyway, asks the
/// writer to take charges left that long in [`Shared::charges`]), when
/// [`MAX_PENDING_CHARGES`] wait, before maintenance, or before a read of their request.
#[derive(Debug, Default)]
struct PendingCharges {
    charges: Vec<Charge>,
    /// When the oldest pending charge was queued.
    since: Option<tokio::time::Instant>,
}

/// How long charges wait for a batch to ride along with.
const CHARGE_IDLE: Duration = Duration::from_millis(20);
/// Most charges held back at once.
const MAX_PENDING_CHARGES: usize = 512;
/// Most charges kept, handed over or pending, while the writer cannot write them (a disk
/// refusing every flush for a long while): past it a charge is dropped, counted in memory
/// only, rather than memory growing without end.
const MAX_KEPT_CHARGES: usize = MAX_PENDING_CHARGES * 16;

impl PendingCharges {
    fn push(&mut self, charge: Charge) {
        self.since.get_or_insert_with(tokio::time::Instant::now);
        self.charges.push(charge);
    }

    /// Takes the charges handed over in `handed`, behind those pending already.
    fn take_handed(&mut self, handed: &std::sync::Mutex<PendingCharges>) {
        let mut handed = locked(handed);
        let Some(since) = handed.since.take() else {
            return;
        };
        let room = MAX_KEPT_CHARGES.saturating_sub(self.charges.len());
        if handed.charges.len() > room {
            tracing::error!(
                dropped = handed.charges.len() - room,
                "the store keeps refusing charges; some were dropped"
            );
            handed.charges.truncate(room);
        }
        self.since = Some(self.since.map_or(since, |pending| pending.min(since)));
        self.charges.append(&mut handed.charges);
    }

    fn len(&self) -> usize {
        self.charges.len()
    }

    /// The transaction that wrote them committed.
    fn committed(&mut self) {
        self.charges.clear();
        self.since = None;
    }

    /// When they are written alone, if no transaction carries them first.
    fn deadline(&self) -> Option<tokio::time::Instant> {
        self.since.map(|since| since + CHARGE_IDLE)
    }

    /// Whether the oldest has waited [`CHARGE_IDLE`] for a transaction to ride along with.
    fn idle(&self) -> bool {
        self.deadline()
            .is_some_and(|due| due <= tokio::time::Instant::now())
    }

    /// Whether a charge of `request_id` is pending.
    fn of_request(&self, request_id: &str) -> bool {
        self.charges
            .iter()
            .any(|(record, _)| record.request_id == request_id)
    }

    /// Writes every pending charge inside the open transaction (cleared only once it commits).
    fn write(&self, prepared: &mut Prepared<'_>) -> rusqlite::Result<()> {
        for (record, deltas) in &self.charges {
            super::sqlite_spend::insert_charge(prepared, record, deltas)?;
        }
        Ok(())
    }

    /// Commits the pending charges in a transaction of their own.
    fn flush(&mut self, prepared: &mut Prepared<'_>) {
        if self.charges.is_empty() {
            return;
        }
        let result = prepared.transaction(|prepared| self.write(prepared));
        match result {
            Ok(()) => self.committed(),
            // Kept for the next transaction: a full or busy disk passes. Tried alone again
            // only after another `CHARGE_IDLE`, not at once and again.
            Err(error) => {
                self.since = Some(tokio::time::Instant::now());
                tracing::warn!(%error, pending = self.len(), "charges could not be written yet")
            }
        }
    }
}

/// Handle to the writer thread; the thread ends when the handle is dropped.
#[derive(Debug)]
pub struct SqliteWriter {
    jobs: mpsc::UnboundedSender<Job>,
    /// The writer thread's own runtime: a task spawned here hands batches to the writer
    /// without waking another thread (see [`SqliteWriter::runtime`]).
    runtime: tokio::runtime::Handle,
    /// What the writer thread and this handle share.
    shared: Arc<Shared>,
    /// The database's page size: a WAL frame holds one page.
    page_size: i64,
}

/// The state the writer thread publishes to its handle.
#[derive(Debug, Default)]
struct Shared {
    /// A catch-up is queued: at most one waits at a time (the job queue stays bounded).
    catch_up_queued: AtomicBool,
    /// Charges handed over and not yet taken by the writer (see [`PendingCharges`]).
    charges: std::sync::Mutex<PendingCharges>,
    /// A [`Job::TakeCharges`] is queued: at most one waits at a time.
    take_charges_queued: AtomicBool,
    /// Jobs the writer ran that changed rows, each one transaction (a batch, or pending
    /// charges written alone): the checkpointer reads it around a pass to learn whether
    /// commits came during it, which SQLite's own count of frames does not say.
    commits: AtomicU64,
}

impl SqliteWriter {
    /// Opens the (already migrated) database and starts the writer thread.
    pub fn open(path: &Path, max_bytes: Option<u64>, leases: Leases) -> Result<Self, StoreError> {
        // Through the WAL shim, a commit's frames are one write; its syncs are NORMAL's
        // under the name FULL (see `sqlite_wal_vfs`). Without it, SQLite's own NORMAL.
        let (connection, synchronous) = match super::sqlite_wal_vfs::register() {
            Some(vfs) => (
                Connection::open_with_flags_and_vfs(path, rusqlite::OpenFlags::default(), vfs),
                "FULL",
            ),
            None => (Connection::open(path), "NORMAL"),
        };
        let connection = connection.map_err(writer_error)?;
        // This process owns the store (a lock file), so only an outside tool holding the
        // database can make the writer wait: after 2s that is reported as the store being
        // unavailable (and retried by the journal) rather than a request hanging.
        connection
            .execute_batch(&format!(
                "PRAGMA journal_mode = WAL; PRAGMA synchronous = {synchronous}; PRAGMA foreign_keys = ON;
                 PRAGMA wal_autocheckpoint = 0;
                 PRAGMA journal_size_limit = {WAL_SIZE_LIMIT};"
            ))
            .map_err(writer_error)?;
        connection
            .busy_timeout(BUSY_TIMEOUT)
            .map_err(writer_error)?;
        let page_size: i64 = connection
            .query_row("PRAGMA page_size", [], |row| row.get(0))
            .map_err(writer_error)?;
        let page_size = page_size.max(1);
        if let Some(max_bytes) = max_bytes {
            // Past the cap SQLite answers SQLITE_FULL, which the journal handles as a full
            // disk: writes wait, new requests get 503, service resumes once there is room.
            let pages = (max_bytes / page_size.max(1) as u64).max(1);
            connection
                .execute_batch(&format!("PRAGMA max_page_count = {pages};"))
                .map_err(writer_error)?;
        }
        connection.set_prepared_statement_cache_capacity(32);
        // Unbounded, but never long: the journal's queue bounds batches, charges are bounded
        // below, and at most one catch-up waits.
        let (jobs, queue) = mpsc::unbounded_channel::<Job>();
        let shared = Arc::new(Shared::default());
        let state = Arc::clone(&shared);
        let (_thread, runtime) = crate::threads::spawn_with_runtime(
            "sqlite-writer",
            || {
                tokio::runtime::Builder::new_current_thread()
                    .enable_time()
                    .build()
            },
            move |runtime| {
                runtime.block_on(write_loop(connection, queue, &state, &leases, page_size));
            },
        )
        .map_err(|e| StoreError::Writer(format!("cannot start the writer thread: {e}")))?;
        Ok(Self {
            jobs,
            runtime,
            shared,
            page_size,
        })
    }

    /// The writer thread's runtime. Its only other task is the one applying jobs, which runs
    /// each job to its end before yielding: a task spawned here (the runtime's journal) hands
    /// a batch over and gets it back within one thread, instead of two wake-ups of another.
    pub fn runtime(&self) -> &tokio::runtime::Handle {
        &self.runtime
    }

    /// Applies `ops` in one transaction on the writer thread; returns the events' numbers.
    pub async fn apply(&self, ops: Vec<WriteOp>) -> Applied {
        let (done, result) = oneshot::channel();
        if let Err(mpsc::error::SendError(job)) = self.jobs.send(Job::Apply(ops, done)) {
            let ops = match job {
                Job::Apply(ops, _) => ops,
                _ => Vec::new(),
            };
            return (ops, Err(stopped()));
        }
        result
            .await
            .unwrap_or_else(|_| (Vec::new(), Err(stopped())))
    }

    /// Hands a settled call's charge to the writer; it commits with the writer's next
    /// transaction. No job of its own: a job would wake the writer thread for nothing but
    /// this, one wake-up in three of a request at a steady rate (docs/profiling.md, the
    /// sixty-fifth pass). Only when [`MAX_PENDING_CHARGES`] wait is the writer asked at once.
    pub fn charge(&self, charge: Charge) -> Result<(), StoreError> {
        if self.jobs.is_closed() {
            return Err(stopped());
        }
        let waiting = {
            let mut handed = locked(&self.shared.charges);
            if handed.len() >= MAX_KEPT_CHARGES {
                tracing::error!("the store's writer takes no charges; one was dropped");
                return Ok(());
            }
            handed.push(charge);
            handed.len()
        };
        if waiting >= MAX_PENDING_CHARGES {
            self.take_charges();
        }
        Ok(())
    }

    /// Asks the writer to take the charges handed over once the oldest has waited
    /// [`CHARGE_IDLE`]: no job carried them meanwhile (the store's checkpointer calls it on
    /// its every tick).
    pub fn take_idle_charges(&self) {
        if locked(&self.shared.charges).idle() {
            self.take_charges();
        }
    }

    fn take_charges(&self) {
        if !self.shared.take_charges_queued.swap(true, Ordering::AcqRel) {
            let _ = self.send(Job::TakeCharges);
        }
    }

    /// Runs `work` on the writer's connection between two transactions and returns its result.
    /// The connection is shared with the writer's kept statements, so `work` opens its
    /// transactions with `unchecked_transaction`: the writer runs one job at a time, and every
    /// job ends its transactions, so none is open when `work` begins.
    pub async fn maintain<T: Send + 'static>(
        &self,
        work: impl FnOnce(&Connection) -> Result<T, rusqlite::Error> + Send + 'static,
    ) -> Result<T, StoreError> {
        let (done, result) = oneshot::channel();
        self.send(Job::Maintain(Box::new(move |connection| {
            let _ = done.send(work(connection).map_err(writer_error));
        })))?;
        result.await.map_err(|_| stopped())?
    }

    /// Runs the read `work` of requests `request_ids` on the writer's connection, between two
    /// transactions, once those requests' pending charges are stored. For a read of a few
    /// rows that follows a write (a request's view once it ended): this connection's cache
    /// holds the pages it just wrote, and the read costs one hop to this thread, where every
    /// statement through sqlx's driver costs two. It holds up writes while it runs: lists
    /// and scans stay on the reader pool.
    pub async fn read<T: Send + 'static>(
        &self,
        request_ids: &[&str],
        work: impl FnOnce(&mut Prepared<'_>) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let (done, result) = oneshot::channel();
        self.send(Job::Read(
            request_ids.iter().map(|id| (*id).to_owned()).collect(),
            Box::new(move |prepared| {
                let _ = done.send(work(prepared));
            }),
        ))?;
        result.await.map_err(|_| stopped())?
    }

    /// Whether a WAL of `frames` frames is long enough to ask for a catch-up.
    pub fn wants_catch_up(&self, frames: i64) -> bool {
        frames.saturating_mul(self.page_size) >= CATCH_UP_BYTES
    }

    /// Asks the writer to copy the WAL's remaining frames between two transactions (the
    /// checkpointer has copied the rest) and to start the WAL over.
    pub fn catch_up(&self) {
        if !self.shared.catch_up_queued.swap(true, Ordering::AcqRel) {
            let _ = self.send(Job::CatchUp);
        }
    }

    /// How many transactions that changed rows the writer has committed so far (a refused
    /// one may count too: the count only ever errs high). Two reads tell whether any came
    /// between them.
    pub fn commits(&self) -> u64 {
        self.shared.commits.load(Ordering::Acquire)
    }

    /// The frames in the WAL of the writer's database (a PASSIVE checkpoint's count).
    #[cfg(test)]
    pub async fn wal_frames(&self) -> i64 {
        self.maintain(|connection| checkpoint(connection, "PASSIVE"))
            .await
            .expect("a checkpoint")
            .1
    }

    fn send(&self, job: Job) -> Result<(), StoreError> {
        self.jobs.send(job).map_err(|_| stopped())
    }
}

fn stopped() -> StoreError {
    StoreError::Writer("the writer thread stopped".into())
}

/// A write failure, classified: the database being busy, out of space or failing I/O may pass
/// (the journal retries); anything else (a constraint, a malformed value) will not.
pub(super) fn writer_error(error: rusqlite::Error) -> StoreError {
    classified(error, StoreError::Writer)
}

/// SQLite's `error` as the store reports it: `Unavailable` where it may pass (the database
/// busy, out of space or memory, or failing I/O), `otherwise` where it will not.
pub(super) fn classified(
    error: rusqlite::Error,
    otherwise: fn(String) -> StoreError,
) -> StoreError {
    use rusqlite::ErrorCode as Code;
    match error.sqlite_error_code() {
        Some(
            Code::DatabaseBusy
            | Code::DatabaseLocked
            | Code::DiskFull
            | Code::SystemIoFailure
            | Code::CannotOpen
            | Code::OutOfMemory,
        ) => StoreError::Unavailable(error.to_string()),
        _ => otherwise(error.to_string()),
    }
}

/// The statements the writer runs (its writes, and the reads of [`SqliteWriter::read`]),
/// each prepared on its first use and kept for the connection's life, found again by the
/// address and length of its text (`ptr::eq` on a `&'static str`): the same call site always
/// passes the same text. Two texts never match unless they are the same bytes; one text at
/// two addresses would only take two slots.
///
/// Why not rusqlite's `prepare_cached`: its cache hashes a statement's whole text to find it,
/// and again to put it back, and clears the statement's bindings each time; and
/// `Connection::transaction` prepares and finalizes `BEGIN` and `COMMIT` anew for every
/// transaction (docs/profiling.md, the twenty-third pass).
pub(super) struct Prepared<'c> {
    connection: &'c Connection,
    statements: Vec<Kept<'c>>,
    /// The statements used since their bindings were last cleared, one bit each.
    bound: u32,
}

/// A kept statement: its text (the key it is found by), and the names of its result's
/// columns, read once at preparation, so that a row's column is found by comparing names
/// (rusqlite's lookup by name asks SQLite for every column's name at each access).
struct Kept<'c> {
    sql: &'static str,
    statement: Statement<'c>,
    columns: Box<[Box<str>]>,
}

/// Most statements kept at once: more than the writer has, so that none is ever prepared
/// twice; it bounds the list (and its scan) should that ever change. One bit each in
/// [`Prepared::bound`].
const MAX_PREPARED: usize = 32;
const _: () = assert!(MAX_PREPARED <= u32::BITS as usize);

impl<'c> Prepared<'c> {
    fn new(connection: &'c Connection) -> Self {
        Self {
            connection,
            statements: Vec::with_capacity(MAX_PREPARED),
            bound: 0,
        }
    }

    /// The statement of `sql`, prepared on first use. Its parameters are bound anew by each
    /// use; rusqlite resets it after each execution or query.
    pub(super) fn get(&mut self, sql: &'static str) -> rusqlite::Result<&mut Statement<'c>> {
        let index = self.kept(sql)?;
        Ok(&mut self.statements[index].statement)
    }

    /// The statement of `sql`, as [`Prepared::get`], with the names of the columns it returns.
    pub(super) fn query(
        &mut self,
        sql: &'static str,
    ) -> rusqlite::Result<(&mut Statement<'c>, &[Box<str>])> {
        let index = self.kept(sql)?;
        let kept = &mut self.statements[index];
        Ok((&mut kept.statement, &kept.columns))
    }

    /// The index of `sql`'s kept statement, prepared and kept on first use.
    fn kept(&mut self, sql: &'static str) -> rusqlite::Result<usize> {
        let kept = self
            .statements
            .iter()
            .position(|kept| std::ptr::eq(kept.sql, sql));
        let index = match kept {
            Some(index) => index,
            None => {
                // Kept: prepared outside the connection's small-allocation pool, which the
                // statements' executions need (SQLite's hint for a statement used many times).
                let statement = self
                    .connection
                    .prepare_with_flags(sql, PrepFlags::SQLITE_PREPARE_PERSISTENT)?;
                let columns = statement
                    .column_names()
                    .into_iter()
                    .map(Box::from)
                    .collect();
                if self.statements.len() >= MAX_PREPARED {
                    self.statements.pop();
                }
                self.statements.push(Kept {
                    sql,
                    statement,
                    columns,
                });
                self.statements.len() - 1
            }
        };
        self.bound |= 1 << index;
        Ok(index)
    }

    /// Lets go of the values the statements used since the last call were bound to. SQLite
    /// copies each bound text into its statement, from the connection's small-allocation
    /// pool while it has room, and keeps it until the statement is bound again: let go here,
    /// as rusqlite's cache did when it took a statement back, the pool is there for the next
    /// transaction's cursors and values.
    fn release_bindings(&mut self) {
        for (index, kept) in self.statements.iter_mut().enumerate() {
            if self.bound & (1 << index) != 0 {
                kept.statement.clear_bindings();
            }
        }
        self.bound = 0;
    }

    fn execute(&mut self, sql: &'static str) -> rusqlite::Result<()> {
        self.get(sql)?.execute([]).map(drop)
    }

    /// Runs `body` in a transaction: committed when it returns `Ok`, rolled back when it or
    /// the commit fails.
    fn transaction<T, E: From<rusqlite::Error>>(
        &mut self,
        body: impl FnOnce(&mut Self) -> Result<T, E>,
    ) -> Result<T, E> {
        self.execute("BEGIN")?;
        let result = body(self).and_then(|value| {
            self.execute("COMMIT")?;
            Ok(value)
        });
        // Some failures end the transaction by themselves (a full disk, an I/O error).
        if result.is_err()
            && !self.connection.is_autocommit()
            && let Err(error) = self.execute("ROLLBACK")
        {
            tracing::error!(%error, "a failed transaction could not be rolled back");
        }
        self.release_bindings();
        result
    }
}

/// The lease identity the writer writes as: new runs are leased to `holder` for `duration`,
/// and only runs it holds may change.
#[derive(Debug, Clone)]
pub struct Leases {
    pub holder: String,
    pub duration: Duration,
}

impl Leases {
    /// When a lease taken or renewed now expires.
    pub fn expiry(&self) -> TimeText {
        let duration = chrono::Duration::from_std(self.duration).unwrap_or(chrono::Duration::MAX);
        stored_time::text(
            &Utc::now()
                .checked_add_signed(duration)
                .unwrap_or(DateTime::<Utc>::MAX_UTC),
        )
    }
}

/// Why a transaction was abandoned: a database error, a conditional write that found the
/// state changed, or a run's write from an instance that does not hold its lease.
enum Abandon {
    Sqlite(rusqlite::Error),
    Conflict(String),
    LeaseLost(String),
}

fn lease_lost(run_id: &str) -> Abandon {
    Abandon::LeaseLost(format!("run `{run_id}` is not held by this instance"))
}

/// Refuses a write of `run_id` unless this writer's holder holds the run's lease.
fn fence(prepared: &mut Prepared<'_>, run_id: &str, leases: &Leases) -> Result<(), Abandon> {
    let held = prepared
        .get("SELECT 1 FROM runs WHERE id = ?1 AND lease_holder = ?2")?
        .exists(params![run_id, leases.holder])?;
    if held {
        Ok(())
    } else {
        Err(lease_lost(run_id))
    }
}

impl From<rusqlite::Error> for Abandon {
    fn from(error: rusqlite::Error) -> Self {
        Self::Sqlite(error)
    }
}

async fn write_loop(
    connection: Connection,
    mut queue: mpsc::UnboundedReceiver<Job>,
    shared: &Shared,
    leases: &Leases,
    page_size: i64,
) {
    let mut last_wait: Option<Instant> = None;
    let mut charges = PendingCharges::default();
    let mut last_seqs = LastSeqs::default();
    let mut prepared = Prepared::new(&connection);
    let mut changes = connection.total_changes();
    loop {
        // The last job's transaction, if it changed rows, counts before the writer waits.
        let changed = connection.total_changes();
        if changed != changes {
            changes = changed;
            shared.commits.fetch_add(1, Ordering::Release);
        }
        let job = match charges.deadline() {
            None => queue.recv().await,
            Some(deadline) => match tokio::time::timeout_at(deadline, queue.recv()).await {
                Ok(job) => job,
                Err(_) => {
                    charges.flush(&mut prepared);
                    continue;
                }
            },
        };
        let Some(job) = job else {
            break;
        };
        // Charges handed over before this job was queued ride along with it, or are stored
        // before it reads.
        charges.take_handed(&shared.charges);
        match job {
            Job::Apply(ops, done) => {
                let result = apply(&mut prepared, &ops, leases, &charges, &mut last_seqs).map_err(
                    |abandon| match abandon {
                        Abandon::Sqlite(error) => writer_error(error),
                        Abandon::Conflict(message) => StoreError::Conflict(message),
                        Abandon::LeaseLost(message) => StoreError::LeaseLost(message),
                    },
                );
                if result.is_ok() {
                    charges.committed();
                } else {
                    // A refused batch never holds back the charges that rode along with it.
                    charges.flush(&mut prepared);
                }
                let _ = done.send((ops, result));
            }
            Job::TakeCharges => {
                shared.take_charges_queued.store(false, Ordering::Release);
                if charges.idle() || charges.len() >= MAX_PENDING_CHARGES {
                    charges.flush(&mut prepared);
                }
            }
            Job::Maintain(work) => {
                charges.flush(&mut prepared);
                last_seqs.forget();
                work(&connection);
            }
            Job::Read(request_ids, work) => {
                // A read sees every charge of its requests accepted before it. Other
                // requests' charges go on waiting for a transaction to ride along with: at
                // concurrency, flushing them for every `wait` cost a commit per request.
                if request_ids.iter().any(|id| charges.of_request(id)) {
                    charges.flush(&mut prepared);
                }
                work(&mut prepared);
                prepared.release_bindings();
            }
            Job::CatchUp => {
                charges.flush(&mut prepared);
                shared.catch_up_queued.store(false, Ordering::Release);
                match checkpoint(&connection, "PASSIVE") {
                    Ok((_, frames, _)) if frames.saturating_mul(page_size) >= STARVED_BYTES => {
                        wait_for_readers(&connection, &mut last_wait, frames);
                    }
                    Ok((0, frames, copied)) if frames > 0 && frames == copied => {
                        restart_wal(&connection);
                    }
                    Ok(_) => {}
                    Err(error) => tracing::warn!(%error, "WAL catch-up checkpoint failed"),
                }
            }
        }
    }
    charges.take_handed(&shared.charges);
    charges.flush(&mut prepared);
}

/// A checkpoint in `mode`: (busy, frames in the WAL, frames copied).
fn checkpoint(connection: &Connection, mode: &str) -> Result<(i64, i64, i64), rusqlite::Error> {
    connection.query_row(&format!("PRAGMA wal_checkpoint({mode})"), [], |row| {
        Ok((row.get(0)?, row.get(1)?, row.get(2)?))
    })
}

/// Starts the WAL over now, in the catch-up, once its checkpoint copied every frame. The
/// first write after such a checkpoint restarts the WAL, and the restart syncs the WAL's new
/// header to the disk (and cuts the file back to [`WAL_SIZE_LIMIT`]): left to the next
/// request's commit, that sync (0.15-0.3 ms here) was that request's, once per catch-up.
/// Written now, by a write of the header's own `user_version` unchanged (one page, no
/// table), the catch-up pays it, mostly between two requests. A reader still on the old
/// frames keeps the WAL from restarting: the write then appends one frame, and the next
/// catch-up tries again.
fn restart_wal(connection: &Connection) {
    let restarted = connection
        .query_row("PRAGMA user_version", [], |row| row.get::<_, i64>(0))
        .and_then(|version| connection.execute_batch(&format!("PRAGMA user_version = {version}")));
    if let Err(error) = restarted {
        tracing::warn!(%error, "the WAL's restart after a catch-up failed; the next write restarts it");
    }
}

/// The WAL is past [`STARVED_BYTES`]: readers hold old frames and keep it from restarting.
/// Waits for them (at most [`STARVED_WAIT`], at most once per [`STARVED_RETRY`]), copies
/// everything and restarts the WAL.
fn wait_for_readers(connection: &Connection, last_wait: &mut Option<Instant>, frames: i64) {
    if last_wait.is_some_and(|at| at.elapsed() < STARVED_RETRY) {
        return;
    }
    *last_wait = Some(Instant::now());
    let started = Instant::now();
    // A short wait: a reader that holds on (a backup's long read) must not stall writes.
    let _ = connection.busy_timeout(STARVED_WAIT);
    let result = checkpoint(connection, "TRUNCATE");
    let _ = connection.busy_timeout(BUSY_TIMEOUT);
    match result {
        Ok((0, _, _)) => tracing::info!(
            frames,
            waited_ms = started.elapsed().as_millis() as u64,
            "the WAL was restarted after waiting for readers"
        ),
        Ok((_, frames, copied)) => tracing::warn!(
            frames,
            copied,
            "the WAL cannot restart: readers hold old frames; retrying in a few seconds"
        ),
        Err(error) => tracing::warn!(%error, "WAL restart failed"),
    }
}

/// Moves a pending approval to its decision; a conflict when it is not pending.
fn decide(prepared: &mut Prepared<'_>, decision: &ApprovalDecision) -> Result<(), Abandon> {
    let changed = prepared
        .get(
            "UPDATE approvals SET status = ?1, reason = ?2, decided_by = ?3, decided_at = ?4
             WHERE id = ?5 AND status = 'pending'",
        )?
        .execute(params![
            decision.status.as_str(),
            decision.reason,
            decision.decided_by,
            stored_time::text(&decision.at),
            decision.id
        ])?;
    if changed == 1 {
        Ok(())
    } else {
        Err(Abandon::Conflict(format!(
            "approval `{}` is not pending",
            decision.id
        )))
    }
}

/// An optional JSON column's text ([`to_text`]: serde_json's bytes).
fn json_opt(value: &Option<Value>) -> Option<String> {
    value.as_ref().map(to_text)
}

fn apply(
    prepared: &mut Prepared<'_>,
    ops: &[WriteOp],
    leases: &Leases,
    charges: &PendingCharges,
    last_seqs: &mut LastSeqs,
) -> Result<Vec<i64>, Abandon> {
    let (numbers, next_seq) =
        prepared.transaction(|prepared| write_ops(prepared, ops, leases, charges, last_seqs))?;
    last_seqs.committed(next_seq);
    Ok(numbers)
}

/// Writes `ops` (and the pending charges) inside the open transaction; returns the events'
/// numbers and each request's next number after them.
fn write_ops<'o>(
    prepared: &mut Prepared<'_>,
    ops: &'o [WriteOp],
    leases: &Leases,
    charges: &PendingCharges,
    last_seqs: &LastSeqs,
) -> Result<(Vec<i64>, IdMap<&'o str, i64>), Abandon> {
    charges.write(prepared)?;
    let mut numbers = Vec::new();
    // The next number of each request the batch appends to (this writer is the store's only
    // one, so the stored last number plus what the batch appended is exact).
    let mut next_seq: IdMap<&str, i64> = IdMap::default();
    let mut folds = Folds::plan(ops);
    // Consecutive events of one run, numbered, being gathered into one row. The batch's other
    // ops between them do not end it: none of them reads `events` (a request's numbers are
    // counted here), so the row may be written after them, as PostgreSQL's batch writes its
    // rows after its other ops (docs/profiling.md, the thirty-fifth pass).
    let mut row = EventRow::default();
    for (index, op) in ops.iter().enumerate() {
        if folds.is_folded(index) {
            continue;
        }
        if let WriteOp::InsertRequest(request) = op {
            next_seq.insert(&request.id, 1);
        }
        match op {
            WriteOp::TouchSession(session) => {
                prepared.get(
"INSERT INTO sessions (id, agent_id, owner, metadata, created_at, updated_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6)
                     ON CONFLICT(id) DO UPDATE SET updated_at = excluded.updated_at",
)?
                .execute(params![
                    session.id,
                    session.agent_id,
                    session.owner,
                    to_text(&session.metadata),
                    stored_time::text(&session.created_at),
                    stored_time::text(&session.updated_at)
                ])?;
            }
            WriteOp::InsertMessage(message) => {
                prepared.get(
"INSERT INTO messages (id, session_id, parent_id, request_id, role, content, created_at)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
)?
                .execute(params![
                    message.id,
                    message.session_id,
                    message.parent_id,
                    message.request_id,
                    message.role,
                    to_text(&message.content),
                    stored_time::text(&message.created_at)
                ])?;
            }
            WriteOp::InsertRequest(request) => {
                let row = folds
                    .take_request(index)
                    .unwrap_or_else(|| RequestRow::inserted(request));
                let named = super::NamedInput::of(&request.input);
                prepared.get(
"INSERT INTO requests (id, session_id, agent_id, protocol, status, input, output, error, usage,
                     metadata, created_at, updated_at, owner, input_digest, prefix_of, prefix_len,
                     leading_digest)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16,
                     ?17)",
)?
                .execute(params![
                    request.id,
                    request.session_id,
                    request.agent_id,
                    request.protocol,
                    row.status.as_str(),
                    to_text(&request.input),
                    row.output,
                    row.error.map(to_text),
                    row.usage.map(to_text),
                    to_text(&request.metadata),
                    stored_time::text(&request.created_at),
                    stored_time::text(&row.updated_at),
                    request.owner,
                    named.input_digest,
                    named.prefix_of,
                    named.prefix_len,
                    named.leading_digest
                ])?;
            }
            WriteOp::UpdateRequest {
                id,
                status,
                output,
                error,
                usage,
                at,
            } => {
                prepared.get(
"UPDATE requests SET status = ?1, output = COALESCE(?2, output), error = ?3,
                     usage = COALESCE(?4, usage), updated_at = ?5 WHERE id = ?6",
)?
                .execute(params![
                    status.as_str(),
                    output,
                    json_opt(error),
                    json_opt(usage),
                    stored_time::text(at),
                    id
                ])?;
            }
            WriteOp::InsertRun(run) => {
                let row = folds
                    .take_run(index)
                    .unwrap_or_else(|| RunRow::inserted(run));
                prepared.get(
"INSERT INTO runs (id, request_id, attempt, status, state, error, created_at, updated_at,
                     started_at, ended_at, lease_holder, lease_expires_at)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12)",
)?
                .execute(params![
                    run.id,
                    run.request_id,
                    run.attempt,
                    row.status.as_str(),
                    row.state.map(to_text),
                    row.error.map(to_text),
                    stored_time::text(&run.created_at),
                    stored_time::text(&row.updated_at),
                    row.started_at.as_ref().map(stored_time::text),
                    row.ended_at.as_ref().map(stored_time::text),
                    row.leased.then_some(&leases.holder),
                    row.leased.then(|| leases.expiry())
                ])?;
            }
            WriteOp::UpdateRun {
                id,
                status,
                error,
                state,
                at,
            } => {
                // Only the holder changes a run. An ended run keeps no checkpoint (only a live
                // run is ever resumed) and no lease. Two statements, not one choosing by
                // `CASE`: with the lease column the `WHERE` reads set through a `CASE`, SQLite
                // took ~150 µs per update against ~12 µs (measured), and every run ends with
                // this update.
                let changed = if status.is_terminal() {
                    prepared.get(
"UPDATE runs SET status = ?1, error = COALESCE(?2, error), state = NULL,
                         updated_at = ?3, ended_at = ?3, lease_holder = NULL, lease_expires_at = NULL
                         WHERE id = ?4 AND lease_holder = ?5",
)?
                    .execute(params![
                        status.as_str(),
                        json_opt(error),
                        stored_time::text(at),
                        id,
                        leases.holder
                    ])?
                } else {
                    prepared.get(
"UPDATE runs SET status = ?1, error = COALESCE(?2, error),
                         state = COALESCE(?3, state), updated_at = ?4,
                         started_at = CASE WHEN ?1 = 'running' THEN COALESCE(started_at, ?4) ELSE started_at END
                         WHERE id = ?5 AND lease_holder = ?6",
)?
                    .execute(params![
                        status.as_str(),
                        json_opt(error),
                        json_opt(state),
                        stored_time::text(at),
                        id,
                        leases.holder
                    ])?
                };
                if changed != 1 {
                    return Err(lease_lost(id));
                }
            }
            WriteOp::InsertApproval(approval) => {
                fence(prepared, &approval.run_id, leases)?;
                prepared.get(
"INSERT INTO approvals (id, request_id, run_id, session_id, agent_id, tool_call_id, tool_id,
                     arguments, rule, status, reason, decided_by, created_at, expires_at, decided_at, call_key, kind, execution)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18)",
)?
                .execute(params![
                    approval.id,
                    approval.request_id,
                    approval.run_id,
                    approval.session_id,
                    approval.agent_id,
                    approval.tool_call_id,
                    approval.tool_id,
                    to_text(&approval.arguments),
                    approval.rule,
                    approval.status.as_str(),
                    approval.reason,
                    approval.decided_by,
                    stored_time::text(&approval.created_at),
                    approval.expires_at.as_ref().map(stored_time::text),
                    approval.decided_at.as_ref().map(stored_time::text),
                    approval.call_key,
                    approval.kind.as_str(),
                    approval.execution
                ])?;
            }
            WriteOp::DecideApproval(decision) => decide(prepared, decision)?,
            WriteOp::StartToolCall(call) => {
                fence(prepared, &call.run_id, leases)?;
                prepared.get(
"INSERT INTO tool_calls (run_id, call_key, model_call_id, request_id, tool_id, arguments,
                     idempotency_key, outcome, result, duration_ms, recorded_at, executions)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, 'started', 'null', 0, ?8, 1)
                     ON CONFLICT(run_id, call_key) DO UPDATE SET executions = executions + 1",
)?
                .execute(params![
                    call.run_id,
                    call.call_key,
                    call.model_call_id,
                    call.request_id,
                    call.tool_id,
                    to_text(&call.arguments),
                    call.idempotency_key,
                    stored_time::text(&call.recorded_at)
                ])?;
            }
            WriteOp::RecordToolCall(call) => {
                fence(prepared, &call.run_id, leases)?;
                prepared.get(
"INSERT INTO tool_calls (run_id, call_key, model_call_id, request_id, tool_id, arguments,
                     idempotency_key, outcome, result, duration_ms, recorded_at)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)
                     ON CONFLICT(run_id, call_key) DO UPDATE SET tool_id = excluded.tool_id,
                     model_call_id = excluded.model_call_id, arguments = excluded.arguments,
                     idempotency_key = excluded.idempotency_key, outcome = excluded.outcome,
                     result = excluded.result, duration_ms = excluded.duration_ms,
                     recorded_at = excluded.recorded_at",
)?
                .execute(params![
                    call.run_id,
                    call.call_key,
                    call.model_call_id,
                    call.request_id,
                    call.tool_id,
                    to_text(&call.arguments),
                    call.idempotency_key,
                    call.outcome,
                    to_text(&call.result),
                    call.duration_ms,
                    stored_time::text(&call.recorded_at)
                ])?;
            }
            WriteOp::AppendEvent(event) => {
                let seq = match next_seq.get_mut(&*event.request_id) {
                    Some(seq) => seq,
                    None => {
                        let last: i64 = match last_seqs.get(&event.request_id) {
                            Some(last) => last,
                            None => prepared
                                .get(LAST_SEQ)?
                                .query_row(params![event.request_id], |row| row.get(0))?,
                        };
                        next_seq.entry(&event.request_id).or_insert(last + 1)
                    }
                };
                let number = *seq;
                *seq += 1;
                numbers.push(number);
                row.add(prepared, event, number)?;
            }
        }
    }
    row.write(prepared)?;
    Ok((numbers, next_seq))
}

/// Consecutive events of one run (the batch's other ops between them aside) being gathered
/// into one row of `events` (migration 0012): the first in the row's columns, the others in
/// `more`. A row takes the events
/// `event_rows::may_join` allows, and about [`ROW_BYTES`] bytes: a row past a page's room
/// spills into overflow pages and packs its pages worse than single events did.
#[derive(Default)]
struct EventRow<'a> {
    /// The first event, its number, and its data as stored.
    first: Option<(&'a super::EventRecord, i64, String)>,
    /// The events after the first, as a JSON array still open at its end.
    more: String,
    count: usize,
}

/// About how many bytes a row of several events may hold (a page is 2 KiB).
const ROW_BYTES: usize = 640;

impl<'a> EventRow<'a> {
    /// Adds `event`, numbered `number`, to this row, or writes this row and starts the next
    /// with it.
    fn add(
        &mut self,
        prepared: &mut Prepared<'_>,
        event: &'a super::EventRecord,
        number: i64,
    ) -> rusqlite::Result<()> {
        if let Some((first, _, data)) = &self.first {
            if may_join(&first.request_id, &first.run_id, self.count, event) {
                let later = LaterEvent {
                    id: event.id.as_str(),
                    event_type: event.event_type.as_str(),
                    at: stored_time::text(&event.at),
                    data: &event.data,
                };
                // Written straight into `more`, and taken back out if the row would be too
                // long.
                let mark = self.more.len();
                self.more.push(if mark == 0 { '[' } else { ',' });
                later.write(&mut self.more);
                // The event's bytes, without the separator, as the row's length.
                if data.len() + self.more.len() - 1 <= ROW_BYTES {
                    self.count += 1;
                    return Ok(());
                }
                self.more.truncate(mark);
            }
            self.write(prepared)?;
        }
        self.first = Some((event, number, to_text(&event.data)));
        self.count = 1;
        Ok(())
    }

    /// Writes the row gathered so far, if any, and empties it.
    fn write(&mut self, prepared: &mut Prepared<'_>) -> rusqlite::Result<()> {
        let Some((first, number, data)) = self.first.take() else {
            return Ok(());
        };
        let more = if self.more.is_empty() {
            None
        } else {
            self.more.push(']');
            Some(std::mem::take(&mut self.more))
        };
        self.count = 0;
        prepared
            .get(
                "INSERT INTO events (id, request_id, run_id, seq, type, at, data, more)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
            )?
            .execute(params![
                first.id,
                first.request_id,
                first.run_id,
                number,
                first.event_type,
                stored_time::text(&first.at),
                data,
                more
            ])?;
        Ok(())
    }
}

/// The last event number of requests this writer appended to or inserted lately, so that a
/// batch numbers their events without reading the store's last one first. Exact because this
/// writer is the store's only one; forgotten whole when maintenance ran (it may delete
/// events) and when it reaches [`LastSeqs::MAX`] requests.
#[derive(Default)]
struct LastSeqs(IdMap<String, i64>);

impl LastSeqs {
    const MAX: usize = 4_096;

    fn get(&self, request: &str) -> Option<i64> {
        self.0.get(request).copied()
    }

    /// A batch committed: `next` holds each request's next number after it.
    fn committed(&mut self, next: IdMap<&str, i64>) {
        if self.0.len().saturating_add(next.len()) > Self::MAX {
            self.0.clear();
        }
        for (request, next) in next {
            match self.0.get_mut(request) {
                Some(last) => *last = next - 1,
                None => {
                    self.0.insert(request.to_owned(), next - 1);
                }
            }
        }
    }

    fn forget(&mut self) {
        self.0.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> Connection {
        let connection = Connection::open_in_memory().expect("an in-memory database");
        connection
            .execute_batch("CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT NOT NULL)")
            .expect("a table");
        connection
    }

    fn count(connection: &Connection) -> i64 {
        connection
            .query_row("SELECT COUNT(*) FROM t", [], |row| row.get(0))
            .expect("a count")
    }

    const INSERT: &str = "INSERT INTO t (v) VALUES (?1)";

    #[test]
    fn a_statement_is_prepared_once_and_used_again() {
        let connection = table();
        let mut prepared = Prepared::new(&connection);
        for value in ["a", "b", "c"] {
            prepared
                .transaction(|prepared| prepared.get(INSERT)?.execute(params![value]))
                .expect("an insert");
        }
        assert_eq!(count(&connection), 3);
        // `INSERT`, `BEGIN` and `COMMIT`, each kept once.
        assert_eq!(prepared.statements.len(), 3);
    }

    #[test]
    fn a_failed_transaction_is_rolled_back_and_the_next_one_commits() {
        let connection = table();
        let mut prepared = Prepared::new(&connection);
        let failed: Result<(), rusqlite::Error> = prepared.transaction(|prepared| {
            prepared
                .get(INSERT)?
                .execute(params!["kept only if committed"])?;
            // NOT NULL refuses the second row: the whole transaction goes.
            prepared.get(INSERT)?.execute(params![None::<String>])?;
            Ok(())
        });
        assert!(failed.is_err());
        assert!(connection.is_autocommit(), "no transaction left open");
        assert_eq!(count(&connection), 0);

        prepared
            .transaction(|prepared| prepared.get(INSERT)?.execute(params!["after"]))
            .expect("the next transaction");
        assert_eq!(count(&connection), 1);
    }

    /// A writer on a fresh database of its own (the folder lives as long as the handle).
    fn writer_in_temporary_folder() -> (tempfile::TempDir, SqliteWriter) {
        let dir = tempfile::tempdir().expect("a directory");
        let leases = Leases {
            holder: "test".into(),
            duration: Duration::from_secs(30),
        };
        let writer =
            SqliteWriter::open(&dir.path().join("state.db"), None, leases).expect("a writer");
        (dir, writer)
    }

    /// A charge is handed over without a job, so it is the handle that tells a writer whose
    /// thread stopped: the charge is refused, not left where nothing will take it.
    #[tokio::test]
    async fn a_charge_handed_to_a_writer_whose_thread_stopped_is_refused() {
        let (_dir, writer) = writer_in_temporary_folder();
        let record = UsageRecord {
            id: "use_1".into(),
            at: Utc::now(),
            request_id: "req_1".into(),
            run_id: "run_1".into(),
            owner: "key".into(),
            agent_id: "assistant".into(),
            session_id: "ses_1".into(),
            model: "main".into(),
            source: "model".into(),
            prompt_tokens: 3,
            completion_tokens: 4,
            cost_nanos: None,
            estimated: false,
        };
        writer
            .charge((record.clone(), Vec::new()))
            .expect("handed over while the thread runs");
        let stopped = writer
            .maintain(|_| -> Result<(), rusqlite::Error> { panic!("the writer thread stops") })
            .await;
        assert!(matches!(stopped, Err(StoreError::Writer(_))), "{stopped:?}");
        // The job's reply goes as the panic unwinds the job; the queue, a moment later.
        for _ in 0..1_000 {
            if writer.jobs.is_closed() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let refused = writer.charge((record, Vec::new()));
        assert!(matches!(refused, Err(StoreError::Writer(_))), "{refused:?}");
    }

    #[tokio::test]
    async fn the_writer_counts_its_transactions_that_changed_rows() {
        let (_dir, writer) = writer_in_temporary_folder();
        writer
            .maintain(|connection| connection.execute_batch("CREATE TABLE t (v TEXT)"))
            .await
            .expect("a table");
        let before = writer.commits();
        for value in ["a", "b"] {
            writer
                .maintain(move |connection| {
                    connection
                        .execute("INSERT INTO t (v) VALUES (?1)", params![value])
                        .map(drop)
                })
                .await
                .expect("a row");
        }
        let rows: i64 = writer
            .maintain(|connection| {
                connection.query_row("SELECT COUNT(*) FROM t", [], |row| row.get(0))
            })
            .await
            .expect("a count");
        assert_eq!(rows, 2);
        // A job's count is published before the writer takes the next one: once this one
        // ran, the jobs before it are counted.
        writer.maintain(|_| Ok(())).await.expect("a turn");
        assert_eq!(
            writer.commits() - before,
            2,
            "the two inserts, not the read"
        );
    }

    #[tokio::test]
    async fn a_catch_up_that_copied_every_frame_starts_the_wal_over_itself() {
        let (_dir, writer) = writer_in_temporary_folder();
        writer
            .maintain(|connection| {
                connection.execute_batch(
                    "PRAGMA user_version = 7; CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT NOT NULL)",
                )
            })
            .await
            .expect("a table");
        for n in 0..40 {
            writer
                .maintain(move |connection| {
                    connection
                        .execute(
                            "INSERT INTO t (v) VALUES (?1)",
                            params![n.to_string().repeat(900)],
                        )
                        .map(drop)
                })
                .await
                .expect("a row");
        }
        let before = writer.wal_frames().await;
        assert!(before >= 40, "a frame or more a commit: {before}");

        // Jobs run in turn: the count after it is the catch-up's WAL. Before, the WAL held
        // every frame until the next write restarted it, in that write's commit.
        writer.catch_up();
        let after = writer.wal_frames().await;
        assert_eq!(
            after, 1,
            "the WAL started over with the header's page alone"
        );

        // Nothing changed but the log: the rows, the header's value, and the next commits.
        let (rows, version) = writer
            .maintain(|connection| {
                connection
                    .execute("INSERT INTO t (v) VALUES ('next')", [])
                    .and_then(|_| {
                        connection.query_row("SELECT COUNT(*) FROM t", [], |row| row.get(0))
                    })
                    .and_then(|rows: i64| {
                        connection
                            .query_row("PRAGMA user_version", [], |row| row.get(0))
                            .map(|version: i64| (rows, version))
                    })
            })
            .await
            .expect("a read");
        assert_eq!((rows, version), (41, 7));
    }

    #[test]
    fn the_kept_statements_are_bounded() {
        let connection = table();
        let mut prepared = Prepared::new(&connection);
        // Distinct texts (leaked: `get` takes what lives as long as the program).
        for n in 0..MAX_PREPARED + 5 {
            let sql: &'static str = Box::leak(format!("SELECT {n}").into_boxed_str());
            prepared.get(sql).expect("a select");
        }
        assert_eq!(prepared.statements.len(), MAX_PREPARED);
    }
}
