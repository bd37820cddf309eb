//! The journal: the single, ordered path by which the runtime writes to the store.
//!
//! Writes arrive in *groups*: ops that belong together (a submit, a run's end, an approval
//! decision, a tool call's start) are one group and always commit in one transaction. The
//! writer task applies whatever is queued as one transaction, so a streaming run costs one
//! commit per burst of tokens, not one per token. The writer task runs where the store says
//! writes are cheapest to hand over ([`Store::writer_runtime`]): on the embedded store, the
//! writer thread itself, so a commit wakes one thread (its producer's), not three.
//!
//! A store that can apply several batches at once ([`Store::writer_lanes`]: PostgreSQL) gets
//! one queue and writer task per *lane*, each holding a share of the requests
//! ([`crate::store::lane_of`]): a request's writes stay in one lane, in order, and batches of
//! different lanes overlap. The embedded store has one lane.
//!
//! What the journal promises:
//! - **An acknowledged write has committed.** [`Journal::commit`] resolves only after the
//!   group's transaction committed, and reports a failure to its producer. Fire-and-forget
//!   writes ([`Journal::write`]) are acknowledged by the producer's next `commit`: if an
//!   earlier write of the same request failed, that commit fails too (the request is
//!   *poisoned*) and is not applied, so a run never carries on past a lost write.
//! - **Gapless `seq`.** The store numbers events in the transaction that commits them, after
//!   the request's last stored one, so a failed group never leaves a hole, and a request
//!   written from two instances (its run's holder, an operator deciding an approval
//!   elsewhere) still counts 1, 2, 3...
//! - **One bad group never fails another.** When a batch fails with an error that is not
//!   transient (a constraint, a conflicting decision), its groups are applied one by one and
//!   only the failing group is refused. A transient failure (busy, I/O, full disk) is retried,
//!   with the store marked unavailable meanwhile: producers wait (the queue is bounded), new
//!   submits are refused with 503, `/readyz` is red, and service resumes by itself once a
//!   write succeeds again. A batch that lost a race with another transaction (a deadlock
//!   between two lanes' or two instances' batches) is tried again within a millisecond or
//!   so, the store reported fine (up to [`MAX_CONTENTION_RETRIES`] races lost in a row).
//! - Events reach live subscribers only after their commit.
//! - **A request answered whole commits once.** A write nobody waits on ([`Journal::write`])
//!   of a request nobody streams live ([`super::Following`]) is held, at most [`HOLD`], and
//!   commits with the next write that is waited on (the run's end, at the latest): the
//!   common request is one transaction, not one per step. A streamed request's writes, and
//!   every write whose producer waits, commit at once. A request's submit is held too, even
//!   when streamed ([`Journal::write_submit`]): it commits with its run's first write that
//!   commits, so the common request is one transaction. A write asked to commit at once
//!   that nobody waits on (a status change, [`Journal::write_group_now`]) does too, unless
//!   other runs execute here: then it waits for their next commit, at most [`PROMPT_HOLD`].
//! - **Output deltas are stored as they commit, not as they arrive.** A run's consecutive
//!   `agent.output.delta` events queued while the previous commit was in flight become one
//!   event with their texts joined (up to [`MAX_MERGED_DELTA`] bytes): the same text, in
//!   the same order, for live subscribers and replay alike, in a row per commit instead of a
//!   row per token. A delta whose run's previous delta still waits in the queue joins it
//!   there ([`Journal::extend_queued_delta`]): no event is built only to be merged.
//! - **Nothing secret is stored.** Every write is redacted ([`crate::redact`]) before it is
//!   applied, whoever produced it: the one choke point for everything persisted.
//!
//! What it spends for latency: on the embedded store, where the writer has a thread of its
//! own, the writer polls its queue for up to [`AWAKE`] before it sleeps when a client sends
//! one request after another (its last wait was short, its last batch held one request's
//! writes, the writes it holds began within [`AWAKE`] of that batch's commit, at most one
//! run executes: [`Pace`]): the next write is then taken without waking a thread on a halted
//! CPU, ~0.1 ms of such a client's request, for ~0.1 ms of CPU a request spent polling. A
//! poll that finds nothing stops the polling until a wait is short again, and requests at
//! a steady rate never begin within [`AWAKE`] of the commit before them, so they, a slow
//! model's answer or an idle writer cost at most a poll now and then; under load (a batch
//! of several requests' writes, or more than one run executing) it never polls. While it
//! polls, a producer waits for its commit of a request nobody follows live
//! ([`Journal::commit`], a run's end among them) awake too, for up to [`AWAKE`]: the
//! acknowledgement is then taken without a wake-up of the producer's thread either, for the
//! commit's time of CPU spent waiting where that thread's sleep and wake-up were spent
//! before (docs/profiling.md, the fifty-eighth pass). A held write never wakes the writer:
//! while the writer holds none, the first one's hold is timed on its producer's runtime
//! ([`HoldTimer`]), and the request's end, queued from the same thread, cancels the timer
//! there, so that a request answered whole wakes the writer once, whatever the pace of
//! requests. Under load (more than one run executing) the writer watches its queue for a
//! hold's length after each commit instead ([`Writer::watches`]), and the held writes that
//! come meanwhile need no timer either (the sixty-sixth pass).

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use serde_json::Value;
use tokio::sync::{Notify, Semaphore, oneshot};

use super::events::{ADAPTER_EVENT, output_delta_text};
use super::hub::EventHub;
use crate::ids::IdMap;
use crate::redact::{Redactor, Secrets};
use crate::store::{EventRecord, RequestInFull, Store, StoreError, WriteOp, lane_of};

/// Most groups applied in one transaction.
const MAX_BATCH: usize = 512;
/// Queue length (in groups) before producers wait.
const QUEUE: usize = 8_192;
/// Largest text of a delta event made of several (a longer one starts a new event).
const MAX_MERGED_DELTA: usize = 64 * 1024;
/// Longest a write nobody waits on is held before it commits on its own.
const HOLD: Duration = Duration::from_millis(5);
/// Longest a prompt write waits for another run's commit (see [`Urgency::Prompt`]).
const PROMPT_HOLD: Duration = Duration::from_millis(1);
/// Longest the writer polls its queue before it sleeps (see [`Writer::polls`]).
const AWAKE: Duration = Duration::from_millis(1);
/// How long the writer polls before it lets the other tasks of its thread, and the other
/// threads of its CPU, run: a thread that polls a whole [`AWAKE`] keeps a thread woken on
/// its CPU waiting for the kernel's time slice (p99 at c=1 0.80 -> 1.27 ms,
/// docs/profiling.md, the fifty-third pass).
const AWAKE_SLICE: Duration = Duration::from_micros(50);
/// First pause before a batch that lost a race with another transaction (a deadlock) is tried
/// again; it doubles with each race lost in a row, up to [`MAX_CONTENTION_DELAY`].
const CONTENTION_RETRY_DELAY: Duration = Duration::from_millis(1);
const MAX_CONTENTION_DELAY: Duration = Duration::from_millis(100);
/// Races a batch may lose in a row before it is retried as a store that cannot write (the
/// store then reported unavailable): a batch that never gets through is not a race.
const MAX_CONTENTION_RETRIES: u32 = 50;
/// Longest pause between two tries of a write the store refused for a transient reason.
const MAX_RETRY_DELAY: Duration = Duration::from_secs(1);

/// Why a write was not committed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum JournalError {
    #[error("the store journal is closed")]
    Closed,
    /// The write conflicts with the stored state (an approval decided already).
    #[error("{0}")]
    Conflict(String),
    /// The store refused the write; the request cannot go on.
    #[error("the store refused a write: {0}")]
    Rejected(String),
    /// An earlier write of this request was refused, so this one was not applied.
    #[error("an earlier write of request `{0}` was lost, so the request cannot go on")]
    Poisoned(String),
    /// The run's lease is held by another instance now: it executes the run from here on.
    #[error("{0}")]
    LeaseLost(String),
}

/// When a group nobody waits on commits, as its producer asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Asked {
    /// Held, unless its request is streamed live ([`Journal::write`]).
    Held,
    /// Held even when its request is streamed live: a request's submit, and its run's start,
    /// which commit with the run's first write that commits ([`Journal::write_submit`]).
    Submit,
    /// Committed at once ([`Journal::write_group_now`]).
    Now,
}

/// A group of writes as queued.
struct Group {
    /// The request the group belongs to: a failure poisons it.
    request: Option<String>,
    ops: Vec<WriteOp>,
    /// Applied even to a poisoned request (a run's end), and clears the poison.
    settles: bool,
    /// When it commits if nobody waits on it.
    asked: Asked,
    ack: Option<oneshot::Sender<Result<(), JournalError>>>,
}

impl Group {
    /// The requests the group writes for: its own, and every request it has an event of,
    /// whoever queued it (an approval decision carries its request's event).
    fn requests(&self) -> impl Iterator<Item = &str> {
        let events = self.ops.iter().filter_map(|op| match op {
            WriteOp::AppendEvent(event) => Some(&*event.request_id),
            _ => None,
        });
        self.request.as_deref().into_iter().chain(events)
    }
}

enum Item {
    Group(Group),
    /// Resolved once everything queued before it is committed (or refused).
    Flush(oneshot::Sender<()>),
    /// Forgets a request's lost writes: this instance claimed its run again, and the run
    /// goes on from what the store holds.
    Forgive(String),
}

/// When the writer commits for an item.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Urgency {
    /// Nobody waits on it and its request is not streamed live: held (at most [`HOLD`]), it
    /// commits with the next write that is not: a request answered whole commits once, with
    /// its end.
    Held,
    /// Asked to commit at once, though nobody waits on it (a status change). While other
    /// runs execute here it may wait for their next commit, at most [`PROMPT_HOLD`].
    Prompt,
    /// Its producer waits on it, or its request is streamed live (a submit excepted):
    /// committed at once.
    Now,
}

impl Item {
    fn urgency(&self, hub: &EventHub) -> Urgency {
        match self {
            Item::Group(group) => {
                let streamed = group
                    .request
                    .as_deref()
                    .is_none_or(|request| hub.is_streamed(request));
                match group.asked {
                    _ if group.ack.is_some() => Urgency::Now,
                    Asked::Submit => Urgency::Held,
                    _ if streamed => Urgency::Now,
                    Asked::Now => Urgency::Prompt,
                    Asked::Held => Urgency::Held,
                }
            }
            Item::Flush(_) | Item::Forgive(_) => Urgency::Now,
        }
    }
}

/// The runs executing on this instance (holding an execution slot), as the writer reads
/// them to decide whether a prompt write may wait for another run's commit.
#[derive(Debug, Clone)]
pub struct Executing {
    pub slots: Arc<Semaphore>,
    pub limit: usize,
}

impl Executing {
    fn count(&self) -> usize {
        self.limit.saturating_sub(self.slots.available_permits())
    }
}

/// The queue from producers to the writer: items in the order they were queued, each
/// marked urgent or not when queued.
///
/// A channel would wake the writer for every item. Here a producer wakes it only for an
/// urgent item: a write that will be held anyway (a request's submit, most of a request
/// answered whole) costs no wake-up of the writer's thread. Its hold is timed by the writer
/// when the writer holds writes already ([`QueueState::timed`]), and by a timer on its
/// producer's runtime otherwise ([`HoldTimer`]).
struct Queue {
    state: std::sync::Mutex<QueueState>,
    /// Longest a write nobody waits on is held ([`HOLD`]): when a [`HoldTimer`] fires.
    hold: Duration,
    wake: Notify,
    /// The writer polls its queue before it sleeps ([`Writer::polls`]): a client sends one
    /// request after another, and a producer waits for its commit awake too.
    polling: AtomicBool,
    /// One permit per free place ([`QUEUE`] in all): producers wait while the queue is full.
    room: Semaphore,
}

#[derive(Default)]
struct QueueState {
    items: VecDeque<(Item, Urgency)>,
    /// Items ever queued: the next one's number. The first in `items` is number `pushed -
    /// items.len()` (the writer takes items from the front only).
    pushed: u64,
    /// Per request, the number of its last item queued when that is a lone output delta
    /// (see [`Journal::extend_queued_delta`]); an entry is stale once the writer took it.
    last_delta: IdMap<String, u64>,
    /// The writer holds writes with a deadline set: it drains the queue by then, so a
    /// write that is not urgent needs no wake-up.
    timed: bool,
    /// The timer that wakes the writer for writes queued while it slept with no deadline,
    /// unless an urgent write does first.
    hold_timer: Option<HoldTimer>,
    /// The writer took items and has not waited since: it looks at the queue again before
    /// it waits, so a held write queued meanwhile needs no wake-up, nor a timer (under
    /// load, most of them).
    writer_busy: bool,
    /// When the oldest item not yet taken by the writer was queued: a hold counts from it.
    since: Option<tokio::time::Instant>,
    /// Every producer is gone.
    closed: bool,
    /// The writer is gone: nothing queued will be applied.
    finished: bool,
}

impl QueueState {
    /// Queues `item` behind every earlier one.
    fn queue(&mut self, item: Item, urgency: Urgency) {
        self.note_deltas(&item);
        self.items.push_back((item, urgency));
        self.pushed += 1;
    }

    /// Keeps [`QueueState::last_delta`] as `item` is queued: it ends the stretch of deltas of
    /// every request it writes for (as [`Held::push`] does), and starts one when it is a lone
    /// delta. An item that is not a group (a flush, a forgiven request) ends them all.
    fn note_deltas(&mut self, item: &Item) {
        if self.items.is_empty() {
            // Every entry is stale: the writer took everything.
            self.last_delta.clear();
        }
        let Item::Group(group) = item else {
            self.last_delta.clear();
            return;
        };
        if let (Some(request), Some(_)) = (&group.request, lone_delta(group)) {
            self.last_delta.insert(request.clone(), self.pushed);
            return;
        }
        for request in group.requests() {
            self.last_delta.remove(request);
        }
    }

    /// The queued lone delta of `request`, when its last item queued is one the writer has
    /// not taken yet, with its urgency.
    fn queued_delta(&mut self, request: &str) -> Option<(&mut Group, &mut Urgency)> {
        let number = *self.last_delta.get(request)?;
        let first = self.pushed - self.items.len() as u64;
        let index = usize::try_from(number.checked_sub(first)?).ok()?;
        match self.items.get_mut(index)? {
            (Item::Group(group), urgency) => Some((group, urgency)),
            _ => None,
        }
    }
}

impl Queue {
    fn new(hold: Duration) -> Self {
        Self {
            state: std::sync::Mutex::default(),
            hold,
            wake: Notify::new(),
            polling: AtomicBool::new(false),
            room: Semaphore::new(QUEUE),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, QueueState> {
        crate::threads::locked(&self.state)
    }

    /// Reserves the timing of the hold of the writes queued since the writer last took
    /// any for the producer queuing one now, on its runtime ([`Queue::arm_hold_timer`]
    /// starts the timer once the queue is unlocked). `None` where there is no runtime to
    /// time it on: the caller wakes the writer instead.
    fn reserve_hold_timer(&self, state: &mut QueueState) -> Option<HoldTimerArming> {
        let runtime = tokio::runtime::Handle::try_current().ok()?;
        let number = state.pushed;
        state.hold_timer = Some(HoldTimer {
            number,
            thread: std::thread::current().id(),
            task: None,
        });
        Some(HoldTimerArming {
            runtime,
            number,
            due: state.since.unwrap_or_else(tokio::time::Instant::now) + self.hold,
        })
    }

    /// Starts a timer reserved by [`Queue::reserve_hold_timer`], with the queue unlocked: a
    /// runtime shutting down drops the task, and with it [`HoldTimerFires`], at once, and
    /// that locks the queue to wake the writer.
    fn arm_hold_timer(self: &Arc<Self>, arming: HoldTimerArming) {
        let fires = HoldTimerFires {
            queue: Arc::clone(self),
            number: arming.number,
        };
        let due = arming.due;
        let task = arming.runtime.spawn(async move {
            tokio::time::sleep_until(due).await;
            drop(fires);
        });
        let mut state = self.state();
        // Unless it fired, was stopped or was dropped meanwhile.
        if let Some(timer) = state.hold_timer.as_mut()
            && timer.number == arming.number
        {
            timer.task = Some(task.abort_handle());
        }
    }
}

/// A hold timer reserved, to be started once the queue is unlocked.
struct HoldTimerArming {
    runtime: tokio::runtime::Handle,
    number: u64,
    due: tokio::time::Instant,
}

/// A hold timed on a producer's runtime ([`Queue::reserve_hold_timer`]): the writer was not
/// woken for the writes it times, and sleeps with no deadline of its own, so a request
/// answered whole wakes the writer once, for its end, where it woke it for its submit too.
/// An urgent write wakes the writer anyway and cancels the timer when queued from the
/// timer's thread (a request's end comes from the thread of its submit): cancelling it
/// from another thread would wake that thread's runtime, so the timer is only disowned
/// there, and fires to find it has nothing to do.
struct HoldTimer {
    /// The [`QueueState::pushed`] count when it was armed: which timer it is.
    number: u64,
    thread: std::thread::ThreadId,
    /// Set once the timer's task is spawned: a timer stopped before then is disowned.
    task: Option<tokio::task::AbortHandle>,
}

impl HoldTimer {
    /// Stops the timer: cancelled where that wakes no other thread, disowned elsewhere.
    fn stop(self) {
        if let Some(task) = self.task
            && self.thread == std::thread::current().id()
        {
            task.abort();
        }
    }
}

/// Wakes the writer when dropped, if its [`HoldTimer`] is still the queue's and the writes
/// it times are neither taken nor held by the writer: dropped when the hold ends, and when
/// the timer's runtime drops the task unfinished (it shuts down), so that no held write is
/// left without a wake-up.
struct HoldTimerFires {
    queue: Arc<Queue>,
    number: u64,
}

impl Drop for HoldTimerFires {
    fn drop(&mut self) {
        let wake = {
            let mut state = self.queue.state();
            let ours = state
                .hold_timer
                .as_ref()
                .is_some_and(|timer| timer.number == self.number);
            if ours {
                state.hold_timer = None;
            }
            ours && !state.items.is_empty() && !state.timed && !state.writer_busy
        };
        if wake {
            self.queue.wake.notify_one();
        }
    }
}

/// Held by every [`Journal`] clone: the last one dropped tells the writer to finish.
struct Producers(Arc<Queue>);

impl Drop for Producers {
    fn drop(&mut self) {
        self.0.state().closed = true;
        self.0.wake.notify_one();
    }
}

/// Held by the writer task: if it ends (or is dropped with its runtime), producers get
/// [`JournalError::Closed`] rather than waiting forever.
struct Finished(Arc<Queue>);

impl Drop for Finished {
    fn drop(&mut self) {
        self.0.room.close();
        // Dropping the items drops their acknowledgements: their producers learn it.
        let items = {
            let mut state = self.0.state();
            state.finished = true;
            std::mem::take(&mut state.items)
        };
        drop(items);
    }
}

/// One writer lane: its queue and whether its writer can write.
struct Lane {
    queue: Arc<Queue>,
    available: Arc<AtomicBool>,
}

/// Handle to the writer tasks; cheap to clone.
#[derive(Clone)]
pub struct Journal {
    /// At least one.
    lanes: Arc<[Lane]>,
    /// Only dropped: the last clone's drop ends the writers.
    _producers: Arc<[Producers]>,
    hub: Arc<EventHub>,
    /// Shared with the writers: a reload adds the new workspace's secrets.
    redactor: Arc<std::sync::RwLock<Redactor>>,
}

impl std::fmt::Debug for Journal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let queued: usize = self
            .lanes
            .iter()
            .map(|lane| lane.queue.state().items.len())
            .sum();
        f.debug_struct("Journal")
            .field("lanes", &self.lanes.len())
            .field("queued", &queued)
            .field("available", &self.is_available())
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for Item {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Item::Group(group) => write!(f, "Group({} ops)", group.ops.len()),
            Item::Flush(_) => f.write_str("Flush"),
            Item::Forgive(request) => write!(f, "Forgive({request})"),
        }
    }
}

impl Journal {
    /// Starts the writer task on `tracker`; it ends when every `Journal` clone is dropped.
    pub fn start(
        store: Arc<dyn Store>,
        hub: Arc<EventHub>,
        redactor: Redactor,
        tracker: &tokio_util::task::TaskTracker,
    ) -> Self {
        let lanes = store.writer_lanes();
        Self::start_holding(store, hub, redactor, tracker, HOLD, None, lanes)
    }

    /// [`Journal::start`] for a runtime whose executing runs are counted by `executing`:
    /// while others execute, a prompt write may wait (see [`Urgency::Prompt`]).
    pub fn start_serving(
        store: Arc<dyn Store>,
        hub: Arc<EventHub>,
        redactor: Redactor,
        tracker: &tokio_util::task::TaskTracker,
        executing: Executing,
    ) -> Self {
        let lanes = store.writer_lanes();
        Self::start_holding(store, hub, redactor, tracker, HOLD, Some(executing), lanes)
    }

    /// [`Journal::start`] holding writes nobody waits on for at most `hold`, with `lanes`
    /// writer lanes (at least one; the store's [`Store::writer_lanes`] outside tests).
    fn start_holding(
        store: Arc<dyn Store>,
        hub: Arc<EventHub>,
        redactor: Redactor,
        tracker: &tokio_util::task::TaskTracker,
        hold: Duration,
        executing: Option<Executing>,
        lanes: usize,
    ) -> Self {
        let redactor = Arc::new(std::sync::RwLock::new(redactor));
        let runtime = store.writer_runtime();
        let lanes: Arc<[Lane]> = (0..lanes.max(1))
            .map(|lane| {
                let queue = Arc::new(Queue::new(hold));
                let available = Arc::new(AtomicBool::new(true));
                let writer = Writer {
                    store: Arc::clone(&store),
                    lane,
                    lanes: lanes.max(1),
                    hub: Arc::clone(&hub),
                    redactor: Arc::clone(&redactor),
                    available: Arc::clone(&available),
                    poisoned: HashSet::new(),
                    hold,
                    executing: executing.clone(),
                    own_thread: runtime.is_some(),
                };
                let run = writer.run(Arc::clone(&queue));
                match &runtime {
                    Some(runtime) => tracker.spawn_on(run, runtime),
                    None => tracker.spawn(run),
                };
                Lane { queue, available }
            })
            .collect();
        Self {
            _producers: lanes
                .iter()
                .map(|lane| Producers(Arc::clone(&lane.queue)))
                .collect(),
            lanes,
            hub,
            redactor,
        }
    }

    /// The lane of `request`'s writes (lane 0 for writes of no request): where all of them
    /// go, so that they stay in order.
    fn lane(&self, request: Option<&str>) -> &Lane {
        let count = self.lanes.len();
        let index = match request {
            Some(request) if count > 1 => lane_of(request, count),
            _ => 0,
        };
        // Below `count`, which is at least one (`start_holding`).
        &self.lanes[index]
    }

    /// The lane of `group`: its request's, or, for a group of none, that of the request its
    /// first event is of (an approval's decision), as [`Group::requests`] names them.
    fn lane_of_group(&self, group: &Group) -> &Lane {
        let lane = self.lane(group.requests().next());
        // A group writes for one request: were its events of another lane's request, they
        // could commit out of that request's order.
        debug_assert!(
            group
                .requests()
                .all(|request| std::ptr::eq(self.lane(Some(request)), lane)),
            "a group's events are of its lane's requests"
        );
        lane
    }

    /// Redacts what `also` redacts too, from the next batch on (a reload's secrets, while
    /// runs of the previous inventory still write).
    pub fn add_redactor(&self, also: &Redactor) {
        let mut held = match self.redactor.write() {
            Ok(held) => held,
            Err(poisoned) => poisoned.into_inner(),
        };
        *held = held.merged(also);
    }

    /// Whether a write would store any of `values` otherwise than it is: a secret in it
    /// redacted. The secrets are read once for all of them, as a batch's write does.
    pub fn would_redact(&self, values: &[Value]) -> bool {
        let held = match self.redactor.read() {
            Ok(held) => held,
            Err(poisoned) => poisoned.into_inner(),
        };
        let secrets = held.secrets();
        values.iter().any(|value| {
            let mut stored = value.clone();
            secrets.redact_in_place(&mut stored);
            stored != *value
        })
    }

    /// Whether the store accepts writes (false while a transient failure is being retried
    /// in any lane).
    pub fn is_available(&self) -> bool {
        self.lanes
            .iter()
            .all(|lane| lane.available.load(Ordering::Relaxed))
    }

    /// Queues one write of `request` behind every earlier one, without waiting for it to
    /// commit: the producer learns of a failure at its next [`Journal::commit`].
    pub async fn write(&self, request: Option<&str>, op: WriteOp) -> Result<(), JournalError> {
        self.enqueue(request, vec![op], false, Asked::Held, None)
            .await
    }

    /// Queues a request's submit (or its run's start event) as one group without waiting for
    /// it, held like [`Journal::write`] even when the request is streamed live: it commits
    /// with the run's first write that commits (its end when the model answers at once, its
    /// first output delta when streamed), or after the hold.
    pub async fn write_submit(
        &self,
        request: Option<&str>,
        ops: Vec<WriteOp>,
    ) -> Result<(), JournalError> {
        self.enqueue(request, ops, false, Asked::Submit, None).await
    }

    /// Queues `ops` as one group that commits at once, without waiting for it: a status
    /// change that whoever looks should see.
    pub async fn write_group_now(
        &self,
        request: Option<&str>,
        ops: Vec<WriteOp>,
    ) -> Result<(), JournalError> {
        self.enqueue(request, ops, false, Asked::Now, None).await
    }

    /// Queues `ops` as one group and waits until they committed together: awake, for up to
    /// [`AWAKE`], while the writer polls ([`Queue::polling`]) and nobody follows the request
    /// live, so that the acknowledgement wakes no thread either (a live follower's events
    /// come to this thread during the commit, and would wait for the waiting task's turns).
    pub async fn commit(
        &self,
        request: Option<&str>,
        ops: Vec<WriteOp>,
    ) -> Result<(), JournalError> {
        self.commit_group(request, ops, false).await
    }

    /// Like [`Journal::commit`] for a run's last group: applied even when an earlier write
    /// of the request was lost (the run ends with what is known), which clears that state.
    pub async fn settle(&self, request: &str, ops: Vec<WriteOp>) -> Result<(), JournalError> {
        self.commit_group(Some(request), ops, true).await
    }

    async fn commit_group(
        &self,
        request: Option<&str>,
        ops: Vec<WriteOp>,
        settles: bool,
    ) -> Result<(), JournalError> {
        let (ack, mut done) = oneshot::channel();
        self.enqueue(request, ops, settles, Asked::Now, Some(ack))
            .await?;
        if self.lane(request).queue.polling.load(Ordering::Relaxed)
            && request.is_none_or(|request| !self.hub.is_streamed(request))
        {
            let until = std::time::Instant::now() + AWAKE;
            if let Some(result) = awake_until(until, || acknowledgement(&mut done)).await {
                return result;
            }
        }
        done.await.map_err(|_| JournalError::Closed)?
    }

    async fn enqueue(
        &self,
        request: Option<&str>,
        ops: Vec<WriteOp>,
        settles: bool,
        asked: Asked,
        ack: Option<oneshot::Sender<Result<(), JournalError>>>,
    ) -> Result<(), JournalError> {
        let group = Group {
            request: request.map(str::to_owned),
            ops,
            settles,
            asked,
            ack,
        };
        self.push(self.lane_of_group(&group), Item::Group(group))
            .await
    }

    /// Queues `item` behind every earlier one of `lane`, waiting while its queue is full.
    async fn push(&self, lane: &Lane, item: Item) -> Result<(), JournalError> {
        let queue = &lane.queue;
        let permit = queue
            .room
            .acquire()
            .await
            .map_err(|_| JournalError::Closed)?;
        // Given back by the writer as it takes items.
        permit.forget();
        let urgency = item.urgency(&self.hub);
        let (wake, timer, arming) = {
            let mut state = queue.state();
            if state.finished {
                return Err(JournalError::Closed);
            }
            state.since.get_or_insert_with(tokio::time::Instant::now);
            state.queue(item, urgency);
            if urgency > Urgency::Held {
                (true, state.hold_timer.take(), None)
            } else if state.timed || state.writer_busy || state.hold_timer.is_some() {
                (false, None, None)
            } else {
                let arming = queue.reserve_hold_timer(&mut state);
                (arming.is_none(), None, arming)
            }
        };
        if wake {
            queue.wake.notify_one();
        }
        if let Some(timer) = timer {
            timer.stop();
        }
        if let Some(arming) = arming {
            queue.arm_hold_timer(arming);
        }
        Ok(())
    }

    /// Appends `text` to `run`'s output delta when that is the last write of `request` queued
    /// and the writer has not taken it yet: the event the writer would merge a delta written
    /// now into ([`Held::push`]), without a delta being built and queued only to be merged.
    /// False otherwise; the caller then writes the delta as usual.
    /// Most of a fast stream's deltas arrive while the previous commit is in flight, and each
    /// cost ~3,000 instructions to build and queue (docs/profiling.md, the thirty-first pass).
    pub fn extend_queued_delta(&self, request: &str, run: &str, text: &str) -> bool {
        // As a delta written by `write` would be queued (see `Item::urgency`).
        let urgency = if self.hub.is_streamed(request) {
            Urgency::Now
        } else {
            Urgency::Held
        };
        let queue = &self.lane(Some(request)).queue;
        let timer = {
            let mut state = queue.state();
            if state.finished {
                return false;
            }
            // The queue notes only lone deltas, and a join keeps one lone: the run and the
            // room left are all there is to check.
            let Some((last, queued)) = state.queued_delta(request) else {
                return false;
            };
            let Some(joined) = delta_to_extend(last, run, text.len()) else {
                return false;
            };
            joined.push_str(text);
            *queued = (*queued).max(urgency);
            // A held join needs no wake-up: the delta it joins was queued with one, a
            // deadline or a timer.
            if urgency == Urgency::Held {
                return true;
            }
            state.hold_timer.take()
        };
        queue.wake.notify_one();
        if let Some(timer) = timer {
            timer.stop();
        }
        true
    }

    /// Clears the lost-write state of `request`, behind everything queued so far: a run this
    /// instance lost and then claimed again starts over from the store.
    pub async fn forgive(&self, request: &str) -> Result<(), JournalError> {
        let lane = self.lane(Some(request));
        self.push(lane, Item::Forgive(request.to_owned())).await
    }

    /// Waits until everything queued so far, in every lane, has been committed or refused.
    pub async fn flush(&self) -> Result<(), JournalError> {
        let mut waits = Vec::with_capacity(self.lanes.len());
        for lane in self.lanes.iter() {
            let (done, wait) = oneshot::channel();
            self.push(lane, Item::Flush(done)).await?;
            waits.push(wait);
        }
        for wait in waits {
            wait.await.map_err(|_| JournalError::Closed)?;
        }
        Ok(())
    }
}

/// A writer task's state: it alone applies its lane's writes.
struct Writer {
    store: Arc<dyn Store>,
    /// Its lane, as the store is told with each batch, and how many there are.
    lane: usize,
    lanes: usize,
    hub: Arc<EventHub>,
    redactor: Arc<std::sync::RwLock<Redactor>>,
    available: Arc<AtomicBool>,
    /// Requests with a lost write since their last settled group.
    poisoned: HashSet<String>,
    /// Longest a write nobody waits on is held ([`HOLD`]).
    hold: Duration,
    /// The runs executing here, when the journal serves a runtime (prompt writes linger
    /// only while others execute).
    executing: Option<Executing>,
    /// The writer runs on a thread of its own (the embedded store's writer,
    /// [`Store::writer_runtime`]): it may poll its queue before it sleeps ([`Writer::polls`]).
    own_thread: bool,
}

/// What the writer has seen of its producers' pace, to decide whether a poll of its queue
/// before it sleeps may find the next write ([`Writer::polls`] decides whether it may poll
/// at all). It may where a client sends one request after another: the last wait ended
/// within [`AWAKE`] with something to take (a poll that found nothing says no), the last
/// batch committed held one request's writes at most, and the writes held now began within
/// [`AWAKE`] of that commit. The last is what tells a client that sends its next request
/// as soon as it has its answer from requests at a steady rate: each of those writes its
/// submit and its end close together too, but the next request comes milliseconds later,
/// and a poll after each commit found nothing (~1 ms of CPU a request at 50 a second,
/// docs/profiling.md, the sixty-fourth pass).
#[derive(Debug, Default)]
struct Pace {
    last_wait_short: bool,
    last_batch_one_request: bool,
    last_commit: Option<std::time::Instant>,
    began_after_commit: bool,
}

impl Pace {
    /// The writer took writes at `now` after waiting since `waiting_since`; `first` when
    /// nothing was held before them (the first writes since the last commit).
    fn took(&mut self, waiting_since: std::time::Instant, first: bool, now: std::time::Instant) {
        self.last_wait_short = now.saturating_duration_since(waiting_since) <= AWAKE;
        if first {
            self.began_after_commit = self
                .last_commit
                .is_some_and(|at| now.saturating_duration_since(at) <= AWAKE);
        }
    }

    /// A poll ended, having found writes or not.
    fn polled(&mut self, found: bool) {
        self.last_wait_short = found;
    }

    /// A batch committed at `at`.
    fn committed(&mut self, one_request: bool, at: std::time::Instant) {
        self.last_batch_one_request = one_request;
        self.last_commit = Some(at);
    }

    fn poll_pays(&self) -> bool {
        self.last_wait_short && self.last_batch_one_request && self.began_after_commit
    }
}

impl Writer {
    async fn run(mut self, queue: Arc<Queue>) {
        let _finished = Finished(Arc::clone(&queue));
        let mut items = Vec::with_capacity(MAX_BATCH);
        let mut held = Held::default();
        // Set while writes nobody waits on are held for the next commit. A held write
        // queued while none is set needs no wake-up either: its producer times its hold
        // ([`HoldTimer`]), and a request answered whole wakes the writer once, for its end.
        let mut deadline: Option<tokio::time::Instant> = None;
        // When the oldest held write was queued, and when a lingering prompt write stops
        // waiting.
        let mut held_since: Option<tokio::time::Instant> = None;
        let mut prompt_until: Option<tokio::time::Instant> = None;
        // Until when the writer watches its queue after a commit, under load
        // ([`Writer::watches`]).
        let mut watch_until: Option<tokio::time::Instant> = None;
        // Items were left in the queue (more than a batch): take them without waiting.
        let mut more = false;
        let mut pace = Pace::default();
        loop {
            let waiting_since = std::time::Instant::now();
            let polling = pace.poll_pays() && self.polls();
            queue.polling.store(polling, Ordering::Relaxed);
            if !more && polling {
                more = queued_within(&queue, waiting_since + AWAKE, deadline).await;
                pace.polled(more);
                // It sleeps now: a producer waiting awake would wait for its wake-up.
                queue.polling.store(more, Ordering::Relaxed);
            }
            // Woken by a producer or by the deadline: what is due is decided below.
            match (more, deadline) {
                (true, _) => {}
                (false, None) => queue.wake.notified().await,
                (false, Some(at)) => {
                    let _ = tokio::time::timeout_at(at, queue.wake.notified()).await;
                }
            }
            let now = tokio::time::Instant::now();
            let (mut urgent, lingers, closed) = {
                let mut state = queue.state();
                let taken = state.items.len().min(MAX_BATCH);
                let mut urgency = Urgency::Held;
                for (item, item_urgency) in state.items.drain(..taken) {
                    urgency = urgency.max(item_urgency);
                    items.push(item);
                }
                more = !state.items.is_empty();
                if taken > 0 {
                    held_since = held_since.or(state.since);
                    state.since = more.then_some(now);
                    pace.took(
                        waiting_since,
                        held.groups.is_empty(),
                        std::time::Instant::now(),
                    );
                }
                // A hold that has passed commits, whatever woke the writer: a stream of
                // writes arriving one by one must not stretch it.
                let expired = held_since.is_some_and(|since| since + self.hold <= now)
                    || prompt_until.is_some_and(|until| until <= now);
                if expired {
                    urgency = Urgency::Now;
                }
                let groups = held.groups.len().saturating_add(items.len());
                // Prompt writes wait for another run's commit only while others execute: more
                // than one a lane (the runs executing are counted over every lane, and only
                // this lane's commits carry the write).
                let lingers = urgency == Urgency::Prompt
                    && self
                        .executing
                        .as_ref()
                        .is_some_and(|e| e.count() > self.lanes);
                let urgent = urgency == Urgency::Now || (urgency == Urgency::Prompt && !lingers);
                // Decided with the queue locked, so that no producer skips a wake-up the
                // writer needs: `timed` only while a deadline will drain what is queued.
                let watching = watch_until.is_some_and(|until| until > now);
                state.timed = !urgent && !more && groups < MAX_BATCH && (groups > 0 || watching);
                state.writer_busy = true;
                (urgent, lingers, state.closed && !more)
            };
            queue.room.add_permits(items.len());
            let mut flushes = Vec::new();
            for item in items.drain(..) {
                match item {
                    Item::Group(group) => held.push(group),
                    Item::Flush(done) => flushes.push(done),
                    Item::Forgive(request) => {
                        self.apply(held.take()).await;
                        self.poisoned.remove(&request);
                    }
                }
            }
            if closed {
                // Every producer is gone: what is held still commits.
                self.apply(held.take()).await;
                return;
            }
            urgent |= held.groups.len() >= MAX_BATCH;
            if urgent {
                held_since = None;
                prompt_until = None;
                let one_request = held.of_one_request();
                self.apply(held.take()).await;
                pace.committed(one_request, std::time::Instant::now());
                for done in flushes {
                    let _ = done.send(());
                }
                // Watch for a hold's length under load: whatever is queued meanwhile is
                // drained by then, with no timer armed for it.
                watch_until = self.watches().then(|| {
                    queue.state().timed = true;
                    tokio::time::Instant::now() + self.hold
                });
            } else if lingers {
                prompt_until = prompt_until.or(Some(now + PROMPT_HOLD));
            }
            let held_until = (!held.groups.is_empty())
                .then(|| held_since.map(|since| since + self.hold))
                .flatten();
            let watching = watch_until.filter(|until| *until > tokio::time::Instant::now());
            deadline = [held_until, prompt_until, watching]
                .into_iter()
                .flatten()
                .min();
            // Writes queued while it was busy woke nobody and armed no timer: it takes them
            // now, before it waits.
            let mut state = queue.state();
            more |= !state.items.is_empty();
            state.writer_busy = more;
        }
    }

    /// Whether the writer may poll its queue before it waits, for up to [`AWAKE`]: when it
    /// has a thread of its own and serves a runtime in which at most one run executes. It
    /// then does when its [`Pace`] says a poll pays: where a client sends one request after
    /// another, its next write comes within the poll, and a wake-up of a halted CPU (tens
    /// of µs) is saved on each hand-over. Not between requests at a steady rate, and hardly
    /// during a slow model's answer (the wait before was long, or a poll found nothing), and
    /// never under load (a batch holds many requests' writes, and many runs execute): there
    /// a poll would find nothing, or the writer is never idle. It pays through a longer run
    /// too: at a memory recall at c=1 the poll spends ~0.45 ms of CPU a request and saves
    /// ~0.41 ms of its time (docs/profiling.md, the seventy-fifth pass).
    fn polls(&self) -> bool {
        self.own_thread && self.executing.as_ref().is_some_and(|e| e.count() <= 1)
    }

    /// Whether the writer watches its queue for a hold's length after a commit: under load
    /// (more than one run executing), where the next held writes come within the hold and
    /// the watch lets them ride without a timer of their producer's ([`HoldTimer`]); a timer
    /// armed after nearly every commit cost chat at c=32 ~3% of its requests a second
    /// (docs/profiling.md, the sixty-sixth pass).
    fn watches(&self) -> bool {
        self.executing.as_ref().is_some_and(|e| e.count() > 1)
    }

    /// Applies a batch: all groups in one transaction, or, when that fails for a reason
    /// that is not transient, each group alone.
    async fn apply(&mut self, groups: Vec<Group>) {
        let mut groups: Vec<Group> = groups
            .into_iter()
            .filter_map(|group| self.refuse_if_poisoned(group))
            .collect();
        if groups.is_empty() {
            return;
        }
        let lengths: Vec<usize> = groups.iter().map(|g| g.ops.len()).collect();
        // Sized once: collected through `flat_map`, a batch of many groups grew it by
        // doubling, copying every op so far each time.
        let mut ops: Vec<WriteOp> = Vec::with_capacity(lengths.iter().sum());
        for group in &mut groups {
            ops.append(&mut group.ops);
        }
        let redactor = match self.redactor.read() {
            Ok(redactor) => redactor.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        };
        let secrets = redactor.secrets();
        for op in &mut ops {
            redact(op, &secrets);
        }
        drop(secrets);
        let (ops, applied) = self.apply_retrying(ops).await;
        match applied {
            Ok(numbers) => {
                let (published, spent) = self.committed(&numbers, ops).await;
                for group in groups {
                    self.settled(&group, &Ok(()));
                    ack(group.ack, Ok(()));
                }
                // Counted, and the batch's other writes freed, once the waiters are on their
                // way: a JSON answer waits on the publication, not on the metrics or the
                // allocator.
                published
                    .iter()
                    .for_each(|e| crate::metrics::event_committed(e));
                drop(spent);
            }
            Err(_) => {
                // Give every group its ops back, in order, and try them one by one.
                let mut rest = ops.into_iter();
                for (group, length) in groups.iter_mut().zip(lengths) {
                    group.ops = rest.by_ref().take(length).collect();
                }
                self.apply_each(groups).await;
            }
        }
    }

    /// The fallback: each group in its own transaction, so only the failing one is refused.
    async fn apply_each(&mut self, groups: Vec<Group>) {
        for group in groups {
            let Some(mut group) = self.refuse_if_poisoned(group) else {
                continue;
            };
            let (ops, applied) = self.apply_retrying(std::mem::take(&mut group.ops)).await;
            let result = match applied {
                Ok(numbers) => {
                    let (published, _spent) = self.committed(&numbers, ops).await;
                    published
                        .iter()
                        .for_each(|e| crate::metrics::event_committed(e));
                    Ok(())
                }
                Err(StoreError::Conflict(message)) => Err(JournalError::Conflict(message)),
                Err(StoreError::LeaseLost(message)) => Err(JournalError::LeaseLost(message)),
                Err(error) => {
                    tracing::error!(%error, request = group.request.as_deref(), "the store refused a write group");
                    // A request whose submit nobody waited on was never stored: its followers
                    // learn it now instead of waiting for an end that cannot come.
                    if let Some(request) = &group.request
                        && ops.iter().any(|op| matches!(op, WriteOp::InsertRequest(_)))
                    {
                        self.hub.close(request);
                    }
                    Err(JournalError::Rejected(error.to_string()))
                }
            };
            self.settled(&group, &result);
            ack(group.ack, result);
        }
    }

    /// A settling group that committed clears its request's poison; any other refused group
    /// poisons it (a conflict is an answer, not a loss).
    fn settled(&mut self, group: &Group, result: &Result<(), JournalError>) {
        let Some(request) = &group.request else {
            return;
        };
        match result {
            Ok(()) if group.settles => {
                self.poisoned.remove(request);
            }
            Err(JournalError::Rejected(_) | JournalError::LeaseLost(_)) if !group.settles => {
                self.poisoned.insert(request.clone());
            }
            _ => {}
        }
    }

    /// A group of a poisoned request is refused (unless it settles the request).
    fn refuse_if_poisoned(&mut self, group: Group) -> Option<Group> {
        match &group.request {
            Some(request) if !group.settles && self.poisoned.contains(request) => {
                ack(group.ack, Err(JournalError::Poisoned(request.clone())));
                None
            }
            _ => Some(group),
        }
    }

    /// After a commit: give the events the numbers the store gave them, hand over the views
    /// awaited at the requests' ends they hold, and publish them. Returns them with the
    /// batch's other writes, which the caller frees after it has woken their producers.
    async fn committed(
        &mut self,
        numbers: &[i64],
        ops: Vec<WriteOp>,
    ) -> (Vec<Arc<EventRecord>>, Vec<WriteOp>) {
        let events = ops
            .iter()
            .filter(|op| matches!(op, WriteOp::AppendEvent(_)))
            .count();
        if events != numbers.len() {
            tracing::error!(
                events,
                numbers = numbers.len(),
                "the store numbered a batch's events wrongly"
            );
        }
        let mut numbers = numbers.iter();
        let mut published = Vec::with_capacity(events);
        let mut spent = Vec::with_capacity(ops.len().saturating_sub(events));
        for op in ops {
            match op {
                WriteOp::AppendEvent(mut event) => {
                    if let Some(seq) = numbers.next() {
                        event.seq = *seq;
                    }
                    published.push(Arc::new(event));
                }
                other => spent.push(other),
            }
        }
        self.publish_with_views(&published).await;
        (published, spent)
    }

    /// Publishes a commit's events. A request whose view is awaited at its end has the view
    /// read here, next to the commit, and sent before its events are published: its waiter
    /// wakes once, with the view, instead of waking at the end and asking the writer's
    /// thread for it (a round trip to a thread that had just gone idle: docs/profiling.md,
    /// the seventeenth pass). The others' events go first; the awaited views are read
    /// together (one statement on PostgreSQL: the fortieth pass), then each is sent before
    /// its request's events. A failed read sends none; the waiters read them then.
    async fn publish_with_views(&self, published: &[Arc<EventRecord>]) {
        let awaited = self.hub.views_awaited(published);
        if awaited.is_empty() {
            self.hub.publish(published);
            return;
        }
        let mut held: IdMap<Arc<str>, Vec<Arc<EventRecord>>> = awaited
            .iter()
            .map(|(request, _)| (Arc::clone(request), Vec::new()))
            .collect();
        let mut now = Vec::with_capacity(published.len());
        for event in published {
            match held.get_mut(&*event.request_id) {
                Some(events) => events.push(Arc::clone(event)),
                None => now.push(Arc::clone(event)),
            }
        }
        self.hub.publish(&now);
        let ids: Vec<&str> = awaited.iter().map(|(request, _)| &**request).collect();
        let views = match self.store.requests_in_full(self.lane, &ids).await {
            Ok(views) => views,
            Err(error) => {
                tracing::warn!(%error, views = ids.len(), "the views awaited at a commit could not be read; their waiters read them");
                Vec::new()
            }
        };
        let mut views: IdMap<String, RequestInFull> = views
            .into_iter()
            .map(|view| (view.request.id.clone(), view))
            .collect();
        for (request, sender) in awaited {
            if let Some(view) = views.remove(&*request) {
                let _ = sender.send(view);
            }
            if let Some(events) = held.remove(&*request) {
                self.hub.publish(&events);
            }
        }
    }

    /// Applies `ops` in one transaction; a transient failure is retried until it succeeds,
    /// with the store marked unavailable meanwhile. Other failures are returned.
    async fn apply_retrying(
        &self,
        mut ops: Vec<WriteOp>,
    ) -> (Vec<WriteOp>, Result<Vec<i64>, StoreError>) {
        let mut delay = Duration::from_millis(20);
        let mut races_lost = 0_u32;
        let mut contention_delay = CONTENTION_RETRY_DELAY;
        // One id for every try: a try after a commit whose reply was lost is not applied again.
        let batch_id = crate::store::new_batch_id();
        loop {
            let started = std::time::Instant::now();
            let applied;
            (ops, applied) = self.store.apply_owned(self.lane, &batch_id, ops).await;
            if let Err(error) = &applied {
                crate::metrics::store_error(error.is_transient());
            }
            match applied {
                Ok(numbers) => {
                    crate::metrics::journal_committed(ops.len(), started.elapsed());
                    if !self.available.swap(true, Ordering::Relaxed) {
                        tracing::info!("the store accepts writes again");
                    }
                    return (ops, Ok(numbers));
                }
                Err(error) if error.is_contention() && races_lost < MAX_CONTENTION_RETRIES => {
                    // A race lost to another transaction (another lane's batch, another
                    // instance's): the database refused one of the two, and the other went
                    // on. Nothing is wrong with the store: tried again almost at once.
                    races_lost += 1;
                    if races_lost == 5 {
                        tracing::warn!(%error, "a batch lost five races with other transactions in a row; still trying");
                    } else {
                        tracing::debug!(%error, "a batch lost a race with another transaction; trying it again");
                    }
                    tokio::time::sleep(contention_delay).await;
                    contention_delay = (contention_delay * 2).min(MAX_CONTENTION_DELAY);
                }
                Err(error) if error.is_transient() => {
                    if self.available.swap(false, Ordering::Relaxed) {
                        tracing::error!(%error, "the store cannot write; retrying until it can (new requests get 503)");
                    }
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(MAX_RETRY_DELAY);
                }
                Err(error) => return (ops, Err(error)),
            }
        }
    }
}

/// The groups waiting for the writer's next transaction, in order, with consecutive output
/// deltas merged.
#[derive(Default)]
struct Held {
    groups: Vec<Group>,
    /// Per request, the index of its last group when that is a lone delta.
    last_delta: IdMap<String, usize>,
}

impl Held {
    /// Adds `group`, or, when it is a lone output delta following another of the same run
    /// with nothing of its request in between, appends its text to that one.
    fn push(&mut self, group: Group) {
        let (Some(request), Some((run, text))) = (group.request.as_deref(), lone_delta(&group))
        else {
            self.end_delta_stretches(&group);
            self.groups.push(group);
            return;
        };
        if let Some(joined) = self
            .last_delta
            .get(request)
            .and_then(|&i| self.groups.get_mut(i))
            .and_then(|previous| delta_to_extend(previous, run, text.len()))
        {
            joined.push_str(text);
            return;
        }
        self.last_delta
            .insert(request.to_owned(), self.groups.len());
        self.groups.push(group);
    }

    /// Any other group ends the stretch of deltas of every request it writes for.
    fn end_delta_stretches(&mut self, group: &Group) {
        for request in group.requests() {
            self.last_delta.remove(request);
        }
    }

    /// Whether everything held writes for one request at most (groups of none aside).
    fn of_one_request(&self) -> bool {
        let mut requests = self.groups.iter().flat_map(Group::requests);
        let first = requests.next();
        requests.all(|request| Some(request) == first)
    }

    /// Everything held, for one transaction.
    fn take(&mut self) -> Vec<Group> {
        self.last_delta.clear();
        std::mem::take(&mut self.groups)
    }
}

/// Polls `queue` until an item is queued or every producer is gone (true), or until `until`
/// or `deadline`, whichever comes first (false).
async fn queued_within(
    queue: &Queue,
    until: std::time::Instant,
    deadline: Option<tokio::time::Instant>,
) -> bool {
    let until = deadline.map_or(until, |deadline| until.min(deadline.into_std()));
    awake_until(until, || {
        let state = queue.state();
        (!state.items.is_empty() || state.closed).then_some(())
    })
    .await
    .is_some()
}

/// The outcome of a commit, once the writer has sent it (or is gone without sending it).
fn acknowledgement(
    done: &mut oneshot::Receiver<Result<(), JournalError>>,
) -> Option<Result<(), JournalError>> {
    match done.try_recv() {
        Ok(result) => Some(result),
        Err(oneshot::error::TryRecvError::Closed) => Some(Err(JournalError::Closed)),
        Err(oneshot::error::TryRecvError::Empty) => None,
    }
}

/// Asks `ready` until it gives a value or `until` passes (`None`), without sleeping: what
/// is awaited is taken without a wake-up of this thread, on a CPU that would otherwise
/// halt (tens of µs on a virtual machine's idle CPU). Every [`AWAKE_SLICE`] it lets the
/// other threads of its CPU and the other tasks of its thread run.
async fn awake_until<T>(
    until: std::time::Instant,
    mut ready: impl FnMut() -> Option<T>,
) -> Option<T> {
    let mut slice_ends = std::time::Instant::now() + AWAKE_SLICE;
    loop {
        if let Some(value) = ready() {
            return Some(value);
        }
        let now = std::time::Instant::now();
        if now >= until {
            return None;
        }
        if now >= slice_ends {
            // A thread woken on this CPU runs now, not when the kernel's slice of this one
            // ends.
            std::thread::yield_now();
            tokio::task::yield_now().await;
            slice_ends = std::time::Instant::now() + AWAKE_SLICE;
        } else {
            std::hint::spin_loop();
        }
    }
}

/// The text of `group`'s output delta, when `group` is one of `run` with room left for `more`
/// bytes: what a later delta of the run is appended to.
fn delta_to_extend<'g>(group: &'g mut Group, run: &str, more: usize) -> Option<&'g mut String> {
    let Some(WriteOp::AppendEvent(event)) = group.ops.first_mut() else {
        return None;
    };
    if *event.run_id != *run {
        return None;
    }
    match crate::json::at_mut(&mut event.data, &["event", "text"]) {
        Some(Value::String(joined)) if joined.len().saturating_add(more) <= MAX_MERGED_DELTA => {
            Some(joined)
        }
        _ => None,
    }
}

/// The run and text of a group that is exactly one output delta event, unacknowledged.
fn lone_delta(group: &Group) -> Option<(&str, &str)> {
    let [WriteOp::AppendEvent(event)] = group.ops.as_slice() else {
        return None;
    };
    if group.ack.is_some() || group.settles || event.event_type != ADAPTER_EVENT {
        return None;
    }
    Some((&*event.run_id, output_delta_text(&event.data)?))
}

/// Removes secrets from every value a write stores.
fn redact(op: &mut WriteOp, secrets: &Secrets<'_>) {
    let text = |text: &mut String| *text = secrets.redact_text(text);
    match op {
        WriteOp::TouchSession(session) => secrets.redact_in_place(&mut session.metadata),
        WriteOp::InsertMessage(message) => secrets.redact_in_place(&mut message.content),
        WriteOp::InsertRequest(request) => {
            secrets.redact_in_place(&mut request.input);
            secrets.redact_in_place(&mut request.metadata);
            if let Some(value) = request.output.as_mut() {
                text(value);
            }
            if let Some(error) = &mut request.error {
                secrets.redact_in_place(error);
            }
        }
        WriteOp::UpdateRequest { output, error, .. } => {
            if let Some(value) = output.as_mut() {
                text(value);
            }
            if let Some(error) = error {
                secrets.redact_in_place(error);
            }
        }
        WriteOp::InsertRun(run) => {
            for value in [&mut run.state, &mut run.error].into_iter().flatten() {
                secrets.redact_in_place(value);
            }
        }
        WriteOp::UpdateRun { error, state, .. } => {
            for value in [error, state].into_iter().flatten() {
                secrets.redact_in_place(value);
            }
        }
        WriteOp::AppendEvent(event) => secrets.redact_in_place(&mut event.data),
        WriteOp::InsertApproval(approval) => {
            secrets.redact_in_place(&mut approval.arguments);
            if let Some(value) = approval.reason.as_mut() {
                text(value);
            }
        }
        WriteOp::DecideApproval(decision) => {
            if let Some(value) = decision.reason.as_mut() {
                text(value);
            }
        }
        WriteOp::StartToolCall(call) | WriteOp::RecordToolCall(call) => {
            secrets.redact_in_place(&mut call.arguments);
            secrets.redact_in_place(&mut call.result);
        }
    }
}

fn ack(ack: Option<oneshot::Sender<Result<(), JournalError>>>, result: Result<(), JournalError>) {
    if let Some(ack) = ack {
        let _ = ack.send(result);
    }
}

#[cfg(test)]
mod tests {
    use chrono::Utc;
    use serde_json::json;

    use super::*;
    use crate::runtime::events::REQUEST_COMPLETED;
    use crate::store::{EventRecord, RunStatus, SqliteStore, test_records};

    async fn journal_on_a_fresh_store() -> (tempfile::TempDir, Arc<dyn Store>, Journal) {
        let (dir, store, journal, _) = journal_holding(HOLD).await;
        (dir, store, journal)
    }

    async fn fresh_store() -> (tempfile::TempDir, Arc<dyn Store>) {
        let (dir, store) = SqliteStore::in_temporary_folder().await;
        (dir, Arc::new(store))
    }

    async fn journal_holding(
        hold: Duration,
    ) -> (tempfile::TempDir, Arc<dyn Store>, Journal, Arc<EventHub>) {
        journal_in_lanes(hold, 1).await
    }

    async fn journal_in_lanes(
        hold: Duration,
        lanes: usize,
    ) -> (tempfile::TempDir, Arc<dyn Store>, Journal, Arc<EventHub>) {
        let (dir, store) = fresh_store().await;
        let tracker = tokio_util::task::TaskTracker::new();
        let hub = Arc::new(EventHub::default());
        let journal = Journal::start_holding(
            Arc::clone(&store),
            Arc::clone(&hub),
            Redactor::default(),
            &tracker,
            hold,
            None,
            lanes,
        );
        (dir, store, journal, hub)
    }

    /// A journal serving a runtime of four execution slots, `running` of them taken (the
    /// permit, held by the test).
    async fn journal_serving_with_runs_executing(
        running: u32,
    ) -> (
        tempfile::TempDir,
        Arc<dyn Store>,
        Journal,
        Arc<EventHub>,
        tokio::sync::OwnedSemaphorePermit,
    ) {
        let (dir, store) = fresh_store().await;
        let hub = Arc::new(EventHub::default());
        let slots = Arc::new(Semaphore::new(4));
        let permit = Arc::clone(&slots)
            .acquire_many_owned(running)
            .await
            .unwrap();
        let journal = Journal::start_serving(
            Arc::clone(&store),
            Arc::clone(&hub),
            Redactor::default(),
            &tokio_util::task::TaskTracker::new(),
            Executing { slots, limit: 4 },
        );
        (dir, store, journal, hub, permit)
    }

    /// A journal holding writes nobody waits on for `hold`, with request `req_a` stored.
    async fn request_a_held_for(
        hold: Duration,
    ) -> (tempfile::TempDir, Arc<dyn Store>, Journal, Arc<EventHub>) {
        let (dir, store, journal, hub) = journal_holding(hold).await;
        journal
            .commit(Some("req_a"), request_ops("req_a"))
            .await
            .unwrap();
        (dir, store, journal, hub)
    }

    /// The types of a request's stored events, in order.
    async fn stored_types(store: &Arc<dyn Store>, request: &str) -> Vec<String> {
        store
            .events(request, 0, 10_000)
            .await
            .unwrap()
            .into_iter()
            .map(|e| e.event_type)
            .collect()
    }

    /// Waits until the writer of `request`'s lane is done with what it took and waits: a
    /// held write queued before then is taken by it as it looks at the queue again, where
    /// a test expects to find it queued.
    async fn until_the_writer_waits(journal: &Journal, request: &str) {
        let queue = &journal.lane(Some(request)).queue;
        for _ in 0..10_000 {
            if !queue.state().writer_busy {
                return;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        panic!("the writer never waited");
    }

    /// The texts of a request's stored output deltas, one per stored event.
    async fn stored_deltas(store: &Arc<dyn Store>, request: &str) -> Vec<String> {
        store
            .events(request, 0, 100)
            .await
            .unwrap()
            .iter()
            .filter_map(|e| output_delta_text(&e.data).map(str::to_owned))
            .collect()
    }

    #[tokio::test]
    async fn writes_nobody_waits_on_commit_with_the_next_commit() {
        // A hold far longer than the test: only the commit can have stored the deltas.
        let (_dir, store, journal, _hub) = request_a_held_for(Duration::from_secs(600)).await;
        for text in ["one ", "two "] {
            journal
                .write(Some("req_a"), delta("req_a", "run", text))
                .await
                .unwrap();
        }
        journal
            .commit(Some("req_a"), vec![event("req_a", "end")])
            .await
            .unwrap();
        // Held together, the two deltas were stored as one event, before the end.
        assert_eq!(stored_deltas(&store, "req_a").await, ["one two "]);
        let types = stored_types(&store, "req_a").await;
        assert_eq!(types, [ADAPTER_EVENT, "end"]);
    }

    #[tokio::test]
    async fn an_awaited_view_is_read_after_the_ends_commit_and_handed_over_before_it_is_published()
    {
        let (_dir, _store, journal, hub) = request_a_held_for(HOLD).await;
        let mut awaited = hub.await_view("req_a");
        let mut live = hub.subscribe("req_a");
        journal
            .commit(Some("req_a"), vec![event("req_a", ADAPTER_EVENT)])
            .await
            .unwrap();
        assert_eq!(live.recv().await.unwrap().event_type, ADAPTER_EVENT);
        assert!(awaited.take().is_none(), "no view before the end");
        let ended = WriteOp::UpdateRequest {
            id: "req_a".into(),
            status: RunStatus::Completed,
            output: Some("done".into()),
            error: None,
            usage: None,
            at: Utc::now(),
        };
        // Not waited on: what the follower sees is all the test looks at.
        journal
            .write_group_now(
                Some("req_a"),
                vec![ended, event("req_a", REQUEST_COMPLETED)],
            )
            .await
            .unwrap();
        let end = live.recv().await.unwrap();
        assert_eq!(end.event_type, REQUEST_COMPLETED);
        // The follower that saw the end finds the view, read after the end committed.
        let view = awaited
            .take()
            .expect("the view before the end was published");
        assert_eq!(view.request.status, RunStatus::Completed);
        assert_eq!(view.request.output.as_deref(), Some("done"));
        // Taken out of the hub once delivered.
        assert!(hub.views_awaited(&[end]).is_empty());
    }

    /// Two requests ending in one commit: their views are read together, and each is handed
    /// to its own waiter before its end is published.
    #[tokio::test]
    async fn views_awaited_at_ends_in_one_commit_are_each_handed_to_their_own_waiter() {
        let (_dir, _store, journal, hub) = request_a_held_for(HOLD).await;
        journal
            .commit(Some("req_b"), request_ops("req_b"))
            .await
            .unwrap();
        let mut awaited_a = hub.await_view("req_a");
        let mut awaited_b = hub.await_view("req_b");
        let mut live_b = hub.subscribe("req_b");
        let ended = |id: &str| WriteOp::UpdateRequest {
            id: id.into(),
            status: RunStatus::Completed,
            output: Some(format!("{id} done")),
            error: None,
            usage: None,
            at: Utc::now(),
        };
        journal
            .commit(
                None,
                vec![
                    ended("req_a"),
                    event("req_a", REQUEST_COMPLETED),
                    ended("req_b"),
                    event("req_b", REQUEST_COMPLETED),
                ],
            )
            .await
            .unwrap();
        assert_eq!(live_b.recv().await.unwrap().event_type, REQUEST_COMPLETED);
        for (awaited, id) in [(&mut awaited_a, "req_a"), (&mut awaited_b, "req_b")] {
            let view = awaited
                .take()
                .expect("each view before its end was published");
            assert_eq!(view.request.id, id);
            assert_eq!(view.request.output, Some(format!("{id} done")));
        }
    }

    #[tokio::test]
    async fn a_submit_nobody_waits_on_commits_with_its_runs_end() {
        // A hold far longer than the test: only the end's commit can store the submit.
        let (_dir, store, journal, _hub) = journal_holding(Duration::from_secs(600)).await;
        let mut ops = request_ops("req_a");
        ops.push(event("req_a", "submitted"));
        journal.write_submit(Some("req_a"), ops).await.unwrap();
        assert!(store.request("req_a").await.unwrap().is_none());
        journal
            .commit(Some("req_a"), vec![event("req_a", "end")])
            .await
            .unwrap();
        assert!(store.request("req_a").await.unwrap().is_some());
        assert_eq!(stored_types(&store, "req_a").await, ["submitted", "end"]);
    }

    #[tokio::test]
    async fn a_streamed_requests_writes_commit_at_once_its_submit_and_start_with_the_first() {
        let (_dir, store, journal, hub) = journal_holding(Duration::from_secs(600)).await;
        let _streamed = hub.stream("req_a");
        let mut live = hub.subscribe("req_a");
        journal
            .write_submit(Some("req_a"), request_ops("req_a"))
            .await
            .unwrap();
        // The run's start is held the same way (`RunEvents::record_as`).
        journal
            .write_submit(Some("req_a"), vec![event("req_a", "started")])
            .await
            .unwrap();
        // The submit and the start wait for the run's first output, though the request is
        // streamed.
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(store.request("req_a").await.unwrap().is_none());
        assert!(stored_types(&store, "req_a").await.is_empty());
        journal
            .write(Some("req_a"), delta("req_a", "run", "now "))
            .await
            .unwrap();
        // No commit follows: the delta reaches the follower (and the store) by itself, and
        // the submit and the start with it, before it.
        let mut shown = Vec::new();
        for _ in 0..2 {
            let event = tokio::time::timeout(Duration::from_secs(30), live.recv())
                .await
                .expect("a streamed request's write was held")
                .unwrap();
            shown.push(event.event_type.clone());
            if event.event_type == ADAPTER_EVENT {
                assert_eq!(output_delta_text(&event.data), Some("now "));
            }
        }
        assert_eq!(shown, ["started", ADAPTER_EVENT]);
        assert_eq!(
            stored_types(&store, "req_a").await,
            ["started", ADAPTER_EVENT]
        );
        assert!(store.request("req_a").await.unwrap().is_some());
    }

    #[tokio::test]
    async fn a_prompt_write_commits_by_itself_while_other_runs_execute() {
        // Two of four slots taken: other runs execute, so the prompt write may wait for
        // their commit, which never comes; the hold far longer than the test is not its.
        let (_dir, store, journal, hub, _running) = journal_serving_with_runs_executing(2).await;
        let mut live = hub.subscribe("req_a");
        let mut ops = request_ops("req_a");
        ops.push(event("req_a", "submitted"));
        journal.write_group_now(Some("req_a"), ops).await.unwrap();
        let event = tokio::time::timeout(Duration::from_secs(30), live.recv())
            .await
            .expect("a prompt write waited for a commit that never came")
            .unwrap();
        assert_eq!(event.event_type, "submitted");
        assert_eq!(stored_types(&store, "req_a").await, ["submitted"]);
    }

    #[tokio::test]
    async fn a_held_write_commits_by_itself_after_the_hold() {
        let (_dir, store, journal, hub) = request_a_held_for(Duration::from_millis(20)).await;
        let mut live = hub.subscribe("req_a");
        journal
            .write(Some("req_a"), delta("req_a", "run", "later "))
            .await
            .unwrap();
        let event = tokio::time::timeout(Duration::from_secs(30), live.recv())
            .await
            .expect("a held write never committed")
            .unwrap();
        assert_eq!(output_delta_text(&event.data), Some("later "));
        assert_eq!(stored_deltas(&store, "req_a").await, ["later "]);
    }

    #[tokio::test]
    async fn more_held_writes_than_a_batch_all_commit_in_order_by_a_flush() {
        let (_dir, store, journal, _hub) = request_a_held_for(Duration::from_secs(600)).await;
        let count = MAX_BATCH * 2 + 10;
        for n in 0..count {
            journal
                .write(Some("req_a"), event("req_a", &format!("tick.{n}")))
                .await
                .unwrap();
        }
        journal.flush().await.unwrap();
        let types = stored_types(&store, "req_a").await;
        let expected: Vec<String> = (0..count).map(|n| format!("tick.{n}")).collect();
        assert_eq!(types, expected);
    }

    #[tokio::test]
    async fn the_last_handle_dropped_commits_what_is_held() {
        let (_dir, store, journal, _hub) = request_a_held_for(Duration::from_secs(600)).await;
        journal
            .write(Some("req_a"), event("req_a", "last"))
            .await
            .unwrap();
        drop(journal);
        // The hold is far longer than the test: only the writer finishing stores it.
        let stored = tokio::time::timeout(Duration::from_secs(30), async {
            loop {
                let events = store.events("req_a", 0, 10).await.unwrap();
                if events.iter().any(|e| e.event_type == "last") {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
        assert!(
            stored.is_ok(),
            "a held write was lost when the journal closed"
        );
    }

    #[tokio::test]
    async fn a_lone_clients_requests_commit_in_order_whether_the_writer_polls_or_sleeps() {
        // One run executes (the client's): the embedded store's writer then polls after a
        // commit whose next write comes soon, and sleeps after one that came late.
        let (_dir, store, journal, _hub, _running) = journal_serving_with_runs_executing(1).await;
        for n in 0..12 {
            let request = format!("req_{n}");
            journal
                .write_submit(Some(&request), request_ops(&request))
                .await
                .unwrap();
            journal
                .write(Some(&request), event(&request, "started"))
                .await
                .unwrap();
            journal
                .commit(Some(&request), vec![event(&request, "end")])
                .await
                .unwrap();
            if n % 3 == 2 {
                // Longer than a poll: the writer sleeps and is woken as usual.
                tokio::time::sleep(AWAKE * 3).await;
            }
        }
        for n in 0..12 {
            assert_eq!(
                stored_types(&store, &format!("req_{n}")).await,
                ["started", "end"]
            );
        }
    }

    #[test]
    fn an_acknowledgement_is_taken_as_the_writer_sent_it() {
        let (sender, mut done) = oneshot::channel();
        assert!(acknowledgement(&mut done).is_none());
        sender.send(Ok(())).unwrap();
        assert!(matches!(acknowledgement(&mut done), Some(Ok(()))));
        let (sender, mut done) = oneshot::channel();
        sender
            .send(Err(JournalError::Poisoned("req_a".into())))
            .unwrap();
        assert!(matches!(
            acknowledgement(&mut done),
            Some(Err(JournalError::Poisoned(_)))
        ));
        let (sender, mut done) = oneshot::channel::<Result<(), JournalError>>();
        drop(sender);
        assert!(matches!(
            acknowledgement(&mut done),
            Some(Err(JournalError::Closed))
        ));
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_producer_waiting_awake_gets_its_commits_outcome() {
        // One run executes and the embedded store's writer has a thread of its own; each
        // commit is queued as soon as the last was acknowledged, as a lone client's are, so
        // the writer polls between them and a producer that finds it polling waits awake.
        // Whichever way each waits, it gives what the writer decided.
        let (_dir, store, journal, _hub, _running) = journal_serving_with_runs_executing(1).await;
        journal
            .commit(Some("req_a"), request_ops("req_a"))
            .await
            .unwrap();
        let refused = journal
            .commit(Some("req_a"), vec![event("req_a", "lost"), orphan_run()])
            .await;
        assert!(
            matches!(refused, Err(JournalError::Rejected(_))),
            "{refused:?}"
        );
        let poisoned = journal
            .commit(Some("req_a"), vec![event("req_a", "next")])
            .await;
        assert!(
            matches!(poisoned, Err(JournalError::Poisoned(_))),
            "{poisoned:?}"
        );
        journal
            .settle("req_a", vec![event("req_a", "end")])
            .await
            .unwrap();
        assert_eq!(stored_types(&store, "req_a").await, ["end"]);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_wait_awake_lets_its_threads_other_tasks_run_and_ends_at_its_end() {
        let (sender, mut receiver) = oneshot::channel::<u32>();
        let producer = tokio::spawn(async move { sender.send(7) });
        // One thread: the sender runs only when the wait yields to it.
        let long = std::time::Instant::now() + Duration::from_secs(600);
        let got = awake_until(long, || receiver.try_recv().ok()).await;
        assert_eq!(got, Some(7));
        producer.await.unwrap().unwrap();
        let started = std::time::Instant::now();
        assert_eq!(awake_until(started + AWAKE, || None::<u32>).await, None);
        assert!(started.elapsed() >= AWAKE);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_poll_lets_its_threads_other_tasks_run_and_finds_what_they_queue() {
        let queue = Arc::new(Queue::new(HOLD));
        let producer = {
            let queue = Arc::clone(&queue);
            tokio::spawn(async move {
                queue
                    .state()
                    .queue(Item::Forgive("req_a".into()), Urgency::Now);
            })
        };
        // One thread: the producer runs only when the poll yields to it.
        let long = std::time::Instant::now() + Duration::from_secs(600);
        assert!(queued_within(&queue, long, None).await);
        producer.await.unwrap();
    }

    #[tokio::test]
    async fn a_poll_that_finds_nothing_lasts_until_its_end_or_the_writers_deadline() {
        let queue = Queue::new(HOLD);
        let started = std::time::Instant::now();
        assert!(!queued_within(&queue, started + AWAKE, None).await);
        assert!(started.elapsed() >= AWAKE);
        // A deadline (a hold that ends) sooner than the poll's end stops it.
        let started = std::time::Instant::now();
        let deadline = tokio::time::Instant::now() + AWAKE;
        let long = started + Duration::from_secs(600);
        assert!(!queued_within(&queue, long, Some(deadline)).await);
        assert!(started.elapsed() < Duration::from_secs(600));
    }

    #[tokio::test]
    async fn a_poll_ends_when_every_producer_is_gone() {
        let queue = Queue::new(HOLD);
        queue.state().closed = true;
        let long = std::time::Instant::now() + Duration::from_secs(600);
        assert!(queued_within(&queue, long, None).await);
    }

    #[tokio::test]
    async fn a_held_write_wakes_no_writer_and_the_next_urgent_one_cancels_its_timer() {
        let (_dir, store, journal, _hub) = journal_holding(Duration::from_secs(600)).await;
        journal
            .commit(Some("req_a"), request_ops("req_a"))
            .await
            .unwrap();
        until_the_writer_waits(&journal, "req_a").await;
        journal
            .write(Some("req_a"), event("req_a", "held"))
            .await
            .unwrap();
        let queue = Arc::clone(&journal.lane(Some("req_a")).queue);
        let timer = {
            let state = queue.state();
            // Not taken: the writer was not woken for it, and holds nothing to time it by.
            assert_eq!(state.items.len(), 1);
            assert!(!state.timed);
            let timer = state.hold_timer.as_ref().expect("its hold is timed here");
            timer.task.clone().expect("its timer is started")
        };
        // A second held write rides on the same timer.
        journal
            .write(Some("req_a"), event("req_a", "held too"))
            .await
            .unwrap();
        assert_eq!(queue.state().items.len(), 2);
        journal
            .commit(Some("req_a"), vec![event("req_a", "end")])
            .await
            .unwrap();
        assert_eq!(
            stored_types(&store, "req_a").await,
            ["held", "held too", "end"]
        );
        // Cancelled here, on the thread that armed it: it will not wake this runtime.
        assert!(queue.state().hold_timer.is_none());
        for _ in 0..10_000 {
            if timer.is_finished() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        assert!(timer.is_finished());
    }

    #[tokio::test]
    async fn a_held_write_alone_commits_when_its_producers_timer_fires() {
        let (_dir, store, journal, _hub) = journal_holding(Duration::from_millis(20)).await;
        journal
            .commit(Some("req_a"), request_ops("req_a"))
            .await
            .unwrap();
        until_the_writer_waits(&journal, "req_a").await;
        journal
            .write(Some("req_a"), event("req_a", "held"))
            .await
            .unwrap();
        // Queued while the writer slept with no deadline: timed here.
        assert!(
            journal
                .lane(Some("req_a"))
                .queue
                .state()
                .hold_timer
                .is_some()
        );
        for _ in 0..30_000 {
            if !stored_types(&store, "req_a").await.is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        assert_eq!(stored_types(&store, "req_a").await, ["held"]);
        assert!(
            journal
                .lane(Some("req_a"))
                .queue
                .state()
                .hold_timer
                .is_none()
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_held_write_queued_at_any_moment_of_the_writers_turn_commits_unflushed() {
        // A held write queued a little after a write that commits at once finds the writer
        // asleep, taking, committing or done: it is woken for, timed, or taken as the writer
        // looks at the queue again before it waits, and never waits for a later write.
        let (_dir, store, journal, _hub) = journal_holding(Duration::from_millis(2)).await;
        journal
            .commit(Some("req_a"), request_ops("req_a"))
            .await
            .unwrap();
        for step in 0..200_usize {
            journal
                .write_group_now(Some("req_a"), vec![event("req_a", "now")])
                .await
                .unwrap();
            let queued_at =
                std::time::Instant::now() + Duration::from_micros(step as u64 % 20 * 25);
            while std::time::Instant::now() < queued_at {
                std::hint::spin_loop();
            }
            journal
                .write(Some("req_a"), event("req_a", "held"))
                .await
                .unwrap();
            let mut stored = 0;
            for _ in 0..30_000 {
                stored = stored_types(&store, "req_a").await.len();
                if stored == 2 * (step + 1) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            assert_eq!(stored, 2 * (step + 1), "step {step}'s held write commits");
        }
    }

    #[tokio::test]
    async fn under_load_the_writer_watches_after_a_commit_and_no_timer_is_armed() {
        // Each try: a commit, then a held write once the writer waits. With one run
        // executing the writer sleeps with no deadline, so the write arms its producer's
        // timer; with two, it watches for a hold's length, so the write needs none (unless
        // a thread stalled past the hold's 5 ms, hence several tries).
        for (running, timed_here) in [(1, true), (2, false)] {
            let (_dir, _store, journal, _hub, _permit) =
                journal_serving_with_runs_executing(running).await;
            let mut armed = Vec::new();
            for attempt in 0..10 {
                let request = format!("req_{attempt}");
                journal
                    .commit(Some(&request), request_ops(&request))
                    .await
                    .unwrap();
                until_the_writer_waits(&journal, &request).await;
                journal
                    .write(Some(&request), event(&request, "held"))
                    .await
                    .unwrap();
                armed.push(
                    journal
                        .lane(Some(&request))
                        .queue
                        .state()
                        .hold_timer
                        .is_some(),
                );
                journal.flush().await.unwrap();
            }
            assert!(
                armed.contains(&timed_here),
                "{running} executing: {armed:?}"
            );
        }
    }

    #[tokio::test]
    async fn a_hold_timer_dropped_with_its_runtime_wakes_the_writer() {
        let (_dir, _store, journal, _hub) = journal_holding(Duration::from_secs(600)).await;
        journal
            .commit(Some("req_a"), request_ops("req_a"))
            .await
            .unwrap();
        until_the_writer_waits(&journal, "req_a").await;
        let producer = journal.clone();
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .build()
                .unwrap();
            runtime
                .block_on(producer.write(Some("req_a"), event("req_a", "held")))
                .unwrap();
            // The runtime ends here, its timer unfired.
        })
        .join()
        .unwrap();
        // The writer was woken: it took the write and times its hold itself.
        let queue = &journal.lane(Some("req_a")).queue;
        for _ in 0..30_000 {
            {
                let state = queue.state();
                if state.items.is_empty() && state.timed {
                    break;
                }
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let state = queue.state();
        assert!(state.items.is_empty() && state.timed && state.hold_timer.is_none());
    }

    #[test]
    fn the_writer_polls_after_back_to_back_requests_and_not_between_requests_at_a_rate() {
        let start = std::time::Instant::now();
        let at = |micros: u64| start + Duration::from_micros(micros);
        // A lone client: its request's writes come 200 µs after the last commit, its end
        // 300 µs after them, and it committed alone: a poll may find the next request.
        let mut pace = Pace::default();
        pace.committed(true, at(0));
        pace.took(at(0), true, at(200));
        assert!(pace.poll_pays());
        pace.took(at(200), false, at(500));
        pace.committed(true, at(600));
        assert!(pace.poll_pays());
        // A poll that found nothing stops the polling until a wait is short again.
        pace.polled(false);
        assert!(!pace.poll_pays());

        // Requests 20 ms apart: each one's end comes soon after its submit, but its writes
        // began long after the commit before them, so no poll follows its commit.
        let mut pace = Pace::default();
        pace.committed(true, at(0));
        pace.took(at(0), true, at(20_000));
        assert!(!pace.poll_pays());
        pace.took(at(20_000), false, at(20_300));
        pace.committed(true, at(20_400));
        assert!(!pace.poll_pays());

        // Several requests' writes in one batch (load): no poll, however close they come.
        let mut pace = Pace::default();
        pace.committed(false, at(0));
        pace.took(at(0), true, at(50));
        assert!(!pace.poll_pays());
        // Nothing committed yet: nothing to go by.
        let mut pace = Pace::default();
        pace.took(at(0), true, at(10));
        assert!(!pace.poll_pays());
    }

    #[test]
    fn a_batch_is_of_one_request_when_its_groups_write_for_one_at_most() {
        let group = |request: Option<&str>| Group {
            request: request.map(Into::into),
            ops: Vec::new(),
            settles: false,
            asked: Asked::Held,
            ack: None,
        };
        let mut held = Held::default();
        assert!(held.of_one_request());
        held.push(group(None));
        held.push(group(Some("req_a")));
        held.push(group(Some("req_a")));
        assert!(held.of_one_request());
        held.push(group(Some("req_b")));
        assert!(!held.of_one_request());
    }

    fn request_ops(id: &str) -> Vec<WriteOp> {
        let session = test_records::session(&format!("ses_{id}"));
        let mut request = test_records::request(id, &session.id);
        // A secret in the input: every write is redacted before it is stored.
        request.input = json!({ "password": "hunter22" });
        vec![
            WriteOp::TouchSession(session),
            WriteOp::InsertRequest(request),
        ]
    }

    fn event(request: &str, event_type: &str) -> WriteOp {
        test_records::event(request, "run", event_type, json!({}))
    }

    fn delta(request: &str, run: &str, text: &str) -> WriteOp {
        let mut op = event(request, ADAPTER_EVENT);
        if let WriteOp::AppendEvent(event) = &mut op {
            event.run_id = run.into();
            event.data = crate::runtime::events::output_delta(text);
        }
        op
    }

    /// Requests spread over two lanes: each lane keeps its requests' writes in order, an
    /// approval-like group of no request follows its event's request, and a flush waits for
    /// what every lane holds.
    #[tokio::test]
    async fn in_two_lanes_each_request_keeps_its_order_and_a_flush_waits_for_both() {
        // A hold far longer than the test: only a commit or a flush stores a held write.
        let (_dir, store, journal, _hub) = journal_in_lanes(Duration::from_secs(600), 2).await;
        let requests: Vec<String> = (0..16).map(|i| format!("req_{i:02}")).collect();
        let lanes: HashSet<usize> = requests.iter().map(|r| lane_of(r, 2)).collect();
        assert_eq!(lanes.len(), 2, "the requests fall in both lanes");
        for request in &requests {
            journal
                .commit(Some(request), request_ops(request))
                .await
                .unwrap();
        }
        // Interleaved across requests (and so across lanes), held: nobody waits on them.
        for step in 0..3 {
            for request in &requests {
                let op = event(request, &format!("step {step}"));
                journal.write(Some(request), op).await.unwrap();
            }
        }
        for request in &requests {
            assert!(stored_types(&store, request).await.is_empty(), "held");
        }
        journal.flush().await.unwrap();
        let steps = |count: usize| -> Vec<(i64, String)> {
            (0..count)
                .map(|step| (step as i64 + 1, format!("step {step}")))
                .collect()
        };
        let stored = |request: String| {
            let store = Arc::clone(&store);
            async move {
                let events = store.events(&request, 0, 100).await.unwrap();
                events
                    .into_iter()
                    .map(|e| (e.seq, e.event_type))
                    .collect::<Vec<_>>()
            }
        };
        for request in &requests {
            assert_eq!(stored(request.clone()).await, steps(3), "{request}");
        }
        // One more held step each, then a group of no request carrying the request's event
        // (as an approval's decision does), waited on: it commits in the request's lane, so
        // the held step commits before it.
        for request in &requests {
            let op = event(request, "step 3");
            journal.write(Some(request), op).await.unwrap();
        }
        for request in &requests {
            let op = event(request, "step 4");
            journal.commit(None, vec![op]).await.unwrap();
            assert_eq!(stored(request.clone()).await, steps(5), "{request}");
        }
        assert!(journal.is_available());
    }

    #[tokio::test]
    async fn deltas_queued_together_are_stored_as_one_event_per_stretch() {
        let (_dir, store, journal) = journal_on_a_fresh_store().await;
        journal
            .commit(Some("req_a"), request_ops("req_a"))
            .await
            .unwrap();
        // Queued before the writer task runs, so they share a batch.
        for text in ["The ", "quick ", "fox"] {
            journal
                .write(Some("req_a"), delta("req_a", "run", text))
                .await
                .unwrap();
        }
        journal
            .write(Some("req_a"), event("req_a", "between"))
            .await
            .unwrap();
        for (run, text) in [("run", " jumps"), ("run", " over"), ("run_2", " again")] {
            journal
                .write(Some("req_a"), delta("req_a", run, text))
                .await
                .unwrap();
        }
        journal.flush().await.unwrap();

        let stored = store.events("req_a", 0, 100).await.unwrap();
        let summary: Vec<(i64, String, Option<String>)> = stored
            .iter()
            .map(|e| {
                let text = output_delta_text(&e.data).map(str::to_owned);
                (e.seq, e.event_type.clone(), text)
            })
            .collect();
        let delta = |seq, text: &str| (seq, ADAPTER_EVENT.to_owned(), Some(text.to_owned()));
        assert_eq!(
            summary,
            vec![
                delta(1, "The quick fox"),
                (2, "between".to_owned(), None),
                delta(3, " jumps over"),
                delta(4, " again"),
            ]
        );
    }

    #[tokio::test]
    async fn a_delta_joins_its_runs_delta_while_that_waits_in_the_queue() {
        // A hold far longer than the test: held writes wait in the queue until the flush.
        let (_dir, store, journal, _hub) = journal_holding(Duration::from_secs(600)).await;
        for request in ["req_a", "req_b"] {
            journal
                .commit(Some(request), request_ops(request))
                .await
                .unwrap();
        }
        until_the_writer_waits(&journal, "req_a").await;
        // Nothing queued: nothing to join.
        assert!(!journal.extend_queued_delta("req_a", "run", "lost"));
        journal
            .write(Some("req_a"), delta("req_a", "run", "The "))
            .await
            .unwrap();
        // Another request's writes queued behind it do not end its stretch.
        journal
            .write(Some("req_b"), delta("req_b", "run", "Other "))
            .await
            .unwrap();
        journal
            .write(Some("req_b"), event("req_b", "between"))
            .await
            .unwrap();
        // Another run's text, or another request's, is not joined to it.
        assert!(!journal.extend_queued_delta("req_a", "run_2", "x"));
        assert!(!journal.extend_queued_delta("req_b", "run", "x"));
        assert!(!journal.extend_queued_delta("req_c", "run", "x"));
        assert!(journal.extend_queued_delta("req_a", "run", "quick "));
        assert!(journal.extend_queued_delta("req_a", "run", "fox"));
        // Nor past the bound of a merged delta.
        assert!(!journal.extend_queued_delta("req_a", "run", &"x".repeat(MAX_MERGED_DELTA)));
        journal
            .write(Some("req_a"), event("req_a", "between"))
            .await
            .unwrap();
        // Behind another write of the request, a delta is no longer the last queued.
        assert!(!journal.extend_queued_delta("req_a", "run", " jumps"));
        journal.flush().await.unwrap();
        assert_eq!(stored_deltas(&store, "req_a").await, ["The quick fox"]);
        assert_eq!(
            stored_types(&store, "req_a").await,
            [ADAPTER_EVENT, "between"]
        );
        assert_eq!(stored_deltas(&store, "req_b").await, ["Other "]);
        // Once the writer took a delta, nothing is joined to it.
        journal
            .write(Some("req_b"), delta("req_b", "run", "last"))
            .await
            .unwrap();
        journal.flush().await.unwrap();
        assert!(!journal.extend_queued_delta("req_b", "run", " late"));
        assert_eq!(stored_deltas(&store, "req_b").await, ["Other ", "last"]);
    }

    #[test]
    fn a_delta_the_writer_took_is_not_found_in_the_queue() {
        let mut state = QueueState::default();
        for request in ["req_a", "req_b"] {
            let group = Group {
                request: Some(request.into()),
                ops: vec![delta(request, "run", "text")],
                settles: false,
                asked: Asked::Held,
                ack: None,
            };
            state.queue(Item::Group(group), Urgency::Held);
        }
        assert!(state.queued_delta("req_a").is_some());
        // The writer takes the first item, and only it.
        state.items.pop_front();
        assert!(state.queued_delta("req_a").is_none());
        let (group, _) = state
            .queued_delta("req_b")
            .expect("req_b's delta is queued");
        assert_eq!(group.request.as_deref(), Some("req_b"));
    }

    #[tokio::test]
    async fn text_joined_to_a_held_delta_of_a_request_streamed_since_commits_at_once() {
        let (_dir, store, journal, hub) = journal_holding(Duration::from_secs(600)).await;
        journal
            .commit(Some("req_a"), request_ops("req_a"))
            .await
            .unwrap();
        until_the_writer_waits(&journal, "req_a").await;
        journal
            .write(Some("req_a"), delta("req_a", "run", "held "))
            .await
            .unwrap();
        // A follower arrives: the request's writes commit at once from now on, the delta
        // they join among them.
        let _streamed = hub.stream("req_a");
        let mut live = hub.subscribe("req_a");
        assert!(journal.extend_queued_delta("req_a", "run", "now"));
        let event = tokio::time::timeout(Duration::from_secs(30), live.recv())
            .await
            .expect("the joined delta waited for the hold")
            .unwrap();
        assert_eq!(output_delta_text(&event.data), Some("held now"));
        assert_eq!(stored_deltas(&store, "req_a").await, ["held now"]);
    }

    /// A run of a request that does not exist: the store refuses it (foreign key), always.
    fn orphan_run() -> WriteOp {
        WriteOp::InsertRun(test_records::run("run_orphan", "req_missing"))
    }

    #[tokio::test]
    async fn a_refused_group_fails_alone_poisons_its_request_and_leaves_no_seq_hole() {
        let (_dir, store, journal) = journal_on_a_fresh_store().await;
        journal
            .commit(Some("req_a"), request_ops("req_a"))
            .await
            .unwrap();
        journal
            .commit(Some("req_b"), request_ops("req_b"))
            .await
            .unwrap();

        // Queued together, so they share a batch: only the bad group is refused.
        let good = journal.commit(Some("req_a"), vec![event("req_a", "one")]);
        let bad = journal.commit(Some("req_b"), vec![event("req_b", "lost"), orphan_run()]);
        let also_good = journal.commit(Some("req_a"), vec![event("req_a", "two")]);
        let (good, bad, also_good) = tokio::join!(good, bad, also_good);
        good.unwrap();
        also_good.unwrap();
        assert!(matches!(bad, Err(JournalError::Rejected(_))), "{bad:?}");

        // The request whose write was lost cannot go on...
        let after = journal
            .commit(Some("req_b"), vec![event("req_b", "next")])
            .await;
        assert!(matches!(after, Err(JournalError::Poisoned(_))), "{after:?}");
        // ...until its end settles it, numbered right after its last committed event.
        journal
            .settle("req_b", vec![event("req_b", "runtime.request.failed")])
            .await
            .unwrap();
        journal
            .commit(Some("req_b"), vec![event("req_b", "later")])
            .await
            .unwrap();

        let seqs = |events: Vec<EventRecord>| {
            events
                .into_iter()
                .map(|e| (e.seq, e.event_type))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            seqs(store.events("req_a", 0, 10).await.unwrap()),
            vec![(1, "one".to_owned()), (2, "two".to_owned())]
        );
        assert_eq!(
            seqs(store.events("req_b", 0, 10).await.unwrap()),
            vec![
                (1, "runtime.request.failed".to_owned()),
                (2, "later".to_owned())
            ]
        );
        // Redacted before it was stored.
        let stored = store.request("req_a").await.unwrap().unwrap();
        assert_eq!(stored.input, json!({ "password": "[redacted]" }));
        assert!(journal.is_available());
    }

    #[tokio::test]
    async fn a_conditional_decision_is_a_conflict_the_second_time_and_poisons_nothing() {
        use crate::store::{ApprovalDecision, ApprovalStatus};
        let (_dir, _store, journal) = journal_on_a_fresh_store().await;
        let decision = ApprovalDecision {
            id: "apr_missing".into(),
            status: ApprovalStatus::Approved,
            reason: None,
            decided_by: "ops".into(),
            at: Utc::now(),
        };
        let result = journal
            .commit(None, vec![WriteOp::DecideApproval(decision)])
            .await;
        assert!(
            matches!(result, Err(JournalError::Conflict(_))),
            "{result:?}"
        );
    }
}
