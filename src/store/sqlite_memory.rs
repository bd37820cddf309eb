//! Memory records on the embedded store: a table kept in step with an FTS5 index (Porter
//! stemming) by triggers; writes go through the single writer, reads through the pool.

use chrono::{DateTime, Utc};
use rusqlite::OptionalExtension;
use sqlx::Row;
use sqlx::sqlite::SqliteRow;

use super::conditions::{self, Dialect};
use super::sqlite::{SqliteStore, parse_json};
use super::stored_time;
use super::{
    CompactReport, MemoryFilter, MemoryRecord, MemoryStatus, MemoryStore, MemoryTransition, Page,
    PageRequest, StoreError,
};

/// The upsert every write uses: a record of the same namespace, scope and content is the
/// same record, only its `updated_at` moves.
const PUT: &str = "INSERT INTO memories (id, namespace, scope, owner, content, metadata, status,
     content_hash, near_hash, source_request_id, source_run_id, decided_by, created_at, updated_at)
     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14)
     ON CONFLICT(namespace, scope, content_hash) DO UPDATE SET updated_at = excluded.updated_at
     RETURNING id";

fn put(connection: &rusqlite::Connection, record: &MemoryRecord) -> rusqlite::Result<String> {
    connection.prepare_cached(PUT)?.query_row(
        rusqlite::params![
            record.id,
            record.namespace,
            record.scope,
            record.owner,
            record.content,
            record.metadata.to_string(),
            record.status.as_str(),
            record.content_hash,
            record.near_hash,
            record.source_request_id,
            record.source_run_id,
            record.decided_by,
            stored_time::text(&record.created_at),
            stored_time::text(&record.updated_at),
        ],
        |row| row.get(0),
    )
}

fn memory_from_row(row: &SqliteRow) -> Result<MemoryRecord, StoreError> {
    let status: String = row.try_get("status")?;
    Ok(MemoryRecord {
        id: row.try_get("id")?,
        namespace: row.try_get("namespace")?,
        scope: row.try_get("scope")?,
        owner: row.try_get("owner")?,
        content: row.try_get("content")?,
        metadata: parse_json(row.try_get("metadata")?)?.unwrap_or_default(),
        status: MemoryStatus::parse(&status)
            .ok_or_else(|| StoreError::Corrupt(format!("unknown memory status `{status}`")))?,
        content_hash: row.try_get("content_hash")?,
        near_hash: row.try_get("near_hash")?,
        source_request_id: row.try_get("source_request_id")?,
        source_run_id: row.try_get("source_run_id")?,
        decided_by: row.try_get("decided_by")?,
        created_at: stored_time::parse(&row.try_get::<String, _>("created_at")?)?,
        updated_at: stored_time::parse(&row.try_get::<String, _>("updated_at")?)?,
    })
}

/// Matches ranked by relevance alone before recall reads any row: enough that the records
/// of the namespace asked about are among them whenever it holds most of the matches.
const RECALL_CANDIDATES: i64 = 200;

// bm25 (`rank`) is negative, better is lower: dividing by the age factor moves an old record's
// score towards 0, behind fresher ones of the same relevance (a month-old record counts half).
// The full-text search is the outer loop (CROSS JOIN, a subquery): the planner would otherwise
// walk the namespace's rows and run the search again for each one.
const RECALL_FROM_CANDIDATES: &str = "SELECT m.* FROM
       (SELECT rowid AS hit, rank AS relevance FROM memory_fts WHERE memory_fts MATCH ?4
         ORDER BY rank LIMIT CAST(?5 AS INTEGER)) f
     CROSS JOIN memories m ON m.rowid = f.hit
     WHERE m.namespace = ?1 AND m.scope = ?2 AND m.status = 'active'
     ORDER BY f.relevance / (1.0 + max(julianday('now') - julianday(m.updated_at), 0) / 30.0),
              m.id DESC
     LIMIT CAST(?3 AS INTEGER)";
const RECALL_EVERY_MATCH: &str =
    "SELECT m.* FROM memory_fts CROSS JOIN memories m ON m.rowid = memory_fts.rowid
     WHERE memory_fts MATCH ?4 AND m.namespace = ?1 AND m.scope = ?2 AND m.status = 'active'
     ORDER BY bm25(memory_fts)
            / (1.0 + max(julianday('now') - julianday(m.updated_at), 0) / 30.0),
              m.id DESC
     LIMIT CAST(?3 AS INTEGER)";

/// An FTS5 query matching any of `words`, each a quoted string (no operator can slip in).
fn any_of(words: &[String]) -> String {
    words
        .iter()
        .map(|word| format!("\"{}\"", word.replace('"', "\"\"")))
        .collect::<Vec<_>>()
        .join(" OR ")
}

impl SqliteStore {
    async fn memory_required(&self, id: &str) -> Result<MemoryRecord, StoreError> {
        self.memory(id)
            .await?
            .ok_or_else(|| StoreError::Corrupt(format!("memory `{id}` vanished after its write")))
    }
}

/// A page of memories, newest first, spelled from the filters given: a status's or an
/// owner's read their index (`memories_by_status`, `memories_by_owner`).
pub(super) fn memories_page(filter: &MemoryFilter) -> String {
    let conditions = conditions::of_memories(
        filter,
        "rowid IN (SELECT rowid FROM memory_fts WHERE memory_fts MATCH ?5)",
        Dialect::Sqlite,
    );
    format!("SELECT * FROM memories WHERE {conditions} ORDER BY id DESC LIMIT CAST(?6 AS INTEGER)")
}

#[async_trait::async_trait]
impl MemoryStore for SqliteStore {
    async fn put_memory(&self, record: &MemoryRecord) -> Result<(MemoryRecord, bool), StoreError> {
        let owned = record.clone();
        let id = self
            .writer
            .maintain(move |connection| put(connection, &owned))
            .await?;
        let merged = id != record.id;
        Ok((self.memory_required(&id).await?, merged))
    }

    async fn import_memories(&self, records: &[MemoryRecord]) -> Result<u64, StoreError> {
        let records = records.to_vec();
        self.writer
            .maintain(move |connection| {
                let transaction = connection.unchecked_transaction()?;
                let mut merged = 0;
                for record in &records {
                    if put(&transaction, record)? != record.id {
                        merged += 1;
                    }
                }
                transaction.commit()?;
                Ok(merged)
            })
            .await
    }

    async fn memory(&self, id: &str) -> Result<Option<MemoryRecord>, StoreError> {
        let row = sqlx::query("SELECT * FROM memories WHERE id = ?")
            .bind(id)
            .fetch_optional(&mut *self.reader.lend().await?)
            .await?;
        row.as_ref().map(memory_from_row).transpose()
    }

    async fn memories(
        &self,
        filter: &MemoryFilter,
        page: &PageRequest,
    ) -> Result<Page<MemoryRecord>, StoreError> {
        let words = (!filter.words.is_empty()).then(|| any_of(&filter.words));
        let rows = sqlx::query(sqlx::AssertSqlSafe(memories_page(filter)))
            .bind(&filter.namespace)
            .bind(filter.status.map(MemoryStatus::as_str))
            .bind(&filter.owner)
            .bind(&page.cursor)
            .bind(words)
            .bind(page.limit + 1)
            .fetch_all(&mut *self.reader.lend().await?)
            .await?;
        let items = rows
            .iter()
            .map(memory_from_row)
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Page::from_overfetch(items, page.limit, |m| m.id.clone()))
    }

    async fn recall_memories(
        &self,
        namespace: &str,
        scope: &str,
        words: &[String],
        limit: i64,
    ) -> Result<Vec<MemoryRecord>, StoreError> {
        if words.is_empty() {
            let rows = sqlx::query(
                "SELECT * FROM memories WHERE namespace = ?1 AND scope = ?2 AND status = 'active'
                 ORDER BY updated_at DESC LIMIT CAST(?3 AS INTEGER)",
            )
            .bind(namespace)
            .bind(scope)
            .bind(limit)
            .fetch_all(&mut *self.reader.lend().await?)
            .await?;
            return rows.iter().map(memory_from_row).collect();
        }
        // First the most relevant matches of the whole index, ranked inside FTS5 (cheap),
        // then only those rows read and filtered; when they hold too few of this namespace's
        // records, every match is read.
        let candidates = limit.saturating_mul(20).max(RECALL_CANDIDATES);
        let query = any_of(words);
        let rows = sqlx::query(RECALL_FROM_CANDIDATES)
            .bind(namespace)
            .bind(scope)
            .bind(limit)
            .bind(&query)
            .bind(candidates)
            .fetch_all(&mut *self.reader.lend().await?)
            .await?;
        let rows = if (rows.len() as i64) < limit {
            sqlx::query(RECALL_EVERY_MATCH)
                .bind(namespace)
                .bind(scope)
                .bind(limit)
                .bind(&query)
                .fetch_all(&mut *self.reader.lend().await?)
                .await?
        } else {
            rows
        };
        rows.iter().map(memory_from_row).collect()
    }

    async fn set_memory_status(
        &self,
        id: &str,
        from: &[MemoryStatus],
        to: MemoryStatus,
        by: &str,
        at: DateTime<Utc>,
    ) -> Result<MemoryTransition, StoreError> {
        let from: Vec<&str> = from.iter().map(|s| s.as_str()).collect();
        let from = serde_json::to_string(&from).unwrap_or_default();
        let (id_owned, by) = (id.to_owned(), by.to_owned());
        let found = self
            .writer
            .maintain(move |connection| {
                let changed = connection
                    .prepare_cached(
                        "UPDATE memories SET status = ?2, decided_by = ?3, updated_at = ?4
                         WHERE id = ?1 AND status IN (SELECT value FROM json_each(?5))",
                    )?
                    .execute(rusqlite::params![
                        id_owned,
                        to.as_str(),
                        by,
                        stored_time::text(&at),
                        from
                    ])?;
                if changed == 1 {
                    return Ok(None);
                }
                connection
                    .query_row(
                        "SELECT status FROM memories WHERE id = ?1",
                        [&id_owned],
                        |row| row.get::<_, String>(0),
                    )
                    .optional()
                    .map(Some)
            })
            .await?;
        match found {
            None => Ok(MemoryTransition::Changed(Box::new(
                self.memory_required(id).await?,
            ))),
            Some(None) => Ok(MemoryTransition::NotFound),
            Some(Some(status)) => MemoryStatus::parse(&status)
                .map(MemoryTransition::Refused)
                .ok_or_else(|| StoreError::Corrupt(format!("unknown memory status `{status}`"))),
        }
    }

    async fn delete_memory(&self, id: &str) -> Result<bool, StoreError> {
        let id = id.to_owned();
        self.writer
            .maintain(move |connection| {
                connection
                    .execute("DELETE FROM memories WHERE id = ?1", [&id])
                    .map(|deleted| deleted == 1)
            })
            .await
    }

    async fn compact_memories(
        &self,
        namespace: Option<&str>,
        expire_before: Option<DateTime<Utc>>,
        at: DateTime<Utc>,
    ) -> Result<CompactReport, StoreError> {
        let namespace = namespace.map(str::to_owned);
        self.writer
            .maintain(move |connection| {
                let transaction = connection.unchecked_transaction()?;
                // The newest of a group of near-duplicates never has a newer one: it stays,
                // whatever order the rows are visited in.
                let merged = transaction.execute(
                    "UPDATE memories SET status = 'archived', decided_by = 'compaction',
                            updated_at = ?2
                     WHERE status = 'active' AND (?1 IS NULL OR namespace = ?1)
                       AND EXISTS (SELECT 1 FROM memories n
                            WHERE n.namespace = memories.namespace AND n.scope = memories.scope
                              AND n.near_hash = memories.near_hash AND n.status = 'active'
                              AND (n.updated_at > memories.updated_at
                                   OR (n.updated_at = memories.updated_at AND n.id > memories.id)))",
                    rusqlite::params![namespace, stored_time::text(&at)],
                )?;
                let expired = match expire_before {
                    Some(cutoff) => transaction.execute(
                        "UPDATE memories SET status = 'archived', decided_by = 'compaction',
                                updated_at = ?2
                         WHERE status = 'active' AND (?1 IS NULL OR namespace = ?1)
                           AND updated_at < ?3",
                        rusqlite::params![namespace, stored_time::text(&at), stored_time::text(&cutoff)],
                    )?,
                    None => 0,
                };
                transaction.commit()?;
                Ok(CompactReport {
                    merged: merged as u64,
                    expired: expired as u64,
                })
            })
            .await
    }
}
