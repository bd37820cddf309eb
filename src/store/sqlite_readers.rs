//! The embedded store's read connections, of two kinds, each opened when a read first needs
//! it and lent to one read at a time.
//!
//! Stepping readers ([`Readers::step`], [`Readers::one`], [`Readers::all`]): rusqlite
//! connections, read-only, for the reads on requests' paths (records by key, a request's or
//! run's events, memory recall). Each connection has a thread of its own, and a read runs
//! whole there: one hop there and one back, whatever its statements, and a read can decide
//! row by row what to read next (a recall reads a candidate's record only while it can still
//! rank). One read at a time keeps to the first reader, whose thread and caches stay warm.
//! Through sqlx's SQLite driver every statement, and the rows it returns, is a round trip to
//! the connection's own thread, and its statement cache and owned rows cost more besides
//! (docs/profiling.md, the seventy-second pass).
//!
//! sqlx connections ([`Readers::lend`]) for the listings, counts and maintenance reads not yet
//! moved. Why not sqlx's pool: it pings every connection given back to it before another
//! read may take it, in sqlx's SQLite driver a round trip to the connection's own thread: two
//! more wake-ups after every read, on a machine where a wake-up costs more than most reads'
//! own work (the sixty-ninth pass). The ping guards against a connection left half-way
//! through a command by a read dropped mid-await; a SQLite connection's commands run one
//! after another on its thread, so the next read's command simply runs after what is left of
//! that one (a dropped transaction queues its rollback first, as sqlx's own `Transaction`
//! does), and a local file never goes stale.
//!
//! Connections stay open once opened (at most [`READERS`] of each kind, as many as reads ever
//! ran at once): each holds its page cache, which SQLite empties at the read after any commit
//! anyway. A stepping read the caller stopped awaiting still runs to its end and gives its
//! connection back.

use std::ops::{Deref, DerefMut};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use sqlx::ConnectOptions;
use sqlx::sqlite::{SqliteConnectOptions, SqliteConnection};
use tokio::sync::{MappedMutexGuard, Mutex, MutexGuard, Semaphore, SemaphorePermit};

use super::StoreError;
use super::sqlite_writer::classified;

/// Most read connections open at once: reads beyond them wait for one to be given back.
pub(super) const READERS: usize = 4;
/// How long a read waits for a connection before the store is reported unavailable (sqlx's
/// pool's own default).
const LEND_TIMEOUT: Duration = Duration::from_secs(30);

/// The read connections of one database.
#[derive(Debug)]
pub(super) struct Readers {
    options: SqliteConnectOptions,
    /// A place for each connection, empty until a read first needs it; a read holds the lock
    /// of the one it uses. Reads take the first free place, so that one read at a time keeps
    /// to one connection and one thread.
    places: [Mutex<Option<SqliteConnection>>; READERS],
    /// One permit a free place: a read that holds one always finds a place unlocked.
    free: Semaphore,
    /// The rusqlite connections of [`Readers::step`].
    stepping: Arc<Stepping>,
}

/// The stepping readers: up to [`READERS`] threads, each with its own rusqlite connection,
/// started as reads first need them; one permit a thread that may take a read.
#[derive(Debug)]
struct Stepping {
    path: PathBuf,
    threads: [std::sync::Mutex<Option<SteppingThread>>; READERS],
    free: Arc<Semaphore>,
}

/// A read as its thread runs it: given the thread's connection, or why it could not open.
type SteppingRead = Box<dyn FnOnce(Result<&rusqlite::Connection, StoreError>) + Send>;

/// One stepping reader's thread: the reads it is sent, and whether it runs one now.
#[derive(Debug)]
struct SteppingThread {
    reads: std::sync::mpsc::Sender<SteppingRead>,
    busy: Arc<AtomicBool>,
}

impl Stepping {
    /// The first thread with no read running, started if need be, marked busy. A caller
    /// holding a permit always finds one (a read frees its thread before its permit).
    fn take_thread(
        &self,
    ) -> Result<(std::sync::mpsc::Sender<SteppingRead>, Arc<AtomicBool>), StoreError> {
        for place in &self.threads {
            let mut place = place.lock().unwrap_or_else(PoisonError::into_inner);
            let thread = match &mut *place {
                Some(thread) => thread,
                None => place.insert(self.start_thread()?),
            };
            if !thread.busy.swap(true, Ordering::AcqRel) {
                return Ok((thread.reads.clone(), Arc::clone(&thread.busy)));
            }
        }
        Err(StoreError::Reader("every reader is busy".into()))
    }

    /// Starts a thread that opens its connection at its first read (again after a failed
    /// open) and runs the reads it is sent, until the store is dropped.
    fn start_thread(&self) -> Result<SteppingThread, StoreError> {
        let (reads, incoming) = std::sync::mpsc::channel::<SteppingRead>();
        let path = self.path.clone();
        std::thread::Builder::new()
            .name("sqlite-reader".into())
            .spawn(move || {
                let mut connection = None;
                for read in incoming {
                    if connection.is_none() {
                        match open(&path) {
                            Ok(opened) => connection = Some(opened),
                            Err(error) => {
                                read(Err(reader_error(error)));
                                continue;
                            }
                        }
                    }
                    if let Some(connection) = &connection {
                        // A read that panicked has already dropped its statements and freed
                        // this thread; the thread goes on serving the next.
                        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            read(Ok(connection))
                        }));
                    }
                }
            })
            .map_err(|error| StoreError::Reader(format!("cannot start a reader: {error}")))?;
        Ok(SteppingThread {
            reads,
            busy: Arc::new(AtomicBool::new(false)),
        })
    }
}

/// Frees a stepping reader's thread when its read ends, however it ends (its result sent, or
/// a panic): the thread first, then the permit, so that a read given the permit finds it.
struct Freed {
    busy: Arc<AtomicBool>,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl Drop for Freed {
    fn drop(&mut self) {
        self.busy.store(false, Ordering::Release);
    }
}

/// A read-only connection to the database at `path`.
fn open(path: &std::path::Path) -> Result<rusqlite::Connection, rusqlite::Error> {
    use rusqlite::OpenFlags;
    let connection = rusqlite::Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )?;
    connection.busy_timeout(BUSY_TIMEOUT)?;
    Ok(connection)
}

/// A read's failure, classified as [`super::sqlite_writer::writer_error`] classifies a write's.
pub(super) fn reader_error(error: rusqlite::Error) -> StoreError {
    classified(error, StoreError::Reader)
}

/// How long a read waits for a lock an outside tool holds (sqlx's readers' setting too).
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);

impl Readers {
    /// Read connections with `options` (opened read-only), none opened yet.
    pub(super) fn new(options: SqliteConnectOptions) -> Self {
        let stepping = Arc::new(Stepping {
            path: options.get_filename().to_path_buf(),
            threads: std::array::from_fn(|_| std::sync::Mutex::new(None)),
            free: Arc::new(Semaphore::new(READERS)),
        });
        Self {
            options: options.read_only(true),
            places: std::array::from_fn(|_| Mutex::new(None)),
            free: Semaphore::new(READERS),
            stepping,
        }
    }

    /// Runs `read` on a stepping reader's connection (opened read-only on first need), on
    /// that reader's own thread, and returns what it returns. One read at a time keeps to one
    /// thread and connection (the first free), whose caches stay warm. The reader is free
    /// again when `read` ends, even if the caller stopped waiting.
    pub(super) async fn step<T: Send + 'static>(
        &self,
        read: impl FnOnce(&rusqlite::Connection) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let permit = tokio::time::timeout(
            LEND_TIMEOUT,
            Arc::clone(&self.stepping.free).acquire_owned(),
        )
        .await
        .map_err(|_| sqlx::Error::PoolTimedOut)?
        .map_err(|_| sqlx::Error::PoolClosed)?;
        // A permit held means a thread free: each read frees its thread before its permit.
        let (thread, busy) = self.stepping.take_thread()?;
        let (done, result) = tokio::sync::oneshot::channel();
        let freed = Freed {
            busy,
            _permit: permit,
        };
        let job: SteppingRead = Box::new(move |connection| {
            let result = connection.and_then(read);
            // Freed before the answer: the caller's next read finds this reader free.
            drop(freed);
            let _ = done.send(result);
        });
        thread
            .send(job)
            .map_err(|_| StoreError::Reader("a reader's thread stopped".into()))?;
        result
            .await
            .map_err(|_| StoreError::Reader("a reader's thread stopped mid-read".into()))?
    }

    /// A connection for one read (several statements, or a transaction, if the read needs
    /// them), opened if its place is empty. It is free again when the returned guard drops.
    pub(super) async fn lend(&self) -> Result<Reader<'_>, StoreError> {
        let permit = tokio::time::timeout(LEND_TIMEOUT, self.free.acquire())
            .await
            .map_err(|_| sqlx::Error::PoolTimedOut)?
            .map_err(|_| sqlx::Error::PoolClosed)?;
        // A permit held means a place unlocked: each guard below drops before its permit.
        let mut place = self
            .places
            .iter()
            .find_map(|place| place.try_lock().ok())
            .ok_or(sqlx::Error::PoolTimedOut)?;
        if place.is_none() {
            *place = Some(self.options.connect().await?);
        }
        let connection =
            MutexGuard::try_map(place, Option::as_mut).map_err(|_| sqlx::Error::PoolClosed)?;
        Ok(Reader {
            connection,
            _permit: permit,
        })
    }
}

impl Readers {
    /// The first row `sql` finds for `params` (a lookup by key), as `map` reads it, on a
    /// stepping reader.
    pub(super) async fn one<T: Send + 'static>(
        &self,
        sql: &'static str,
        params: impl rusqlite::Params + Send + 'static,
        map: fn(&rusqlite::Row<'_>) -> Result<T, StoreError>,
    ) -> Result<Option<T>, StoreError> {
        self.step(move |connection| {
            let mut statement = connection.prepare_cached(sql).map_err(reader_error)?;
            rows_of(&mut statement, params, map).next().transpose()
        })
        .await
    }

    /// Every row `sql` finds for `params`, as `map` reads it, on a stepping reader.
    pub(super) async fn all<T: Send + 'static>(
        &self,
        sql: &'static str,
        params: impl rusqlite::Params + Send + 'static,
        map: fn(&rusqlite::Row<'_>) -> Result<T, StoreError>,
    ) -> Result<Vec<T>, StoreError> {
        self.step(move |connection| {
            let mut statement = connection.prepare_cached(sql).map_err(reader_error)?;
            rows_of(&mut statement, params, map).collect()
        })
        .await
    }
}

/// The rows `statement` yields for `params`, each as `map` reads it, one at a time.
pub(super) fn rows_of<'s, T: 's>(
    statement: &'s mut rusqlite::Statement<'_>,
    params: impl rusqlite::Params,
    map: impl Fn(&rusqlite::Row<'_>) -> Result<T, StoreError> + 's,
) -> impl Iterator<Item = Result<T, StoreError>> + 's {
    let (rows, failed) = match statement.query(params) {
        Ok(rows) => (Some(rows.mapped(move |row| Ok(map(row)))), None),
        Err(error) => (None, Some(Err(reader_error(error)))),
    };
    failed.into_iter().chain(
        rows.into_iter()
            .flatten()
            .map(|read| read.map_err(reader_error).and_then(|mapped| mapped)),
    )
}

/// A connection lent to one read; free again, with no round trip, when this drops.
#[derive(Debug)]
pub(super) struct Reader<'a> {
    // Declared (so dropped) before the permit: a read given the permit finds the place free.
    connection: MappedMutexGuard<'a, SqliteConnection>,
    _permit: SemaphorePermit<'a>,
}

impl Deref for Reader<'_> {
    type Target = SqliteConnection;

    fn deref(&self) -> &SqliteConnection {
        &self.connection
    }
}

impl DerefMut for Reader<'_> {
    fn deref_mut(&mut self) -> &mut SqliteConnection {
        &mut self.connection
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::str::FromStr;

    /// Read connections on a new database holding one small table, and a connection that
    /// writes to it.
    async fn readers_of_a_new_database() -> (tempfile::TempDir, Readers, SqliteConnection) {
        let dir = tempfile::tempdir().expect("a folder");
        let options = SqliteConnectOptions::from_str("sqlite://")
            .expect("options")
            .filename(dir.path().join("state.db"))
            .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
            .create_if_missing(true);
        let mut writer = options.connect().await.expect("a connection");
        sqlx::query(
            "CREATE TABLE numbers (n INTEGER);
             WITH RECURSIVE up(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM up WHERE n < 100)
             INSERT INTO numbers SELECT n FROM up;",
        )
        .execute(&mut writer)
        .await
        .expect("a table");
        (dir, Readers::new(options), writer)
    }

    fn open(readers: &Readers) -> usize {
        readers
            .places
            .iter()
            .filter(|place| place.try_lock().is_ok_and(|place| place.is_some()))
            .count()
    }

    async fn count(readers: &Readers) -> i64 {
        sqlx::query_scalar("SELECT COUNT(*) FROM numbers")
            .fetch_one(&mut *readers.lend().await.expect("a reader"))
            .await
            .expect("a count")
    }

    /// How a read's transaction ends.
    enum Ending {
        Committed,
        Dropped,
    }

    /// The table's sum, read in a transaction of its own on a lent connection.
    async fn sum_in_a_transaction(readers: &Readers, ending: Ending) -> i64 {
        let mut reader = readers.lend().await.expect("a reader");
        let mut transaction = sqlx::Connection::begin(&mut *reader).await.expect("begun");
        let sum = sqlx::query_scalar("SELECT SUM(n) FROM numbers")
            .fetch_one(&mut *transaction)
            .await
            .expect("a sum");
        if let Ending::Committed = ending {
            transaction.commit().await.expect("committed");
        }
        sum
    }

    /// The table's count and sum, read by a stepping read.
    async fn stepped_count_and_sum(readers: &Readers) -> (i64, i64) {
        readers
            .step(|connection| {
                connection
                    .query_row("SELECT COUNT(*), SUM(n) FROM numbers", [], |row| {
                        Ok((row.get(0)?, row.get(1)?))
                    })
                    .map_err(reader_error)
            })
            .await
            .expect("a stepping read")
    }

    #[tokio::test]
    async fn stepping_reads_keep_one_connection_see_each_commit_and_never_write() {
        let (_dir, readers, mut writer) = readers_of_a_new_database().await;
        let started = || {
            let threads = readers.stepping.threads.iter();
            threads
                .filter(|thread| thread.lock().is_ok_and(|thread| thread.is_some()))
                .count()
        };
        assert_eq!(started(), 0, "nothing is started before a read needs it");
        assert_eq!(stepped_count_and_sum(&readers).await, (100, 5050));
        sqlx::query("INSERT INTO numbers VALUES (101)")
            .execute(&mut writer)
            .await
            .expect("a row more");
        assert_eq!(
            stepped_count_and_sum(&readers).await,
            (101, 5151),
            "the next read sees the commit made since the last"
        );
        assert_eq!(started(), 1, "both reads kept to the one reader");
        let refused = readers
            .step(|connection| {
                connection
                    .execute("DELETE FROM numbers", [])
                    .map_err(reader_error)
            })
            .await;
        assert!(
            matches!(&refused, Err(StoreError::Reader(message)) if message.contains("readonly")),
            "{refused:?}"
        );
        assert_eq!(stepped_count_and_sum(&readers).await, (101, 5151));
        assert_eq!(started(), 1, "a failed read frees its reader");
    }

    #[tokio::test]
    async fn stepping_reads_beyond_the_readers_wait_and_a_read_that_panics_frees_its_reader() {
        let (_dir, readers, _writer) = readers_of_a_new_database().await;
        let readers = Arc::new(readers);
        // Four reads held inside their readers until let go.
        let (let_go, held) = std::sync::mpsc::channel::<()>();
        let held = Arc::new(std::sync::Mutex::new(held));
        let mut holding = Vec::new();
        for _ in 0..READERS {
            let (readers, held) = (Arc::clone(&readers), Arc::clone(&held));
            holding.push(tokio::spawn(async move {
                readers
                    .step(move |_| {
                        let _ = held.lock().map(|held| held.recv());
                        Ok(())
                    })
                    .await
            }));
        }
        while readers.stepping.free.available_permits() > 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let waiting =
            tokio::time::timeout(Duration::from_millis(50), stepped_count_and_sum(&readers)).await;
        assert!(waiting.is_err(), "a fifth read waits while four run");
        for _ in 0..READERS {
            let_go.send(()).expect("a held read");
        }
        for held in holding {
            held.await.expect("joined").expect("a held read's end");
        }
        let panicked = readers
            .step(|_| -> Result<(), StoreError> { panic!("a read's own bug") })
            .await;
        assert!(
            matches!(panicked, Err(StoreError::Reader(_))),
            "{panicked:?}"
        );
        for _ in 0..READERS + 1 {
            assert_eq!(stepped_count_and_sum(&readers).await, (100, 5050));
        }
        assert_eq!(readers.stepping.free.available_permits(), READERS);
    }

    #[tokio::test]
    async fn reads_one_after_another_keep_to_one_connection_and_none_opens_before_a_read() {
        let (_dir, readers, _writer) = readers_of_a_new_database().await;
        assert_eq!(
            open(&readers),
            0,
            "nothing is opened before a read needs it"
        );
        for _ in 0..5 {
            assert_eq!(count(&readers).await, 100);
        }
        assert_eq!(open(&readers), 1);
    }

    #[tokio::test]
    async fn reads_beyond_the_connections_wait_for_one_given_back() {
        let (_dir, readers, _writer) = readers_of_a_new_database().await;
        let mut lent = Vec::new();
        for _ in 0..READERS {
            lent.push(readers.lend().await.expect("a reader"));
        }
        assert_eq!(READERS, 4);
        let waiting = tokio::time::timeout(Duration::from_millis(50), readers.lend()).await;
        assert!(waiting.is_err(), "a fifth read waits while four are lent");
        lent.pop();
        assert_eq!(
            count(&readers).await,
            100,
            "a connection given back serves the next"
        );
        drop(lent);
        assert_eq!(open(&readers), READERS, "never more than four were opened");
    }

    #[tokio::test]
    async fn a_read_dropped_half_way_leaves_its_connection_fit_for_the_next() {
        let (_dir, readers, mut writer) = readers_of_a_new_database().await;
        // A transaction dropped before its end (a request whose client went away).
        sum_in_a_transaction(&readers, Ending::Dropped).await;
        {
            // A statement whose rows were no longer awaited.
            let mut reader = readers.lend().await.expect("a reader");
            let dropped = tokio::time::timeout(
                Duration::ZERO,
                sqlx::query_scalar::<_, i64>(
                    "WITH RECURSIVE up(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM up
                     WHERE n < 100000) SELECT n FROM up",
                )
                .fetch_all(&mut *reader),
            )
            .await;
            assert!(dropped.is_err(), "the read was dropped before it ended");
        }
        assert_eq!(open(&readers), 1, "both reads used the one connection");
        // A commit after them: a read still inside either one's snapshot would not see it.
        sqlx::query("INSERT INTO numbers VALUES (101)")
            .execute(&mut writer)
            .await
            .expect("a row more");
        let sum = sum_in_a_transaction(&readers, Ending::Committed).await;
        assert_eq!(sum, 5050 + 101, "the next read sees the table as it is now");
    }
}
