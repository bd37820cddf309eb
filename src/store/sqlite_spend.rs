//! Spend on the embedded store: the ledger and counters are written by the single writer in
//! one transaction; reservations and rate buckets live in the process (it owns the store).

use sqlx::Row;

use super::StoreError;
use super::spend::{
    Amount, CounterDelta, CounterKey, SpendStore, UsageFilter, UsageGroupBy, UsageRecord,
    UsageTotals, from_nanos,
};
use super::sqlite::SqliteStore;
use super::sqlite_writer::time;

const INSERT_USAGE: &str = "INSERT INTO usage_records (id, at, request_id, run_id, owner,
     agent_id, session_id, model, source, prompt_tokens, completion_tokens, cost_nanos, estimated)
     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13)";
const ADD_TO_COUNTER: &str =
    "INSERT INTO budget_usage (budget, subject, bucket, tokens, cost_nanos)
     VALUES (?1, ?2, ?3, ?4, ?5)
     ON CONFLICT (budget, subject, bucket) DO UPDATE SET tokens = tokens + excluded.tokens,
       cost_nanos = cost_nanos + excluded.cost_nanos";

/// SQLite integers are signed 64-bit: token counts past that are held at its maximum.
fn int(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

#[async_trait::async_trait]
impl SpendStore for SqliteStore {
    async fn record_usage(
        &self,
        record: &UsageRecord,
        deltas: &[CounterDelta],
        _hold: Option<&str>,
    ) -> Result<(), StoreError> {
        let record = record.clone();
        let deltas = deltas.to_vec();
        self.writer
            .maintain(move |connection| {
                let transaction = connection.transaction()?;
                transaction
                    .prepare_cached(INSERT_USAGE)?
                    .execute(rusqlite::params![
                        record.id,
                        time(&record.at),
                        record.request_id,
                        record.run_id,
                        record.owner,
                        record.agent_id,
                        record.session_id,
                        record.model,
                        record.source,
                        int(record.prompt_tokens),
                        int(record.completion_tokens),
                        record.cost_nanos,
                        record.estimated,
                    ])?;
                {
                    let mut add = transaction.prepare_cached(ADD_TO_COUNTER)?;
                    for delta in &deltas {
                        add.execute(rusqlite::params![
                            delta.key.budget,
                            delta.key.subject,
                            delta.bucket,
                            int(delta.amount.tokens),
                            delta.amount.cost_nanos,
                        ])?;
                    }
                }
                transaction.commit()
            })
            .await
    }

    async fn counter_buckets(
        &self,
        key: &CounterKey,
        from_bucket: i64,
    ) -> Result<Vec<(i64, Amount)>, StoreError> {
        let rows = sqlx::query(
            "SELECT bucket, tokens, cost_nanos FROM budget_usage
             WHERE budget = ?1 AND subject = ?2 AND bucket >= ?3 ORDER BY bucket",
        )
        .bind(&key.budget)
        .bind(&key.subject)
        .bind(from_bucket)
        .fetch_all(&self.reader)
        .await?;
        rows.iter().map(bucket_from_row).collect()
    }

    async fn budget_subjects(
        &self,
        budget: &str,
        from_bucket: i64,
    ) -> Result<Vec<(String, Amount)>, StoreError> {
        let rows = sqlx::query(
            "SELECT subject, SUM(tokens) AS tokens, SUM(cost_nanos) AS cost_nanos FROM budget_usage
             WHERE budget = ?1 AND bucket >= ?2 GROUP BY subject ORDER BY subject",
        )
        .bind(budget)
        .bind(from_bucket)
        .fetch_all(&self.reader)
        .await?;
        rows.iter()
            .map(|row| {
                Ok((
                    row.try_get("subject")?,
                    amount(row.try_get("tokens")?, row.try_get("cost_nanos")?),
                ))
            })
            .collect()
    }

    async fn usage_totals(
        &self,
        filter: &UsageFilter,
        group_by: Option<UsageGroupBy>,
    ) -> Result<Vec<UsageTotals>, StoreError> {
        let group = match group_by {
            None => "''",
            Some(UsageGroupBy::Day) => "substr(at, 1, 10)",
            Some(UsageGroupBy::Agent) => "agent_id",
            Some(UsageGroupBy::Key) => "owner",
            Some(UsageGroupBy::Model) => "model",
        };
        // Only the grouping expression is formatted in, from the fixed list above; every value
        // is bound.
        let sql = format!(
            "SELECT {group} AS grp, COUNT(*) AS calls, SUM(prompt_tokens) AS prompt,
               SUM(completion_tokens) AS completion, SUM(cost_nanos) AS cost,
               SUM(estimated) AS estimated
             FROM usage_records
             WHERE (?1 IS NULL OR owner = ?1) AND (?2 IS NULL OR agent_id = ?2)
               AND (?3 IS NULL OR session_id = ?3) AND (?4 IS NULL OR model = ?4)
               AND (?5 IS NULL OR at >= ?5) AND (?6 IS NULL OR at < ?6)
               AND (?7 IS NULL OR request_id = ?7)
             GROUP BY grp ORDER BY grp"
        );
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(&filter.owner)
            .bind(&filter.agent_id)
            .bind(&filter.session_id)
            .bind(&filter.model)
            .bind(filter.from.as_ref().map(time))
            .bind(filter.to.as_ref().map(time))
            .bind(&filter.request_id)
            .fetch_all(&self.reader)
            .await?;
        rows.iter()
            .map(|row| {
                let prompt = row.try_get::<Option<i64>, _>("prompt")?.unwrap_or(0).max(0) as u64;
                let completion = row
                    .try_get::<Option<i64>, _>("completion")?
                    .unwrap_or(0)
                    .max(0) as u64;
                Ok(UsageTotals {
                    group: row.try_get("grp")?,
                    calls: row.try_get::<i64, _>("calls")?.max(0) as u64,
                    prompt_tokens: prompt,
                    completion_tokens: completion,
                    total_tokens: prompt.saturating_add(completion),
                    cost: row.try_get::<Option<i64>, _>("cost")?.map(from_nanos),
                    estimated_calls: row
                        .try_get::<Option<i64>, _>("estimated")?
                        .unwrap_or(0)
                        .max(0) as u64,
                })
            })
            .collect()
    }
}

fn amount(tokens: i64, cost_nanos: i64) -> Amount {
    Amount {
        tokens: tokens.max(0) as u64,
        cost_nanos,
    }
}

fn bucket_from_row(row: &sqlx::sqlite::SqliteRow) -> Result<(i64, Amount), StoreError> {
    Ok((
        row.try_get("bucket")?,
        amount(row.try_get("tokens")?, row.try_get("cost_nanos")?),
    ))
}
