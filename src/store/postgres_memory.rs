//! Memory records on PostgreSQL: the table carries a stored English `tsvector` of the content
//! with a GIN index; relevance is `ts_rank`, weighed by recency.

use std::collections::{HashMap, HashSet};

use chrono::{DateTime, Utc};
use sqlx::Row;
use sqlx::postgres::PgRow;

use super::conditions::{self, Dialect};
use super::postgres::{PostgresStore, json, text};
use super::{
    CompactReport, MemoryFilter, MemoryRecord, MemoryStatus, MemoryStore, MemoryTransition, Page,
    PageRequest, StoreError,
};

/// An upsert of memory records from `$source` (rows of the fourteen columns), returning
/// `$returning`: a record of the same namespace, scope and content is the same record, only
/// its `updated_at` moves. [`PUT`] and [`PUT_MANY`] share it, so they merge alike.
macro_rules! upsert_memories {
    ($source:literal, $returning:literal) => {
        concat!(
            "INSERT INTO memories (id, namespace, scope, owner, content, metadata, status,
             content_hash, near_hash, source_request_id, source_run_id, decided_by, created_at,
             updated_at) ",
            $source,
            " ON CONFLICT (namespace, scope, content_hash)
             DO UPDATE SET updated_at = excluded.updated_at RETURNING ",
            $returning
        )
    };
}

const PUT: &str = upsert_memories!(
    "VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)",
    "*"
);

fn put<'q>(
    record: &'q MemoryRecord,
) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
    sqlx::query(PUT)
        .bind(text(&record.id))
        .bind(text(&record.namespace))
        .bind(text(&record.scope))
        .bind(text(&record.owner))
        .bind(text(&record.content))
        .bind(json(&record.metadata))
        .bind(record.status.as_str())
        .bind(&record.content_hash)
        .bind(&record.near_hash)
        .bind(record.source_request_id.as_deref().map(text))
        .bind(record.source_run_id.as_deref().map(text))
        .bind(record.decided_by.as_deref().map(text))
        .bind(record.created_at)
        .bind(record.updated_at)
}

/// Records an import writes in one statement: a round trip carries a thousand, not one.
const IMPORT_CHUNK: usize = 1_000;

/// [`PUT`] for many records at once, each column bound as an array, returning only the ids.
/// The records' keys (namespace, scope, content hash) must differ: one statement cannot merge
/// a row twice.
const PUT_MANY: &str = upsert_memories!(
    "SELECT * FROM UNNEST($1::text[], $2::text[], $3::text[], $4::text[], $5::text[],
            $6::jsonb[], $7::text[], $8::text[], $9::text[], $10::text[], $11::text[],
            $12::text[], $13::timestamptz[], $14::timestamptz[])",
    "id"
);

fn put_many(
    records: &[MemoryRecord],
) -> sqlx::query::Query<'_, sqlx::Postgres, sqlx::postgres::PgArguments> {
    let column = |field: fn(&MemoryRecord) -> &str| -> Vec<String> {
        records.iter().map(|record| text(field(record))).collect()
    };
    let optional = |field: fn(&MemoryRecord) -> Option<&str>| -> Vec<Option<String>> {
        records
            .iter()
            .map(|record| field(record).map(text))
            .collect()
    };
    sqlx::query(PUT_MANY)
        .bind(column(|r| &r.id))
        .bind(column(|r| &r.namespace))
        .bind(column(|r| &r.scope))
        .bind(column(|r| &r.owner))
        .bind(column(|r| &r.content))
        .bind(
            records
                .iter()
                .map(|r| json(&r.metadata))
                .collect::<Vec<_>>(),
        )
        .bind(column(|r| r.status.as_str()))
        .bind(column(|r| &r.content_hash))
        .bind(column(|r| &r.near_hash))
        .bind(optional(|r| r.source_request_id.as_deref()))
        .bind(optional(|r| r.source_run_id.as_deref()))
        .bind(optional(|r| r.decided_by.as_deref()))
        .bind(records.iter().map(|r| r.created_at).collect::<Vec<_>>())
        .bind(records.iter().map(|r| r.updated_at).collect::<Vec<_>>())
}

/// The records of an import with those of one key (namespace, scope and content hash, as
/// PostgreSQL holds them) merged as [`PUT`] merges them one after another: the first one's
/// fields and the last one's `updated_at`; and how many were merged so.
fn merged_within(records: &[MemoryRecord]) -> (Vec<MemoryRecord>, u64) {
    let mut first_of: HashMap<(String, String, &str), usize> = HashMap::new();
    let mut kept: Vec<MemoryRecord> = Vec::with_capacity(records.len());
    let mut merged = 0;
    for record in records {
        let key = (
            text(&record.namespace),
            text(&record.scope),
            record.content_hash.as_str(),
        );
        match first_of.get(&key) {
            Some(&at) => {
                kept[at].updated_at = record.updated_at;
                merged += 1;
            }
            None => {
                first_of.insert(key, kept.len());
                kept.push(record.clone());
            }
        }
    }
    (kept, merged)
}

fn memory_from_row(row: &PgRow) -> Result<MemoryRecord, StoreError> {
    let status: String = row.try_get("status")?;
    Ok(MemoryRecord {
        id: row.try_get("id")?,
        namespace: row.try_get("namespace")?,
        scope: row.try_get("scope")?,
        owner: row.try_get("owner")?,
        content: row.try_get("content")?,
        metadata: row.try_get("metadata")?,
        status: MemoryStatus::parse(&status)
            .ok_or_else(|| StoreError::Corrupt(format!("unknown memory status `{status}`")))?,
        content_hash: row.try_get("content_hash")?,
        near_hash: row.try_get("near_hash")?,
        source_request_id: row.try_get("source_request_id")?,
        source_run_id: row.try_get("source_run_id")?,
        decided_by: row.try_get("decided_by")?,
        created_at: row.try_get("created_at")?,
        updated_at: row.try_get("updated_at")?,
    })
}

/// A `tsquery` matching any of `words`, each a quoted lexeme (no operator can slip in).
fn any_of(words: &[String]) -> String {
    words
        .iter()
        .map(|word| format!("'{}'", word.replace(['\'', '\\'], "")))
        .collect::<Vec<_>>()
        .join(" | ")
}

#[async_trait::async_trait]
impl MemoryStore for PostgresStore {
    async fn put_memory(&self, record: &MemoryRecord) -> Result<(MemoryRecord, bool), StoreError> {
        let row = put(record).fetch_one(&self.pool).await?;
        let stored = memory_from_row(&row)?;
        let merged = stored.id != record.id;
        Ok((stored, merged))
    }

    async fn import_memories(&self, records: &[MemoryRecord]) -> Result<u64, StoreError> {
        let (records, mut merged) = merged_within(records);
        let mut transaction = self.pool.begin().await?;
        for chunk in records.chunks(IMPORT_CHUNK) {
            let stored: Vec<String> = put_many(chunk)
                .fetch_all(&mut *transaction)
                .await?
                .iter()
                .map(|row| row.try_get("id"))
                .collect::<Result<_, _>>()?;
            // A record merged into one stored before answers with the stored one's id.
            let ids: HashSet<&str> = chunk.iter().map(|record| record.id.as_str()).collect();
            merged += stored
                .iter()
                .filter(|id| !ids.contains(id.as_str()))
                .count() as u64;
        }
        transaction.commit().await?;
        Ok(merged)
    }

    async fn memory(&self, id: &str) -> Result<Option<MemoryRecord>, StoreError> {
        let row = sqlx::query("SELECT * FROM memories WHERE id = $1")
            .bind(text(id))
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(memory_from_row).transpose()
    }

    async fn memories(
        &self,
        filter: &MemoryFilter,
        page: &PageRequest,
    ) -> Result<Page<MemoryRecord>, StoreError> {
        let words = (!filter.words.is_empty()).then(|| any_of(&filter.words));
        let conditions = conditions::of_memories(
            filter,
            "words @@ to_tsquery('english', $5)",
            Dialect::Postgres,
        );
        let sql = format!("SELECT * FROM memories WHERE {conditions} ORDER BY id DESC LIMIT $6");
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(filter.namespace.as_deref().map(text))
            .bind(filter.status.map(MemoryStatus::as_str))
            .bind(filter.owner.as_deref().map(text))
            .bind(page.cursor.as_deref().map(text))
            .bind(words)
            .bind(page.limit + 1)
            .fetch_all(&self.pool)
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
        let query = if words.is_empty() {
            sqlx::query(
                "SELECT * FROM memories WHERE namespace = $1 AND scope = $2 AND status = 'active'
                 ORDER BY updated_at DESC LIMIT $3",
            )
            .bind(text(namespace))
            .bind(text(scope))
            .bind(limit)
        } else {
            // The matches come from the GIN index first (a materialized CTE): a prepared
            // statement's generic plan would otherwise walk the namespace's rows by the btree
            // and test each against the query. They are ranked with only what the ranking
            // reads, and the best `limit` read whole after: a match's content and metadata
            // are not copied into the CTE for the few kept. A month-old record counts half;
            // its age is `date_part`'s double, not `EXTRACT`'s numeric (PostgreSQL 14 on),
            // whose arithmetic for every match took a tenth of a large recall's time.
            sqlx::query(
                "WITH hits AS MATERIALIZED (
                     SELECT m.id, m.namespace, m.scope, m.status, m.updated_at,
                            ts_rank(m.words, q) AS relevance
                       FROM memories m, to_tsquery('english', $4) q
                      WHERE m.words @@ q),
                 best AS (
                     SELECT id, relevance
                                / (1.0 + GREATEST(date_part('epoch', now() - updated_at), 0)
                                         / 2592000.0) AS weight
                       FROM hits
                      WHERE namespace = $1 AND scope = $2 AND status = 'active'
                      ORDER BY weight DESC, id DESC
                      LIMIT $3)
                 SELECT m.* FROM best JOIN memories m ON m.id = best.id
                  ORDER BY best.weight DESC, m.id DESC",
            )
            .bind(text(namespace))
            .bind(text(scope))
            .bind(limit)
            .bind(any_of(words))
        };
        let rows = query.fetch_all(&self.pool).await?;
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
        let changed = sqlx::query(
            "UPDATE memories SET status = $2, decided_by = $3, updated_at = $4
             WHERE id = $1 AND status = ANY($5) RETURNING *",
        )
        .bind(text(id))
        .bind(to.as_str())
        .bind(text(by))
        .bind(at)
        .bind(&from)
        .fetch_optional(&self.pool)
        .await?;
        if let Some(row) = changed {
            return Ok(MemoryTransition::Changed(Box::new(memory_from_row(&row)?)));
        }
        Ok(match self.memory(id).await? {
            Some(record) => MemoryTransition::Refused(record.status),
            None => MemoryTransition::NotFound,
        })
    }

    async fn delete_memory(&self, id: &str) -> Result<bool, StoreError> {
        let deleted = sqlx::query("DELETE FROM memories WHERE id = $1")
            .bind(text(id))
            .execute(&self.pool)
            .await?;
        Ok(deleted.rows_affected() == 1)
    }

    async fn compact_memories(
        &self,
        namespace: Option<&str>,
        expire_before: Option<DateTime<Utc>>,
        at: DateTime<Utc>,
    ) -> Result<CompactReport, StoreError> {
        let mut transaction = self.pool.begin().await?;
        // The newest of each group of near-duplicates stays (ties: the greater id).
        let merged = sqlx::query(
            "UPDATE memories m SET status = 'archived', decided_by = 'compaction', updated_at = $2
             WHERE m.status = 'active' AND ($1::text IS NULL OR m.namespace = $1)
               AND EXISTS (SELECT 1 FROM memories n
                    WHERE n.namespace = m.namespace AND n.scope = m.scope
                      AND n.near_hash = m.near_hash AND n.status = 'active'
                      AND (n.updated_at, n.id) > (m.updated_at, m.id))",
        )
        .bind(namespace.map(text))
        .bind(at)
        .execute(&mut *transaction)
        .await?
        .rows_affected();
        let expired = match expire_before {
            Some(cutoff) => sqlx::query(
                "UPDATE memories SET status = 'archived', decided_by = 'compaction',
                        updated_at = $2
                 WHERE status = 'active' AND ($1::text IS NULL OR namespace = $1)
                   AND updated_at < $3",
            )
            .bind(namespace.map(text))
            .bind(at)
            .bind(cutoff)
            .execute(&mut *transaction)
            .await?
            .rows_affected(),
            None => 0,
        };
        transaction.commit().await?;
        Ok(CompactReport { merged, expired })
    }
}
