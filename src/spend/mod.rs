//! Spend control (issue 15): budgets and rate limits, enforced without leaks.
//!
//! - **Budgets** (`Runtime.spec.budgets`): before every upstream model call the run
//!   *reserves* the call's worst case (estimated prompt tokens plus the answer's cap) on every
//!   matching budget; a reservation that would take a budget past its limit refuses the call.
//!   After the call the reservation is *settled* to the real usage (or the documented
//!   estimate), written to the ledger with the counters in one transaction. So concurrent
//!   calls never overshoot: used + reserved stays within the limit at every moment, as long as
//!   no call uses more than it reserved.
//! - **Windows** are counted in buckets (see [`Span`]): a rolling window in sixtieths of its
//!   length, counting the bucket it starts in whole (usage leaves a little late, never
//!   early); calendar windows in UTC; `total` in one bucket.
//! - **Rate limits** (`Runtime.spec.rateLimits`) are token buckets holding a minute's worth:
//!   a request takes one request token at admission, and a request is admitted only while
//!   its tokens-per-minute bucket is positive; each call's tokens are taken after it.
//! - **Where the state lives**: on the embedded store, reservations and rate buckets live in
//!   this process (it owns the store) and counters are read from the store once per counter;
//!   on PostgreSQL every instance shares them through the store's atomic operations.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::{DateTime, Datelike, TimeZone, Utc};
use serde::Serialize;
use serde_json::{Value, json};

use crate::store::spend::{
    Amount, Claim, CounterDelta, CounterKey, RateBucket, RateTake, UsageRecord, from_nanos,
    to_nanos,
};
use crate::store::{Store, StoreError};
use crate::workspace::{BudgetConfig, BudgetScope, BudgetWindow, CompiledWorkspace, wire_name};

/// How many buckets a rolling window is counted in.
const ROLLING_BUCKETS: u64 = 60;
/// Counters the embedded store keeps in memory before it lets idle ones go.
const MAX_LOCAL_COUNTERS: usize = 100_000;
/// An answer's cap when neither the client nor the model states one: what a budget reserves.
pub const DEFAULT_OUTPUT_CAP: u64 = 4_096;

/// Who a call is charged to (borrowed: it is asked for on every model call).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Payer<'a> {
    /// The client key identity.
    pub key: &'a str,
    /// The named key's labels (none for unnamed keys).
    pub key_labels: &'a BTreeMap<String, String>,
    pub agent: &'a str,
    /// The session charged: a subagent's calls are charged to its parent's session.
    pub session: &'a str,
}

impl<'a> Payer<'a> {
    /// The subject of a budget scope: each key, agent or session has its own counter.
    fn subject(&self, scope: BudgetScope) -> &'a str {
        match scope {
            BudgetScope::ApiKey => self.key,
            BudgetScope::Agent => self.agent,
            BudgetScope::Session => self.session,
            BudgetScope::Workspace => "*",
        }
    }

    fn matches(&self, matcher: &crate::workspace::SpendMatch) -> bool {
        matcher.matches(self.key, self.key_labels, self.agent)
    }
}

/// Where "now" falls in a budget's window: the bucket a charge goes to, the first bucket
/// that counts, and when the oldest counted usage leaves the window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    pub bucket: i64,
    pub from_bucket: i64,
    pub resets_at: Option<DateTime<Utc>>,
}

impl Span {
    pub fn of(window: BudgetWindow, now: DateTime<Utc>) -> Span {
        let seconds = now.timestamp();
        match window {
            BudgetWindow::Rolling(length) => {
                let length = length.as_secs().max(1);
                let bucket_len = i64::try_from((length / ROLLING_BUCKETS).max(1)).unwrap_or(1);
                let length = i64::try_from(length).unwrap_or(i64::MAX / 4);
                let bucket = seconds.div_euclid(bucket_len) * bucket_len;
                let start = seconds.saturating_sub(length);
                let from_bucket = start.div_euclid(bucket_len) * bucket_len;
                Span {
                    bucket,
                    from_bucket,
                    resets_at: Utc
                        .timestamp_opt(from_bucket + bucket_len + length, 0)
                        .single(),
                }
            }
            BudgetWindow::CalendarDay => {
                let day = now.date_naive();
                let start = day.and_hms_opt(0, 0, 0).map(|t| t.and_utc().timestamp());
                let start = start.unwrap_or(seconds);
                Span {
                    bucket: start,
                    from_bucket: start,
                    resets_at: Utc.timestamp_opt(start + 86_400, 0).single(),
                }
            }
            BudgetWindow::CalendarMonth => {
                let first = Utc
                    .with_ymd_and_hms(now.year(), now.month(), 1, 0, 0, 0)
                    .single()
                    .map(|t| t.timestamp())
                    .unwrap_or(seconds);
                let (year, month) = if now.month() == 12 {
                    (now.year() + 1, 1)
                } else {
                    (now.year(), now.month() + 1)
                };
                Span {
                    bucket: first,
                    from_bucket: first,
                    resets_at: Utc.with_ymd_and_hms(year, month, 1, 0, 0, 0).single(),
                }
            }
            BudgetWindow::Total => Span {
                bucket: 0,
                from_bucket: 0,
                resets_at: None,
            },
        }
    }
}

/// A budget that refused a request or a call.
#[derive(Debug, Clone, PartialEq)]
pub struct BudgetRefusal {
    pub budget: String,
    pub scope: BudgetScope,
    pub subject: String,
    pub max_tokens: Option<u64>,
    pub max_cost: Option<f64>,
    pub used: Amount,
    pub reserved: Amount,
    /// When usage starts leaving the window (`None`: a `total` budget never resets).
    pub resets_at: Option<DateTime<Utc>>,
    /// Only calls in flight hold the room the call needs: it frees when they end.
    pub in_flight: bool,
}

impl BudgetRefusal {
    /// Whole seconds to wait (at least 1), for `retry-after`: a moment when calls in flight
    /// hold the room, else until the window resets (none for `total`).
    pub fn retry_after(&self) -> Option<u64> {
        if self.in_flight {
            return Some(1);
        }
        let at = self.resets_at?;
        let wait = (at - Utc::now()).num_milliseconds().max(0) as u64;
        Some(wait.div_ceil(1000).max(1))
    }

    /// Whether its figures are the caller's own: a key's or a session's counter. An agent's or
    /// the workspace's add up other keys' usage, which a client never sees.
    fn figures_are_own(&self) -> bool {
        matches!(self.scope, BudgetScope::ApiKey | BudgetScope::Session)
    }

    pub fn message(&self) -> String {
        let state = if self.in_flight {
            "calls in flight hold the room this one needs".to_owned()
        } else if self.figures_are_own() {
            format!(
                "{} tokens{} used",
                self.used.tokens,
                if self.max_cost.is_some() {
                    format!(" and {:.6} cost", from_nanos(self.used.cost_nanos))
                } else {
                    String::new()
                }
            )
        } else {
            "its limit is reached".to_owned()
        };
        format!(
            "budget `{}` ({}) has no room: {state}; {}",
            self.budget,
            wire_name(&self.scope),
            match (self.in_flight, self.resets_at) {
                (true, _) => "try again shortly".to_owned(),
                (false, Some(at)) => format!("it resets at {}", at.to_rfc3339()),
                (false, None) => "it never resets (window `total`)".to_owned(),
            }
        )
    }

    /// `runtime.budget.exceeded`'s data (the request's owner reads it: an agent's or the
    /// workspace's figures are left out, operators read them at `/admin/budgets`).
    pub fn event_data(&self) -> Value {
        let own = self.figures_are_own();
        let figures = |amount: Amount| {
            own.then(|| json!({ "tokens": amount.tokens, "cost": from_nanos(amount.cost_nanos) }))
        };
        json!({
            "budget": self.budget,
            "scope": self.scope,
            "subject": if own { Some(&self.subject) } else { None },
            "limit": { "tokens": self.max_tokens, "cost": self.max_cost },
            "used": figures(self.used),
            "reserved": figures(self.reserved),
            "inFlight": self.in_flight,
            "resetsAt": self.resets_at,
        })
    }

    /// The error a run fails with.
    pub fn run_error(&self) -> Value {
        json!({
            "kind": "budget_exceeded",
            "message": self.message(),
            "budget": self.budget,
            "retryAfter": self.retry_after(),
        })
    }
}

/// A rate limit that refused a request.
#[derive(Debug, Clone, PartialEq)]
pub struct RateRefusal {
    pub limit: String,
    pub dimension: &'static str,
    pub wait: Duration,
}

impl RateRefusal {
    pub fn retry_after(&self) -> u64 {
        (self.wait.as_millis() as u64).div_ceil(1000).max(1)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SpendError {
    #[error("{}", .0.message())]
    Budget(Box<BudgetRefusal>),
    #[error("rate limit `{}` ({} per minute) is exhausted; retry in {}s", .0.limit, .0.dimension, .0.retry_after())]
    Rate(RateRefusal),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// A call's reservation. Settle it with [`Spend::settle`]; dropped unsettled, it is given
/// back (on the embedded store at once; on a shared store when the run ends).
#[derive(Debug)]
pub struct Hold {
    id: String,
    entries: Vec<(CounterKey, Amount)>,
    local: Option<Arc<Local>>,
}

impl Drop for Hold {
    fn drop(&mut self) {
        if let Some(local) = self.local.take() {
            local.release(&self.entries);
        }
    }
}

/// A call's usage, as the upstream reported it or as estimated.
#[derive(Debug, Clone, PartialEq)]
pub struct Charge {
    /// The catalog model id, or `agent:<id>` / `memory:<provider>`.
    pub model: String,
    pub source: &'static str,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub cost: Option<f64>,
    pub estimated: bool,
}

/// A rate bucket's name, subject and dimension.
type RateKey = (String, String, &'static str);

/// The state the embedded store keeps in this process.
#[derive(Debug, Default)]
pub struct Local {
    counters: Mutex<HashMap<CounterKey, LocalCounter>>,
    rates: Mutex<HashMap<RateKey, (f64, Instant)>>,
}

#[derive(Debug)]
struct LocalCounter {
    buckets: BTreeMap<i64, Amount>,
    reserved: Amount,
    /// The first bucket read from the store: a caller counting from an earlier one (a reload
    /// widened the window) has the counter read again.
    loaded_from: i64,
    /// When it was last used: a counter let go must not be one a caller is about to use, nor
    /// one whose charge may still wait for the writer's next transaction.
    touched_at: Instant,
}

/// How long a counter stays in memory after its last use, whatever the cap.
const KEEP_TOUCHED: Duration = Duration::from_secs(60);

impl LocalCounter {
    fn used(&mut self, from_bucket: i64) -> Amount {
        // Buckets that left the window are never counted again.
        self.buckets = self.buckets.split_off(&from_bucket);
        self.loaded_from = self.loaded_from.max(from_bucket);
        self.buckets
            .values()
            .fold(Amount::default(), |sum, amount| sum.plus(*amount))
    }

    /// Whether it holds everything a caller counting from `from_bucket` needs.
    fn covers(&self, from_bucket: i64) -> bool {
        self.loaded_from <= from_bucket
    }
}

impl Local {
    /// The counters, whatever a panicking holder left (every change is one whole step).
    fn counters(&self) -> std::sync::MutexGuard<'_, HashMap<CounterKey, LocalCounter>> {
        crate::threads::locked(&self.counters)
    }

    fn release(&self, entries: &[(CounterKey, Amount)]) {
        let mut counters = self.counters();
        for (key, amount) in entries {
            if let Some(counter) = counters.get_mut(key) {
                counter.reserved = counter.reserved.minus(*amount);
            }
        }
    }

    fn take_rate(&self, bucket: &RateBucket, amount: f64, need: f64) -> RateTake {
        let mut rates = crate::threads::locked(&self.rates);
        let capacity = bucket.per_minute as f64;
        let now = Instant::now();
        let entry = rates
            .entry((
                bucket.name.clone(),
                bucket.subject.clone(),
                bucket.dimension,
            ))
            .or_insert((capacity, now));
        let level = (entry.0 + now.duration_since(entry.1).as_secs_f64() * bucket.per_second())
            .min(capacity);
        *entry = (level, now);
        if level >= need {
            entry.0 = level - amount;
            RateTake::Taken
        } else {
            RateTake::Refused {
                wait_secs: (need - level) / bucket.per_second(),
            }
        }
    }
}

/// The runtime's accountant: budgets and rate limits of the workspace a run started with,
/// against the store's ledger.
#[derive(Debug)]
pub struct Spend {
    store: Arc<dyn Store>,
    /// The embedded store's in-process state; `None` on a shared store.
    local: Option<Arc<Local>>,
}

/// One matching budget's claim, with its budget.
struct Matched<'w> {
    budget: &'w BudgetConfig,
    key: CounterKey,
    span: Span,
}

impl Spend {
    pub fn new(store: Arc<dyn Store>) -> Self {
        let local = (!store.is_shared()).then(Arc::default);
        Self { store, local }
    }

    fn matching<'w>(
        workspace: &'w CompiledWorkspace,
        payer: &Payer<'_>,
        now: DateTime<Utc>,
    ) -> Vec<Matched<'w>> {
        workspace
            .runtime
            .budgets
            .iter()
            .filter(|budget| payer.matches(&budget.matcher))
            .map(|budget| Matched {
                key: CounterKey {
                    budget: budget.name.clone(),
                    subject: payer.subject(budget.scope).to_owned(),
                },
                span: Span::of(budget.window, now),
                budget,
            })
            .collect()
    }

    fn claim(matched: &Matched<'_>, amount: Amount) -> Claim {
        Claim {
            key: matched.key.clone(),
            from_bucket: matched.span.from_bucket,
            amount,
            max_tokens: matched.budget.max_tokens,
            max_cost_nanos: matched.budget.max_cost.map(to_nanos),
        }
    }

    fn refusal(matched: &Matched<'_>, used: Amount, reserved: Amount, asked: Amount) -> SpendError {
        // Without the calls in flight it would fit: room comes back when they end.
        let in_flight = Self::claim(matched, asked).fits(used, Amount::default());
        SpendError::Budget(Box::new(BudgetRefusal {
            in_flight,
            budget: matched.budget.name.clone(),
            scope: matched.budget.scope,
            subject: matched.key.subject.clone(),
            max_tokens: matched.budget.max_tokens,
            max_cost: matched.budget.max_cost,
            used,
            reserved,
            resets_at: matched.span.resets_at,
        }))
    }

    /// Reads from the store every counter of `matched` this process does not hold (or holds
    /// from a later bucket than its caller counts from).
    async fn load(&self, local: &Local, matched: &[Matched<'_>]) -> Result<(), StoreError> {
        for m in matched {
            let covered = local
                .counters()
                .get(&m.key)
                .is_some_and(|counter| counter.covers(m.span.from_bucket));
            if covered {
                continue;
            }
            let buckets: BTreeMap<i64, Amount> = self
                .store
                .counter_buckets(&m.key, m.span.from_bucket)
                .await?
                .into_iter()
                .collect();
            let mut counters = local.counters();
            // Bounded: past the cap, counters nothing is reserved on and nobody used for a
            // while are let go (read again from the store when next touched).
            if counters.len() >= MAX_LOCAL_COUNTERS {
                counters.retain(|_, counter| {
                    counter.reserved != Amount::default()
                        || counter.touched_at.elapsed() < KEEP_TOUCHED
                });
            }
            let now = Instant::now();
            match counters.get_mut(&m.key) {
                // Someone loaded it meanwhile: theirs is the one charges went to since.
                Some(counter) if counter.covers(m.span.from_bucket) => counter.touched_at = now,
                // A wider window: older buckets from the store, the ones memory holds (charges
                // that may still wait for the writer included) from memory.
                Some(counter) => {
                    let mut merged = buckets;
                    merged.retain(|bucket, _| *bucket < counter.loaded_from);
                    merged.append(&mut counter.buckets);
                    counter.buckets = merged;
                    counter.loaded_from = m.span.from_bucket;
                    counter.touched_at = now;
                }
                None => {
                    counters.insert(
                        m.key.clone(),
                        LocalCounter {
                            buckets,
                            reserved: Amount::default(),
                            loaded_from: m.span.from_bucket,
                            touched_at: now,
                        },
                    );
                }
            }
        }
        Ok(())
    }

    /// Runs `work` on the counters in memory once every one of `matched` is there (loaded,
    /// and marked used so that none is let go meanwhile).
    async fn with_counters<T>(
        &self,
        local: &Local,
        matched: &[Matched<'_>],
        work: impl FnOnce(&mut HashMap<CounterKey, LocalCounter>) -> T,
    ) -> Result<T, StoreError> {
        for _ in 0..3 {
            self.load(local, matched).await?;
            let mut counters = local.counters();
            let ready = matched.iter().all(|m| {
                counters
                    .get(&m.key)
                    .is_some_and(|counter| counter.covers(m.span.from_bucket))
            });
            if ready {
                let now = Instant::now();
                for m in matched {
                    if let Some(counter) = counters.get_mut(&m.key) {
                        counter.touched_at = now;
                    }
                }
                return Ok(work(&mut counters));
            }
        }
        Err(StoreError::Unavailable(
            "budget counters are being read again; try again shortly".into(),
        ))
    }

    /// A counter's used and reserved amounts now.
    async fn state(&self, matched: &Matched<'_>) -> Result<(Amount, Amount), StoreError> {
        match &self.local {
            Some(local) => {
                let from = matched.span.from_bucket;
                self.with_counters(local, std::slice::from_ref(matched), |counters| {
                    counters
                        .get_mut(&matched.key)
                        .map(|counter| (counter.used(from), counter.reserved))
                        .unwrap_or_default()
                })
                .await
            }
            None => {
                self.store
                    .counter_state(&matched.key, matched.span.from_bucket)
                    .await
            }
        }
    }

    fn rate_buckets(workspace: &CompiledWorkspace, payer: &Payer) -> Vec<(RateBucket, bool)> {
        let mut buckets = Vec::new();
        for limit in workspace
            .runtime
            .rate_limits
            .iter()
            .filter(|limit| payer.matches(&limit.matcher))
        {
            let subject = match limit.scope {
                crate::workspace::RateLimitScope::ApiKey => payer.key.to_owned(),
                crate::workspace::RateLimitScope::Agent => payer.agent.to_owned(),
            };
            for (per_minute, dimension, requests) in [
                (limit.requests_per_minute, "requests", true),
                (limit.tokens_per_minute, "tokens", false),
            ] {
                if let Some(per_minute) = per_minute {
                    buckets.push((
                        RateBucket {
                            name: limit.name.clone(),
                            subject: subject.clone(),
                            dimension,
                            per_minute,
                        },
                        requests,
                    ));
                }
            }
        }
        buckets
    }

    async fn take_rate(
        &self,
        bucket: &RateBucket,
        amount: f64,
        need: f64,
    ) -> Result<RateTake, StoreError> {
        match &self.local {
            Some(local) => Ok(local.take_rate(bucket, amount, need)),
            None => self.store.take_rate_shared(bucket, amount, need).await,
        }
    }

    /// Admission of a new request: every matching budget has room left, and (for a client's
    /// request, `rate_limited`; a subagent's request is part of its parent's) the rate limits
    /// give it a request and have tokens left.
    pub async fn admit(
        &self,
        workspace: &CompiledWorkspace,
        payer: &Payer<'_>,
        rate_limited: bool,
    ) -> Result<(), SpendError> {
        let now = Utc::now();
        for matched in Self::matching(workspace, payer, now) {
            let (used, reserved) = self.state(&matched).await?;
            let least = Amount {
                tokens: 1,
                cost_nanos: 1,
            };
            if !Self::claim(&matched, least).fits(used, reserved) {
                crate::metrics::budget_refused(&matched.budget.name, "admission");
                return Err(Self::refusal(&matched, used, reserved, least));
            }
        }
        let buckets = if rate_limited {
            Self::rate_buckets(workspace, payer)
        } else {
            Vec::new()
        };
        let mut taken: Vec<&RateBucket> = Vec::new();
        for (bucket, requests) in &buckets {
            let (amount, need) = if *requests { (1.0, 1.0) } else { (0.0, 1.0) };
            if let RateTake::Refused { wait_secs } = self.take_rate(bucket, amount, need).await? {
                // A refused request takes nothing: the request tokens taken already go back.
                for given in taken {
                    self.take_rate(given, -1.0, f64::NEG_INFINITY).await?;
                }
                crate::metrics::rate_limited(&bucket.name);
                return Err(SpendError::Rate(RateRefusal {
                    limit: bucket.name.clone(),
                    dimension: bucket.dimension,
                    wait: Duration::from_secs_f64(wait_secs.clamp(0.0, 86_400.0)),
                }));
            }
            if *requests {
                taken.push(bucket);
            }
        }
        Ok(())
    }

    /// Reserves `amount` on every matching budget for one call of `run_id`, or refuses it.
    /// `None`: no budget applies.
    pub async fn reserve(
        &self,
        workspace: &CompiledWorkspace,
        payer: &Payer<'_>,
        run_id: &str,
        amount: Amount,
    ) -> Result<Option<Hold>, SpendError> {
        if workspace.runtime.budgets.is_empty() {
            return Ok(None);
        }
        let matched = Self::matching(workspace, payer, Utc::now());
        if matched.is_empty() {
            return Ok(None);
        }
        let amount = amount.bounded();
        let id = crate::runtime::new_id("hold");
        let entries: Vec<(CounterKey, Amount)> =
            matched.iter().map(|m| (m.key.clone(), amount)).collect();
        match &self.local {
            Some(local) => {
                let refused = self
                    .with_counters(local, &matched, |counters| {
                        for m in &matched {
                            let Some(counter) = counters.get_mut(&m.key) else {
                                continue;
                            };
                            let used = counter.used(m.span.from_bucket);
                            if !Self::claim(m, amount).fits(used, counter.reserved) {
                                return Some(Self::refusal(m, used, counter.reserved, amount));
                            }
                        }
                        for m in &matched {
                            if let Some(counter) = counters.get_mut(&m.key) {
                                counter.reserved = counter.reserved.plus(amount);
                            }
                        }
                        None
                    })
                    .await?;
                if let Some(refused) = refused {
                    if let SpendError::Budget(refusal) = &refused {
                        crate::metrics::budget_refused(&refusal.budget, "call");
                    }
                    return Err(refused);
                }
                Ok(Some(Hold {
                    id,
                    entries,
                    local: Some(Arc::clone(local)),
                }))
            }
            None => {
                let claims: Vec<Claim> = matched.iter().map(|m| Self::claim(m, amount)).collect();
                if let Some(refused) = self.store.reserve_shared(&id, run_id, &claims).await? {
                    let m = &matched[refused.index.min(matched.len() - 1)];
                    crate::metrics::budget_refused(&m.budget.name, "call");
                    return Err(Self::refusal(m, refused.used, refused.reserved, amount));
                }
                Ok(Some(Hold {
                    id,
                    entries,
                    local: None,
                }))
            }
        }
    }

    /// Charges a call: releases its reservation, records its usage in the ledger and its
    /// counters (one transaction), and takes its tokens from the tokens-per-minute buckets.
    pub async fn settle(
        &self,
        workspace: &CompiledWorkspace,
        payer: &Payer<'_>,
        hold: Option<Hold>,
        record: &UsageRecord,
    ) -> Result<(), StoreError> {
        let amount = Amount {
            tokens: record
                .prompt_tokens
                .saturating_add(record.completion_tokens),
            cost_nanos: record.cost_nanos.unwrap_or(0),
        }
        .bounded();
        let matched = Self::matching(workspace, payer, record.at);
        let deltas: Vec<CounterDelta> = matched
            .iter()
            .map(|m| CounterDelta {
                key: m.key.clone(),
                bucket: m.span.bucket,
                amount,
            })
            .collect();
        let mut hold = hold;
        let hold_id = hold.as_ref().map(|hold| hold.id.clone());
        if let Some(local) = &self.local {
            self.load(local, &matched).await?;
        }
        // The store first (handed to its writer, which commits it with its next transaction),
        // with the reservation still held: no moment shows the call neither reserved nor
        // used.
        let written = self
            .store
            .record_usage(record, &deltas, hold_id.as_deref())
            .await;
        if let Some(local) = &self.local {
            let mut counters = local.counters();
            if let Some(hold) = hold.as_mut() {
                for (key, reserved) in hold.entries.drain(..) {
                    if let Some(counter) = counters.get_mut(&key) {
                        counter.reserved = counter.reserved.minus(reserved);
                    }
                }
            }
            // A counter let go meanwhile is read again from the store, charge included.
            let now = Instant::now();
            for delta in &deltas {
                if let Some(counter) = counters.get_mut(&delta.key) {
                    let bucket = counter.buckets.entry(delta.bucket).or_default();
                    *bucket = bucket.plus(delta.amount);
                    counter.touched_at = now;
                }
            }
        }
        if let Some(hold) = hold.as_mut() {
            hold.local = None;
        }
        written?;
        for (bucket, requests) in Self::rate_buckets(workspace, payer) {
            if !requests && amount.tokens > 0 {
                self.take_rate(&bucket, amount.tokens as f64, f64::NEG_INFINITY)
                    .await?;
            }
        }
        Ok(())
    }

    /// Gives a reservation back uncharged (the call was never sent).
    pub async fn release(&self, hold: Hold) -> Result<(), StoreError> {
        if self.local.is_none() {
            self.store.release_shared(&hold.id).await?;
        }
        drop(hold);
        Ok(())
    }

    /// Every budget's counters now: one entry per subject it counted anything for.
    pub async fn budgets(
        &self,
        workspace: &CompiledWorkspace,
    ) -> Result<Vec<BudgetState>, StoreError> {
        let now = Utc::now();
        let mut states = Vec::new();
        for budget in &workspace.runtime.budgets {
            let span = Span::of(budget.window, now);
            let mut subjects: BTreeMap<String, Amount> = self
                .store
                .budget_subjects(&budget.name, span.from_bucket)
                .await?
                .into_iter()
                .collect();
            if let Some(local) = &self.local {
                for (key, counter) in local.counters().iter() {
                    if key.budget == budget.name && counter.reserved != Amount::default() {
                        subjects.entry(key.subject.clone()).or_default();
                    }
                }
            }
            for (subject, used) in subjects {
                let key = CounterKey {
                    budget: budget.name.clone(),
                    subject: subject.clone(),
                };
                let reserved = match &self.local {
                    Some(local) => local
                        .counters()
                        .get(&key)
                        .map(|counter| counter.reserved)
                        .unwrap_or_default(),
                    None => self.store.reserved_shared(&key).await?,
                };
                states.push(BudgetState {
                    name: budget.name.clone(),
                    scope: wire_name(&budget.scope),
                    subject,
                    window: budget.window.describe(),
                    limit: Figures {
                        tokens: budget.max_tokens,
                        cost: budget.max_cost,
                    },
                    used: Figures::of(used),
                    reserved: Figures::of(reserved),
                    resets_at: span.resets_at,
                });
            }
        }
        Ok(states)
    }
}

/// Tokens and cost as the API shows them.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct Figures {
    pub tokens: Option<u64>,
    pub cost: Option<f64>,
}

impl Figures {
    fn of(amount: Amount) -> Self {
        Self {
            tokens: Some(amount.tokens),
            cost: Some(from_nanos(amount.cost_nanos)),
        }
    }
}

/// One budget's counter for one subject, as `/admin/budgets` shows it.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct BudgetState {
    pub name: String,
    /// `apiKey`, `agent`, `session` or `workspace`.
    pub scope: String,
    /// The key identity, agent, session, or `*` for a workspace budget.
    pub subject: String,
    pub window: String,
    pub limit: Figures,
    pub used: Figures,
    pub reserved: Figures,
    /// When the oldest counted usage leaves the window (`null` for `total`).
    pub resets_at: Option<DateTime<Utc>>,
}

/// Estimated tokens of a prompt: one per three bytes of its JSON, which is above what
/// tokenizers count for English and code (about four bytes a token) and near it for
/// languages written with multi-byte characters.
pub fn estimate_tokens(bytes: usize) -> u64 {
    (bytes as u64).div_ceil(3)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(text: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(text)
            .map(|t| t.with_timezone(&Utc))
            .unwrap_or_default()
    }

    #[test]
    fn windows_count_whole_buckets_and_reset_when_the_oldest_leaves() {
        let now = at("2026-11-25T10:30:00Z");
        let day = Span::of(BudgetWindow::CalendarDay, now);
        assert_eq!(day.bucket, at("2026-11-25T00:00:00Z").timestamp());
        assert_eq!(day.resets_at, Some(at("2026-11-26T00:00:00Z")));
        let month = Span::of(BudgetWindow::CalendarMonth, at("2026-12-31T23:59:59Z"));
        assert_eq!(month.from_bucket, at("2026-12-01T00:00:00Z").timestamp());
        assert_eq!(month.resets_at, Some(at("2027-01-01T00:00:00Z")));
        let rolling = Span::of(BudgetWindow::Rolling(Duration::from_secs(3_600)), now);
        // Buckets of a minute: the one the window starts in counts whole.
        assert_eq!(rolling.from_bucket, at("2026-11-25T09:30:00Z").timestamp());
        assert_eq!(rolling.bucket, now.timestamp());
        assert_eq!(rolling.resets_at, Some(at("2026-11-25T10:31:00Z")));
        let total = Span::of(BudgetWindow::Total, now);
        assert_eq!((total.bucket, total.resets_at), (0, None));
    }

    #[test]
    fn a_claim_fits_only_within_every_limit() {
        let claim = Claim {
            key: CounterKey {
                budget: "b".into(),
                subject: "s".into(),
            },
            from_bucket: 0,
            amount: Amount {
                tokens: 10,
                cost_nanos: 5,
            },
            max_tokens: Some(100),
            max_cost_nanos: Some(50),
        };
        let used = Amount {
            tokens: 60,
            cost_nanos: 20,
        };
        assert!(claim.fits(
            used,
            Amount {
                tokens: 30,
                cost_nanos: 0
            }
        ));
        assert!(!claim.fits(
            used,
            Amount {
                tokens: 31,
                cost_nanos: 0
            }
        ));
        assert!(!claim.fits(
            used,
            Amount {
                tokens: 0,
                cost_nanos: 26
            }
        ));
    }

    /// A workspace with `spend` (YAML under `spec:`) and an embedded store, in `dir`.
    async fn spend_on_sqlite(
        dir: &std::path::Path,
        spend: &str,
    ) -> (CompiledWorkspace, Arc<dyn Store>) {
        let write = |path: &str, text: String| {
            let path = dir.join(path);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, text).unwrap();
        };
        write(
            "config/runtime/workspace.yaml",
            format!(
                "apiVersion: stable-harness/v1\nkind: Runtime\nmetadata: {{ name: t }}\nspec:\n{spend}"
            ),
        );
        write(
            "config/agents/a.yaml",
            "apiVersion: stable-harness/v1\nkind: Agent\nmetadata: { name: helper }\nspec:\n  backend: scripted\n  script: [{ reply: hi }]\n".into(),
        );
        let workspace = crate::workspace::load(dir).unwrap();
        let store: Arc<dyn Store> = Arc::new(
            crate::store::SqliteStore::open_file(&dir.join("state.db"))
                .await
                .unwrap(),
        );
        (workspace, store)
    }

    static NO_LABELS: BTreeMap<String, String> = BTreeMap::new();

    fn payer(key: &str) -> Payer<'_> {
        Payer {
            key,
            key_labels: &NO_LABELS,
            agent: "helper",
            session: "ses_1",
        }
    }

    #[tokio::test]
    async fn a_refused_request_gives_back_the_rate_tokens_it_took() {
        let dir = tempfile::tempdir().unwrap();
        // A bucket of 3 requests shared by the agent, and a bucket of 1 for key `key-aaaaaaaaaaaa`.
        let (workspace, store) = spend_on_sqlite(
            dir.path(),
            "  rateLimits:\n    - { name: agent-pace, scope: agent, requestsPerMinute: 3 }\n    - { name: key-pace, scope: apiKey, match: { keys: [key-aaaaaaaaaaaa] }, requestsPerMinute: 1 }\n",
        )
        .await;
        let spend = Spend::new(store);
        let (a, b) = (payer("key-aaaaaaaaaaaa"), payer("key-bbbbbbbbbbbb"));
        spend.admit(&workspace, &a, true).await.unwrap();
        for _ in 0..5 {
            let refused = spend.admit(&workspace, &a, true).await;
            assert!(
                matches!(&refused, Err(SpendError::Rate(r)) if r.limit == "key-pace"),
                "{refused:?}"
            );
        }
        // The agent's bucket lost nothing to the refused requests: two are left for others.
        spend.admit(&workspace, &b, true).await.unwrap();
        spend.admit(&workspace, &b, true).await.unwrap();
        let refused = spend.admit(&workspace, &b, true).await;
        assert!(
            matches!(&refused, Err(SpendError::Rate(r)) if r.limit == "agent-pace" && r.retry_after() >= 1),
            "{refused:?}"
        );
        // A subagent's request takes no rate-limit token.
        spend.admit(&workspace, &b, false).await.unwrap();
    }

    #[tokio::test]
    async fn a_window_widened_by_a_reload_reads_older_usage_and_keeps_what_memory_holds() {
        let dir = tempfile::tempdir().unwrap();
        let daily = "  budgets:\n    - { name: pool, scope: workspace, maxTokens: 1000, window: calendarDay }\n";
        let (workspace, store) = spend_on_sqlite(dir.path(), daily).await;
        let spend = Spend::new(Arc::clone(&store));
        let who = payer("key-aaaaaaaaaaaa");
        let record = |id: &str, tokens: u64| UsageRecord {
            id: id.into(),
            at: Utc::now(),
            request_id: "req_1".into(),
            run_id: "run_1".into(),
            owner: who.key.to_owned(),
            agent_id: who.agent.to_owned(),
            session_id: who.session.to_owned(),
            model: "m".into(),
            source: "model".into(),
            prompt_tokens: tokens,
            completion_tokens: 0,
            cost_nanos: None,
            estimated: false,
        };
        // Ten days ago, 700 tokens: outside today's window.
        let old = CounterDelta {
            key: CounterKey {
                budget: "pool".into(),
                subject: "*".into(),
            },
            bucket: Utc::now().timestamp() - 10 * 86_400,
            amount: Amount {
                tokens: 700,
                cost_nanos: 0,
            },
        };
        store
            .record_usage(&record("use_old", 700), &[old], None)
            .await
            .unwrap();
        // Today, 200 tokens, charged through the accountant (memory and store).
        let hold = spend
            .reserve(
                &workspace,
                &who,
                "run_1",
                Amount {
                    tokens: 250,
                    cost_nanos: 0,
                },
            )
            .await
            .unwrap();
        spend
            .settle(&workspace, &who, hold, &record("use_new", 200))
            .await
            .unwrap();
        let state = |workspace: CompiledWorkspace| {
            let spend = &spend;
            async move {
                spend
                    .budgets(&workspace)
                    .await
                    .unwrap()
                    .into_iter()
                    .map(|b| b.used.tokens.unwrap_or(0))
                    .sum::<u64>()
            }
        };
        // The charge waits for the store writer's next transaction, and with none coming here
        // (no run writes after it), for the net: the store's checkpointer's next tick.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while state(workspace.clone()).await != 200 {
            assert!(
                std::time::Instant::now() < deadline,
                "the charge was never counted"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // The same budget, now counting everything: the old usage counts, today's once.
        std::fs::write(
            dir.path().join("config/runtime/workspace.yaml"),
            "apiVersion: stable-harness/v1\nkind: Runtime\nmetadata: { name: t }\nspec:\n  budgets:\n    - { name: pool, scope: workspace, maxTokens: 1000, window: total }\n",
        )
        .unwrap();
        let widened = crate::workspace::load(dir.path()).unwrap();
        assert_eq!(state(widened.clone()).await, 900);
        let refused = spend
            .reserve(
                &widened,
                &who,
                "run_1",
                Amount {
                    tokens: 101,
                    cost_nanos: 0,
                },
            )
            .await;
        assert!(matches!(refused, Err(SpendError::Budget(_))), "{refused:?}");
        let fits = spend
            .reserve(
                &widened,
                &who,
                "run_1",
                Amount {
                    tokens: 100,
                    cost_nanos: 0,
                },
            )
            .await;
        assert!(matches!(fits, Ok(Some(_))), "{fits:?}");
    }
}
