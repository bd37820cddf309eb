//! Memory records on the embedded store: a table kept in step with an FTS5 index (Porter
//! stemming) by triggers; writes go through the single writer, reads through the stepping
//! readers (`Readers::step`), where a recall decides row by row what to read.

use chrono::{DateTime, Utc};
use rusqlite::OptionalExtension;

use super::conditions::{self, Dialect};
use super::sqlite::{Columns, SqliteStore};
use super::sqlite_readers::{reader_error, rows_of};
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

fn memory_from_row(row: &impl Columns) -> Result<MemoryRecord, StoreError> {
    let status = row.text("status")?;
    Ok(MemoryRecord {
        id: row.text("id")?,
        namespace: row.text("namespace")?,
        scope: row.text("scope")?,
        owner: row.text("owner")?,
        content: row.text("content")?,
        metadata: row.json("metadata")?.unwrap_or_default(),
        status: MemoryStatus::parse(&status)
            .ok_or_else(|| StoreError::Corrupt(format!("unknown memory status `{status}`")))?,
        content_hash: row.text("content_hash")?,
        near_hash: row.text("near_hash")?,
        source_request_id: row.opt_text("source_request_id")?,
        source_run_id: row.opt_text("source_run_id")?,
        decided_by: row.opt_text("decided_by")?,
        created_at: row.time("created_at")?,
        updated_at: row.time("updated_at")?,
    })
}

/// The records `statement` yields for `params`.
fn memories_of(
    statement: &mut rusqlite::Statement<'_>,
    params: impl rusqlite::Params,
) -> Result<Vec<MemoryRecord>, StoreError> {
    rows_of(statement, params, |row| memory_from_row(row)).collect()
}

/// Matches ranked by relevance alone before recall reads any row: enough that the records
/// of the namespace asked about are among them whenever it holds most of the matches.
const RECALL_CANDIDATES: i64 = 200;

/// The best matches of the whole index by relevance (bm25 as FTS5's `rank`: negative, better
/// is lower), best first.
const RECALL_RANKED: &str = "SELECT rowid, rank FROM memory_fts WHERE memory_fts MATCH ?1
     ORDER BY rank LIMIT CAST(?2 AS INTEGER)";
// Dividing by the age factor moves an old record's score towards 0, behind fresher ones of the
// same relevance (a month-old record counts half). `?3` is the recall's time ([`RECALL_TIME`]).
const RECALL_CANDIDATE: &str = "SELECT *,
       ?2 / (1.0 + max(?3 - julianday(updated_at), 0) / 30.0) AS recall_score
     FROM memories WHERE rowid = ?1 AND namespace = ?4 AND scope = ?5 AND status = 'active'";
// A recall's time as a Julian day, read once for all its candidates (each its own statement),
// from the text the store writes times in: SQLite reads it as it reads `updated_at`.
const RECALL_TIME: &str = "SELECT julianday(?1)";
// The full-text search is the outer loop (CROSS JOIN): the planner would otherwise walk the
// namespace's rows and run the search again for each one.
const RECALL_EVERY_MATCH: &str =
    "SELECT m.* FROM memory_fts CROSS JOIN memories m ON m.rowid = memory_fts.rowid
     WHERE memory_fts MATCH ?4 AND m.namespace = ?1 AND m.scope = ?2 AND m.status = 'active'
     ORDER BY bm25(memory_fts)
            / (1.0 + max(julianday('now') - julianday(m.updated_at), 0) / 30.0),
              m.id DESC
     LIMIT CAST(?3 AS INTEGER)";

/// The best `limit` active records of `namespace` and `scope` matching the FTS5 `query`, by
/// relevance weighed by age (`RECALL_CANDIDATE`), then by id, newest first.
///
/// The best [`RECALL_CANDIDATES`] matches of the whole index come out of FTS5 best first, and
/// a candidate's record is read only while it can still rank: its score is never better than
/// its relevance (age only moves it towards 0), so once `limit` records are kept, a candidate
/// whose relevance is already worse than the last kept score, and every one after it, cannot.
/// Where the candidates end before `limit` records of the namespace are found, every match is
/// read and ranked (`RECALL_EVERY_MATCH`).
fn recall_ranked(
    connection: &rusqlite::Connection,
    namespace: &str,
    scope: &str,
    query: &str,
    limit: usize,
) -> Result<Vec<MemoryRecord>, StoreError> {
    if limit == 0 {
        return Ok(Vec::new());
    }
    let now: f64 = connection
        .prepare_cached(RECALL_TIME)
        .and_then(|mut time| time.query_row([stored_time::now()], |row| row.get(0)))
        .map_err(reader_error)?;
    let candidates = i64::try_from(limit)
        .unwrap_or(i64::MAX)
        .saturating_mul(20)
        .max(RECALL_CANDIDATES);
    let mut ranked = connection
        .prepare_cached(RECALL_RANKED)
        .map_err(reader_error)?;
    let mut read = connection
        .prepare_cached(RECALL_CANDIDATE)
        .map_err(reader_error)?;
    // The best kept so far, best first: (score, record).
    let mut kept: Vec<(f64, MemoryRecord)> = Vec::with_capacity(limit + 1);
    let mut seen = 0i64;
    let mut matches = ranked
        .query(rusqlite::params![query, candidates])
        .map_err(reader_error)?;
    while let Some(hit) = matches.next().map_err(reader_error)? {
        seen += 1;
        let (rowid, relevance): (i64, f64) = (
            hit.get(0).map_err(reader_error)?,
            hit.get(1).map_err(reader_error)?,
        );
        if kept.len() == limit && kept.last().is_some_and(|(worst, _)| relevance > *worst) {
            return Ok(kept.into_iter().map(|(_, record)| record).collect());
        }
        let mut rows = read
            .query(rusqlite::params![rowid, relevance, now, namespace, scope])
            .map_err(reader_error)?;
        let Some(row) = rows.next().map_err(reader_error)? else {
            continue;
        };
        // SQLite orders a NULL score (an unreadable time) first.
        let score = row
            .get::<_, Option<f64>>("recall_score")
            .map_err(reader_error)?
            .unwrap_or(f64::NEG_INFINITY);
        let record = memory_from_row(row)?;
        let place = kept.partition_point(|(better, other)| {
            *better < score || (*better == score && other.id > record.id)
        });
        if place < limit {
            kept.insert(place, (score, record));
            kept.truncate(limit);
        }
    }
    if kept.len() == limit || seen < candidates {
        return Ok(kept.into_iter().map(|(_, record)| record).collect());
    }
    let mut every = connection
        .prepare_cached(RECALL_EVERY_MATCH)
        .map_err(reader_error)?;
    memories_of(
        &mut every,
        rusqlite::params![
            namespace,
            scope,
            i64::try_from(limit).unwrap_or(i64::MAX),
            query
        ],
    )
}

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
        self.reader
            .one(
                "SELECT * FROM memories WHERE id = ?1",
                (id.to_owned(),),
                |row| memory_from_row(row),
            )
            .await
    }

    async fn memories(
        &self,
        filter: &MemoryFilter,
        page: &PageRequest,
    ) -> Result<Page<MemoryRecord>, StoreError> {
        let sql = memories_page(filter);
        let words = (!filter.words.is_empty()).then(|| any_of(&filter.words));
        let params = (
            filter.namespace.clone(),
            filter.status.map(MemoryStatus::as_str),
            filter.owner.clone(),
            page.cursor.clone(),
            words,
            page.limit.saturating_add(1),
        );
        let items = self
            .reader
            .all(sql, params, |row| memory_from_row(row))
            .await?;
        Ok(Page::from_overfetch(items, page.limit, |m| m.id.clone()))
    }

    async fn recall_memories(
        &self,
        namespace: &str,
        scope: &str,
        words: &[String],
        limit: i64,
    ) -> Result<Vec<MemoryRecord>, StoreError> {
        // A negative limit asks for nothing (SQLite would read it as no limit at all).
        let Ok(count) = usize::try_from(limit) else {
            return Ok(Vec::new());
        };
        let (namespace, scope) = (namespace.to_owned(), scope.to_owned());
        if words.is_empty() {
            return self
                .reader
                .all(
                    "SELECT * FROM memories
                     WHERE namespace = ?1 AND scope = ?2 AND status = 'active'
                     ORDER BY updated_at DESC LIMIT CAST(?3 AS INTEGER)",
                    (namespace, scope, limit),
                    |row| memory_from_row(row),
                )
                .await;
        }
        let query = any_of(words);
        self.reader
            .step(move |connection| recall_ranked(connection, &namespace, &scope, &query, count))
            .await
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::{content_hash, near_hash, search_words};
    use crate::store::MemoryStore;

    /// `count` records of four to nine words of a 40-word vocabulary (the later words far
    /// rarer: some match a handful of records, some thousands), up to ~90 days old, spread
    /// over two namespaces (one of 5% of the records), two scopes and three statuses; the
    /// same every run.
    fn records(count: usize) -> Vec<MemoryRecord> {
        let mut rng = fastrand::Rng::with_seed(16);
        let vocabulary: Vec<String> = (0..40).map(|n| format!("word{n}")).collect();
        let now = Utc::now();
        (0..count)
            .map(|n| {
                let content = (0..rng.usize(4..10))
                    .map(|_| vocabulary[(rng.f64().powi(3) * 40.0) as usize].as_str())
                    .collect::<Vec<_>>()
                    .join(" ");
                let at = now - chrono::Duration::minutes(rng.i64(0..90 * 24 * 60));
                MemoryRecord {
                    id: format!("mem_{n:05}"),
                    namespace: ["agent/a", "agent/b"][usize::from(rng.u8(..20) == 0)].to_owned(),
                    scope: ["", "key-b"][usize::from(rng.u8(..10) == 0)].to_owned(),
                    owner: "key-a".to_owned(),
                    content_hash: content_hash(&format!("{n} {content}")),
                    near_hash: near_hash(&format!("{n} {content}")),
                    content,
                    metadata: serde_json::json!({ "n": n }),
                    status: [
                        MemoryStatus::Active,
                        MemoryStatus::Archived,
                        MemoryStatus::Pending,
                    ][usize::from(rng.u8(..10) == 0) + usize::from(rng.u8(..20) == 0)],
                    source_request_id: None,
                    source_run_id: None,
                    decided_by: None,
                    created_at: at,
                    updated_at: at,
                }
            })
            .collect()
    }

    /// What a recall finds, by definition: the namespace's best among the candidates, all of
    /// them read and ranked in one statement; every match ranked where that finds too few.
    const CANDIDATES_RANKED: &str = "SELECT m.* FROM
           (SELECT rowid AS hit, rank AS relevance FROM memory_fts WHERE memory_fts MATCH ?4
             ORDER BY rank LIMIT CAST(?5 AS INTEGER)) f
         CROSS JOIN memories m ON m.rowid = f.hit
         WHERE m.namespace = ?1 AND m.scope = ?2 AND m.status = 'active'
         ORDER BY f.relevance / (1.0 + max(julianday('now') - julianday(m.updated_at), 0) / 30.0),
                  m.id DESC
         LIMIT CAST(?3 AS INTEGER)";

    /// The recall that reads candidates only while they can rank finds what ranking them all
    /// finds: the same records in the same order, for many questions and limits, with more
    /// and fewer matches than candidates.
    #[tokio::test]
    async fn recall_reading_only_what_can_rank_finds_what_ranking_every_match_finds() {
        let dir = tempfile::tempdir().expect("a folder");
        let path = dir.path().join("state.db");
        let store = SqliteStore::open_file(&path).await.expect("a store");
        store
            .import_memories(&records(3_000))
            .await
            .expect("imported");
        let connection = rusqlite::Connection::open(&path).expect("a connection");
        let mut every = connection.prepare(RECALL_EVERY_MATCH).expect("prepared");
        let mut candidates = connection.prepare(CANDIDATES_RANKED).expect("prepared");
        let mut rng = fastrand::Rng::with_seed(95);
        let mut compared = 0;
        let (mut filled, mut short) = (0, 0);
        for _ in 0..200 {
            let words: Vec<String> = (0..rng.usize(1..4))
                .map(|_| format!("word{}", rng.usize(..40)))
                .collect();
            let query = any_of(&search_words(&words.join(" ")));
            let (namespace, scope) = (["agent/a", "agent/b"][rng.usize(..2)], "");
            let limit = [1, 3, 5, 8, 20][rng.usize(..5)];
            let stepped =
                recall_ranked(&connection, namespace, scope, &query, limit).expect("a recall");
            let cap = (limit as i64 * 20).max(RECALL_CANDIDATES);
            let asked = rusqlite::params![namespace, scope, limit as i64, query, cap];
            let mut ranked = memories_of(&mut candidates, asked).expect("candidates ranked");
            if ranked.len() < limit {
                ranked = memories_of(&mut every, &asked[..4]).expect("every match ranked");
            }
            let ids = |records: &[MemoryRecord]| -> Vec<String> {
                records.iter().map(|m| m.id.clone()).collect()
            };
            assert_eq!(
                ids(&stepped),
                ids(&ranked),
                "{query} in {namespace}, {limit}"
            );
            assert_eq!(stepped, ranked, "records read whole");
            compared += 1;
            filled += usize::from(stepped.len() == limit);
            short += usize::from(stepped.len() < limit);
        }
        assert_eq!(compared, 200);
        assert!(filled > 50 && short > 5, "{filled} filled, {short} short");
    }
}
