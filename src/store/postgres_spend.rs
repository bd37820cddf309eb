//! Spend on PostgreSQL, shared by every instance: a reservation checks and takes room under a
//! transaction-scoped advisory lock per counter (taken in a fixed order, so two reservations
//! never deadlock), settling releases it and adds the usage in one transaction, and rate
//! buckets refill and debit in one statement on the database's clock.

use sqlx::Row;

use super::StoreError;
use super::postgres::{PostgresStore, text};
use super::spend::{
    Amount, Claim, ClaimRefused, CounterDelta, CounterKey, RateBucket, RateTake, SpendStore,
    UsageFilter, UsageGroupBy, UsageRecord, UsageTotals, from_nanos,
};

fn int(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
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
        let mut transaction = self.pool.begin().await?;
        if let Some(hold) = hold {
            sqlx::query("DELETE FROM budget_reservations WHERE hold_id = $1")
                .bind(text(hold))
                .execute(&mut *transaction)
                .await?;
        }
        sqlx::query(
            "INSERT INTO usage_records (id, at, request_id, run_id, owner, agent_id, session_id,
               model, source, prompt_tokens, completion_tokens, cost_nanos, estimated)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)",
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
        .execute(&mut *transaction)
        .await?;
        for delta in deltas {
            sqlx::query(
                "INSERT INTO budget_usage (budget, subject, bucket, tokens, cost_nanos)
                 VALUES ($1, $2, $3, $4, $5)
                 ON CONFLICT (budget, subject, bucket) DO UPDATE
                   SET tokens = budget_usage.tokens + excluded.tokens,
                       cost_nanos = budget_usage.cost_nanos + excluded.cost_nanos",
            )
            .bind(text(&delta.key.budget))
            .bind(text(&delta.key.subject))
            .bind(delta.bucket)
            .bind(int(delta.amount.tokens))
            .bind(delta.amount.cost_nanos)
            .execute(&mut *transaction)
            .await?;
        }
        transaction.commit().await?;
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
        let group = match group_by {
            None => "''",
            Some(UsageGroupBy::Day) => "to_char(at AT TIME ZONE 'UTC', 'YYYY-MM-DD')",
            Some(UsageGroupBy::Agent) => "agent_id",
            Some(UsageGroupBy::Key) => "owner",
            Some(UsageGroupBy::Model) => "model",
        };
        // Only the grouping expression is formatted in, from the fixed list above.
        let sql = format!(
            "SELECT {group} AS grp, COUNT(*)::BIGINT AS calls,
               SUM(prompt_tokens)::BIGINT AS prompt, SUM(completion_tokens)::BIGINT AS completion,
               SUM(cost_nanos)::BIGINT AS cost, COUNT(*) FILTER (WHERE estimated)::BIGINT AS estimated
             FROM usage_records
             WHERE ($1::TEXT IS NULL OR owner = $1) AND ($2::TEXT IS NULL OR agent_id = $2)
               AND ($3::TEXT IS NULL OR session_id = $3) AND ($4::TEXT IS NULL OR model = $4)
               AND ($5::TIMESTAMPTZ IS NULL OR at >= $5) AND ($6::TIMESTAMPTZ IS NULL OR at < $6)
               AND ($7::TEXT IS NULL OR request_id = $7)
             GROUP BY grp ORDER BY grp"
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
                    estimated_calls: row.try_get::<i64, _>("estimated")?.max(0) as u64,
                })
            })
            .collect()
    }

    async fn reserve_shared(
        &self,
        hold: &str,
        run_id: &str,
        claims: &[Claim],
    ) -> Result<Option<ClaimRefused>, StoreError> {
        let mut order: Vec<usize> = (0..claims.len()).collect();
        order.sort_by(|a, b| claims[*a].key.cmp(&claims[*b].key));
        let mut transaction = self.pool.begin().await?;
        for index in order {
            let claim = &claims[index];
            let budget = text(&claim.key.budget);
            let subject = text(&claim.key.subject);
            sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended($1 || '/' || $2, 15))")
                .bind(&budget)
                .bind(&subject)
                .execute(&mut *transaction)
                .await?;
            // A dead instance's reservations no longer count: they go here.
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "DELETE FROM budget_reservations r WHERE r.budget = $1 AND r.subject = $2
                   AND NOT {IN_FORCE}"
            )))
            .bind(&budget)
            .bind(&subject)
            .bind(self.lease_ms)
            .execute(&mut *transaction)
            .await?;
            let used = sqlx::query(
                "SELECT SUM(tokens)::BIGINT AS tokens, SUM(cost_nanos)::BIGINT AS cost_nanos
                 FROM budget_usage WHERE budget = $1 AND subject = $2 AND bucket >= $3",
            )
            .bind(&budget)
            .bind(&subject)
            .bind(claim.from_bucket)
            .fetch_one(&mut *transaction)
            .await?;
            let used = amount(used.try_get("tokens")?, used.try_get("cost_nanos")?);
            let reserved = sqlx::query(sqlx::AssertSqlSafe(live_reserved()))
                .bind(&budget)
                .bind(&subject)
                .bind(self.lease_ms)
                .fetch_one(&mut *transaction)
                .await?;
            let reserved = amount(reserved.try_get("tokens")?, reserved.try_get("cost_nanos")?);
            if !claim.fits(used, reserved) {
                transaction.rollback().await?;
                return Ok(Some(ClaimRefused {
                    index,
                    used,
                    reserved,
                }));
            }
            sqlx::query(
                "INSERT INTO budget_reservations (hold_id, budget, subject, run_id, tokens, cost_nanos)
                 VALUES ($1, $2, $3, $4, $5, $6)",
            )
            .bind(text(hold))
            .bind(&budget)
            .bind(&subject)
            .bind(text(run_id))
            .bind(int(claim.amount.tokens))
            .bind(claim.amount.cost_nanos)
            .execute(&mut *transaction)
            .await?;
        }
        transaction.commit().await?;
        Ok(None)
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
        let name = text(&bucket.name);
        let subject = text(&bucket.subject);
        let mut transaction = self.pool.begin().await?;
        sqlx::query(
            "INSERT INTO rate_buckets (name, subject, dimension, level, updated_at)
             VALUES ($1, $2, $3, $4, now()) ON CONFLICT (name, subject, dimension) DO NOTHING",
        )
        .bind(&name)
        .bind(&subject)
        .bind(bucket.dimension)
        .bind(capacity)
        .execute(&mut *transaction)
        .await?;
        // Refilled by the time passed on the database's clock, the same for every instance.
        let row = sqlx::query(
            "SELECT LEAST($4, level + EXTRACT(EPOCH FROM now() - updated_at)::FLOAT8 * $5) AS level
             FROM rate_buckets WHERE name = $1 AND subject = $2 AND dimension = $3 FOR UPDATE",
        )
        .bind(&name)
        .bind(&subject)
        .bind(bucket.dimension)
        .bind(capacity)
        .bind(rate)
        .fetch_one(&mut *transaction)
        .await?;
        let level: f64 = row.try_get("level")?;
        let taken = level >= need;
        let after = if taken { level - amount } else { level };
        sqlx::query(
            "UPDATE rate_buckets SET level = $4, updated_at = now()
             WHERE name = $1 AND subject = $2 AND dimension = $3",
        )
        .bind(&name)
        .bind(&subject)
        .bind(bucket.dimension)
        .bind(after)
        .execute(&mut *transaction)
        .await?;
        transaction.commit().await?;
        Ok(if taken {
            RateTake::Taken
        } else {
            RateTake::Refused {
                wait_secs: ((need - level) / rate).max(0.0),
            }
        })
    }
}
