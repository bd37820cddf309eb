//! The embedded store's read connections: a few sqlx SQLite connections, each lent to one read
//! at a time and opened when a read first needs it.
//!
//! Why not sqlx's pool: it pings every connection given back to it before another read may
//! take it, and in sqlx's SQLite driver a ping is a round trip to the connection's own thread:
//! two more wake-ups after every read, on a machine where a wake-up costs more than most
//! reads' own work (docs/profiling.md, the sixty-ninth pass). The ping guards against a
//! connection left half-way through a command by a read dropped mid-await; a SQLite
//! connection's commands run one after another on its thread, so the next read's command
//! simply runs after what is left of that one (a dropped transaction queues its rollback
//! first, as sqlx's own `Transaction` does), and a local file never goes stale.
//!
//! Connections stay open once opened (at most [`READERS`], as many as reads ever ran at once):
//! each holds its thread and its page cache, which SQLite empties at the read after any commit
//! anyway.
//!
//! Beside them, a few rusqlite connections ([`Readers::step`]) for reads that decide row by
//! row what to read next (a memory recall reads a candidate's record only while it can still
//! rank among the best): each such read runs whole on one of the runtime's blocking threads,
//! one hop there and one back, where through sqlx every statement is a round trip.

use std::ops::{Deref, DerefMut};
use std::path::PathBuf;
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use sqlx::ConnectOptions;
use sqlx::sqlite::{SqliteConnectOptions, SqliteConnection};
use tokio::sync::{MappedMutexGuard, Mutex, MutexGuard, Semaphore, SemaphorePermit};

use super::StoreError;
use super::sqlite_writer::may_pass;

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

/// The rusqlite read connections: those not lent, and one permit a connection that may be
/// lent (at most [`READERS`] open).
#[derive(Debug)]
struct Stepping {
    path: PathBuf,
    idle: std::sync::Mutex<Vec<rusqlite::Connection>>,
    free: Arc<Semaphore>,
}

impl Stepping {
    fn open(&self) -> Result<rusqlite::Connection, rusqlite::Error> {
        use rusqlite::OpenFlags;
        let connection = rusqlite::Connection::open_with_flags(
            &self.path,
            OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )?;
        connection.busy_timeout(BUSY_TIMEOUT)?;
        Ok(connection)
    }
}

/// A read's failure, classified as [`super::sqlite_writer::writer_error`] classifies a write's.
pub(super) fn reader_error(error: rusqlite::Error) -> StoreError {
    if may_pass(&error) {
        StoreError::Unavailable(error.to_string())
    } else {
        StoreError::Reader(error.to_string())
    }
}

/// How long a read waits for a lock an outside tool holds (sqlx's readers' setting too).
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);

impl Readers {
    /// Read connections with `options` (opened read-only), none opened yet.
    pub(super) fn new(options: SqliteConnectOptions) -> Self {
        let stepping = Arc::new(Stepping {
            path: options.get_filename().to_path_buf(),
            idle: std::sync::Mutex::new(Vec::with_capacity(READERS)),
            free: Arc::new(Semaphore::new(READERS)),
        });
        Self {
            options: options.read_only(true),
            places: std::array::from_fn(|_| Mutex::new(None)),
            free: Semaphore::new(READERS),
            stepping,
        }
    }

    /// Runs `read` on a rusqlite connection (opened read-only on first need) on one of the
    /// runtime's blocking threads, and returns what it returns. The connection is free again
    /// when `read` ends, even if the caller stopped waiting.
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
        let stepping = Arc::clone(&self.stepping);
        tokio::task::spawn_blocking(move || {
            let _permit = permit;
            let idle = || stepping.idle.lock().unwrap_or_else(PoisonError::into_inner);
            let kept = idle().pop();
            let connection = match kept {
                Some(connection) => connection,
                None => stepping.open().map_err(reader_error)?,
            };
            let result = read(&connection);
            idle().push(connection);
            result
        })
        .await
        .map_err(|stopped| StoreError::Reader(format!("a read stopped: {stopped}")))?
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
            let mut rows = statement.query(params).map_err(reader_error)?;
            rows.next().map_err(reader_error)?.map(map).transpose()
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
        let idle = || readers.stepping.idle.lock().expect("the idle list").len();
        assert_eq!(idle(), 0, "nothing is opened before a read needs it");
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
        assert_eq!(idle(), 1, "both reads used the one connection");
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
        assert_eq!(idle(), 1, "a failed read gives its connection back");
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
