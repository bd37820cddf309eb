//! Spend on PostgreSQL, shared by every instance. A reservation (`stable_harness_reserve`)
//! checks and takes room in one statement, under a transaction-scoped advisory lock per
//! counter (taken in a fixed order, so two reservations never deadlock); a rate bucket refills
//! and is taken from in one upsert on the database's clock.
//!
//! Settling a call (its reservation released, its ledger record and its counters) rides along
//! with this instance's next batch of the call's request's writer lane
//! (`stable_harness_record_usage`, in the statement that applies the batch): the common
//! request commits once before its answer, not twice, and a charge costs no round trip of its
//! own. The run's next write is that lane's batch at the latest,
//! so an answer is never acknowledged before its charges are stored; until they commit, the
//! reservation still counts, so other instances never see a call neither reserved nor used.
//! See [`PendingCharges`].

use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use sqlx::PgPool;
use sqlx::Row;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::StoreError;
use super::conditions::{self, Dialect};
use super::postgres::{PostgresStore, Storable, text};
use super::spend::{
    Amount, Claim, ClaimRefused, CounterDelta, CounterKey, RateBucket, RateTake, SpendStore,
    UsageFilter, UsageGroupBy, UsageRecord, UsageTotals,
};

/// How long a charge waits for a batch to ride along with before it is written alone. Only
/// a safety net: every charge is followed by its run's `runtime.usage.recorded` event, which
/// the journal commits within its hold (5 ms), and the answer waits for the run's end, which
/// comes after the charge whatever this is. Longer than the embedded store's 20 ms, since a
/// lone write here costs a round trip and a flush of its own.
const CHARGE_IDLE: Duration = Duration::from_millis(250);
/// Most charges queued at once. Past it (the database refused every write for a long while)
/// a charge is dropped with an error, as on the embedded store, rather than memory growing
/// without end; the runs making calls meanwhile wait at their next commit anyway.
const MAX_QUEUED_CHARGES: usize = 8_192;

/// A queued charge: its JSON as `stable_harness_record_usage` reads it ([`charge_json`]).
type Charge = Box<serde_json::value::RawValue>;

/// Charges settled on this instance and not yet written, in one writer lane (the store keeps
/// one of these per lane, and a charge waits in its request's): each rides along with the
/// next batch this instance applies in that lane ([`PendingCharges::take`] in
/// `apply_in_lane`, under [`Self::writing`]). A lane of the journal is FIFO and a run's next
/// write (its end at the latest) is a batch of its request's lane queued after its charge,
/// so that batch, or one before it, commits the charge. A charge that
/// waits [`CHARGE_IDLE`] with no batch to ride along with is written alone
/// ([`flush_idle_charges`]).
#[derive(Debug, Default)]
pub(super) struct PendingCharges {
    queue: Mutex<Queue>,
    /// Wakes [`flush_idle_charges`] when a charge is queued while none waited.
    queued: tokio::sync::Notify,
    /// Held by whoever writes charges (a batch, a lone write), from taking them to knowing
    /// their outcome: a batch applied after a lone write began commits after that write did,
    /// so no answer goes out before the charges queued ahead of it are stored.
    pub(super) writing: tokio::sync::Mutex<()>,
}

#[derive(Debug, Default)]
struct Queue {
    charges: Vec<Charge>,
    /// When the oldest queued charge was queued (or last failed to be written alone).
    since: Option<Instant>,
}

impl PendingCharges {
    fn queue(&self) -> MutexGuard<'_, Queue> {
        crate::threads::locked(&self.queue)
    }

    fn push(&self, charge: Charge) {
        let mut queue = self.queue();
        if queue.charges.len() >= MAX_QUEUED_CHARGES {
            tracing::error!("the store keeps refusing charges; one was dropped");
            return;
        }
        queue.charges.push(charge);
        if queue.since.is_none() {
            queue.since = Some(Instant::now());
            self.queued.notify_one();
        }
    }

    /// Every queued charge, for the batch or lone write about to be applied.
    pub(super) fn take(&self) -> Vec<Charge> {
        let mut queue = self.queue();
        queue.since = None;
        std::mem::take(&mut queue.charges)
    }

    /// Queues again charges whose write failed, ahead of any queued since, to be tried with
    /// the next batch or alone after another [`CHARGE_IDLE`].
    fn put_back(&self, mut charges: Vec<Charge>) {
        if charges.is_empty() {
            return;
        }
        let mut queue = self.queue();
        charges.append(&mut queue.charges);
        queue.charges = charges;
        queue.since = Some(Instant::now());
        self.queued.notify_one();
    }

    /// When the queued charges are written alone, if no batch takes them first.
    fn deadline(&self) -> Option<Instant> {
        self.queue().since.map(|since| since + CHARGE_IDLE)
    }

    /// After the batch that carried `charges` failed with `error`: a transient failure keeps
    /// them for the batch's next try; any other refusal is the batch's own (a conflict, a lost
    /// lease), so they are written alone at once rather than held hostage by it. The caller
    /// holds [`Self::writing`].
    pub(super) async fn after_failed_batch(
        &self,
        pool: &PgPool,
        charges: Vec<Charge>,
        error: &StoreError,
    ) {
        if error.is_transient() {
            self.put_back(charges);
        } else {
            self.write_alone(pool, charges).await;
        }
    }

    /// Writes `charges` in a transaction of their own. The caller holds [`Self::writing`].
    async fn write_alone(&self, pool: &PgPool, charges: Vec<Charge>) {
        if charges.is_empty() {
            return;
        }
        let written = sqlx::query("SELECT stable_harness_record_usage($1)")
            .bind(sqlx::types::Json(&charges))
            .execute(pool)
            .await
            .map_err(StoreError::from);
        match written {
            Ok(_) => {}
            Err(error) if error.is_transient() => {
                // The journal reports the store unavailable meanwhile; tried every
                // `CHARGE_IDLE`, so not worth a warning each time.
                tracing::debug!(%error, "charges could not be written yet; trying again");
                self.put_back(charges);
            }
            Err(error) => tracing::error!(
                %error,
                charges = charges.len(),
                "calls' usage could not be recorded in the ledger"
            ),
        }
    }
}

/// Writes charges that waited [`CHARGE_IDLE`] for a batch alone, until `stop`; then writes
/// what is left.
pub(super) async fn flush_idle_charges(
    pool: PgPool,
    charges: std::sync::Arc<PendingCharges>,
    stop: CancellationToken,
) {
    loop {
        match charges.deadline() {
            None => tokio::select! {
                () = stop.cancelled() => break,
                () = charges.queued.notified() => {}
            },
            Some(deadline) => tokio::select! {
                () = stop.cancelled() => break,
                () = tokio::time::sleep_until(deadline) => {
                    let _writing = charges.writing.lock().await;
                    // A batch may have taken them meanwhile, or newer ones may wait.
                    if charges.deadline().is_some_and(|due| due <= Instant::now()) {
                        charges.write_alone(&pool, charges.take()).await;
                    }
                }
            },
        }
    }
    let _writing = charges.writing.lock().await;
    charges.write_alone(&pool, charges.take()).await;
}

/// A counter and an amount as the spend functions read them (a claim, a charge's delta).
#[derive(serde::Serialize)]
struct CounterJson<'a> {
    budget: Storable<'a, str>,
    subject: Storable<'a, str>,
    tokens: i64,
    cost_nanos: i64,
}

impl<'a> CounterJson<'a> {
    fn of(key: &'a CounterKey, amount: Amount) -> Self {
        Self {
            budget: Storable(&key.budget),
            subject: Storable(&key.subject),
            tokens: int(amount.tokens),
            cost_nanos: amount.cost_nanos,
        }
    }
}

/// A charge's delta of one counter's bucket.
#[derive(serde::Serialize)]
struct DeltaJson<'a> {
    #[serde(flatten)]
    counter: CounterJson<'a>,
    bucket: i64,
}

/// A claim of a reservation, as `stable_harness_reserve` reads it.
#[derive(serde::Serialize)]
struct ClaimJson<'a> {
    #[serde(flatten)]
    counter: CounterJson<'a>,
    from_bucket: i64,
    max_tokens: Option<i64>,
    max_cost_nanos: Option<i64>,
}

/// A charge as `stable_harness_record_usage` reads it, serialized once from its record
/// when it is queued (it waits as that text for the batch that carries it).
#[derive(serde::Serialize)]
struct ChargeJson<'a> {
    record: UsageJson<'a>,
    hold: Option<Storable<'a, str>>,
    deltas: Vec<DeltaJson<'a>>,
}

#[derive(serde::Serialize)]
struct UsageJson<'a> {
    id: Storable<'a, str>,
    #[serde(serialize_with = "crate::time::serialize")]
    at: chrono::DateTime<chrono::Utc>,
    request_id: Storable<'a, str>,
    run_id: Storable<'a, str>,
    owner: Storable<'a, str>,
    agent_id: Storable<'a, str>,
    session_id: Storable<'a, str>,
    model: Storable<'a, str>,
    source: Storable<'a, str>,
    prompt_tokens: i64,
    completion_tokens: i64,
    cost_nanos: Option<i64>,
    estimated: bool,
}

/// A charge as `stable_harness_record_usage` reads it ([`ChargeJson`]).
fn charge_json(
    record: &UsageRecord,
    deltas: &[CounterDelta],
    hold: Option<&str>,
) -> Result<Charge, StoreError> {
    let charge = ChargeJson {
        record: UsageJson {
            id: Storable(&record.id),
            at: record.at,
            request_id: Storable(&record.request_id),
            run_id: Storable(&record.run_id),
            owner: Storable(&record.owner),
            agent_id: Storable(&record.agent_id),
            session_id: Storable(&record.session_id),
            model: Storable(&record.model),
            source: Storable(&record.source),
            prompt_tokens: int(record.prompt_tokens),
            completion_tokens: int(record.completion_tokens),
            cost_nanos: record.cost_nanos,
            estimated: record.estimated,
        },
        hold: hold.map(Storable),
        deltas: deltas
            .iter()
            .map(|delta| DeltaJson {
                counter: CounterJson::of(&delta.key, delta.amount),
                bucket: delta.bucket,
            })
            .collect(),
    };
    // Strings, numbers and booleans only: serializing it does not fail.
    serde_json::value::to_raw_value(&charge).map_err(|error| StoreError::Writer(error.to_string()))
}

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
    /// Queued for this instance's next batch of the request's writer lane (see
    /// [`PendingCharges`]).
    async fn record_usage(
        &self,
        record: &UsageRecord,
        deltas: &[CounterDelta],
        hold: Option<&str>,
    ) -> Result<(), StoreError> {
        let lane = crate::store::lane_of(&record.request_id, self.charges.len());
        self.pending_charges(lane)
            .push(charge_json(record, deltas, hold)?);
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
        let sorted: Vec<ClaimJson<'_>> = order
            .iter()
            .map(|index| {
                let claim = &claims[*index];
                ClaimJson {
                    counter: CounterJson::of(&claim.key, claim.amount),
                    from_bucket: claim.from_bucket,
                    max_tokens: claim.max_tokens.map(int),
                    max_cost_nanos: claim.max_cost_nanos,
                }
            })
            .collect();
        let refused: Option<serde_json::Value> =
            sqlx::query_scalar("SELECT stable_harness_reserve($1, $2, $3, $4::jsonb)")
                .bind(text(hold))
                .bind(text(run_id))
                .bind(self.lease_ms)
                .bind(sqlx::types::Json(sorted))
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

#[cfg(test)]
mod tests {
    use chrono::{TimeZone, Utc};
    use serde_json::json;

    use super::*;

    /// A charge is queued as the ledger's function has always read it: the JSON it was
    /// built as field by field (`json!`, chrono's time text), U+0000 made storable. Fails
    /// when a field is renamed, dropped or written as another type.
    #[test]
    fn a_charge_is_queued_as_the_ledger_function_reads_it() {
        let record = UsageRecord {
            id: "use\0".into(),
            at: Utc.timestamp_opt(1_764_470_000, 123_456_789).unwrap(),
            request_id: "req".into(),
            run_id: "run".into(),
            owner: "o".into(),
            agent_id: "a".into(),
            session_id: "ses".into(),
            model: "m\0".into(),
            source: "upstream".into(),
            prompt_tokens: u64::MAX,
            completion_tokens: 5,
            cost_nanos: None,
            estimated: true,
        };
        let deltas = [CounterDelta {
            key: CounterKey {
                budget: "b\0".into(),
                subject: "s".into(),
            },
            bucket: 42,
            amount: Amount {
                tokens: 9,
                cost_nanos: -1,
            },
        }];
        for hold in [None, Some("hold\0")] {
            let charge: serde_json::Value =
                serde_json::from_str(charge_json(&record, &deltas, hold).unwrap().get()).unwrap();
            let expected = json!({
                "record": {
                    "id": text(&record.id), "at": record.at, "request_id": record.request_id,
                    "run_id": record.run_id, "owner": record.owner, "agent_id": record.agent_id,
                    "session_id": record.session_id, "model": text(&record.model),
                    "source": record.source, "prompt_tokens": i64::MAX, "completion_tokens": 5,
                    "cost_nanos": null, "estimated": true,
                },
                "hold": hold.map(text),
                "deltas": [{ "budget": text("b\0"), "subject": "s", "tokens": 9,
                    "cost_nanos": -1, "bucket": 42 }],
            });
            assert_eq!(charge, expected);
        }
    }
}
