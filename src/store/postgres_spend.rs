//! Spend on PostgreSQL, shared by every instance, each operation one statement (one round
//! trip, one transaction): a reservation (`stable_harness_reserve`) checks and takes room
//! under a transaction-scoped advisory lock per counter (taken in a fixed order, so two
//! reservations never deadlock); settling releases it and adds the usage; a rate bucket
//! refills and is taken from in one upsert on the database's clock.

use sqlx::Row;

use super::StoreError;
use super::conditions::{self, Dialect};
use super::postgres::{PostgresStore, text};
use super::spend::{
    Amount, Claim, ClaimRefused, CounterDelta, CounterKey, RateBucket, RateTake, SpendStore,
    UsageFilter, UsageGroupBy, UsageRecord, UsageTotals,
};

fn int(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

/// The sums of a group of usage records, as the columns [`usage_totals_from_row`] reads.
macro_rules! usage_sums {
    () => {
        "COUNT(*)::BIGINT AS calls, SUM(prompt_tokens)::BIGINT AS prompt,
         SUM(completion_tokens)::BIGINT AS completion, SUM(cost_nanos)::BIGINT AS cost,
         COUNT(*) FILTER (WHERE estimated)::BIGINT AS estimated"
    };
}
pub(super) use usage_sums;

/// The sums of a group of usage records, from the columns [`usage_sums`] names.
pub(super) fn usage_totals_from_row(
    row: &sqlx::postgres::PgRow,
    group: String,
) -> Result<UsageTotals, StoreError> {
    Ok(UsageTotals::from_sums(
        group,
        row.try_get("calls")?,
        row.try_get("prompt")?,
        row.try_get("completion")?,
        row.try_get("cost")?,
        row.try_get("estimated")?,
    ))
}

fn amount(tokens: Option<i64>, cost_nanos: Option<i64>) -> Amount {
    Amount {
        tokens: tokens.unwrap_or(0).max(0) as u64,
        cost_nanos: cost_nanos.unwrap_or(0),
    }
}

/// Reservations still in force: younger than a lease (the run may not be committed yet), or
/// held by a run that holds its lease. A dead instance's stop counting when its leases expire.
const IN_FORCE: &str = "(r.created_at > now() - $3 * interval '1 millisecond'
       OR EXISTS (SELECT 1 FROM runs u WHERE u.id = r.run_id AND u.lease_expires_at > now()
         AND u.status IN ('queued', 'running', 'waiting_approval')))";

fn live_reserved() -> String {
    format!(
        "SELECT SUM(r.tokens)::BIGINT AS tokens, SUM(r.cost_nanos)::BIGINT AS cost_nanos
         FROM budget_reservations r WHERE r.budget = $1 AND r.subject = $2 AND {IN_FORCE}"
    )
}

#[async_trait::async_trait]
impl SpendStore for PostgresStore {
    async fn record_usage(
        &self,
        record: &UsageRecord,
        deltas: &[CounterDelta],
        hold: Option<&str>,
    ) -> Result<(), StoreError> {
        let deltas: Vec<serde_json::Value> = deltas
            .iter()
            .map(|delta| {
                serde_json::json!({
                    "budget": text(&delta.key.budget),
                    "subject": text(&delta.key.subject),
                    "bucket": delta.bucket,
                    "tokens": int(delta.amount.tokens),
                    "cost_nanos": delta.amount.cost_nanos,
                })
            })
            .collect();
        // One statement: the reservation released, the ledger record and the counters, in
        // one transaction and one round trip. A record written already is left as it is.
        sqlx::query(
            "WITH released AS (
               DELETE FROM budget_reservations WHERE hold_id = $14
             ), recorded AS (
               INSERT INTO usage_records (id, at, request_id, run_id, owner, agent_id, session_id,
                 model, source, prompt_tokens, completion_tokens, cost_nanos, estimated)
               VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)
               ON CONFLICT (id) DO NOTHING
               RETURNING id
             )
             INSERT INTO budget_usage (budget, subject, bucket, tokens, cost_nanos)
             SELECT d.budget, d.subject, d.bucket, d.tokens, d.cost_nanos
               FROM jsonb_to_recordset($15::jsonb)
                    AS d(budget text, subject text, bucket bigint, tokens bigint, cost_nanos bigint)
              WHERE EXISTS (SELECT 1 FROM recorded)
             ON CONFLICT (budget, subject, bucket) DO UPDATE
               SET tokens = budget_usage.tokens + excluded.tokens,
                   cost_nanos = budget_usage.cost_nanos + excluded.cost_nanos",
        )
        .bind(text(&record.id))
        .bind(record.at)
        .bind(text(&record.request_id))
        .bind(text(&record.run_id))
        .bind(text(&record.owner))
        .bind(text(&record.agent_id))
        .bind(text(&record.session_id))
        .bind(text(&record.model))
        .bind(text(&record.source))
        .bind(int(record.prompt_tokens))
        .bind(int(record.completion_tokens))
        .bind(record.cost_nanos)
        .bind(record.estimated)
        .bind(hold.map(text))
        .bind(serde_json::Value::Array(deltas))
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    async fn counter_buckets(
        &self,
        key: &CounterKey,
        from_bucket: i64,
    ) -> Result<Vec<(i64, Amount)>, StoreError> {
        let rows = sqlx::query(
            "SELECT bucket, tokens, cost_nanos FROM budget_usage
             WHERE budget = $1 AND subject = $2 AND bucket >= $3 ORDER BY bucket",
        )
        .bind(text(&key.budget))
        .bind(text(&key.subject))
        .bind(from_bucket)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|row| {
                Ok((
                    row.try_get("bucket")?,
                    amount(row.try_get("tokens")?, row.try_get("cost_nanos")?),
                ))
            })
            .collect()
    }

    async fn budget_subjects(
        &self,
        budget: &str,
        from_bucket: i64,
    ) -> Result<Vec<(String, Amount)>, StoreError> {
        let rows = sqlx::query(
            "SELECT subject, SUM(tokens)::BIGINT AS tokens, SUM(cost_nanos)::BIGINT AS cost_nanos
             FROM budget_usage WHERE budget = $1 AND bucket >= $2
             GROUP BY subject
             UNION
             SELECT r.subject, 0::BIGINT, 0::BIGINT FROM budget_reservations r
             WHERE r.budget = $1 AND NOT EXISTS (SELECT 1 FROM budget_usage b
               WHERE b.budget = $1 AND b.subject = r.subject AND b.bucket >= $2)
             ORDER BY subject",
        )
        .bind(text(budget))
        .bind(from_bucket)
        .fetch_all(&self.pool)
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
        let group = UsageGroupBy::column(group_by, "to_char(at AT TIME ZONE 'UTC', 'YYYY-MM-DD')");
        let conditions = conditions::of_usage(filter, Dialect::Postgres);
        // Only fixed expressions are formatted in (the grouping, the conditions); every value
        // is bound.
        let sql = format!(
            concat!(
                "SELECT {group} AS grp, ",
                usage_sums!(),
                " FROM usage_records WHERE {conditions} GROUP BY grp ORDER BY grp"
            ),
            group = group,
            conditions = conditions
        );
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(filter.owner.as_deref().map(text))
            .bind(filter.agent_id.as_deref().map(text))
            .bind(filter.session_id.as_deref().map(text))
            .bind(filter.model.as_deref().map(text))
            .bind(filter.from)
            .bind(filter.to)
            .bind(filter.request_id.as_deref().map(text))
            .fetch_all(&self.pool)
            .await?;
        rows.iter()
            .map(|row| usage_totals_from_row(row, row.try_get("grp")?))
            .collect()
    }

    async fn reserve_shared(
        &self,
        hold: &str,
        run_id: &str,
        claims: &[Claim],
    ) -> Result<Option<ClaimRefused>, StoreError> {
        // Sorted, so that concurrent reservations lock counters in one order.
        let mut order: Vec<usize> = (0..claims.len()).collect();
        order.sort_by(|a, b| claims[*a].key.cmp(&claims[*b].key));
        let sorted: Vec<serde_json::Value> = order
            .iter()
            .map(|index| {
                let claim = &claims[*index];
                serde_json::json!({
                    "budget": text(&claim.key.budget),
                    "subject": text(&claim.key.subject),
                    "from_bucket": claim.from_bucket,
                    "tokens": int(claim.amount.tokens),
                    "cost_nanos": claim.amount.cost_nanos,
                    "max_tokens": claim.max_tokens.map(int),
                    "max_cost_nanos": claim.max_cost_nanos,
                })
            })
            .collect();
        let refused: Option<serde_json::Value> =
            sqlx::query_scalar("SELECT stable_harness_reserve($1, $2, $3, $4::jsonb)")
                .bind(text(hold))
                .bind(text(run_id))
                .bind(self.lease_ms)
                .bind(serde_json::Value::Array(sorted))
                .fetch_one(&self.pool)
                .await?;
        let Some(refused) = refused else {
            return Ok(None);
        };
        let figure = |name: &str| refused.get(name).and_then(serde_json::Value::as_i64);
        let place = figure("index")
            .and_then(|place| usize::try_from(place).ok())
            .and_then(|place| order.get(place).copied())
            .ok_or_else(|| StoreError::Corrupt(format!("a reservation's refusal: {refused}")))?;
        Ok(Some(ClaimRefused {
            index: place,
            used: amount(figure("used_tokens"), figure("used_cost")),
            reserved: amount(figure("reserved_tokens"), figure("reserved_cost")),
        }))
    }

    async fn release_shared(&self, hold: &str) -> Result<(), StoreError> {
        sqlx::query("DELETE FROM budget_reservations WHERE hold_id = $1")
            .bind(text(hold))
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn reserved_shared(&self, key: &CounterKey) -> Result<Amount, StoreError> {
        let row = sqlx::query(sqlx::AssertSqlSafe(live_reserved()))
            .bind(text(&key.budget))
            .bind(text(&key.subject))
            .bind(self.lease_ms)
            .fetch_one(&self.pool)
            .await?;
        Ok(amount(row.try_get("tokens")?, row.try_get("cost_nanos")?))
    }

    async fn take_rate_shared(
        &self,
        bucket: &RateBucket,
        amount: f64,
        need: f64,
    ) -> Result<RateTake, StoreError> {
        let capacity = bucket.per_minute as f64;
        let rate = bucket.per_second();
        // One statement: the bucket refilled by the time passed on the database's clock (the
        // same for every instance), then taken from if it holds `need`; the row lock of the
        // upsert orders concurrent takes.
        let row = sqlx::query(
            "INSERT INTO rate_buckets AS b (name, subject, dimension, level, updated_at, taken)
             VALUES ($1, $2, $3, $4 - $6, now(), true)
             ON CONFLICT (name, subject, dimension) DO UPDATE SET
               level = LEAST($4, b.level + EXTRACT(EPOCH FROM now() - b.updated_at)::FLOAT8 * $5)
                       - CASE WHEN LEAST($4, b.level + EXTRACT(EPOCH FROM now() - b.updated_at)::FLOAT8 * $5) >= $7
                              THEN $6 ELSE 0 END,
               taken = LEAST($4, b.level + EXTRACT(EPOCH FROM now() - b.updated_at)::FLOAT8 * $5) >= $7,
               updated_at = now()
             RETURNING level, taken",
        )
        .bind(text(&bucket.name))
        .bind(text(&bucket.subject))
        .bind(bucket.dimension)
        .bind(capacity)
        .bind(rate)
        .bind(amount)
        .bind(need)
        .fetch_one(&self.pool)
        .await?;
        let level: f64 = row.try_get("level")?;
        let taken: bool = row.try_get("taken")?;
        Ok(if taken {
            RateTake::Taken
        } else {
            RateTake::Refused {
                wait_secs: ((need - level) / rate).max(0.0),
            }
        })
    }

    async fn counter_state(
        &self,
        key: &CounterKey,
        from_bucket: i64,
    ) -> Result<(Amount, Amount), StoreError> {
        let row = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT
               (SELECT SUM(tokens)::BIGINT FROM budget_usage
                 WHERE budget = $1 AND subject = $2 AND bucket >= $4) AS used_tokens,
               (SELECT SUM(cost_nanos)::BIGINT FROM budget_usage
                 WHERE budget = $1 AND subject = $2 AND bucket >= $4) AS used_cost,
               (SELECT SUM(r.tokens)::BIGINT FROM budget_reservations r
                 WHERE r.budget = $1 AND r.subject = $2 AND {IN_FORCE}) AS reserved_tokens,
               (SELECT SUM(r.cost_nanos)::BIGINT FROM budget_reservations r
                 WHERE r.budget = $1 AND r.subject = $2 AND {IN_FORCE}) AS reserved_cost"
        )))
        .bind(text(&key.budget))
        .bind(text(&key.subject))
        .bind(self.lease_ms)
        .bind(from_bucket)
        .fetch_one(&self.pool)
        .await?;
        Ok((
            amount(row.try_get("used_tokens")?, row.try_get("used_cost")?),
            amount(
                row.try_get("reserved_tokens")?,
                row.try_get("reserved_cost")?,
            ),
        ))
    }
}
