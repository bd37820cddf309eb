//! What the store keeps for spend control (issue 15): the usage ledger (one record per charged
//! upstream call), budget counters per window bucket, and — on a store several instances
//! share — reservations of calls in flight and rate-limit buckets, each changed atomically.
//!
//! The rules (which budgets match, windows, estimates) live in `crate::spend`; the store
//! keeps what it is given.

use chrono::{DateTime, Utc};
use serde::Serialize;

use super::StoreError;

/// One charged upstream call.
#[derive(Debug, Clone, PartialEq)]
pub struct UsageRecord {
    pub id: String,
    pub at: DateTime<Utc>,
    pub request_id: String,
    pub run_id: String,
    /// The client key identity charged.
    pub owner: String,
    pub agent_id: String,
    /// The session charged (a subagent's calls are charged to its parent's).
    pub session_id: String,
    /// The model id (a catalog id), or what else answered (`agent:<id>`, `memory:<name>`).
    pub model: String,
    /// `model`, `agent` (a remote agent's report) or `memory` (a memory provider's report).
    pub source: String,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    /// In billionths of the pricing's currency; `None` without a price.
    pub cost_nanos: Option<i64>,
    /// The upstream reported no usage: the figures are the documented estimate.
    pub estimated: bool,
}

impl UsageRecord {
    /// Its figures within [`Amount::bounded`]'s limits: what an upstream or a service
    /// reports is bounded before anything adds it up.
    pub fn bounded(mut self) -> Self {
        self.prompt_tokens = self.prompt_tokens.min(MAX_TOKENS_PER_CALL);
        self.completion_tokens = self.completion_tokens.min(MAX_TOKENS_PER_CALL);
        self.cost_nanos = self
            .cost_nanos
            .map(|cost| cost.clamp(0, MAX_COST_NANOS_PER_CALL));
        self
    }
}

/// One budget's counter for one subject (a key identity, agent, session, or `*`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CounterKey {
    pub budget: String,
    pub subject: String,
}

/// The most tokens one call is charged or reserved.
pub const MAX_TOKENS_PER_CALL: u64 = 1 << 40;
/// The most cost one call is charged or reserved, in nano-units (a billion units).
pub const MAX_COST_NANOS_PER_CALL: i64 = 1_000_000_000 * 1_000_000_000;

/// Tokens and cost, together.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Amount {
    pub tokens: u64,
    pub cost_nanos: i64,
}

impl Amount {
    pub fn plus(self, other: Amount) -> Amount {
        Amount {
            tokens: self.tokens.saturating_add(other.tokens),
            cost_nanos: self.cost_nanos.saturating_add(other.cost_nanos),
        }
    }

    /// Within what every database sums without overflow: a trillion tokens and a billion
    /// units of cost per call (an upstream or a service reports what it likes).
    pub fn bounded(self) -> Amount {
        Amount {
            tokens: self.tokens.min(MAX_TOKENS_PER_CALL),
            cost_nanos: self.cost_nanos.clamp(0, MAX_COST_NANOS_PER_CALL),
        }
    }

    pub fn minus(self, other: Amount) -> Amount {
        Amount {
            tokens: self.tokens.saturating_sub(other.tokens),
            cost_nanos: self.cost_nanos.saturating_sub(other.cost_nanos).max(0),
        }
    }
}

/// A settled call's share of one counter, in the bucket it was charged to.
#[derive(Debug, Clone, PartialEq)]
pub struct CounterDelta {
    pub key: CounterKey,
    pub bucket: i64,
    pub amount: Amount,
}

/// A reservation asked of one counter: granted only if what is used since `from_bucket`, what
/// is reserved, and `amount` stay within the limits.
#[derive(Debug, Clone, PartialEq)]
pub struct Claim {
    pub key: CounterKey,
    pub from_bucket: i64,
    pub amount: Amount,
    pub max_tokens: Option<u64>,
    pub max_cost_nanos: Option<i64>,
}

impl Claim {
    /// Whether the claim fits beside `used` and `reserved`.
    pub fn fits(&self, used: Amount, reserved: Amount) -> bool {
        let total = used.plus(reserved).plus(self.amount);
        self.max_tokens.is_none_or(|max| total.tokens <= max)
            && self
                .max_cost_nanos
                .is_none_or(|max| total.cost_nanos <= max)
    }
}

/// A refused claim: which one, and the counter's state when it was refused.
#[derive(Debug, Clone, PartialEq)]
pub struct ClaimRefused {
    pub index: usize,
    pub used: Amount,
    pub reserved: Amount,
}

/// What a rate bucket said.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RateTake {
    Taken,
    /// Not enough in the bucket: how long until there is.
    Refused {
        wait_secs: f64,
    },
}

/// One token bucket: its capacity is a minute's rate, refilled evenly.
#[derive(Debug, Clone, PartialEq)]
pub struct RateBucket {
    pub name: String,
    pub subject: String,
    /// `requests` or `tokens`.
    pub dimension: &'static str,
    pub per_minute: u64,
}

impl RateBucket {
    pub fn per_second(&self) -> f64 {
        self.per_minute as f64 / 60.0
    }
}

/// How `/admin/usage` groups the ledger.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum UsageGroupBy {
    Day,
    Agent,
    Key,
    Model,
}

impl UsageGroupBy {
    /// The SQL expression a group is named by; `day` is the dialect's UTC date of `at`. Only
    /// these fixed expressions are ever formatted into a query.
    pub(crate) fn column(group_by: Option<Self>, day: &'static str) -> &'static str {
        match group_by {
            None => "''",
            Some(Self::Day) => day,
            Some(Self::Agent) => "agent_id",
            Some(Self::Key) => "owner",
            Some(Self::Model) => "model",
        }
    }
}

/// Which usage records to add up.
#[derive(Debug, Clone, Default)]
pub struct UsageFilter {
    /// Only records of this key identity, agent, session or model.
    pub owner: Option<String>,
    pub agent_id: Option<String>,
    pub session_id: Option<String>,
    pub model: Option<String>,
    pub request_id: Option<String>,
    pub from: Option<DateTime<Utc>>,
    pub to: Option<DateTime<Utc>>,
}

/// Usage added up over a group of records.
#[derive(Debug, Clone, Default, PartialEq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct UsageTotals {
    /// The group's name (a day, an agent, a key identity or a model); empty for a total.
    pub group: String,
    pub calls: u64,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub total_tokens: u64,
    /// In the currency of `pricing`; `null` when no call of the group had a price.
    pub cost: Option<f64>,
    /// Calls whose upstream reported no usage (their figures are estimates).
    pub estimated_calls: u64,
}

impl UsageTotals {
    /// A group's sums as the databases return them (`SUM` of no rows is `NULL`).
    pub(crate) fn from_sums(
        group: String,
        calls: i64,
        prompt: Option<i64>,
        completion: Option<i64>,
        cost_nanos: Option<i64>,
        estimated: Option<i64>,
    ) -> Self {
        let count = |value: Option<i64>| value.unwrap_or(0).max(0) as u64;
        let (prompt_tokens, completion_tokens) = (count(prompt), count(completion));
        Self {
            group,
            calls: count(Some(calls)),
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens.saturating_add(completion_tokens),
            cost: cost_nanos.map(from_nanos),
            estimated_calls: count(estimated),
        }
    }
}

/// Nano-units of a currency amount.
pub fn to_nanos(cost: f64) -> i64 {
    // `as` saturates: a huge or non-finite figure cannot wrap.
    (cost * 1e9).round() as i64
}

pub fn from_nanos(nanos: i64) -> f64 {
    nanos as f64 / 1e9
}

/// The spend side of a store.
#[async_trait::async_trait]
pub trait SpendStore: Send + Sync {
    /// Stores a settled call and adds it to its counters, in one transaction; on a shared
    /// store the reservation `hold` (if any) is released in the same transaction. Both stores
    /// queue it for their next write (it commits with the next batch applied, at the latest
    /// the one holding its run's next step or end), so it returns before it is stored.
    async fn record_usage(
        &self,
        record: &UsageRecord,
        deltas: &[CounterDelta],
        hold: Option<&str>,
    ) -> Result<(), StoreError>;
    /// A counter's buckets from `from_bucket` on: `(bucket, amount)`.
    async fn counter_buckets(
        &self,
        key: &CounterKey,
        from_bucket: i64,
    ) -> Result<Vec<(i64, Amount)>, StoreError>;
    /// Every subject a budget counted something for since `from_bucket`, with its total.
    async fn budget_subjects(
        &self,
        budget: &str,
        from_bucket: i64,
    ) -> Result<Vec<(String, Amount)>, StoreError>;
    /// The ledger added up, by `group_by` (`None`: one total).
    async fn usage_totals(
        &self,
        filter: &UsageFilter,
        group_by: Option<UsageGroupBy>,
    ) -> Result<Vec<UsageTotals>, StoreError>;

    // Shared stores only (several instances): the embedded store keeps these in memory.

    /// Reserves every claim for `run_id` under `hold`, or none: `Some` names the first claim
    /// that does not fit.
    async fn reserve_shared(
        &self,
        _hold: &str,
        _run_id: &str,
        _claims: &[Claim],
    ) -> Result<Option<ClaimRefused>, StoreError> {
        Err(StoreError::Unsupported(
            "reservations are kept in memory on this store".into(),
        ))
    }
    /// Releases a reservation without charging it (the call was never made).
    async fn release_shared(&self, _hold: &str) -> Result<(), StoreError> {
        Ok(())
    }
    /// What live runs have reserved on a counter.
    async fn reserved_shared(&self, _key: &CounterKey) -> Result<Amount, StoreError> {
        Ok(Amount::default())
    }
    /// A counter's used amount since `from_bucket` and what is reserved on it, read together.
    async fn counter_state(
        &self,
        key: &CounterKey,
        from_bucket: i64,
    ) -> Result<(Amount, Amount), StoreError> {
        let used = self
            .counter_buckets(key, from_bucket)
            .await?
            .into_iter()
            .fold(Amount::default(), |sum, (_, amount)| sum.plus(amount));
        Ok((used, self.reserved_shared(key).await?))
    }
    /// Takes `amount` from a bucket if it holds at least `need`, refilling it first.
    async fn take_rate_shared(
        &self,
        _bucket: &RateBucket,
        _amount: f64,
        _need: f64,
    ) -> Result<RateTake, StoreError> {
        Err(StoreError::Unsupported(
            "rate buckets are kept in memory on this store".into(),
        ))
    }
}
