//! The embedded store: one SQLite file in write-ahead-log mode.
//!
//! Writes go through a pool of exactly one connection, so they queue in the runtime instead of
//! spinning on SQLite's busy lock; reads use their own small pool and never wait for a writer
//! (WAL readers see the last committed state). `synchronous = NORMAL` in WAL mode makes a
//! commit durable against a process crash without an fsync per commit.

use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteRow, SqliteSynchronous,
};
use sqlx::{Row, SqlitePool};

use super::{
    EventRecord, MessageRecord, Page, PageRequest, RequestFilter, RequestRecord, RunRecord,
    RunStatus, SessionRecord, Store, StoreError, WriteOp,
};

/// Events per multi-row INSERT (9 parameters each, well under SQLite's parameter limit).
const MAX_EVENTS_PER_INSERT: usize = 64;

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("migrations/sqlite");

#[derive(Debug, Clone)]
pub struct SqliteStore {
    path: PathBuf,
    writer: SqlitePool,
    reader: SqlitePool,
}

impl SqliteStore {
    /// Opens (creating the file and its folder if needed) and migrates the database at `path`.
    pub async fn open_file(path: &Path) -> Result<Self, StoreError> {
        if let Some(parent) = path.parent()
            && !parent.as_os_str().is_empty()
        {
            std::fs::create_dir_all(parent).map_err(|source| StoreError::Folder {
                path: parent.display().to_string(),
                source,
            })?;
        }
        let options = SqliteConnectOptions::from_str("sqlite://")?
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            .busy_timeout(Duration::from_secs(10))
            .foreign_keys(true);
        // The writer never checkpoints inside a commit (that fsync is a latency spike on the
        // request path); a background task checkpoints instead.
        let writer = SqlitePoolOptions::new()
            .max_connections(1)
            .min_connections(1)
            .connect_with(options.clone().pragma("wal_autocheckpoint", "0"))
            .await?;
        MIGRATOR.run(&writer).await?;
        let reader = SqlitePoolOptions::new()
            .max_connections(4)
            .min_connections(1)
            .connect_with(options.clone().read_only(true))
            .await?;
        let checkpointer = SqlitePoolOptions::new()
            .max_connections(1)
            .min_connections(1)
            .connect_with(options)
            .await?;
        tokio::spawn(checkpoint_loop(checkpointer));
        Ok(Self {
            path: path.to_path_buf(),
            writer,
            reader,
        })
    }
}

/// Folds the write-ahead log back into the database once a second, off the request path.
/// PASSIVE never blocks the writer; it stops by itself when the store is dropped (pool closed).
async fn checkpoint_loop(pool: SqlitePool) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if pool.is_closed() {
            return;
        }
        if let Err(error) = sqlx::query("PRAGMA wal_checkpoint(PASSIVE)")
            .execute(&pool)
            .await
        {
            if pool.is_closed() {
                return;
            }
            tracing::warn!(%error, "WAL checkpoint failed");
        }
    }
}

/// One multi-row INSERT for a run of `AppendEvent` ops (other ops are skipped).
fn events_insert(ops: &[WriteOp]) -> sqlx::QueryBuilder<sqlx::Sqlite> {
    let mut insert = sqlx::QueryBuilder::new(
        "INSERT INTO events (id, request_id, run_id, session_id, agent_id, seq, type, at, data) ",
    );
    let events = ops.iter().filter_map(|op| match op {
        WriteOp::AppendEvent(event) => Some(event),
        _ => None,
    });
    insert.push_values(events, |mut row, event| {
        row.push_bind(&event.id)
            .push_bind(&event.request_id)
            .push_bind(&event.run_id)
            .push_bind(&event.session_id)
            .push_bind(&event.agent_id)
            .push_bind(event.seq)
            .push_bind(&event.event_type)
            .push_bind(time(&event.at))
            .push_bind(json(&event.data));
    });
    insert
}

fn json(value: &Value) -> String {
    value.to_string()
}

fn json_opt(value: &Option<Value>) -> Option<String> {
    value.as_ref().map(json)
}

fn parse_json(text: Option<String>) -> Result<Option<Value>, StoreError> {
    text.map(|t| {
        serde_json::from_str(&t).map_err(|e| StoreError::Corrupt(format!("JSON column: {e}")))
    })
    .transpose()
}

fn parse_status(text: &str) -> Result<RunStatus, StoreError> {
    RunStatus::parse(text).ok_or_else(|| StoreError::Corrupt(format!("unknown status `{text}`")))
}

fn time(value: &DateTime<Utc>) -> String {
    value.to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
}

fn parse_time(text: &str) -> Result<DateTime<Utc>, StoreError> {
    DateTime::parse_from_rfc3339(text)
        .map(|t| t.with_timezone(&Utc))
        .map_err(|e| StoreError::Corrupt(format!("timestamp `{text}`: {e}")))
}

fn parse_time_opt(text: Option<String>) -> Result<Option<DateTime<Utc>>, StoreError> {
    text.as_deref().map(parse_time).transpose()
}

fn request_from_row(row: &SqliteRow) -> Result<RequestRecord, StoreError> {
    Ok(RequestRecord {
        id: row.try_get("id")?,
        session_id: row.try_get("session_id")?,
        agent_id: row.try_get("agent_id")?,
        protocol: row.try_get("protocol")?,
        status: parse_status(&row.try_get::<String, _>("status")?)?,
        input: parse_json(row.try_get("input")?)?.unwrap_or(Value::Null),
        output: row.try_get("output")?,
        error: parse_json(row.try_get("error")?)?,
        usage: parse_json(row.try_get("usage")?)?,
        metadata: parse_json(row.try_get("metadata")?)?.unwrap_or(Value::Null),
        created_at: parse_time(&row.try_get::<String, _>("created_at")?)?,
        updated_at: parse_time(&row.try_get::<String, _>("updated_at")?)?,
    })
}

fn run_from_row(row: &SqliteRow) -> Result<RunRecord, StoreError> {
    Ok(RunRecord {
        id: row.try_get("id")?,
        request_id: row.try_get("request_id")?,
        attempt: row.try_get("attempt")?,
        status: parse_status(&row.try_get::<String, _>("status")?)?,
        state: parse_json(row.try_get("state")?)?,
        error: parse_json(row.try_get("error")?)?,
        created_at: parse_time(&row.try_get::<String, _>("created_at")?)?,
        updated_at: parse_time(&row.try_get::<String, _>("updated_at")?)?,
        started_at: parse_time_opt(row.try_get("started_at")?)?,
        ended_at: parse_time_opt(row.try_get("ended_at")?)?,
    })
}

fn event_from_row(row: &SqliteRow) -> Result<EventRecord, StoreError> {
    Ok(EventRecord {
        id: row.try_get("id")?,
        request_id: row.try_get("request_id")?,
        run_id: row.try_get("run_id")?,
        session_id: row.try_get("session_id")?,
        agent_id: row.try_get("agent_id")?,
        seq: row.try_get("seq")?,
        event_type: row.try_get("type")?,
        at: parse_time(&row.try_get::<String, _>("at")?)?,
        data: parse_json(row.try_get("data")?)?.unwrap_or(Value::Null),
    })
}

const EVENT_COLUMNS: &str = "id, request_id, run_id, session_id, agent_id, seq, type, at, data";

#[async_trait::async_trait]
impl Store for SqliteStore {
    async fn apply(&self, ops: &[WriteOp]) -> Result<(), StoreError> {
        // A batch of nothing but events is one statement, atomic on its own: no BEGIN/COMMIT
        // round trips (the common case while a run streams).
        if ops.len() <= MAX_EVENTS_PER_INSERT
            && ops.iter().all(|op| matches!(op, WriteOp::AppendEvent(_)))
        {
            if !ops.is_empty() {
                events_insert(ops).build().execute(&self.writer).await?;
            }
            return Ok(());
        }
        let mut tx = self.writer.begin().await?;
        let mut index = 0;
        while index < ops.len() {
            // Consecutive events (a streaming burst) go in one multi-row INSERT: each statement
            // is a round trip to the connection's thread, so fewer statements is lower latency.
            let burst = ops[index..]
                .iter()
                .take(MAX_EVENTS_PER_INSERT)
                .take_while(|op| matches!(op, WriteOp::AppendEvent(_)))
                .count();
            if burst > 0 {
                let mut insert = events_insert(&ops[index..index + burst]);
                insert.build().execute(&mut *tx).await?;
                index += burst;
                continue;
            }
            let op = &ops[index];
            index += 1;
            match op {
                WriteOp::TouchSession(session) => {
                    sqlx::query(
                        "INSERT INTO sessions (id, agent_id, metadata, created_at, updated_at) VALUES (?, ?, ?, ?, ?)
                         ON CONFLICT(id) DO UPDATE SET updated_at = excluded.updated_at",
                    )
                    .bind(&session.id)
                    .bind(&session.agent_id)
                    .bind(json(&session.metadata))
                    .bind(time(&session.created_at))
                    .bind(time(&session.updated_at))
                    .execute(&mut *tx)
                    .await?;
                }
                WriteOp::InsertMessage(message) => {
                    sqlx::query(
                        "INSERT INTO messages (id, session_id, parent_id, request_id, role, content, created_at)
                         VALUES (?, ?, ?, ?, ?, ?, ?)",
                    )
                    .bind(&message.id)
                    .bind(&message.session_id)
                    .bind(&message.parent_id)
                    .bind(&message.request_id)
                    .bind(&message.role)
                    .bind(json(&message.content))
                    .bind(time(&message.created_at))
                    .execute(&mut *tx)
                    .await?;
                }
                WriteOp::InsertRequest(request) => {
                    sqlx::query(
                        "INSERT INTO requests (id, session_id, agent_id, protocol, status, input, output, error, usage,
                         metadata, created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    )
                    .bind(&request.id)
                    .bind(&request.session_id)
                    .bind(&request.agent_id)
                    .bind(&request.protocol)
                    .bind(request.status.as_str())
                    .bind(json(&request.input))
                    .bind(&request.output)
                    .bind(json_opt(&request.error))
                    .bind(json_opt(&request.usage))
                    .bind(json(&request.metadata))
                    .bind(time(&request.created_at))
                    .bind(time(&request.updated_at))
                    .execute(&mut *tx)
                    .await?;
                }
                WriteOp::UpdateRequest {
                    id,
                    status,
                    output,
                    error,
                    usage,
                    at,
                } => {
                    sqlx::query(
                        "UPDATE requests SET status = ?, output = COALESCE(?, output), error = ?,
                         usage = COALESCE(?, usage), updated_at = ? WHERE id = ?",
                    )
                    .bind(status.as_str())
                    .bind(output)
                    .bind(json_opt(error))
                    .bind(json_opt(usage))
                    .bind(time(at))
                    .bind(id)
                    .execute(&mut *tx)
                    .await?;
                }
                WriteOp::InsertRun(run) => {
                    sqlx::query(
                        "INSERT INTO runs (id, request_id, attempt, status, state, error, created_at, updated_at,
                         started_at, ended_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    )
                    .bind(&run.id)
                    .bind(&run.request_id)
                    .bind(run.attempt)
                    .bind(run.status.as_str())
                    .bind(json_opt(&run.state))
                    .bind(json_opt(&run.error))
                    .bind(time(&run.created_at))
                    .bind(time(&run.updated_at))
                    .bind(run.started_at.as_ref().map(time))
                    .bind(run.ended_at.as_ref().map(time))
                    .execute(&mut *tx)
                    .await?;
                }
                WriteOp::UpdateRun {
                    id,
                    status,
                    error,
                    state,
                    at,
                } => {
                    let at = time(at);
                    sqlx::query(
                        "UPDATE runs SET status = ?1, error = COALESCE(?2, error), state = COALESCE(?3, state),
                         updated_at = ?4,
                         started_at = CASE WHEN ?1 = 'running' THEN COALESCE(started_at, ?4) ELSE started_at END,
                         ended_at = CASE WHEN ?1 IN ('completed', 'failed', 'cancelled') THEN ?4 ELSE ended_at END
                         WHERE id = ?5",
                    )
                    .bind(status.as_str())
                    .bind(json_opt(error))
                    .bind(json_opt(state))
                    .bind(&at)
                    .bind(id)
                    .execute(&mut *tx)
                    .await?;
                }
                WriteOp::AppendEvent(_) => {}
            }
        }
        tx.commit().await?;
        Ok(())
    }

    async fn request(&self, id: &str) -> Result<Option<RequestRecord>, StoreError> {
        let row = sqlx::query("SELECT * FROM requests WHERE id = ?")
            .bind(id)
            .fetch_optional(&self.reader)
            .await?;
        row.as_ref().map(request_from_row).transpose()
    }

    async fn requests(
        &self,
        filter: &RequestFilter,
        page: &PageRequest,
    ) -> Result<Page<RequestRecord>, StoreError> {
        // Fixed SQL with optional filters: `? IS NULL OR column = ?` keeps it one prepared statement.
        let rows = sqlx::query(
            "SELECT * FROM requests
             WHERE (?1 IS NULL OR status = ?1) AND (?2 IS NULL OR agent_id = ?2)
               AND (?3 IS NULL OR session_id = ?3) AND (?4 IS NULL OR id < ?4)
             ORDER BY id DESC LIMIT ?5",
        )
        .bind(filter.status.map(RunStatus::as_str))
        .bind(&filter.agent_id)
        .bind(&filter.session_id)
        .bind(&page.cursor)
        .bind(page.limit + 1)
        .fetch_all(&self.reader)
        .await?;
        let mut items = rows
            .iter()
            .map(request_from_row)
            .collect::<Result<Vec<_>, _>>()?;
        let next_cursor = if items.len() as i64 > page.limit {
            items.truncate(page.limit as usize);
            items.last().map(|r| r.id.clone())
        } else {
            None
        };
        Ok(Page { items, next_cursor })
    }

    async fn run(&self, id: &str) -> Result<Option<RunRecord>, StoreError> {
        let row = sqlx::query("SELECT * FROM runs WHERE id = ?")
            .bind(id)
            .fetch_optional(&self.reader)
            .await?;
        row.as_ref().map(run_from_row).transpose()
    }

    async fn runs_of(&self, request_id: &str) -> Result<Vec<RunRecord>, StoreError> {
        let rows = sqlx::query("SELECT * FROM runs WHERE request_id = ? ORDER BY attempt")
            .bind(request_id)
            .fetch_all(&self.reader)
            .await?;
        rows.iter().map(run_from_row).collect()
    }

    async fn runs_with_status(&self, statuses: &[RunStatus]) -> Result<Vec<RunRecord>, StoreError> {
        let wanted: Vec<&str> = statuses.iter().map(|s| s.as_str()).collect();
        let rows = sqlx::query("SELECT * FROM runs WHERE status IN (SELECT value FROM json_each(?)) ORDER BY created_at")
            .bind(serde_json::to_string(&wanted).unwrap_or_default())
            .fetch_all(&self.reader)
            .await?;
        rows.iter().map(run_from_row).collect()
    }

    async fn events(
        &self,
        request_id: &str,
        after: i64,
        limit: i64,
    ) -> Result<Vec<EventRecord>, StoreError> {
        let sql = format!(
            "SELECT {EVENT_COLUMNS} FROM events WHERE request_id = ? AND seq > ? ORDER BY seq LIMIT ?"
        );
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(request_id)
            .bind(after)
            .bind(limit)
            .fetch_all(&self.reader)
            .await?;
        rows.iter().map(event_from_row).collect()
    }

    async fn run_events(
        &self,
        run_id: &str,
        after: i64,
        limit: i64,
    ) -> Result<Vec<EventRecord>, StoreError> {
        let sql = format!(
            "SELECT {EVENT_COLUMNS} FROM events WHERE run_id = ? AND seq > ? ORDER BY seq LIMIT ?"
        );
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(run_id)
            .bind(after)
            .bind(limit)
            .fetch_all(&self.reader)
            .await?;
        rows.iter().map(event_from_row).collect()
    }

    async fn last_seq(&self, request_id: &str) -> Result<i64, StoreError> {
        let row =
            sqlx::query("SELECT COALESCE(MAX(seq), 0) AS seq FROM events WHERE request_id = ?")
                .bind(request_id)
                .fetch_one(&self.reader)
                .await?;
        Ok(row.try_get("seq")?)
    }

    async fn session(&self, id: &str) -> Result<Option<SessionRecord>, StoreError> {
        let row = sqlx::query("SELECT * FROM sessions WHERE id = ?")
            .bind(id)
            .fetch_optional(&self.reader)
            .await?;
        row.map(|row| {
            Ok(SessionRecord {
                id: row.try_get("id")?,
                agent_id: row.try_get("agent_id")?,
                metadata: parse_json(row.try_get("metadata")?)?.unwrap_or(Value::Null),
                created_at: parse_time(&row.try_get::<String, _>("created_at")?)?,
                updated_at: parse_time(&row.try_get::<String, _>("updated_at")?)?,
            })
        })
        .transpose()
    }

    async fn messages(&self, session_id: &str) -> Result<Vec<MessageRecord>, StoreError> {
        let rows =
            sqlx::query("SELECT * FROM messages WHERE session_id = ? ORDER BY created_at, id")
                .bind(session_id)
                .fetch_all(&self.reader)
                .await?;
        rows.iter()
            .map(|row| {
                Ok(MessageRecord {
                    id: row.try_get("id")?,
                    session_id: row.try_get("session_id")?,
                    parent_id: row.try_get("parent_id")?,
                    request_id: row.try_get("request_id")?,
                    role: row.try_get("role")?,
                    content: parse_json(row.try_get("content")?)?.unwrap_or(Value::Null),
                    created_at: parse_time(&row.try_get::<String, _>("created_at")?)?,
                })
            })
            .collect()
    }

    async fn ping(&self) -> Result<(), StoreError> {
        sqlx::query("SELECT 1").execute(&self.reader).await?;
        Ok(())
    }

    fn describe(&self) -> String {
        format!("sqlite {}", self.path.display())
    }
}
