//! The embedded store: one SQLite file in write-ahead-log mode.
//!
//! Writes go to a single writer thread ([`super::sqlite_writer`]) that applies each batch in one
//! transaction; reads use a few sqlx connections ([`super::sqlite_readers`]) and never wait for
//! the writer (WAL readers see the last committed state). `synchronous = NORMAL` in WAL mode
//! makes a commit durable against a process crash without an fsync per commit, and
//! checkpoints run in the background.
//!
//! Every `LIMIT` binds its count as `CAST(?n AS INTEGER)`, never as a bare `?n`. SQLite
//! (3.51) plans a bare `LIMIT ?n` with the value bound, so binding it again marks the
//! statement expired, and every execution of a cached statement prepared it anew: each page
//! of a listing, and the writer's claim of runs every second, which held up writes while it
//! did (docs/profiling.md, the thirteenth pass). The cast leaves the count a value read at
//! run time.

use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use rusqlite::OptionalExtension;
use serde_json::Value;
use sqlx::sqlite::{
    SqliteAutoVacuum, SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous,
};
use sqlx::{Row, SqlitePool};

use super::conditions::{self, Conditions, Dialect};
use super::event_rows::{EventRows, StoredLaterEvent, count_owned_sql, unpack};
use super::spend::UsageTotals;
use super::sqlite_readers::{Readers, all_rows, column, first_row, reader_error, rows_of};
use super::sqlite_writer::{Leases, Prepared, SqliteWriter};
use super::stored_time;
use super::{
    ApprovalKind, ApprovalRecord, ApprovalStatus, ArchiveRows, ClientCallRecord, EventRecord,
    InputHolder, Lease, MaintenanceRecord, MessageRecord, OpenOptions, Page, PageRequest,
    PathBelow, PathRead, PathWalk, PruneCounts, PruneFilter, RequestFilter, RequestInFull,
    RequestInput, RequestRecord, RunRecord, RunStatus, SessionFilter, SessionRecord, Store,
    StoreError, StoreStats, ToolCallRecord, WriteOp,
};

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("migrations/sqlite");

/// A live run: the condition of the partial index `runs_live`, spelled exactly as the index
/// is (SQLite reads a partial index only for a query that repeats its condition), and as
/// comparisons, not `IN (...)`, which built a temporary b-tree on every run written.
macro_rules! live_run {
    () => {
        "(status = 'queued' OR status = 'running' OR status = 'waiting_approval')"
    };
}

#[derive(Debug, Clone)]
pub struct SqliteStore {
    path: PathBuf,
    pub(super) writer: Arc<SqliteWriter>,
    pub(super) reader: Arc<Readers>,
    /// Who this process holds leases as, and for how long.
    leases: Leases,
    /// This process's ownership of the store, held for the store's life.
    _owner: Arc<StoreOwnership>,
}

/// The page size of a store created now (an existing store keeps its own).
///
/// Every transaction writes each page it dirtied to the WAL whole, and a request's two
/// transactions dirty about 20 pages each (a leaf of every table and index they append
/// to). With 2 KiB pages a request writes ~42% fewer WAL bytes than with SQLite's default
/// 4 KiB, for the same file size (measured in docs/profiling.md); 1 KiB pages write fewer
/// still but waste space and split big rows into many more frames.
const PAGE_SIZE: u32 = 2048;

impl SqliteStore {
    /// Opens (creating the file and its folder if needed) and migrates the database at `path`,
    /// after taking ownership of it: a second process gets [`StoreError::InUse`] before
    /// anything is read or written.
    pub async fn open_file(path: &Path) -> Result<Self, StoreError> {
        Self::open_file_with(path, &OpenOptions::default()).await
    }

    /// The file whose advisory lock (`flock`) marks the database at `database` as owned by a
    /// process: `state.db.lock` beside `state.db`.
    pub fn ownership_lock_path(database: &Path) -> PathBuf {
        let mut name = database.as_os_str().to_owned();
        name.push(".lock");
        PathBuf::from(name)
    }

    /// [`SqliteStore::open_file`], with the workspace's `store` settings: the database capped
    /// at `store.maxSize`, runs leased for `store.leaseDuration`.
    ///
    /// One process owns the file, so every lease found at open belongs to a process that is
    /// gone: they are voided, and this process claims those runs at once.
    pub async fn open_file_with(path: &Path, open: &OpenOptions) -> Result<Self, StoreError> {
        if let Some(parent) = path.parent()
            && !parent.as_os_str().is_empty()
        {
            std::fs::create_dir_all(parent).map_err(|source| StoreError::Folder {
                path: parent.display().to_string(),
                source,
            })?;
        }
        let owner = Arc::new(StoreOwnership::take(path)?);
        let options = SqliteConnectOptions::from_str("sqlite://")?
            .filename(path)
            .create_if_missing(true)
            .page_size(PAGE_SIZE)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            .busy_timeout(Duration::from_secs(10))
            .foreign_keys(true);
        // Migrations and background checkpoints share one sqlx connection.
        let checkpointer = SqlitePoolOptions::new()
            .max_connections(1)
            .min_connections(1)
            .test_before_acquire(false)
            // Pruned space goes back to the filesystem in small steps (takes effect when the
            // file is created; an older store is converted once, below).
            .connect_with(options.clone().auto_vacuum(SqliteAutoVacuum::Incremental))
            .await?;
        MIGRATOR.run(&checkpointer).await?;
        convert_to_incremental_vacuum(&checkpointer).await?;
        sqlx::query(concat!(
            "UPDATE runs SET lease_expires_at = NULL, lease_holder = NULL WHERE ",
            live_run!(),
            " AND lease_holder IS NOT NULL"
        ))
        .execute(&checkpointer)
        .await?;
        let leases = Leases {
            holder: super::new_holder(),
            duration: open.lease,
        };
        let writer = Arc::new(SqliteWriter::open(path, open.max_bytes, leases.clone())?);
        let reader = Arc::new(Readers::new(path.to_path_buf()));
        tokio::spawn(checkpoint_loop(checkpointer, Arc::clone(&writer)));
        Ok(Self {
            path: path.to_path_buf(),
            writer,
            reader,
            leases,
            _owner: owner,
        })
    }
}

impl SqliteStore {
    /// The events `sql` (`EVENTS_OF_REQUEST` or `EVENTS_OF_RUN`) finds for `owner` after
    /// `read`'s cursor, at most its limit, each row unpacked as it is read.
    async fn events_after(
        &self,
        sql: &'static str,
        owner: &str,
        read: EventRows,
    ) -> Result<Vec<EventRecord>, StoreError> {
        let owner = owner.to_owned();
        self.reader
            .step(move |connection| {
                let mut statement = connection.prepare_cached(sql).map_err(reader_error)?;
                let params = (owner, read.lowest_first_seq(), read.rows());
                read.keep_unpacked(rows_of(&mut statement, params, |row| events_from_row(row)))
            })
            .await
    }

    /// The runs with these ids, oldest first.
    async fn runs_by_id(&self, ids: &[String]) -> Result<Vec<RunRecord>, StoreError> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        self.reader
            .all(
                "SELECT * FROM runs WHERE id IN (SELECT value FROM json_each(?1)) ORDER BY id",
                (serde_json::to_string(ids).unwrap_or_default(),),
                |row| run_from_row(row),
            )
            .await
    }

    /// Copies a consistent snapshot of the database at `database` to the new file `to`,
    /// reading only: it needs no ownership, so it works beside the server that owns it.
    pub async fn backup_file(database: &Path, to: &Path) -> Result<u64, StoreError> {
        if !database.exists() {
            return Err(StoreError::Archive {
                path: database.display().to_string(),
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "no store there"),
            });
        }
        super::prepare_new_file(to)?;
        vacuum_into(&Readers::new(database.to_path_buf()), to).await
    }
}

/// `VACUUM INTO`: one read transaction (a consistent snapshot) written out as a compact new
/// database; SQLite refuses to overwrite an existing file.
async fn vacuum_into(readers: &Readers, to: &Path) -> Result<u64, StoreError> {
    let into = to.to_string_lossy().into_owned();
    readers
        .step(move |connection| {
            connection
                .execute("VACUUM INTO ?1", (into,))
                .map_err(reader_error)
        })
        .await?;
    Ok(std::fs::metadata(to).map_or(0, |m| m.len()))
}

/// A request's last event: the last of its last row of events.
fn last_event_in(
    connection: &rusqlite::Connection,
    request_id: &str,
) -> Result<Option<EventRecord>, StoreError> {
    let row = first_row(connection, LAST_EVENT_ROW, (request_id,), |row| {
        events_from_row(row)
    })?;
    Ok(row.and_then(|mut events| events.pop()))
}

/// Exclusive ownership of a store by this process: an advisory lock (`flock`) on the file
/// `state.db.lock` beside the database, released when the process exits however it exits
/// (even `kill -9`), so a crashed server never blocks its successor.
#[derive(Debug)]
struct StoreOwnership {
    _file: std::fs::File,
}

impl StoreOwnership {
    fn take(database: &Path) -> Result<Self, StoreError> {
        let path = SqliteStore::ownership_lock_path(database);
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|source| StoreError::Lock {
                path: path.display().to_string(),
                source,
            })?;
        match file.try_lock() {
            Ok(()) => Ok(Self { _file: file }),
            Err(std::fs::TryLockError::WouldBlock) => {
                Err(StoreError::InUse(database.display().to_string()))
            }
            Err(std::fs::TryLockError::Error(source)) => Err(StoreError::Lock {
                path: path.display().to_string(),
                source,
            }),
        }
    }
}

/// How often the checkpointer copies the WAL's frames back into the database. A page the
/// requests rewrite all the time (an index's last leaf) is copied once per pass, so fewer
/// passes copy less; and requests that meet a pass are slower, fewer of them with fewer
/// passes (docs/profiling.md, the fifth pass).
const CHECKPOINT_EVERY: Duration = Duration::from_millis(400);

/// Passes the checkpointer makes in a row, each copying what the one before left (see
/// [`after_pass`]), until one has copied every frame of a WAL long enough to restart with
/// no commit during it. SQLite syncs the database only after such a pass (one that copied
/// up to the WAL's end as it stands when the copy ends); otherwise the writer's catch-up
/// copied the last frames and synced the database itself (~1.4 ms here, during which
/// requests wait for the writer). After it, the catch-up copies nothing and only restarts
/// the WAL.
const CATCH_UP_PASSES: u32 = 3;
/// Frames a reader held back from a pass past which another pass is not made.
const AGAIN_FRAMES: i64 = 64;
/// Commits during a pass past which another pass is not made: writes that keep coming (one
/// request after another, or 32 at once) commit many times during a pass (3-6 ms), and a
/// pass after it would meet as many, for one more sync of the WAL and of the database each
/// time. At 200 requests a second a pass meets one commit or two (~20-40 frames each).
const AGAIN_COMMITS: u64 = 2;

/// Copies the write-ahead log's frames back into the database every [`CHECKPOINT_EVERY`], off
/// the request path, and asks the writer to catch up (which restarts the WAL, see
/// [`super::sqlite_writer`]) once the WAL is past 4 MiB: the writer then has
/// only the frames of the last moment left to copy, or none ([`CATCH_UP_PASSES`]). PASSIVE
/// never blocks the writer or readers; the loop stops by itself when the store is dropped
/// (pool closed). Its tick is also the net under charges handed to the writer: it asks the
/// writer to take those no job carried within 20 ms (`SqliteWriter::take_idle_charges`).
async fn checkpoint_loop(pool: SqlitePool, writer: Arc<SqliteWriter>) {
    let mut tick = tokio::time::interval(CHECKPOINT_EVERY);
    // A failing checkpoint (a full disk) is said once, and again when it passes.
    let mut failing = false;
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if pool.is_closed() {
            return;
        }
        // The net under charges handed to the writer with no job of their own: this tick
        // comes anyway, so the net costs no wake-up (see `sqlite_writer::PendingCharges`).
        writer.take_idle_charges();
        match copy_back(&pool, &writer).await {
            Ok(()) => {
                if std::mem::take(&mut failing) {
                    tracing::info!("WAL checkpoints succeed again");
                }
            }
            Err(error) => {
                if pool.is_closed() {
                    return;
                }
                if !std::mem::replace(&mut failing, true) {
                    tracing::warn!(%error, "WAL checkpoint failed; retrying quietly until it passes");
                }
            }
        }
    }
}

/// One PASSIVE pass, as the checkpointer saw it.
#[derive(Debug, Clone, Copy)]
struct Pass {
    /// Frames in the WAL when the pass began (SQLite's count leaves out those committed
    /// during it).
    frames: i64,
    /// Frames copied back into the database, up to the oldest reader's.
    copied: i64,
    /// Commits the writer made during the pass ([`SqliteWriter::commits`]).
    commits: u64,
    /// Its number in this tick's row of passes, from 1.
    number: u32,
}

/// What the checkpointer does after a pass.
#[derive(Debug, PartialEq, Eq)]
enum AfterPass {
    /// The WAL is short: nothing to restart yet.
    Done,
    /// A reader held a few frames back, or a commit or two came during the pass: copy them
    /// too, off the request path.
    Again,
    /// Every frame copied with nothing written since, or too much left, or the passes
    /// spent: the writer copies the rest, if any, and restarts the WAL.
    CatchUp,
}

fn after_pass(writer: &SqliteWriter, pass: Pass) -> AfterPass {
    let held_back = pass.frames.saturating_sub(pass.copied);
    if !writer.wants_catch_up(pass.frames) {
        AfterPass::Done
    } else if (held_back > 0 || pass.commits > 0)
        && held_back <= AGAIN_FRAMES
        && pass.commits <= AGAIN_COMMITS
        && pass.number < CATCH_UP_PASSES
    {
        AfterPass::Again
    } else {
        AfterPass::CatchUp
    }
}

/// One tick of the checkpointer: PASSIVE passes (see [`after_pass`]), then the writer's
/// catch-up if the WAL is long.
async fn copy_back(pool: &SqlitePool, writer: &SqliteWriter) -> Result<(), sqlx::Error> {
    for number in 1..=CATCH_UP_PASSES {
        let commits_before = writer.commits();
        let row = sqlx::query("PRAGMA wal_checkpoint(PASSIVE)")
            .fetch_one(pool)
            .await?;
        let pass = Pass {
            frames: row.try_get(1).unwrap_or(0),
            copied: row.try_get(2).unwrap_or(0),
            commits: writer.commits().wrapping_sub(commits_before),
            number,
        };
        match after_pass(writer, pass) {
            AfterPass::Done => break,
            AfterPass::Again => continue,
            AfterPass::CatchUp => {
                writer.catch_up();
                break;
            }
        }
    }
    Ok(())
}

/// A store created before retention existed has `auto_vacuum = NONE`, which never gives
/// pruned space back; converting it takes one `VACUUM` (a full rewrite), once, at start.
async fn convert_to_incremental_vacuum(pool: &SqlitePool) -> Result<(), StoreError> {
    let mode: i64 = sqlx::query_scalar("PRAGMA auto_vacuum")
        .fetch_one(pool)
        .await?;
    if mode != 2 {
        tracing::info!("converting the store to incremental vacuum (once; rewrites the file)");
        sqlx::query("PRAGMA auto_vacuum = INCREMENTAL")
            .execute(pool)
            .await?;
        // The rewrite needs about the store's size again in free space; without it the store
        // still serves (pruned pages are reused, only not given back) and the next start
        // tries again.
        if let Err(error) = sqlx::query("VACUUM").execute(pool).await {
            tracing::warn!(%error, "cannot convert the store to incremental vacuum now; pruned space is reused but not given back until it can");
        }
    }
    Ok(())
}

fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(suffix);
    PathBuf::from(name)
}

/// The sessions a prune may remove: idle past the cutoff of their agent, with every request
/// ended past the cutoff of its own agent, none among the newest `min_keep` ended requests,
/// no pending approval and no live run. An agent without a cutoff keeps everything (`?1`:
/// per-agent cutoffs as a JSON object, `?2`: everyone else's, or NULL; `?3`: minKeep; `?4`:
/// after this id (`after`); `?5`: limit; `?6`: only among these ids, a JSON array (`among`)).
fn prunable_sessions(after: bool, among: bool) -> String {
    let conditions = Conditions::new(Dialect::Sqlite)
        .compare(after, "s.id", ">", 4, "text")
        .filter(
            among,
            "s.id IN (SELECT value FROM json_each(?6))",
            6,
            "text",
        );
    format!(
        r#"
WITH kept AS (
    SELECT id FROM requests WHERE status IN ('completed', 'failed', 'cancelled')
    ORDER BY id DESC LIMIT CAST(?3 AS INTEGER)
)
SELECT s.id FROM sessions s
WHERE {conditions}
  AND s.updated_at < COALESCE(json_extract(?1, '$."' || s.agent_id || '"'), ?2, '')
  AND NOT EXISTS (SELECT 1 FROM sessions f
                  WHERE json_extract(f.metadata, '$.forkedFrom.sessionId') = s.id)
  AND NOT EXISTS (
    SELECT 1 FROM requests r WHERE r.session_id = s.id AND (
        r.status NOT IN ('completed', 'failed', 'cancelled')
        OR r.updated_at >= COALESCE(json_extract(?1, '$."' || r.agent_id || '"'), ?2, '~')
        OR r.id IN kept
        OR EXISTS (SELECT 1 FROM approvals a WHERE a.request_id = r.id AND a.status = 'pending')
        OR EXISTS (SELECT 1 FROM runs u WHERE u.request_id = r.id
                   AND u.status NOT IN ('completed', 'failed', 'cancelled'))
        OR EXISTS (SELECT 1 FROM requests n WHERE n.prefix_of = r.id AND n.session_id <> s.id)))
ORDER BY s.id LIMIT CAST(?5 AS INTEGER)"#
    )
}

/// Maintenance records kept (the newest).
const MAINTENANCE_KEPT: u32 = 1_000;

/// How this store's SQL names the set of session ids a prune counts or deletes.
const IN_SESSIONS: &str = "IN (SELECT value FROM json_each(?1))";

pub(super) fn parse_json(text: Option<String>) -> Result<Option<Value>, StoreError> {
    text.map(|t| {
        serde_json::from_str(&t).map_err(|e| StoreError::Corrupt(format!("JSON column: {e}")))
    })
    .transpose()
}

fn parse_status(text: &str) -> Result<RunStatus, StoreError> {
    RunStatus::parse(text).ok_or_else(|| StoreError::Corrupt(format!("unknown status `{text}`")))
}

/// A row of a reader's or the writer's connection ([`Readers::step`] and
/// [`SqliteWriter::read`]): the records they read are mapped once.
pub(super) trait Columns {
    fn text(&self, name: &str) -> Result<String, StoreError>;
    fn opt_text(&self, name: &str) -> Result<Option<String>, StoreError>;
    fn int(&self, name: &str) -> Result<i64, StoreError>;

    fn json(&self, name: &str) -> Result<Option<Value>, StoreError> {
        parse_json(self.opt_text(name)?)
    }

    fn time(&self, name: &str) -> Result<DateTime<Utc>, StoreError> {
        stored_time::parse(&self.text(name)?)
    }

    fn opt_time(&self, name: &str) -> Result<Option<DateTime<Utc>>, StoreError> {
        stored_time::parse_opt(self.opt_text(name)?)
    }
}

impl Columns for rusqlite::Row<'_> {
    fn text(&self, name: &str) -> Result<String, StoreError> {
        column(self, name)
    }

    fn opt_text(&self, name: &str) -> Result<Option<String>, StoreError> {
        column(self, name)
    }

    fn int(&self, name: &str) -> Result<i64, StoreError> {
        column(self, name)
    }
}

/// A row whose columns are found by position among the names its statement was read with
/// (a writer's kept statement keeps them, [`super::sqlite_writer::Prepared::query`]; a read
/// of many rows takes them once), not by asking SQLite for the statement's column names at
/// every access, as rusqlite's `Row::get(&str)` does.
struct NamedRow<'r, 's> {
    row: &'r rusqlite::Row<'s>,
    columns: &'r [Box<str>],
    /// How a failed access is told: as a write's or as a read's.
    error: fn(rusqlite::Error) -> StoreError,
}

impl NamedRow<'_, '_> {
    fn index(&self, name: &str) -> Result<usize, StoreError> {
        self.columns
            .iter()
            .position(|column| **column == *name)
            .ok_or_else(|| (self.error)(rusqlite::Error::InvalidColumnName(name.to_owned())))
    }

    fn get<T: rusqlite::types::FromSql>(&self, name: &str) -> Result<T, StoreError> {
        self.row.get(self.index(name)?).map_err(self.error)
    }
}

impl Columns for NamedRow<'_, '_> {
    /// Parsed from the text SQLite holds, not from a copy of it (a message's content, an
    /// event's data: most of what a long read moves).
    fn json(&self, name: &str) -> Result<Option<Value>, StoreError> {
        let index = self.index(name)?;
        match self.row.get_ref(index).map_err(self.error)? {
            rusqlite::types::ValueRef::Null => Ok(None),
            rusqlite::types::ValueRef::Text(text) => serde_json::from_slice(text)
                .map(Some)
                .map_err(|e| StoreError::Corrupt(format!("JSON column: {e}"))),
            other => Err((self.error)(rusqlite::Error::InvalidColumnType(
                index,
                name.to_owned(),
                other.data_type(),
            ))),
        }
    }

    fn text(&self, name: &str) -> Result<String, StoreError> {
        self.get(name)
    }

    fn opt_text(&self, name: &str) -> Result<Option<String>, StoreError> {
        self.get(name)
    }

    fn int(&self, name: &str) -> Result<i64, StoreError> {
        self.get(name)
    }
}

/// Every row `statement` finds for `params`, each mapped by `map` with its columns found
/// among `columns` (the statement's own, in its order); a failure told by `error`.
fn named_rows<T>(
    statement: &mut rusqlite::Statement<'_>,
    columns: &[Box<str>],
    params: impl rusqlite::Params,
    error: fn(rusqlite::Error) -> StoreError,
    map: impl Fn(&NamedRow<'_, '_>) -> Result<T, StoreError>,
) -> Result<Vec<T>, StoreError> {
    let mut rows = statement.query(params).map_err(error)?;
    let mut mapped = Vec::new();
    while let Some(row) = rows.next().map_err(error)? {
        mapped.push(map(&NamedRow {
            row,
            columns,
            error,
        })?);
    }
    Ok(mapped)
}

/// A page of a session's messages, newest first by the session's index, for a message
/// path's walk ([`PathWalk`]): those of the session message `?1` belongs to (`?2` at most),
/// then those of session `?1` older than time `?2` and id `?3` (`?4` at most).
const NEWEST_OF_SESSION_OF: &str = "SELECT * FROM messages
     WHERE session_id = (SELECT session_id FROM messages WHERE id = ?1)
     ORDER BY created_at DESC, id DESC LIMIT CAST(?2 AS INTEGER)";
const OLDER_OF_SESSION: &str = "SELECT * FROM messages
     WHERE session_id = ?1 AND (created_at, id) < (?2, ?3)
     ORDER BY created_at DESC, id DESC LIMIT CAST(?4 AS INTEGER)";

/// A session's head and the path to it (below `known` when it passes through it), read in
/// `read`'s snapshot; `None` when the session holds no message.
fn head_and_path(
    read: &rusqlite::Transaction<'_>,
    session_id: &str,
    known: Option<&str>,
) -> Result<Option<(String, PathBelow)>, StoreError> {
    let head = first_row(read, SESSION_HEAD, (session_id,), |row| {
        row.get::<_, String>(0).map_err(reader_error)
    })?;
    let Some(head) = head else {
        return Ok(None);
    };
    let path = walk_path(read, PathWalk::from_leaf(&head, known))?;
    Ok(Some((head, path)))
}

/// Walks a message path through `read`'s snapshot, page after page.
fn walk_path(
    read: &rusqlite::Transaction<'_>,
    mut walk: PathWalk,
) -> Result<PathBelow, StoreError> {
    while let Some(next) = walk.next_read() {
        let page = walk.page();
        let messages = match next {
            PathRead::SessionOf { message } => {
                path_page(read, NEWEST_OF_SESSION_OF, (message, page))
            }
            PathRead::Older {
                session,
                created_at,
                id,
            } => {
                let time = stored_time::text(created_at);
                let params = (session, time.as_str(), id, page);
                path_page(read, OLDER_OF_SESSION, params)
            }
        }?;
        walk.walk(messages);
    }
    Ok(walk.into_path())
}

/// The messages a page of a message path's walk reads (`sql`, one of the two above).
fn path_page(
    connection: &rusqlite::Connection,
    sql: &str,
    params: impl rusqlite::Params,
) -> Result<Vec<MessageRecord>, StoreError> {
    let mut statement = connection.prepare_cached(sql).map_err(reader_error)?;
    let columns: Vec<Box<str>> = statement
        .column_names()
        .into_iter()
        .map(Box::from)
        .collect();
    named_rows(&mut statement, &columns, params, reader_error, |row| {
        message_from_row(row)
    })
}

/// A request and its runs whole, as the reader pool's methods read them; then the
/// statements of a request's view, read on the writer's connection
/// ([`Store::request_in_full`]), the approvals' shared with the reader pool.
const REQUEST_BY_ID: &str = "SELECT * FROM requests WHERE id = ?1";
/// [`Store::input_holder`]'s read: the digest's index and the row's own columns, no input.
const INPUT_HOLDER: &str =
    "SELECT id, updated_at, prefix_of, prefix_len, leading_digest FROM requests
     WHERE input_digest = ?1 AND owner = ?2 AND agent_id = ?3 ORDER BY id DESC LIMIT 1";
const RUNS_OF_REQUEST: &str = "SELECT * FROM runs WHERE request_id = ?1 ORDER BY attempt";
/// A request as its view shows it: every column but `input`, which can be large (the whole
/// transcript) and which no view shows ([`RequestInFull`]).
const REQUEST_VIEW_BY_ID: &str = concat!(
    "SELECT ",
    request_columns_but_input!(),
    " FROM requests WHERE id = ?1"
);
/// A request's runs as its view shows them: without their `state` ([`RequestInFull`]).
const RUN_VIEWS_OF_REQUEST: &str = concat!(
    "SELECT ",
    run_columns_but_state!(),
    " FROM runs WHERE request_id = ?1 ORDER BY attempt"
);
const APPROVALS_OF_RUN: &str = "SELECT * FROM approvals WHERE run_id = ?1 ORDER BY id";

/// The rows `sql` selects for `key` on the writer's connection, with its kept statement, each
/// mapped by `map`.
fn writer_rows<T>(
    prepared: &mut Prepared<'_>,
    sql: &'static str,
    key: &str,
    map: impl Fn(&NamedRow<'_, '_>) -> Result<T, StoreError>,
) -> Result<Vec<T>, StoreError> {
    let sqlite = super::sqlite_writer::writer_error;
    let (statement, columns) = prepared.query(sql).map_err(sqlite)?;
    named_rows(statement, columns, [key], sqlite, map)
}

/// A request's view, read on the writer's connection with its kept statements.
fn writer_view(prepared: &mut Prepared<'_>, id: &str) -> Result<Option<RequestInFull>, StoreError> {
    let Some(request) = writer_rows(prepared, REQUEST_VIEW_BY_ID, id, |row| {
        request_without_input(row)
    })?
    .pop() else {
        return Ok(None);
    };
    let runs = writer_rows(prepared, RUN_VIEWS_OF_REQUEST, id, |row| {
        run_without_state(row)
    })?;
    let mut approvals = Vec::new();
    for run in &runs {
        approvals.extend(writer_rows(prepared, APPROVALS_OF_RUN, &run.id, |row| {
            approval_from_row(row)
        })?);
    }
    let charged = prepared
        .get(
            "SELECT COUNT(*), SUM(prompt_tokens), SUM(completion_tokens),
               SUM(cost_nanos), SUM(estimated)
             FROM usage_records WHERE request_id = ?1",
        )
        .and_then(|statement| {
            statement.query_row([id], |row| {
                Ok(UsageTotals::from_sums(
                    String::new(),
                    row.get(0)?,
                    row.get(1)?,
                    row.get(2)?,
                    row.get(3)?,
                    row.get(4)?,
                ))
            })
        })
        .map_err(super::sqlite_writer::writer_error)?;
    Ok(Some(RequestInFull {
        request,
        runs,
        approvals,
        charged,
    }))
}

fn request_from_row<R: Columns>(row: &R) -> Result<RequestRecord, StoreError> {
    Ok(RequestRecord {
        input: row.json("input")?.unwrap_or(Value::Null),
        ..request_without_input(row)?
    })
}

/// A request's record from a row without its `input` (left `Null`): as a view reads it.
fn request_without_input<R: Columns>(row: &R) -> Result<RequestRecord, StoreError> {
    Ok(RequestRecord {
        id: row.text("id")?,
        session_id: row.text("session_id")?,
        agent_id: row.text("agent_id")?,
        protocol: row.text("protocol")?,
        owner: row.text("owner")?,
        status: parse_status(&row.text("status")?)?,
        input: Value::Null,
        output: row.opt_text("output")?,
        error: row.json("error")?,
        usage: row.json("usage")?,
        metadata: row.json("metadata")?.unwrap_or(Value::Null),
        created_at: row.time("created_at")?,
        updated_at: row.time("updated_at")?,
    })
}

fn run_from_row<R: Columns>(row: &R) -> Result<RunRecord, StoreError> {
    Ok(RunRecord {
        state: row.json("state")?,
        ..run_without_state(row)?
    })
}

/// A run's record from a row without its `state` (left `None`): as a view reads it.
fn run_without_state<R: Columns>(row: &R) -> Result<RunRecord, StoreError> {
    Ok(RunRecord {
        id: row.text("id")?,
        request_id: row.text("request_id")?,
        attempt: row.int("attempt")?,
        status: parse_status(&row.text("status")?)?,
        state: None,
        error: row.json("error")?,
        created_at: row.time("created_at")?,
        updated_at: row.time("updated_at")?,
        started_at: row.opt_time("started_at")?,
        ended_at: row.opt_time("ended_at")?,
        lease: Lease::from_columns(
            row.opt_text("lease_holder")?,
            row.opt_time("lease_expires_at")?,
        ),
        cancel_requested_by: row.opt_text("cancel_requested_by")?,
    })
}

fn session_from_row<R: Columns>(row: &R) -> Result<SessionRecord, StoreError> {
    Ok(SessionRecord {
        id: row.text("id")?,
        agent_id: row.text("agent_id")?,
        owner: row.text("owner")?,
        metadata: row.json("metadata")?.unwrap_or(Value::Null),
        created_at: row.time("created_at")?,
        updated_at: row.time("updated_at")?,
    })
}

fn message_from_row<R: Columns>(row: &R) -> Result<MessageRecord, StoreError> {
    Ok(MessageRecord {
        id: row.text("id")?,
        session_id: row.text("session_id")?,
        parent_id: row.opt_text("parent_id")?,
        request_id: row.opt_text("request_id")?,
        role: row.text("role")?,
        content: row.json("content")?.unwrap_or(Value::Null),
        created_at: row.time("created_at")?,
    })
}

/// The events one row of `events` holds: its first, then those in `more`, numbered on.
fn events_from_row<R: Columns>(row: &R) -> Result<Vec<EventRecord>, StoreError> {
    let first = EventRecord {
        id: row.text("id")?,
        request_id: row.text("request_id")?.into(),
        run_id: row.text("run_id")?.into(),
        session_id: row.text("session_id")?.into(),
        agent_id: row.text("agent_id")?.into(),
        seq: row.int("seq")?,
        event_type: row.text("type")?,
        at: row.time("at")?,
        data: row.json("data")?.unwrap_or(Value::Null),
    };
    let Some(more) = row.opt_text("more")? else {
        return Ok(vec![first]);
    };
    let later: Vec<StoredLaterEvent> = serde_json::from_str(&more)
        .map_err(|e| StoreError::Corrupt(format!("events.more of `{}`: {e}", first.id)))?;
    unpack(first, later, stored_time::parse)
}

fn approval_from_row<R: Columns>(row: &R) -> Result<ApprovalRecord, StoreError> {
    let status = row.text("status")?;
    let kind = row.text("kind")?;
    Ok(ApprovalRecord {
        id: row.text("id")?,
        request_id: row.text("request_id")?,
        run_id: row.text("run_id")?,
        session_id: row.text("session_id")?,
        agent_id: row.text("agent_id")?,
        call_key: row.text("call_key")?,
        execution: row.int("execution")?,
        kind: ApprovalKind::parse(&kind)
            .ok_or_else(|| StoreError::Corrupt(format!("unknown approval kind `{kind}`")))?,
        tool_call_id: row.text("tool_call_id")?,
        tool_id: row.text("tool_id")?,
        arguments: row.json("arguments")?.unwrap_or(Value::Null),
        rule: row.opt_text("rule")?,
        status: ApprovalStatus::parse(&status)
            .ok_or_else(|| StoreError::Corrupt(format!("unknown approval status `{status}`")))?,
        reason: row.opt_text("reason")?,
        decided_by: row.opt_text("decided_by")?,
        created_at: row.time("created_at")?,
        expires_at: row.opt_time("expires_at")?,
        decided_at: row.opt_time("decided_at")?,
    })
}

/// A page of requests, newest first, with only the filters given spelled as tests (see
/// [`Conditions`]): one session's requests read `requests_by_session` (every archived
/// session's are read), one owner's `requests_by_owner`.
fn requests_page(filter: &RequestFilter, input: RequestInput) -> String {
    let conditions = conditions::of_requests(filter, Dialect::Sqlite);
    let columns = input.columns();
    format!(
        "SELECT {columns} FROM requests WHERE {conditions} ORDER BY id DESC LIMIT CAST(?5 AS INTEGER)"
    )
}

/// A page of approvals, newest first; one status's read `approvals_by_status`.
fn approvals_page(status: Option<ApprovalStatus>) -> String {
    let conditions = conditions::of_approvals(status.is_some(), Dialect::Sqlite);
    format!("SELECT * FROM approvals WHERE {conditions} ORDER BY id DESC LIMIT CAST(?3 AS INTEGER)")
}

/// Claims up to `?4` live runs whose lease is free or expired (`runs_live`).
const CLAIM_RUNS: &str = concat!(
    "UPDATE runs SET lease_holder = ?1, lease_expires_at = ?2
     WHERE id IN (SELECT id FROM runs WHERE ",
    live_run!(),
    " AND (lease_holder IS NULL OR lease_expires_at < ?3) ORDER BY id LIMIT CAST(?4 AS INTEGER))
     RETURNING id"
);

/// Gives up this process's leases (a graceful stop). Only a live run holds one, so the
/// condition reads `runs_live` instead of every run stored.
const RELEASE_LEASES: &str = concat!(
    "UPDATE runs SET lease_holder = NULL, lease_expires_at = NULL WHERE lease_holder = ?1 AND ",
    live_run!()
);

/// Rows of events with the session and agent of their request (events do not repeat them),
/// from the row that may hold the event after the cursor: the caller binds `?2` and `?3`
/// through [`EventRows`].
macro_rules! event_select {
    ($condition:literal) => {
        event_rows!(
            $condition,
            " AND e.seq > ?2 ORDER BY e.seq LIMIT CAST(?3 AS INTEGER)"
        )
    };
}
/// Rows of events where `$condition`, then `$order` (an order and a limit).
macro_rules! event_rows {
    ($condition:literal, $order:literal) => {
        concat!(
            "SELECT e.id, e.request_id, e.run_id, r.session_id, r.agent_id, e.seq, e.type, e.at, e.data,
                    e.more
             FROM events e JOIN requests r ON r.id = e.request_id WHERE ",
            $condition,
            $order
        )
    };
}
/// A request's last row of events (`events_by_request`, read backwards).
const LAST_EVENT_ROW: &str = event_rows!("e.request_id = ?1", " ORDER BY e.seq DESC LIMIT 1");
/// A request's events after `?2` (`events_by_request`).
const EVENTS_OF_REQUEST: &str = event_select!("e.request_id = ?1");
/// A session by id.
const SESSION: &str = "SELECT * FROM sessions WHERE id = ?1";
/// A session's newest message with no children (its children are found through
/// `messages_by_parent`, which leaves out messages with no parent: migration 0013).
const SESSION_HEAD: &str = "SELECT id FROM messages m WHERE session_id = ?1
       AND NOT EXISTS (SELECT 1 FROM messages c
                        WHERE c.parent_id = m.id AND c.session_id = m.session_id)
     ORDER BY created_at DESC, id DESC LIMIT 1";
/// The newest message of request `?3` in session `?1` that is not its answer: a range of the
/// session's index from the request's stamp `?2` on, newest first.
const REQUEST_LAST_MESSAGE: &str = "SELECT id FROM messages
     WHERE session_id = ?1 AND created_at >= ?2 AND request_id = ?3 AND role <> 'assistant'
     ORDER BY created_at DESC, id DESC LIMIT 1";
/// A session's newest answers, by the session's index (`messages_by_session`).
const NEWEST_ANSWERS: &str = "SELECT * FROM messages WHERE session_id = ?1 AND role = 'assistant'
     ORDER BY created_at DESC, id DESC LIMIT CAST(?2 AS INTEGER)";
/// A run's events after `?2`, within its request's key range: events have no index by run.
/// A row holds one run's events, so the run is a condition on rows.
const EVENTS_OF_RUN: &str =
    event_select!("e.request_id = (SELECT request_id FROM runs WHERE id = ?1) AND e.run_id = ?1");

/// The last event number of request `?1`: its last row's first number and those after it.
pub(super) const LAST_SEQ: &str =
    "SELECT COALESCE((SELECT seq + COALESCE(json_array_length(more), 0)
                          FROM events WHERE request_id = ?1 ORDER BY seq DESC LIMIT 1), 0)";

#[async_trait::async_trait]
impl Store for SqliteStore {
    async fn apply_batch(&self, batch_id: &str, ops: &[WriteOp]) -> Result<Vec<i64>, StoreError> {
        self.apply_owned(0, batch_id, ops.to_vec()).await.1
    }

    fn writer_runtime(&self) -> Option<tokio::runtime::Handle> {
        Some(self.writer.runtime().clone())
    }

    async fn apply_owned(
        &self,
        _lane: usize,
        _batch_id: &str,
        ops: Vec<WriteOp>,
    ) -> (Vec<WriteOp>, Result<Vec<i64>, StoreError>) {
        // The writer is in this process: a commit's outcome is never lost on the way back, so
        // a batch is never tried again after it committed.
        self.writer.apply(ops).await
    }

    /// One hop to the writer's thread, whose connection holds the request's pages: the view
    /// of a request that just ended (`wait`) read four round trips to reader threads.
    async fn request_in_full(&self, request_id: &str) -> Result<Option<RequestInFull>, StoreError> {
        let id = request_id.to_owned();
        self.writer
            .read(&[request_id], move |prepared| writer_view(prepared, &id))
            .await
    }

    /// Every view in one hop to the writer's thread: a commit that ends several awaited
    /// requests reads them between two transactions, not with a round trip each (the
    /// journal's next commit waits on them: the fortieth pass).
    async fn requests_in_full(
        &self,
        _lane: usize,
        ids: &[&str],
    ) -> Result<Vec<RequestInFull>, StoreError> {
        let owned: Vec<String> = ids.iter().map(|id| (*id).to_owned()).collect();
        self.writer
            .read(ids, move |prepared| {
                let mut views = Vec::with_capacity(owned.len());
                for id in &owned {
                    views.extend(writer_view(prepared, id)?);
                }
                Ok(views)
            })
            .await
    }

    async fn request(&self, id: &str) -> Result<Option<RequestRecord>, StoreError> {
        self.reader
            .one(REQUEST_BY_ID, (id.to_owned(),), |row| request_from_row(row))
            .await
    }

    async fn requests(
        &self,
        filter: &RequestFilter,
        page: &PageRequest,
        input: RequestInput,
    ) -> Result<Page<RequestRecord>, StoreError> {
        let params = (
            filter.status.map(RunStatus::as_str),
            filter.agent_id.clone(),
            filter.session_id.clone(),
            page.cursor.clone(),
            page.limit.saturating_add(1),
            filter.owner.clone(),
            stored_time::owned(filter.created_from.as_ref()),
            stored_time::owned(filter.created_before.as_ref()),
        );
        let from_row: fn(&rusqlite::Row<'_>) -> Result<RequestRecord, StoreError> = match input {
            RequestInput::Read => |row| request_from_row(row),
            RequestInput::Skipped => |row| request_without_input(row),
        };
        let sql = requests_page(filter, input);
        let items = self.reader.all(sql, params, from_row).await?;
        Ok(Page::from_overfetch(items, page.limit, |r| r.id.clone()))
    }

    async fn run(&self, id: &str) -> Result<Option<RunRecord>, StoreError> {
        self.reader
            .one(
                "SELECT * FROM runs WHERE id = ?1",
                (id.to_owned(),),
                |row| run_from_row(row),
            )
            .await
    }

    async fn runs_of(&self, request_id: &str) -> Result<Vec<RunRecord>, StoreError> {
        self.reader
            .all(RUNS_OF_REQUEST, (request_id.to_owned(),), |row| {
                run_from_row(row)
            })
            .await
    }

    async fn runs_of_requests(&self, request_ids: &[String]) -> Result<Vec<RunRecord>, StoreError> {
        if request_ids.is_empty() {
            return Ok(Vec::new());
        }
        self.reader
            .all(
                concat!(
                    "SELECT ",
                    run_columns_but_state!(),
                    " FROM runs WHERE request_id IN (SELECT value FROM json_each(?1))
                     ORDER BY request_id, attempt"
                ),
                (serde_json::to_string(request_ids).unwrap_or_default(),),
                |row| run_without_state(row),
            )
            .await
    }

    async fn runs_with_status(&self, statuses: &[RunStatus]) -> Result<Vec<RunRecord>, StoreError> {
        let wanted: Vec<&str> = statuses.iter().map(|s| s.as_str()).collect();
        self.reader
            .all(
                "SELECT * FROM runs WHERE status IN (SELECT value FROM json_each(?1))
                 ORDER BY created_at",
                (serde_json::to_string(&wanted).unwrap_or_default(),),
                |row| run_from_row(row),
            )
            .await
    }

    fn holder(&self) -> &str {
        &self.leases.holder
    }

    async fn claim_runs(&self, limit: i64) -> Result<Vec<RunRecord>, StoreError> {
        let leases = self.leases.clone();
        let claimed: Vec<String> = self
            .writer
            .maintain(move |connection| {
                let now = stored_time::now();
                let mut claim = connection.prepare_cached(CLAIM_RUNS)?;
                let ids = claim
                    .query_map(
                        rusqlite::params![leases.holder, leases.expiry(), now, limit],
                        |row| row.get(0),
                    )?
                    .collect::<Result<Vec<String>, _>>()?;
                Ok(ids)
            })
            .await?;
        self.runs_by_id(&claimed).await
    }

    async fn renew_leases(&self, runs: &[String]) -> Result<Vec<String>, StoreError> {
        let leases = self.leases.clone();
        let runs = serde_json::to_string(runs).unwrap_or_default();
        self.writer
            .maintain(move |connection| {
                let mut renew = connection.prepare_cached(concat!(
                    "UPDATE runs SET lease_expires_at = ?2 WHERE lease_holder = ?1 AND ",
                    live_run!(),
                    " AND id IN (SELECT value FROM json_each(?3)) RETURNING id"
                ))?;
                let ids = renew
                    .query_map(
                        rusqlite::params![leases.holder, leases.expiry(), runs],
                        |row| row.get(0),
                    )?
                    .collect::<Result<Vec<String>, _>>()?;
                Ok(ids)
            })
            .await
    }

    async fn release_leases(&self) -> Result<u64, StoreError> {
        let leases = self.leases.clone();
        self.writer
            .maintain(move |connection| {
                connection
                    .prepare_cached(RELEASE_LEASES)?
                    .execute(rusqlite::params![leases.holder])
                    .map(|released| released as u64)
            })
            .await
    }

    async fn claim_run(&self, run_id: &str) -> Result<Option<RunRecord>, StoreError> {
        let leases = self.leases.clone();
        let run = run_id.to_owned();
        let claimed: Option<String> = self
            .writer
            .maintain(move |connection| {
                let now = stored_time::now();
                connection
                    .prepare_cached(
                        concat!(
                            "UPDATE runs SET lease_holder = ?1, lease_expires_at = ?2 WHERE id = ?3 AND ",
                            live_run!(),
                            " AND (lease_holder IS NULL OR lease_expires_at < ?4) RETURNING id"
                        ),
                    )?
                    .query_row(
                        rusqlite::params![leases.holder, leases.expiry(), run, now],
                        |row| row.get(0),
                    )
                    .optional()
            })
            .await?;
        match claimed {
            Some(id) => self.run(&id).await,
            None => Ok(None),
        }
    }

    async fn request_cancel(&self, run_id: &str, by: &str) -> Result<bool, StoreError> {
        let (run, by) = (run_id.to_owned(), by.to_owned());
        self.writer
            .maintain(move |connection| {
                connection
                    .prepare_cached(concat!(
                        "UPDATE runs SET cancel_requested_by = COALESCE(cancel_requested_by, ?2)
                             WHERE id = ?1 AND ",
                        live_run!()
                    ))?
                    .execute(rusqlite::params![run, by])
                    .map(|marked| marked == 1)
            })
            .await
    }

    async fn cancels_requested(
        &self,
        runs: &[String],
    ) -> Result<Vec<(String, String)>, StoreError> {
        if runs.is_empty() {
            return Ok(Vec::new());
        }
        self.reader
            .all(
                concat!(
                    "SELECT id, cancel_requested_by FROM runs
                     WHERE id IN (SELECT value FROM json_each(?1))
                       AND cancel_requested_by IS NOT NULL AND ",
                    live_run!()
                ),
                (serde_json::to_string(runs).unwrap_or_default(),),
                |row| Ok((row.text("id")?, row.text("cancel_requested_by")?)),
            )
            .await
    }

    async fn events(
        &self,
        request_id: &str,
        after: i64,
        limit: i64,
    ) -> Result<Vec<EventRecord>, StoreError> {
        self.events_after(EVENTS_OF_REQUEST, request_id, EventRows { after, limit })
            .await
    }

    async fn run_events(
        &self,
        run_id: &str,
        after: i64,
        limit: i64,
    ) -> Result<Vec<EventRecord>, StoreError> {
        self.events_after(EVENTS_OF_RUN, run_id, EventRows { after, limit })
            .await
    }

    async fn last_event(&self, request_id: &str) -> Result<Option<EventRecord>, StoreError> {
        let request_id = request_id.to_owned();
        self.reader
            .step(move |connection| last_event_in(connection, &request_id))
            .await
    }

    async fn request_and_last_event(
        &self,
        id: &str,
    ) -> Result<Option<(RequestRecord, Option<EventRecord>)>, StoreError> {
        let id = id.to_owned();
        self.reader
            .step(move |connection| {
                let request = first_row(connection, REQUEST_BY_ID, (&id,), |row| {
                    request_from_row(row)
                })?;
                let Some(request) = request else {
                    return Ok(None);
                };
                Ok(Some((request, last_event_in(connection, &id)?)))
            })
            .await
    }

    async fn session(&self, id: &str) -> Result<Option<SessionRecord>, StoreError> {
        self.reader
            .one(SESSION, (id.to_owned(),), |row| session_from_row(row))
            .await
    }

    async fn messages(&self, session_id: &str) -> Result<Vec<MessageRecord>, StoreError> {
        self.reader
            .all(
                "SELECT * FROM messages WHERE session_id = ?1 ORDER BY created_at, id",
                (session_id.to_owned(),),
                |row| message_from_row(row),
            )
            .await
    }

    async fn message(&self, id: &str) -> Result<Option<MessageRecord>, StoreError> {
        self.reader
            .one(
                "SELECT * FROM messages WHERE id = ?1",
                (id.to_owned(),),
                |row| message_from_row(row),
            )
            .await
    }

    async fn request_last_message(
        &self,
        session_id: &str,
        request_id: &str,
        since: DateTime<Utc>,
    ) -> Result<Option<String>, StoreError> {
        let args = (
            session_id.to_owned(),
            stored_time::text(&since),
            request_id.to_owned(),
        );
        self.reader
            .one(REQUEST_LAST_MESSAGE, args, |row| {
                row.get(0).map_err(reader_error)
            })
            .await
    }

    async fn newest_answers(
        &self,
        session_id: &str,
        limit: u32,
    ) -> Result<Vec<MessageRecord>, StoreError> {
        self.reader
            .all(
                NEWEST_ANSWERS,
                (session_id.to_owned(), i64::from(limit)),
                |row| message_from_row(row),
            )
            .await
    }

    async fn session_head(&self, session_id: &str) -> Result<Option<String>, StoreError> {
        self.reader
            .one(SESSION_HEAD, (session_id.to_owned(),), |row| {
                row.get(0).map_err(reader_error)
            })
            .await
    }

    async fn message_path_below(
        &self,
        leaf: &str,
        known: Option<&str>,
    ) -> Result<PathBelow, StoreError> {
        let walk = PathWalk::from_leaf(leaf, known);
        self.reader
            .step(move |connection| {
                // One snapshot for the path's reads, as one statement would see.
                let read = connection.unchecked_transaction().map_err(reader_error)?;
                walk_path(&read, walk)
            })
            .await
    }

    async fn session_path_below(
        &self,
        session_id: &str,
        known: Option<&str>,
    ) -> Result<Option<(String, PathBelow)>, StoreError> {
        let session_id = session_id.to_owned();
        let known = known.map(str::to_owned);
        self.reader
            .step(move |connection| {
                let read = connection.unchecked_transaction().map_err(reader_error)?;
                head_and_path(&read, &session_id, known.as_deref())
            })
            .await
    }

    async fn session_and_path(
        &self,
        session_id: &str,
        known: Option<&str>,
    ) -> Result<Option<(SessionRecord, Option<(String, PathBelow)>)>, StoreError> {
        let session_id = session_id.to_owned();
        let known = known.map(str::to_owned);
        self.reader
            .step(move |connection| {
                let read = connection.unchecked_transaction().map_err(reader_error)?;
                let session = first_row(&read, SESSION, (session_id.as_str(),), |row| {
                    session_from_row(row)
                })?;
                let Some(session) = session else {
                    return Ok(None);
                };
                let path = head_and_path(&read, &session_id, known.as_deref())?;
                Ok(Some((session, path)))
            })
            .await
    }

    async fn sessions(
        &self,
        filter: &SessionFilter,
        page: &PageRequest,
    ) -> Result<Page<SessionRecord>, StoreError> {
        let conditions = conditions::of_sessions(filter, page.cursor.is_some(), Dialect::Sqlite);
        let sql = format!(
            "SELECT * FROM sessions WHERE {conditions} ORDER BY id DESC LIMIT CAST(?4 AS INTEGER)"
        );
        let params = (
            filter.agent_id.clone(),
            filter.owner.clone(),
            page.cursor.clone(),
            page.limit.saturating_add(1),
        );
        let items = self
            .reader
            .all(sql, params, |row| session_from_row(row))
            .await?;
        Ok(Page::from_overfetch(items, page.limit, |s| s.id.clone()))
    }

    async fn approval(&self, id: &str) -> Result<Option<ApprovalRecord>, StoreError> {
        self.reader
            .one(
                "SELECT * FROM approvals WHERE id = ?1",
                (id.to_owned(),),
                |row| approval_from_row(row),
            )
            .await
    }

    async fn approvals(
        &self,
        status: Option<ApprovalStatus>,
        page: &PageRequest,
    ) -> Result<Page<ApprovalRecord>, StoreError> {
        let params = (
            status.map(ApprovalStatus::as_str),
            page.cursor.clone(),
            page.limit.saturating_add(1),
        );
        let items = self
            .reader
            .all(approvals_page(status), params, |row| approval_from_row(row))
            .await?;
        Ok(Page::from_overfetch(items, page.limit, |a| a.id.clone()))
    }

    async fn count_pending_approvals(&self) -> Result<u64, StoreError> {
        let count = self
            .reader
            .one(
                "SELECT COUNT(*) FROM approvals WHERE status = 'pending'",
                (),
                |row| column::<i64>(row, 0),
            )
            .await?;
        Ok(count.unwrap_or(0).max(0) as u64)
    }

    async fn approvals_of_run(&self, run_id: &str) -> Result<Vec<ApprovalRecord>, StoreError> {
        self.reader
            .all(APPROVALS_OF_RUN, (run_id.to_owned(),), |row| {
                approval_from_row(row)
            })
            .await
    }

    async fn tool_calls_of_run(&self, run_id: &str) -> Result<Vec<ToolCallRecord>, StoreError> {
        self.reader
            .all(
                "SELECT * FROM tool_calls WHERE run_id = ?1",
                (run_id.to_owned(),),
                |row| tool_call_from_row(row),
            )
            .await
    }

    async fn client_calls(
        &self,
        ids: &[String],
        owner: &str,
    ) -> Result<Vec<ClientCallRecord>, StoreError> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        self.reader
            .all(
                "SELECT t.*, EXISTS (SELECT 1 FROM tool_calls s WHERE s.run_id = t.run_id
                     AND s.tool_id NOT LIKE 'client.%') AS server_calls
                 FROM tool_calls t JOIN requests r ON r.id = t.request_id
                 WHERE t.tool_id LIKE 'client.%'
                   AND t.model_call_id IN (SELECT value FROM json_each(?1)) AND r.owner = ?2",
                (
                    serde_json::to_string(ids).unwrap_or_default(),
                    owner.to_owned(),
                ),
                |row| {
                    Ok(ClientCallRecord {
                        call: tool_call_from_row(row)?,
                        server_calls: row.int("server_calls")? != 0,
                    })
                },
            )
            .await
    }

    async fn complete_client_call(
        &self,
        run_id: &str,
        call_key: &str,
        result: &Value,
        at: DateTime<Utc>,
    ) -> Result<bool, StoreError> {
        let (run_id, call_key, result) =
            (run_id.to_owned(), call_key.to_owned(), result.to_string());
        self.writer
            .maintain(move |connection| {
                let changed = connection
                    .prepare_cached(
                        "UPDATE tool_calls SET outcome = 'completed', result = ?3, recorded_at = ?4
                         WHERE run_id = ?1 AND call_key = ?2 AND outcome = 'client'",
                    )?
                    .execute(rusqlite::params![
                        run_id,
                        call_key,
                        result,
                        stored_time::text(&at)
                    ])?;
                Ok(changed == 1)
            })
            .await
    }

    async fn input_holder(
        &self,
        owner: &str,
        agent: &str,
        digest: &str,
    ) -> Result<Option<InputHolder>, StoreError> {
        let params = (digest.to_owned(), owner.to_owned(), agent.to_owned());
        self.reader
            .one(INPUT_HOLDER, params, |row| {
                Ok(InputHolder {
                    request_id: row.text("id")?,
                    updated_at: row.time("updated_at")?,
                    prefix_of: row.opt_text("prefix_of")?,
                    prefix_len: column(row, "prefix_len")?,
                    leading_digest: row.opt_text("leading_digest")?,
                })
            })
            .await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.reader
            .step(|connection| {
                connection
                    .query_row("SELECT 1", [], |_| Ok(()))
                    .map_err(reader_error)
            })
            .await
    }

    async fn prunable_sessions(
        &self,
        filter: &PruneFilter,
        after: Option<&str>,
        limit: i64,
    ) -> Result<Vec<String>, StoreError> {
        let agents = serde_json::to_string(&filter.agent_cutoffs)
            .map_err(|e| StoreError::Corrupt(e.to_string()))?;
        let sql = prunable_sessions(after.is_some(), false);
        let params = (
            agents,
            filter.default_cutoff.clone(),
            i64::try_from(filter.min_keep).unwrap_or(i64::MAX),
            after.map(str::to_owned),
            limit,
            None::<String>,
        );
        self.reader.all(sql, params, |row| row.text("id")).await
    }

    async fn count_owned(&self, sessions: &[String]) -> Result<PruneCounts, StoreError> {
        let ids =
            serde_json::to_string(sessions).map_err(|e| StoreError::Corrupt(e.to_string()))?;
        self.reader
            .step(move |connection| {
                let mut counts = [0; 8];
                let tables = super::owned_by_sessions(IN_SESSIONS);
                for (count, (table, rows)) in counts.iter_mut().zip(tables) {
                    let sql = count_owned_sql(table, &rows, "json_array_length");
                    let n: i64 = connection
                        .query_row(&sql, (&ids,), |row| row.get(0))
                        .map_err(reader_error)?;
                    *count = n.max(0) as u64;
                }
                Ok(PruneCounts::from_owned(counts))
            })
            .await
    }

    async fn requests_per_session(&self, sessions: &[String]) -> Result<Vec<u64>, StoreError> {
        let ids =
            serde_json::to_string(sessions).map_err(|e| StoreError::Corrupt(e.to_string()))?;
        let counted = self
            .reader
            .all(
                super::requests_per_session_sql(IN_SESSIONS),
                (ids,),
                |row| Ok((column(row, 0)?, column(row, 1)?)),
            )
            .await?;
        Ok(super::counts_in_order(sessions, counted))
    }

    async fn archive_rows(&self, sessions: &[String]) -> Result<ArchiveRows, StoreError> {
        let ids =
            serde_json::to_string(sessions).map_err(|e| StoreError::Corrupt(e.to_string()))?;
        self.reader
            .step(move |connection| {
                // One read transaction: every table from the same snapshot.
                let snapshot = connection.unchecked_transaction().map_err(reader_error)?;
                let [
                    sessions,
                    messages,
                    requests,
                    runs,
                    events,
                    tool_calls,
                    approvals,
                ] = super::archive_selects(IN_SESSIONS, event_rows!("", ""));
                let mut events = snapshot.prepare(&events).map_err(reader_error)?;
                let events = rows_of(&mut events, (&ids,), |row| events_from_row(row));
                Ok(ArchiveRows {
                    sessions: all_rows(&snapshot, &sessions, (&ids,), |row| session_from_row(row))?,
                    messages: all_rows(&snapshot, &messages, (&ids,), |row| message_from_row(row))?,
                    requests: all_rows(&snapshot, &requests, (&ids,), |row| request_from_row(row))?,
                    runs: all_rows(&snapshot, &runs, (&ids,), |row| run_from_row(row))?,
                    events: EventRows::EVERY.keep_unpacked(events)?,
                    tool_calls: all_rows(&snapshot, &tool_calls, (&ids,), |row| {
                        tool_call_from_row(row)
                    })?,
                    approvals: all_rows(&snapshot, &approvals, (&ids,), |row| {
                        approval_from_row(row)
                    })?,
                })
            })
            .await
    }

    async fn delete_sessions(
        &self,
        filter: &PruneFilter,
        sessions: &[String],
    ) -> Result<PruneCounts, StoreError> {
        let candidates =
            serde_json::to_string(sessions).map_err(|e| StoreError::Corrupt(e.to_string()))?;
        let agents = serde_json::to_string(&filter.agent_cutoffs)
            .map_err(|e| StoreError::Corrupt(e.to_string()))?;
        let default_cutoff = filter.default_cutoff.clone();
        let min_keep = i64::try_from(filter.min_keep).unwrap_or(i64::MAX);
        let limit = i64::try_from(sessions.len()).unwrap_or(i64::MAX);
        self.writer
            .maintain(move |connection| {
                let tx = connection.unchecked_transaction()?;
                // Judged again inside the writer's transaction: a session continued since it
                // was listed is live again and stays.
                let still: Vec<String> = tx
                    .prepare(&prunable_sessions(false, true))?
                    .query_map(
                        rusqlite::params![
                            agents,
                            default_cutoff,
                            min_keep,
                            None::<String>,
                            limit,
                            candidates
                        ],
                        |row| row.get(0),
                    )?
                    .collect::<Result<_, _>>()?;
                let ids = serde_json::to_string(&still).unwrap_or_else(|_| "[]".to_owned());
                let mut counts = [0; 8];
                for (count, (table, rows)) in
                    counts.iter_mut().zip(super::owned_by_sessions(IN_SESSIONS))
                {
                    let delete = format!("DELETE FROM {rows}");
                    *count = if table == "events" {
                        // A row of events may hold several: they are counted, then deleted.
                        let events: i64 = tx.query_row(
                            &count_owned_sql(table, &rows, "json_array_length"),
                            [&ids],
                            |row| row.get(0),
                        )?;
                        tx.execute(&delete, [&ids])?;
                        events.max(0) as u64
                    } else {
                        tx.execute(&delete, [&ids])? as u64
                    };
                }
                tx.commit()?;
                Ok(PruneCounts::from_owned(counts))
            })
            .await
    }

    async fn reclaim_space(&self, max_pages: i64) -> Result<u64, StoreError> {
        self.writer
            .maintain(move |connection| {
                let free = |c: &rusqlite::Connection| {
                    c.query_row("PRAGMA freelist_count", [], |row| row.get::<_, i64>(0))
                };
                let page_size: i64 =
                    connection.query_row("PRAGMA page_size", [], |row| row.get(0))?;
                let before = free(connection)?;
                // One row per page freed: step to the end, or only one page goes.
                let mut vacuum =
                    connection.prepare(&format!("PRAGMA incremental_vacuum({max_pages})"))?;
                let mut freed = vacuum.query([])?;
                while freed.next()?.is_some() {}
                drop(freed);
                drop(vacuum);
                let after = free(connection)?;
                if after < before {
                    // In WAL mode the file shrinks when a checkpoint copies the shorter
                    // database back: do it now rather than at the next background pass.
                    connection.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(()))?;
                }
                Ok((before - after).max(0) as u64 * page_size.max(0) as u64)
            })
            .await
    }

    async fn backup_to(&self, path: &Path) -> Result<u64, StoreError> {
        vacuum_into(&self.reader, path).await
    }

    async fn stats(&self) -> Result<StoreStats, StoreError> {
        let [page_size, free_pages, requests, sessions] = self
            .reader
            .one(
                "SELECT (SELECT page_size FROM pragma_page_size),
                        (SELECT freelist_count FROM pragma_freelist_count),
                        (SELECT COUNT(*) FROM requests),
                        (SELECT COUNT(*) FROM sessions)",
                (),
                |row| {
                    let mut numbers = [0; 4];
                    for (index, number) in numbers.iter_mut().enumerate() {
                        *number = column::<i64>(row, index)?.max(0) as u64;
                    }
                    Ok(numbers)
                },
            )
            .await?
            .unwrap_or_default();
        let file_size = |path: &Path| std::fs::metadata(path).map_or(0, |m| m.len());
        Ok(StoreStats {
            database_bytes: file_size(&self.path),
            wal_bytes: file_size(&with_suffix(&self.path, "-wal")),
            free_bytes: free_pages.saturating_mul(page_size),
            requests,
            sessions,
        })
    }

    async fn record_maintenance(&self, record: &MaintenanceRecord) -> Result<(), StoreError> {
        let record = record.clone();
        self.writer
            .maintain(move |connection| {
                connection.execute(
                    "INSERT INTO maintenance (id, operation, status, started_at, ended_at, report)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
                    rusqlite::params![
                        record.id,
                        record.operation,
                        record.status,
                        stored_time::text(&record.started_at),
                        stored_time::text(&record.ended_at),
                        record.report.to_string()
                    ],
                )?;
                // The record is a log, kept to its newest entries.
                connection.execute(
                    &format!("DELETE FROM maintenance WHERE id NOT IN (SELECT id FROM maintenance ORDER BY id DESC LIMIT {MAINTENANCE_KEPT})"),
                    [],
                )?;
                Ok(())
            })
            .await
    }

    async fn maintenance(&self, limit: i64) -> Result<Vec<MaintenanceRecord>, StoreError> {
        self.reader
            .all(
                "SELECT * FROM maintenance ORDER BY id DESC LIMIT CAST(?1 AS INTEGER)",
                (limit,),
                |row| {
                    Ok(MaintenanceRecord {
                        id: row.text("id")?,
                        operation: row.text("operation")?,
                        status: row.text("status")?,
                        started_at: row.time("started_at")?,
                        ended_at: row.time("ended_at")?,
                        report: row.json("report")?.unwrap_or(Value::Null),
                    })
                },
            )
            .await
    }

    fn describe(&self) -> String {
        format!("sqlite {}", self.path.display())
    }
}

fn tool_call_from_row<R: Columns>(row: &R) -> Result<ToolCallRecord, StoreError> {
    Ok(ToolCallRecord {
        run_id: row.text("run_id")?,
        call_key: row.text("call_key")?,
        model_call_id: row.text("model_call_id")?,
        request_id: row.text("request_id")?,
        tool_id: row.text("tool_id")?,
        arguments: row.json("arguments")?.unwrap_or(Value::Null),
        idempotency_key: row.text("idempotency_key")?,
        executions: row.int("executions")?,
        outcome: row.text("outcome")?,
        result: row.json("result")?.unwrap_or(Value::Null),
        duration_ms: row.int("duration_ms")?,
        recorded_at: row.time("recorded_at")?,
    })
}

#[cfg(test)]
impl SqliteStore {
    /// A new store in a folder of its own, for unit tests (kept while the folder is).
    pub(crate) async fn in_temporary_folder() -> (tempfile::TempDir, SqliteStore) {
        let dir = tempfile::tempdir().expect("a folder");
        let store = SqliteStore::open_file(&dir.path().join("state.db"))
            .await
            .expect("a store");
        (dir, store)
    }

    /// Every row `sql` returns (its parameters unbound: NULL), as `map` reads it, read on
    /// the store's readers.
    pub(crate) async fn rows_read<T: Send + 'static>(
        &self,
        sql: impl Into<String>,
        map: fn(&rusqlite::Row<'_>) -> rusqlite::Result<T>,
    ) -> Vec<T> {
        let sql = sql.into();
        self.reader
            .step(move |connection| {
                let mut statement = connection.prepare(&sql).map_err(reader_error)?;
                // Unbound: a plan's or program's statement names parameters it is not given.
                let mut rows = statement.raw_query();
                let mut read = Vec::new();
                while let Some(row) = rows.next().map_err(reader_error)? {
                    read.push(map(row).map_err(reader_error)?);
                }
                Ok(read)
            })
            .await
            .expect("a read")
    }

    /// The number in the first column of the first row `sql` returns.
    pub(crate) async fn number_read(&self, sql: impl Into<String>) -> i64 {
        let numbers = self.rows_read(sql, |row| row.get(0)).await;
        numbers.first().copied().expect("a row")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    /// The bundled SQLite is built as `.cargo/config.toml` asks: without the shared page
    /// cache group whose global mutex every page fetch took.
    #[tokio::test]
    async fn the_bundled_sqlite_keeps_a_page_cache_per_connection() {
        let (_dir, store) = SqliteStore::in_temporary_folder().await;
        // One library for every connection: the reader pool's tells the writer's too.
        let options: Vec<String> = store
            .rows_read("PRAGMA compile_options", |row| row.get(0))
            .await;
        assert!(
            options.iter().any(|o| o.starts_with("THREADSAFE=1")),
            "{options:?}"
        );
        assert!(
            !options.iter().any(|o| o == "ENABLE_MEMORY_MANAGEMENT"),
            "{options:?}"
        );
    }

    /// A cached statement with a `LIMIT` runs again without being prepared again (see the
    /// module's doc): the writer's claim of runs, bound with a new limit each pass, and
    /// no bare `LIMIT ?` in any of the embedded store's statements.
    #[tokio::test]
    async fn a_limit_bound_again_never_prepares_its_statement_again() {
        let (_dir, store) = SqliteStore::in_temporary_folder().await;
        let leases = store.leases.clone();
        let reprepared = store
            .writer
            .maintain(move |connection| {
                for limit in [1_i64, 256, 7, 256] {
                    let mut claim = connection.prepare_cached(CLAIM_RUNS)?;
                    claim
                        .query_map(
                            rusqlite::params![leases.holder, leases.expiry(), "", limit],
                            |row| row.get::<_, String>(0),
                        )?
                        .collect::<Result<Vec<String>, _>>()?;
                }
                let claim = connection.prepare_cached(CLAIM_RUNS)?;
                Ok(claim.get_status(rusqlite::StatementStatus::RePrepare))
            })
            .await
            .expect("the claim runs");
        assert_eq!(
            reprepared, 0,
            "the claim was prepared again when bound again"
        );
        let bare = regex::Regex::new(r"LIMIT\s+\?").expect("a pattern");
        for (file, source) in [
            ("sqlite.rs", include_str!("sqlite.rs")),
            ("sqlite_memory.rs", include_str!("sqlite_memory.rs")),
            ("sqlite_spend.rs", include_str!("sqlite_spend.rs")),
            ("sqlite_writer.rs", include_str!("sqlite_writer.rs")),
            ("retention.rs", include_str!("retention.rs")),
            ("conditions.rs", include_str!("conditions.rs")),
        ] {
            // Comments and this test's own pattern name what it looks for: statements only.
            let found: Vec<&str> = source
                .lines()
                .filter(|line| !line.trim_start().starts_with("//") && !line.contains("Regex::new"))
                .filter(|line| bare.is_match(line))
                .collect();
            assert!(found.is_empty(), "{file} binds a bare LIMIT: {found:?}");
        }
    }

    /// A run's events in one batch share a row of `events` though the batch's other ops come
    /// between them, and are read back one by one, numbered in order, by request and by run.
    #[tokio::test]
    async fn a_runs_events_share_a_row_across_the_batchs_other_ops() {
        use super::super::{MessageRecord, test_records};
        use serde_json::json;
        let (_dir, store) = SqliteStore::in_temporary_folder().await;
        let session = || WriteOp::TouchSession(test_records::session("ses_a"));
        let event = |n: i64| {
            test_records::event("req_a", "run_a", "runtime.adapter.event", json!({ "n": n }))
        };
        let message = |n: i64| {
            WriteOp::InsertMessage(MessageRecord {
                id: format!("msg_{n}"),
                session_id: "ses_a".into(),
                parent_id: None,
                request_id: Some("req_a".into()),
                role: "assistant".into(),
                content: json!({ "role": "assistant", "content": "hi" }),
                created_at: Utc::now(),
            })
        };
        let request = WriteOp::InsertRequest(test_records::request("req_a", "ses_a"));
        let run = WriteOp::InsertRun(test_records::run("run_a", "req_a"));
        store
            .apply(&[session(), request, event(1), run, message(1), event(2)])
            .await
            .expect("the first batch");
        store
            .apply(&[event(3), message(2), session(), event(4), message(3)])
            .await
            .expect("the second batch");
        let rows = store
            .number_read("SELECT COUNT(*) FROM events WHERE request_id = 'req_a'")
            .await;
        assert_eq!(rows, 2, "one row per batch");
        for events in [
            store.events("req_a", 0, 10).await.expect("by request"),
            store.run_events("run_a", 0, 10).await.expect("by run"),
        ] {
            let read: Vec<(i64, i64)> = events
                .iter()
                .map(|e| (e.seq, e.data["n"].as_i64().unwrap_or(-1)))
                .collect();
            assert_eq!(read, [(1, 1), (2, 2), (3, 3), (4, 4)]);
        }
        let after: Vec<i64> = store
            .events("req_a", 2, 1)
            .await
            .expect("after a cursor")
            .iter()
            .map(|e| e.seq)
            .collect();
        assert_eq!(after, [3]);
    }

    /// A charge of 3 + 4 tokens to `request_id`, in session `ses_1`.
    fn charge(id: &str, request_id: &str) -> super::super::spend::UsageRecord {
        super::super::spend::UsageRecord {
            id: id.to_owned(),
            at: Utc::now(),
            request_id: request_id.to_owned(),
            run_id: format!("run_{request_id}"),
            owner: "key".to_owned(),
            agent_id: "assistant".to_owned(),
            session_id: "ses_1".to_owned(),
            model: "main".to_owned(),
            source: "model".to_owned(),
            prompt_tokens: 3,
            completion_tokens: 4,
            cost_nanos: None,
            estimated: false,
        }
    }

    /// Usage records of `request_id` the reader pool sees.
    async fn usage_rows(store: &SqliteStore, request_id: &str) -> i64 {
        store
            .number_read(format!(
                "SELECT COUNT(*) FROM usage_records WHERE request_id = '{request_id}'"
            ))
            .await
    }

    /// The view of a request is read after its own pending charges are stored, and only
    /// those: flushing every pending charge for each `wait` cost a commit per request at
    /// concurrency. Others' still commit on their own, after `CHARGE_IDLE`, at the
    /// checkpointer's next tick.
    #[tokio::test]
    async fn reading_a_request_stores_its_own_pending_charges_only() {
        use super::super::spend::{SpendStore, UsageRecord};
        let (_dir, store) = SqliteStore::in_temporary_folder().await;
        // Queues `record`, then reads request `req_a` (which does not exist: the read still
        // runs, after its charges).
        let charge_then_read_a = |record: UsageRecord| {
            let store = &store;
            async move {
                store
                    .record_usage(&record, &[], None)
                    .await
                    .expect("queued");
                let view = store.request_in_full("req_a").await.expect("read");
                assert!(view.is_none());
            }
        };
        let started = std::time::Instant::now();
        charge_then_read_a(charge("use_b", "req_b")).await;
        if started.elapsed() < std::time::Duration::from_millis(15) {
            let stored = usage_rows(&store, "req_b").await;
            assert_eq!(stored, 0, "b waits to ride along");
        }
        charge_then_read_a(charge("use_a", "req_a")).await;
        assert_eq!(usage_rows(&store, "req_a").await, 1);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while usage_rows(&store, "req_b").await == 0 {
            assert!(std::time::Instant::now() < deadline, "b was never stored");
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    }

    /// A charge is handed to the writer without a job of its own, so without waking it: it
    /// waits for the next job, past `CHARGE_IDLE` too, until the net (the checkpointer's
    /// tick) asks the writer to take it.
    #[tokio::test]
    async fn a_charge_waits_for_the_writers_next_job_and_the_net_takes_it_once_idle() {
        use super::super::spend::SpendStore;
        let opened = std::time::Instant::now();
        let (_dir, store) = SqliteStore::in_temporary_folder().await;
        store
            .record_usage(&charge("use_a", "req_a"), &[], None)
            .await
            .expect("handed over");
        tokio::time::sleep(std::time::Duration::from_millis(60)).await;
        // The checkpointer ticks at its start and then every 400 ms: before its second tick,
        // nothing but a job could have stored the charge.
        let stored = usage_rows(&store, "req_a").await;
        if opened.elapsed() < CHECKPOINT_EVERY - std::time::Duration::from_millis(50) {
            assert_eq!(stored, 0, "no job ran, so the charge still waits");
        }
        store.writer.take_idle_charges();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while usage_rows(&store, "req_a").await == 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "the charge was never stored"
            );
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        // Stored once, though the net and the checkpointer may both have asked.
        tokio::time::sleep(CHECKPOINT_EVERY).await;
        assert_eq!(usage_rows(&store, "req_a").await, 1);
    }

    /// The plan SQLite chose for `sql`, one line per step.
    async fn plan(store: &SqliteStore, sql: &str) -> String {
        let steps: Vec<String> = store
            .rows_read(format!("EXPLAIN QUERY PLAN {sql}"), |row| row.get("detail"))
            .await;
        steps.join("\n")
    }

    /// Every listing spells only the filters given, so a selective filter reads its index: with
    /// `?n IS NULL OR column = ?n` SQLite planned one statement for every value and walked the
    /// whole table (an archived session's requests, read per session, made a prune
    /// quadratic). Unfiltered pages walk the key backwards without sorting.
    #[tokio::test]
    async fn listings_read_the_index_of_the_filter_given() {
        use super::super::spend::UsageFilter;
        use super::super::{MemoryFilter, MemoryStatus};
        let (_dir, store) = SqliteStore::in_temporary_folder().await;
        let given = || Some("x".to_owned());
        let reads = [
            (
                requests_page(
                    &RequestFilter {
                        session_id: given(),
                        ..RequestFilter::default()
                    },
                    RequestInput::Read,
                ),
                "requests_by_session",
            ),
            (
                requests_page(
                    &RequestFilter {
                        owner: given(),
                        status: Some(RunStatus::Completed),
                        ..RequestFilter::default()
                    },
                    RequestInput::Skipped,
                ),
                "requests_by_owner",
            ),
            (
                approvals_page(Some(ApprovalStatus::Pending)),
                "approvals_by_status",
            ),
            (
                super::super::sqlite_memory::memories_page(&MemoryFilter {
                    status: Some(MemoryStatus::Active),
                    ..MemoryFilter::default()
                }),
                "memories_by_status",
            ),
            (
                super::super::sqlite_memory::memories_page(&MemoryFilter {
                    owner: given(),
                    ..MemoryFilter::default()
                }),
                "memories_by_owner",
            ),
            (
                super::super::sqlite_spend::usage_totals(
                    &UsageFilter {
                        from: Some(Utc::now()),
                        ..UsageFilter::default()
                    },
                    None,
                ),
                "usage_records_at",
            ),
            (
                super::super::sqlite_spend::usage_totals(
                    &UsageFilter {
                        request_id: given(),
                        ..UsageFilter::default()
                    },
                    None,
                ),
                "usage_records_request",
            ),
            (
                prunable_sessions(false, true),
                "SEARCH s USING INDEX sqlite_autoindex_sessions_1 (id=?)",
            ),
            (EVENTS_OF_REQUEST.to_owned(), "events_by_request"),
            (SESSION_HEAD.to_owned(), "messages_by_parent"),
            (CLAIM_RUNS.to_owned(), "runs_live"),
            (RELEASE_LEASES.to_owned(), "runs_live"),
            // The lookup reads the index alone: a row's own columns come after its input.
            (
                INPUT_HOLDER.to_owned(),
                "USING COVERING INDEX requests_by_input_digest",
            ),
        ];
        for (sql, index) in reads {
            let found = plan(&store, &sql).await;
            assert!(found.contains(index), "{index} unread by {sql}: {found}");
        }
        for sql in [
            requests_page(&RequestFilter::default(), RequestInput::Read),
            requests_page(&RequestFilter::default(), RequestInput::Skipped),
            approvals_page(None),
            super::super::sqlite_memory::memories_page(&MemoryFilter::default()),
        ] {
            let found = plan(&store, &sql).await;
            assert!(!found.contains("TEMP B-TREE"), "sorts: {sql}: {found}");
        }
    }

    /// Writing a run evaluates the condition of `runs_live`; spelled `status IN (...)` it
    /// built a temporary b-tree of the statuses for every run written (migration 0011).
    #[tokio::test]
    async fn writing_a_run_builds_no_temporary_table() {
        let (_dir, store) = SqliteStore::in_temporary_folder().await;
        for sql in [
            "INSERT INTO runs (id, request_id, attempt, status, created_at, updated_at)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            "UPDATE runs SET status = ?1, updated_at = ?2 WHERE id = ?3",
        ] {
            let program: Vec<String> = store
                .rows_read(format!("EXPLAIN {sql}"), |row| row.get("opcode"))
                .await;
            assert!(
                program.iter().any(|op| op == "IdxInsert"),
                "{sql}: {program:?}"
            );
            assert!(
                !program.iter().any(|op| op == "OpenEphemeral"),
                "{sql}: {program:?}"
            );
        }
    }

    /// A one-connection pool on the database at `path` (made if missing), migrated up to
    /// `version` when one is given: a store as an older release left it.
    async fn database_at(path: &Path, version: Option<i64>) -> SqlitePool {
        let options = SqliteConnectOptions::from_str("sqlite://")
            .expect("options")
            .filename(path)
            .create_if_missing(true)
            .foreign_keys(true);
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .connect_with(options)
            .await
            .expect("a database");
        if let Some(version) = version {
            MIGRATOR
                .run_to(version, &pool)
                .await
                .expect("an older schema");
        }
        pool
    }

    /// A store as an older release left it, migrated up to `version` and holding `rows`
    /// (SQL of that schema), opened by this one (which migrates it); its folder with it.
    async fn migrated_from(version: i64, rows: &'static str) -> (tempfile::TempDir, SqliteStore) {
        let dir = tempfile::tempdir().expect("a folder");
        let path = dir.path().join("state.db");
        let old = database_at(&path, Some(version)).await;
        sqlx::raw_sql(rows)
            .execute(&old)
            .await
            .expect("rows of the old schema");
        old.close().await;
        let store = SqliteStore::open_file(&path)
            .await
            .expect("the store, migrated");
        (dir, store)
    }

    /// A store from before migration 0015 opens with its transcripts' holders found as before
    /// by their digest, with no digest of leading messages (a turn naming one holds its own
    /// instructions), and one written after has it.
    #[tokio::test]
    async fn transcripts_held_before_their_leading_digest_are_found_without_one() {
        let (_dir, store) = migrated_from(
            14,
            "INSERT INTO sessions (id, agent_id, owner, created_at, updated_at)
                 VALUES ('ses_1', 'a', 'o', '2026-01-01T00:00:00Z', '2026-01-01T00:00:00Z');
             INSERT INTO requests (id, session_id, agent_id, protocol, status, input, owner,
                                   input_digest, created_at, updated_at)
                 VALUES ('req_1', 'ses_1', 'a', 'responses', 'completed',
                         '{\"messages\":[],\"inputDigest\":\"d1\",\"leading\":[]}', 'o', 'd1',
                         '2026-01-01T00:00:00Z', '2026-01-01T00:00:00Z');",
        )
        .await;
        let found = store.input_holder("o", "a", "d1").await.expect("a lookup");
        let found = found.map(|holder| (holder.request_id, holder.leading_digest));
        assert_eq!(found, Some(("req_1".to_owned(), None)));
        // Of owner `o` and agent `a`, as the rows above.
        let mut request = crate::store::test_records::request("req_2", "ses_2");
        request.input =
            serde_json::json!({ "messages": [], "inputDigest": "d2", "leadingDigest": "l2" });
        let session = crate::store::test_records::session("ses_2");
        store
            .apply(&[
                WriteOp::TouchSession(session),
                WriteOp::InsertRequest(request),
            ])
            .await
            .expect("a request written");
        let found = store.input_holder("o", "a", "d2").await.expect("a lookup");
        let found = found.and_then(|holder| holder.leading_digest);
        assert_eq!(found.as_deref(), Some("l2"));
    }

    /// A store from before migration 0010 (events in a `WITHOUT ROWID` table) opens with its
    /// events intact and in order, and its rebuilt table still refuses a number taken twice.
    #[tokio::test]
    async fn events_stored_before_their_table_was_rebuilt_survive_it() {
        // Inserted out of order: the rebuild must keep them by number, not by arrival.
        let (dir, store) = migrated_from(
            9,
            "INSERT INTO sessions (id, agent_id, created_at, updated_at)
                 VALUES ('ses_1', 'support', '2026-01-01T00:00:00Z', '2026-01-01T00:00:00Z');
             INSERT INTO requests (id, session_id, agent_id, protocol, status, input, created_at, updated_at)
                 VALUES ('req_1', 'ses_1', 'support', 'runtime', 'completed', '[]',
                         '2026-01-01T00:00:00Z', '2026-01-01T00:00:00Z');
             INSERT INTO events (request_id, seq, id, run_id, type, at, data) VALUES
                 ('req_1', 3, 'evt_3', 'run_1', 'runtime.request.completed', '2026-01-01T00:00:03Z', '{\"n\":3}'),
                 ('req_1', 1, 'evt_1', 'run_1', 'runtime.request.started', '2026-01-01T00:00:01Z', '{\"n\":1}'),
                 ('req_1', 2, 'evt_2', 'run_1', 'runtime.progress.narration', '2026-01-01T00:00:02Z', '{\"n\":2}');",
        )
        .await;
        let events = store.events("req_1", 0, 10).await.expect("its events");
        let found: Vec<(i64, &str, &str, Value)> = events
            .iter()
            .map(|e| (e.seq, e.id.as_str(), &*e.session_id, e.data["n"].clone()))
            .collect();
        assert_eq!(
            found,
            [
                (1, "evt_1", "ses_1", Value::from(1)),
                (2, "evt_2", "ses_1", Value::from(2)),
                (3, "evt_3", "ses_1", Value::from(3)),
            ]
        );
        assert_eq!(
            store.events("req_1", 2, 10).await.expect("after 2").len(),
            1
        );
        drop(store);

        let raw = database_at(&dir.path().join("state.db"), None).await;
        let taken = sqlx::query(
            "INSERT INTO events (request_id, seq, id, run_id, type, at, data)
             VALUES ('req_1', 2, 'evt_x', 'run_1', 'runtime.progress.narration', '2026-01-01T00:00:04Z', '{}')",
        )
        .execute(&raw)
        .await
        .expect_err("a number taken twice");
        assert!(taken.to_string().contains("UNIQUE"), "{taken}");
    }

    /// A store from before migration 0013 keeps its charges and its sessions' heads: the
    /// ledger rebuilt without an index of its own key still writes a charge once, and the
    /// index of parents without parentless messages still finds a session's head.
    #[tokio::test]
    async fn charges_and_heads_stored_before_their_indexes_changed_survive_it() {
        use super::super::spend::SpendStore;
        let (_dir, store) = migrated_from(
            12,
            "INSERT INTO sessions (id, agent_id, created_at, updated_at)
                 VALUES ('ses_1', 'support', '2026-01-01T00:00:00Z', '2026-01-01T00:00:00Z');
             INSERT INTO messages (id, session_id, parent_id, role, content, created_at) VALUES
                 ('msg_1', 'ses_1', NULL, 'user', '\"hi\"', '2026-01-01T00:00:01Z'),
                 ('msg_2', 'ses_1', 'msg_1', 'assistant', '\"hello\"', '2026-01-01T00:00:02Z'),
                 ('msg_3', 'ses_1', 'msg_1', 'assistant', '\"a branch\"', '2026-01-01T00:00:01Z');
             INSERT INTO usage_records (id, at, request_id, run_id, owner, agent_id, session_id,
                                        model, source, prompt_tokens, completion_tokens,
                                        cost_nanos, estimated) VALUES
                 ('use_1', '2026-01-01T00:00:02Z', 'req_1', 'run_1', 'key', 'support', 'ses_1',
                  'main', 'model', 30, 40, 70, 0),
                 ('use_2', '2026-01-01T00:00:03Z', 'req_1', 'run_1', 'key', 'support', 'ses_1',
                  'main', 'model', 5, 6, NULL, 1);",
        )
        .await;
        // msg_2 and msg_3 have no children; msg_2 is the newer.
        assert_eq!(
            store
                .session_head("ses_1")
                .await
                .expect("a head")
                .as_deref(),
            Some("msg_2")
        );
        assert_eq!(usage_rows(&store, "req_1").await, 2);
        let again = charge("use_1", "req_1");
        let fresh = charge("use_3", "req_1");
        for record in [&again, &fresh, &fresh] {
            store.record_usage(record, &[], None).await.expect("queued");
        }
        // Read after its own pending charges are stored (see the test above).
        store.request_in_full("req_1").await.expect("a read");
        assert_eq!(usage_rows(&store, "req_1").await, 3, "each charge once");
        let kept = store
            .number_read("SELECT prompt_tokens FROM usage_records WHERE id = 'use_1'")
            .await;
        assert_eq!(kept, 30, "a charge written already is left as it is");

        // What the migration is for: two b-trees fewer in a chat request's commit.
        let indexes = |table: &'static str| {
            let store = &store;
            async move {
                let sql = format!("PRAGMA index_list({table})");
                let read = store.rows_read(sql, |row| {
                    Ok((
                        row.get::<_, String>("name")?,
                        row.get::<_, i64>("partial")? == 1,
                    ))
                });
                read.await.into_iter().collect::<BTreeSet<_>>()
            }
        };
        assert_eq!(
            indexes("usage_records").await,
            BTreeSet::from([
                ("usage_records_at".to_owned(), false),
                ("usage_records_request".to_owned(), false),
            ])
        );
        assert!(
            indexes("messages")
                .await
                .contains(&("messages_by_parent".to_owned(), true))
        );
    }
}

#[cfg(test)]
mod checkpointer_tests {
    use super::*;

    #[tokio::test]
    async fn the_checkpointer_copies_again_what_was_written_during_its_pass() {
        let (_dir, store) = SqliteStore::in_temporary_folder().await;
        let writer = &store.writer;
        // A WAL past 4 MiB, whatever the page size.
        let long = 1 << 22;
        let pass = |frames, copied, commits, number| Pass {
            frames,
            copied,
            commits,
            number,
        };
        assert_eq!(after_pass(writer, pass(10, 4, 1, 1)), AfterPass::Done);
        assert_eq!(
            after_pass(writer, pass(long, long, 0, 1)),
            AfterPass::CatchUp,
            "every frame copied and none written since: the database is synced"
        );
        assert_eq!(
            after_pass(writer, pass(long, long, 1, 1)),
            AfterPass::Again,
            "a commit during the pass: SQLite left the database unsynced"
        );
        assert_eq!(
            after_pass(writer, pass(long, long, AGAIN_COMMITS, CATCH_UP_PASSES - 1)),
            AfterPass::Again
        );
        assert_eq!(
            after_pass(writer, pass(long, long - 20, 0, 1)),
            AfterPass::Again,
            "a reader held a few frames back"
        );
        assert_eq!(
            after_pass(writer, pass(long, long - AGAIN_FRAMES, 1, 1)),
            AfterPass::Again
        );
        assert_eq!(
            after_pass(writer, pass(long, long, AGAIN_COMMITS + 1, 1)),
            AfterPass::CatchUp,
            "writes that keep coming would meet the next pass as well"
        );
        assert_eq!(
            after_pass(writer, pass(long, long - AGAIN_FRAMES - 1, 0, 1)),
            AfterPass::CatchUp,
            "too many frames held back for another pass to catch up"
        );
        assert_eq!(
            after_pass(writer, pass(long, long - 20, 1, CATCH_UP_PASSES)),
            AfterPass::CatchUp,
            "the passes are bounded"
        );
    }

    #[tokio::test]
    async fn a_tick_past_the_catch_up_length_starts_the_wal_over() {
        let (_dir, store) = SqliteStore::in_temporary_folder().await;
        // One commit of ~5 MiB: the WAL is past the catch-up's length at once.
        store
            .writer
            .maintain(|connection| {
                connection.execute_batch(
                    "CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT NOT NULL);
                     WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 1300)
                     INSERT INTO t (v) SELECT hex(randomblob(2000)) FROM n;",
                )
            })
            .await
            .expect("the rows");
        let checkpointer =
            SqlitePool::connect_with(SqliteConnectOptions::new().filename(store.path.clone()))
                .await
                .expect("a connection");
        copy_back(&checkpointer, &store.writer)
            .await
            .expect("a tick");
        // The catch-up is the writer's next job: the count after it sees its restart.
        assert_eq!(store.writer.wal_frames().await, 1, "the WAL started over");
        let rows = store.number_read("SELECT COUNT(*) FROM t").await;
        assert_eq!(rows, 1_300);
    }
}
