//! Spend on the embedded store: a charge (ledger record and counter increments) is handed to
//! the single writer, which commits it inside its next transaction — with the next batch of
//! any run, so it costs neither a transaction nor a round trip of its own; reservations and
//! rate buckets live in the process (it owns the store).

use super::StoreError;
use super::conditions::{self, Dialect};
use super::spend::{
    Amount, CounterDelta, CounterKey, SpendStore, UsageFilter, UsageGroupBy, UsageRecord,
    UsageTotals,
};
use super::sqlite::SqliteStore;
use super::sqlite_readers::column;
use super::sqlite_writer::Prepared;
use super::stored_time;

const INSERT_USAGE: &str = "INSERT OR IGNORE INTO usage_records (id, at, request_id, run_id, owner,
     agent_id, session_id, model, source, prompt_tokens, completion_tokens, cost_nanos, estimated)
     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13)";
const ADD_TO_COUNTER: &str =
    "INSERT INTO budget_usage (budget, subject, bucket, tokens, cost_nanos)
     VALUES (?1, ?2, ?3, ?4, ?5)
     ON CONFLICT (budget, subject, bucket) DO UPDATE SET tokens = tokens + excluded.tokens,
       cost_nanos = cost_nanos + excluded.cost_nanos";

/// Writes one charge: the ledger record (once: a record written already is left as it is) and
/// its counters' increments.
pub(super) fn insert_charge(
    prepared: &mut Prepared<'_>,
    record: &UsageRecord,
    deltas: &[CounterDelta],
) -> rusqlite::Result<()> {
    let inserted = prepared.get(INSERT_USAGE)?.execute(rusqlite::params![
        record.id,
        stored_time::text(&record.at),
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
    if inserted == 0 {
        return Ok(());
    }
    for delta in deltas {
        prepared.get(ADD_TO_COUNTER)?.execute(rusqlite::params![
            delta.key.budget,
            delta.key.subject,
            delta.bucket,
            int(delta.amount.tokens),
            delta.amount.cost_nanos,
        ])?;
    }
    Ok(())
}

/// SQLite integers are signed 64-bit: token counts past that are held at its maximum.
fn int(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

#[async_trait::async_trait]
impl SpendStore for SqliteStore {
    /// Queued to the writer: the charge commits with its next transaction, which comes no
    /// later than the run's next write (see `sqlite_writer::PendingCharges`).
    async fn record_usage(
        &self,
        record: &UsageRecord,
        deltas: &[CounterDelta],
        _hold: Option<&str>,
    ) -> Result<(), StoreError> {
        self.writer.charge((record.clone(), deltas.to_vec()))
    }

    async fn counter_buckets(
        &self,
        key: &CounterKey,
        from_bucket: i64,
    ) -> Result<Vec<(i64, Amount)>, StoreError> {
        self.reader
            .all(
                "SELECT bucket, tokens, cost_nanos FROM budget_usage
                 WHERE budget = ?1 AND subject = ?2 AND bucket >= ?3 ORDER BY bucket",
                (key.budget.clone(), key.subject.clone(), from_bucket),
                |row| Ok((column(row, "bucket")?, amount_of(row)?)),
            )
            .await
    }

    async fn budget_subjects(
        &self,
        budget: &str,
        from_bucket: i64,
    ) -> Result<Vec<(String, Amount)>, StoreError> {
        self.reader
            .all(
                "SELECT subject, SUM(tokens) AS tokens, SUM(cost_nanos) AS cost_nanos
                 FROM budget_usage WHERE budget = ?1 AND bucket >= ?2
                 GROUP BY subject ORDER BY subject",
                (budget.to_owned(), from_bucket),
                |row| Ok((column(row, "subject")?, amount_of(row)?)),
            )
            .await
    }

    async fn usage_totals(
        &self,
        filter: &UsageFilter,
        group_by: Option<UsageGroupBy>,
    ) -> Result<Vec<UsageTotals>, StoreError> {
        let sql = usage_totals(filter, group_by);
        let params = (
            filter.owner.clone(),
            filter.agent_id.clone(),
            filter.session_id.clone(),
            filter.model.clone(),
            stored_time::owned(filter.from.as_ref()),
            stored_time::owned(filter.to.as_ref()),
            filter.request_id.clone(),
        );
        self.reader
            .all(sql, params, |row| {
                Ok(UsageTotals::from_sums(
                    column(row, "grp")?,
                    column(row, "calls")?,
                    column(row, "prompt")?,
                    column(row, "completion")?,
                    column(row, "cost")?,
                    column(row, "estimated")?,
                ))
            })
            .await
    }
}

/// Usage added up, spelled from the filters given: a time range reads `usage_records_at`, one
/// request's records `usage_records_request`. Only fixed expressions are formatted in (the
/// grouping, the conditions); every value is bound.
pub(super) fn usage_totals(filter: &UsageFilter, group_by: Option<UsageGroupBy>) -> String {
    let group = UsageGroupBy::column(group_by, "substr(at, 1, 10)");
    let conditions = conditions::of_usage(filter, Dialect::Sqlite);
    format!(
        "SELECT {group} AS grp, COUNT(*) AS calls, SUM(prompt_tokens) AS prompt,
           SUM(completion_tokens) AS completion, SUM(cost_nanos) AS cost,
           SUM(estimated) AS estimated
         FROM usage_records WHERE {conditions}
         GROUP BY grp ORDER BY grp"
    )
}

fn amount(tokens: i64, cost_nanos: i64) -> Amount {
    Amount {
        tokens: tokens.max(0) as u64,
        cost_nanos,
    }
}

/// The tokens and cost a row of counters holds.
fn amount_of(row: &rusqlite::Row<'_>) -> Result<Amount, StoreError> {
    Ok(amount(column(row, "tokens")?, column(row, "cost_nanos")?))
}
