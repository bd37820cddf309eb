//! The embedded store's read connections: rusqlite connections, read-only, each opened when
//! a read first needs it, each on a thread of its own, lent to one read at a time.
//!
//! A read ([`Readers::step`], [`Readers::one`], [`Readers::all`]) runs whole on its reader's
//! thread: one hop there and one back, whatever its statements, and a read can decide row by
//! row what to read next (a recall reads a candidate's record only while it can still rank).
//! One read at a time keeps to the first reader, whose thread and caches stay warm. Through
//! sqlx's SQLite driver, which the store used before, every statement and the rows it returns
//! were a round trip to the connection's own thread, its pool pinged each connection given
//! back (two more wake-ups a read), and its statement cache and owned rows cost more besides
//! (docs/profiling.md, the sixty-ninth, seventy-second and seventy-third passes).
//!
//! Readers stay open once opened (at most [`READERS`], as many as reads ever ran at once):
//! each holds its page cache, which SQLite empties at the read after any commit anyway. A
//! read the caller stopped awaiting still runs to its end and gives its reader back; a read
//! that fails or panics inside a transaction rolls it back as it unwinds, so the next read
//! sees the database as it is then.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use tokio::sync::Semaphore;

use super::StoreError;
use super::sqlite_writer::classified;

/// Most read connections open at once: reads beyond them wait for one to be given back.
pub(super) const READERS: usize = 4;
/// How long a read waits for a free reader before the store is reported unavailable.
const LEND_TIMEOUT: Duration = Duration::from_secs(30);

/// The readers of one database: up to [`READERS`] threads, each with its own connection,
/// started as reads first need them; one permit a thread that may take a read.
#[derive(Debug)]
pub(super) struct Readers {
    path: PathBuf,
    threads: [std::sync::Mutex<Option<ReaderThread>>; READERS],
    free: Arc<Semaphore>,
}

/// A read as its thread runs it: given the thread's connection, or why it could not open.
type Read = Box<dyn FnOnce(Result<&rusqlite::Connection, StoreError>) + Send>;

/// One reader's thread: the reads it is sent, and whether it runs one now.
#[derive(Debug)]
struct ReaderThread {
    reads: std::sync::mpsc::Sender<Read>,
    busy: Arc<AtomicBool>,
}

impl Readers {
    /// The first thread with no read running, started if need be, marked busy. A caller
    /// holding a permit always finds one (a read frees its thread before its permit).
    fn take_thread(&self) -> Result<(std::sync::mpsc::Sender<Read>, Arc<AtomicBool>), StoreError> {
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
    fn start_thread(&self) -> Result<ReaderThread, StoreError> {
        let (reads, incoming) = std::sync::mpsc::channel::<Read>();
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
        Ok(ReaderThread {
            reads,
            busy: Arc::new(AtomicBool::new(false)),
        })
    }
}

/// Frees a reader's thread when its read ends, however it ends (its result sent, or
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
    // Room for every statement of the requests' paths and the listings' few shapes: one
    // evicted is parsed and planned again at its next use.
    connection.set_prepared_statement_cache_capacity(STATEMENTS_KEPT);
    Ok(connection)
}

/// Column `index` (a position or a name) of a read's row.
pub(super) fn column<T: rusqlite::types::FromSql>(
    row: &rusqlite::Row<'_>,
    index: impl rusqlite::RowIndex,
) -> Result<T, StoreError> {
    row.get(index).map_err(reader_error)
}

/// A read's failure, classified as [`super::sqlite_writer::writer_error`] classifies a write's.
pub(super) fn reader_error(error: rusqlite::Error) -> StoreError {
    classified(error, StoreError::Reader)
}

/// Statements a reader keeps prepared (rusqlite's default is 16).
const STATEMENTS_KEPT: usize = 64;

/// How long a read waits for a lock an outside tool holds.
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);

impl Readers {
    /// Readers of the database at `path` (opened read-only), none opened yet.
    pub(super) fn new(path: PathBuf) -> Self {
        Self {
            path,
            threads: std::array::from_fn(|_| std::sync::Mutex::new(None)),
            free: Arc::new(Semaphore::new(READERS)),
        }
    }

    /// Runs `read` on a reader's connection (opened read-only on first need), on that
    /// reader's own thread, and returns what it returns. One read at a time keeps to one
    /// thread and connection (the first free), whose caches stay warm. The reader is free
    /// again when `read` ends, even if the caller stopped waiting.
    pub(super) async fn step<T: Send + 'static>(
        &self,
        read: impl FnOnce(&rusqlite::Connection) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let permit = tokio::time::timeout(LEND_TIMEOUT, Arc::clone(&self.free).acquire_owned())
            .await
            .map_err(|_| {
                let waited = LEND_TIMEOUT.as_secs();
                StoreError::Unavailable(format!("every reader stayed busy for {waited} s"))
            })?
            .map_err(|_| StoreError::Reader("the readers are closed".into()))?;
        // A permit held means a thread free: each read frees its thread before its permit.
        let (thread, busy) = self.take_thread()?;
        let (done, result) = tokio::sync::oneshot::channel();
        let freed = Freed {
            busy,
            _permit: permit,
        };
        let job: Read = Box::new(move |connection| {
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

    /// The first row `sql` finds for `params` (a lookup by key), as `map` reads it, on a
    /// reader.
    pub(super) async fn one<T: Send + 'static>(
        &self,
        sql: impl AsRef<str> + Send + 'static,
        params: impl rusqlite::Params + Send + 'static,
        map: fn(&rusqlite::Row<'_>) -> Result<T, StoreError>,
    ) -> Result<Option<T>, StoreError> {
        self.step(move |connection| first_row(connection, sql.as_ref(), params, map))
            .await
    }

    /// Every row `sql` finds for `params`, as `map` reads it, on a reader.
    pub(super) async fn all<T: Send + 'static>(
        &self,
        sql: impl AsRef<str> + Send + 'static,
        params: impl rusqlite::Params + Send + 'static,
        map: fn(&rusqlite::Row<'_>) -> Result<T, StoreError>,
    ) -> Result<Vec<T>, StoreError> {
        self.step(move |connection| all_rows(connection, sql.as_ref(), params, map))
            .await
    }
}

/// The first row `sql` (kept prepared) finds for `params`, as `map` reads it.
pub(super) fn first_row<T>(
    connection: &rusqlite::Connection,
    sql: &str,
    params: impl rusqlite::Params,
    map: fn(&rusqlite::Row<'_>) -> Result<T, StoreError>,
) -> Result<Option<T>, StoreError> {
    let mut statement = connection.prepare_cached(sql).map_err(reader_error)?;
    rows_of(&mut statement, params, map).next().transpose()
}

/// Every row `sql` (kept prepared) finds for `params`, as `map` reads it.
pub(super) fn all_rows<T>(
    connection: &rusqlite::Connection,
    sql: &str,
    params: impl rusqlite::Params,
    map: fn(&rusqlite::Row<'_>) -> Result<T, StoreError>,
) -> Result<Vec<T>, StoreError> {
    let mut statement = connection.prepare_cached(sql).map_err(reader_error)?;
    rows_of(&mut statement, params, map).collect()
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Readers of a new database holding one small table, and a connection that writes to
    /// it.
    fn readers_of_a_new_database() -> (tempfile::TempDir, Readers, rusqlite::Connection) {
        let dir = tempfile::tempdir().expect("a folder");
        let path = dir.path().join("state.db");
        let writer = rusqlite::Connection::open(&path).expect("a connection");
        writer
            .execute_batch(
                "PRAGMA journal_mode = WAL;
                 CREATE TABLE numbers (n INTEGER);
                 WITH RECURSIVE up(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM up WHERE n < 100)
                 INSERT INTO numbers SELECT n FROM up;",
            )
            .expect("a table");
        (dir, Readers::new(path), writer)
    }

    fn add_a_row(writer: &rusqlite::Connection) {
        writer
            .execute("INSERT INTO numbers VALUES (101)", [])
            .expect("a row more");
    }

    /// The table's count and sum, read on a reader.
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
            .expect("a read")
    }

    #[tokio::test]
    async fn stepping_reads_keep_one_connection_see_each_commit_and_never_write() {
        let (_dir, readers, writer) = readers_of_a_new_database();
        let started = || {
            let threads = readers.threads.iter();
            threads
                .filter(|thread| thread.lock().is_ok_and(|thread| thread.is_some()))
                .count()
        };
        assert_eq!(started(), 0, "nothing is started before a read needs it");
        assert_eq!(stepped_count_and_sum(&readers).await, (100, 5050));
        add_a_row(&writer);
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
        let (_dir, readers, _writer) = readers_of_a_new_database();
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
        while readers.free.available_permits() > 0 {
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
        assert_eq!(readers.free.available_permits(), READERS);
    }

    #[tokio::test]
    async fn a_read_that_fails_or_panics_inside_a_transaction_leaves_its_reader_fit_for_the_next() {
        let (_dir, readers, writer) = readers_of_a_new_database();
        let failed = readers
            .step(|connection| -> Result<(), StoreError> {
                let snapshot = connection.unchecked_transaction().map_err(reader_error)?;
                snapshot
                    .query_row("SELECT SUM(n) FROM numbers", [], |_| Ok(()))
                    .map_err(reader_error)?;
                Err(StoreError::Corrupt("a row the read cannot use".into()))
            })
            .await;
        assert!(matches!(failed, Err(StoreError::Corrupt(_))), "{failed:?}");
        let panicked = readers
            .step(|connection| -> Result<(), StoreError> {
                let _snapshot = connection.unchecked_transaction().map_err(reader_error)?;
                panic!("a read's own bug, mid-transaction")
            })
            .await;
        assert!(
            matches!(panicked, Err(StoreError::Reader(_))),
            "{panicked:?}"
        );
        // A commit after both: a reader still inside either's snapshot would not see it.
        add_a_row(&writer);
        assert_eq!(
            stepped_count_and_sum(&readers).await,
            (101, 5151),
            "the next read sees the table as it is now"
        );
        let still_in_a_transaction = readers
            .step(|connection| Ok(!connection.is_autocommit()))
            .await
            .expect("a read");
        assert!(!still_in_a_transaction);
    }
}
