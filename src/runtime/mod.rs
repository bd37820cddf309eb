//! Runtime lifecycle (SPEC sections 4 and 7): requests, sessions, runs and their events.
//!
//! [`Runtime::submit`] persists a request and its first run and starts the run on the task
//! tracker; the run resolves its adapter, streams events through the [`journal`] (ordered,
//! batched, published after commit) and ends with exactly one terminal event.
//! [`Runtime::follow`] replays stored events and then follows live ones without gaps or
//! duplicates. Concurrency is bounded: `limits.maxConcurrentRuns` run at once, as many more
//! wait in line, and beyond that `submit` refuses with [`RuntimeError::Busy`]. At shutdown,
//! [`Runtime::stop_admitting`] refuses new requests ([`RuntimeError::ShuttingDown`]) and
//! [`Runtime::shutdown`] waits, bounded, only for runs holding an execution slot.

mod carried_digests;
mod client_turns;
mod clock;
pub mod events;
pub use carried_digests::{CarriedTranscript, SentTranscript, SessionMark};
pub use client_turns::{ClientResult, ClientTurn, names_client_calls};
mod fanout;
mod history;
mod hub;
mod journal;
mod leases;
mod maintenance;
mod memory_admin;
mod named_transcripts;
mod narration;
mod reload;
mod run;
mod steering;
mod watch;
pub mod workflow;

use std::sync::{Arc, Mutex};

use chrono::Utc;
use futures::Stream;
use serde_json::{Map, Value, json};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::adapters::{Adapters, SharedHistory, Transcript};
use crate::gateway::{ApprovalWaiters, ToolGateway};
use crate::ids::IdMap;
use crate::redact::Redactor;
use crate::store::{
    ApprovalDecision, ApprovalRecord, ApprovalStatus, EventRecord, MessageRecord, PREFIX_OF,
    RequestRecord, RunRecord, RunStatus, SessionRecord, Store, StoreError, WriteOp, named_input,
};
use crate::workspace::CompiledWorkspace;

pub use history::DEFAULT_KEPT_HISTORY_BYTES;
pub use hub::{AwaitedView, EventHub, Streamed};
pub use journal::{Journal, JournalError};
pub use maintenance::retention_policy;
pub use memory_admin::{ImportReport, MemoryAdminError};
pub use reload::{ReloadError, Reloaded};
pub use watch::{ApprovalWatch, Watched};

/// Events of one request, in `seq` order, ending after its terminal event.
pub type EventStream =
    std::pin::Pin<Box<dyn Stream<Item = Result<Arc<EventRecord>, StoreError>> + Send + 'static>>;

/// The key of a stored request input naming the session message its history runs through.
const HISTORY_THROUGH: &str = "historyThrough";

/// The key of a stored request input naming the session message its whole transcript (its
/// history, then its own messages) ends at: where a later request may continue from it.
pub const TRANSCRIPT_THROUGH: &str = "transcriptThrough";

/// The members of a stored request's input for its leading messages (a Responses turn's
/// instructions): held, named, and their digest.
pub use crate::store::named_input::{LEADING, LEADING_DIGEST, LEADING_OF};

/// Where a request's leading messages are held already ([`LEADING_OF`]): the request whose
/// input holds them, and their digest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldLeading {
    pub request: String,
    pub digest: String,
}

/// The SHA-256 of leading messages as their JSON text, in hex.
fn leading_digest(leading: &[Value]) -> String {
    named_transcripts::digest_of(leading)
}

/// Where `leading` (a turn's own, non-empty) is held already when it is what `previous` (the
/// turn before, in the same session) leads with: `previous` itself when its input holds
/// them, else the request it names in its session, when their digests agree; never the
/// request of another session that a turn with no session names ([`PREFIX_OF`]). Nothing
/// is read.
pub fn held_leading(previous: &RequestRecord, leading: &[Value]) -> Option<HeldLeading> {
    if leading.is_empty() {
        return None;
    }
    if let Some(theirs) = previous.input.get(LEADING).and_then(Value::as_array) {
        return (theirs.as_slice() == leading).then(|| HeldLeading {
            request: previous.id.clone(),
            digest: leading_digest(leading),
        });
    }
    // One that names another session's request (the one holding its first messages) is
    // not followed: nothing would keep that request from the prune for this session.
    if previous.input.get(PREFIX_OF).is_some() {
        return None;
    }
    let holder = previous.input.get(LEADING_OF)?.as_str()?;
    let theirs = previous.input.get(LEADING_DIGEST)?.as_str()?;
    let digest = leading_digest(leading);
    (digest == theirs).then(|| HeldLeading {
        request: holder.to_owned(),
        digest,
    })
}

/// Where `leading` is held already when it is what request `previous` of session `session`
/// leads with ([`held_leading`]): one read of that request, none when there is nothing to
/// name.
async fn leading_held_before(
    store: &dyn Store,
    previous: &str,
    session: &str,
    leading: &[Value],
) -> Result<Option<HeldLeading>, StoreError> {
    if leading.is_empty() {
        return Ok(None);
    }
    Ok(store
        .request(previous)
        .await?
        .filter(|previous| previous.session_id == session)
        .and_then(|previous| held_leading(&previous, leading)))
}

/// What a follower of a request is told when the store refused the request's first write
/// (the journal's log has the store's own error).
const REQUEST_NOT_STORED: &str =
    "the store refused to store this request, so it was not run to its end here";

/// Where a request's run starts: the messages (its leading messages, the session's history
/// path through the message the input names, if any, shared with the kept path, then the
/// input's own messages), and the message the run's answer hangs under (the request's own
/// last message, else the history's end).
async fn request_start(
    store: &dyn Store,
    histories: &history::Histories,
    request: &RequestRecord,
) -> Result<(Transcript, Option<String>), StoreError> {
    let through = request.input.get(HISTORY_THROUGH).and_then(Value::as_str);
    let history = match through {
        Some(through) => Some(
            histories
                .shared_path(store, &request.session_id, through)
                .await?,
        ),
        None => None,
    };
    // The request holding its first messages, read once: it may hold its leading ones too.
    let holder = named_input::holder_of(store, request).await?;
    let own = named_input::joined_messages(request, holder.as_ref())?;
    let leading = stored_leading(store, request, holder.as_ref()).await?;
    let messages = Transcript::new(leading, history, own);
    let own_last = store
        .request_last_message(&request.session_id, &request.id, request.created_at)
        .await?;
    Ok((messages, own_last.or_else(|| through.map(str::to_owned))))
}

/// A stored request's leading messages ([`LEADING`]): its own, or those of the request its
/// input names ([`LEADING_OF`]), which the server names only in the request's own session
/// (pruned with it, never apart) or, with no session, where its first messages are held
/// (kept by the prune while named): there a request that does not hold them fails the read
/// ([`named_input::joined_leading`]). `read` is a request the caller read already, which
/// may be the one named. A request of its session named and not there (nothing this
/// server writes) gives none, with a warning in the log.
pub async fn stored_leading(
    store: &dyn Store,
    request: &RequestRecord,
    read: Option<&RequestRecord>,
) -> Result<Vec<Value>, StoreError> {
    if let Some(leading) = request.input.get(LEADING).and_then(Value::as_array) {
        return Ok(leading.clone());
    }
    let Some(holder) = request.input.get(LEADING_OF).and_then(Value::as_str) else {
        return Ok(Vec::new());
    };
    let fetched;
    let held = match read.filter(|read| read.id == holder) {
        Some(read) => Some(read),
        None => {
            fetched = store.request(holder).await?;
            fetched.as_ref()
        }
    };
    if named_input::names_leading_with_prefix(request) {
        return named_input::joined_leading(request, held).cloned();
    }
    let leading = held
        .filter(|held| held.session_id == request.session_id)
        .and_then(|held| held.input.get(LEADING).and_then(Value::as_array));
    Ok(leading.cloned().unwrap_or_else(|| {
        tracing::warn!(request_id = %request.id, holder, "the request holding a request's leading messages is not in its session");
        Vec::new()
    }))
}

/// A session a request names, and when the request continues its history, that history and
/// where it ends (shared): the path through its newest leaf, read with the session in one
/// read, or for a fork with none of its own yet, through the message it was forked at. Only
/// the owner's session's history is taken (and kept). With `marked`, also how long the
/// path is through that message, when it passes through it as far as the read tells (the
/// path kept and what was read below it; an older message is not looked for).
async fn session_read(
    store: &dyn Store,
    histories: &history::Histories,
    session_id: &str,
    owner: &str,
    with_history: bool,
    marked: Option<&str>,
) -> Result<(Option<SessionRecord>, SessionHistory, Option<usize>), StoreError> {
    if !with_history {
        return Ok((store.session(session_id).await?, None, None));
    }
    let kept = histories.kept_path(session_id);
    let Some((session, read)) = store
        .session_and_path(session_id, history::known(&kept))
        .await?
    else {
        return Ok((None, None, None));
    };
    if session.owner != owner {
        return Ok((Some(session), None, None));
    }
    let mut marked_len = None;
    let history = match read {
        Some((head, read)) => {
            marked_len = marked.and_then(|marked| history::length_through(&kept, &read, marked));
            let path = histories.joined(session_id, &head, kept, read);
            Some((head, path))
        }
        None => match steering::forked_from(&session) {
            Some((_, message)) => {
                let path = histories.shared_path(store, session_id, message).await?;
                Some((message.to_owned(), path))
            }
            None => None,
        },
    };
    Ok((Some(session), history, marked_len))
}

/// A session's history as a request continues it: where it ends, and its messages.
type SessionHistory = Option<(String, Arc<SharedHistory>)>;

/// Whether a transcript holds an answer: one that does not is a conversation's first turn,
/// never matched with a session's history (nor read for).
fn answered(sent: &[Value]) -> bool {
    sent.iter().any(is_answer)
}

/// Whether a message is a model's answer (`assistant`).
fn is_answer(message: &Value) -> bool {
    message.get("role").and_then(Value::as_str) == Some("assistant")
}

/// How many of a session's newest answers are looked at for the one a client's transcript
/// that leaves the session's newest path holds last (its conversation's newest turn).
const ANSWERS_LOOKED_AT: u32 = 32;
/// How many of those that say what that answer says, and follow what the transcript says
/// before it, have their path read (answers alike, "Done.", are each looked at until one's
/// path is the transcript's).
const BRANCHES_TRIED: usize = 4;

/// Where a session's history (`path`, through `leaf`) and a client's transcript part
/// ([`History::SessionPrefix`]): the last message they share and how many they share, or
/// `None` when they share nothing. A transcript that leaves the newest path may continue
/// another of the session's conversations ([`other_branch`]); failing that, only a match
/// ending short of the path's end reads the path's ids (the kept path holds contents alone).
/// The first `known` messages are known to be the path's (carried on from the turn before):
/// only what follows them is compared.
async fn matching_path(
    store: &dyn Store,
    histories: &history::Histories,
    session_id: &str,
    (leaf, path): (String, Arc<SharedHistory>),
    sent: &[Value],
    known: usize,
) -> Result<Option<(String, usize)>, StoreError> {
    let matched = history::matching_prefix_after(&path, sent, known);
    if matched > 0 && matched == path.len() {
        return Ok(Some((leaf, matched)));
    }
    if let Some(other) = other_branch(store, histories, session_id, sent, matched).await? {
        return Ok(Some(other));
    }
    if matched == 0 {
        return Ok(None);
    }
    let read = store.message_path(&leaf).await?;
    Ok(read
        .get(matched - 1)
        .map(|message| (message.id.clone(), matched)))
}

/// The branch of the session a client's transcript continues when it leaves the session's
/// newest path after `matched` messages: one `user` with two chats open sends each chat's
/// transcript in turn, and each is a branch of the session's tree. Found by the transcript's
/// newest answer: at the end of a branch kept, or else among the session's newest answers,
/// taken when the path through it is the transcript's start, whole (the path read below a
/// kept branch the transcript starts with, and kept for the conversation's next turn).
/// Without it each turn of such a conversation was stored whole, as without a session:
/// storage growing with the square of its turns (docs/profiling.md, the eighty-first pass).
async fn other_branch(
    store: &dyn Store,
    histories: &history::Histories,
    session_id: &str,
    sent: &[Value],
    matched: usize,
) -> Result<Option<(String, usize)>, StoreError> {
    let Some(answer_at) = sent.iter().rposition(is_answer) else {
        return Ok(None);
    };
    // An answer the newest path holds: the transcript changed something after it.
    if answer_at < matched {
        return Ok(None);
    }
    // The longest kept branch the transcript starts with: each path read below it, and a
    // candidate passed over leaves the kept branches as they were, so it serves them all.
    let kept = histories.kept_branch_under(session_id, sent);
    // A branch kept through that answer: a conversation whose turn was the session's newest
    // when another's came (that read extended its path). Nothing to read.
    if let Some((through, path, _)) = &kept
        && path.len() == answer_at + 1
    {
        return Ok(Some((through.clone(), path.len())));
    }
    let answers = store.newest_answers(session_id, ANSWERS_LOOKED_AT).await?;
    let alike = answers
        .iter()
        .filter(|answer| history::same_message(&answer.content, &sent[answer_at]));
    let mut walked = 0;
    for answer in alike {
        if walked == BRANCHES_TRIED {
            break;
        }
        // An answer alike in another conversation is passed over by the message before it
        // (one read by id) before its path is walked.
        let before = match (&answer.parent_id, answer_at.checked_sub(1)) {
            (None, None) => true,
            (Some(parent), Some(at)) => store
                .message(parent)
                .await?
                .is_some_and(|parent| history::same_message(&parent.content, &sent[at])),
            _ => false,
        };
        if !before {
            continue;
        }
        walked += 1;
        let read = store
            .message_path_below(&answer.id, history::known(&kept))
            .await?;
        // Kept only when it is the transcript's start: an answer passed over leaves the
        // kept branches as they were.
        if history::read_path_is(&kept, &read, &sent[..=answer_at]) {
            let path = histories.joined(session_id, &answer.id, kept, read);
            return Ok(Some((answer.id.clone(), path.len())));
        }
    }
    Ok(None)
}

/// The session a request's model calls are charged to: a subagent's request (which only the
/// runtime submits, protocol `agent`) is charged to its parent's; any other to its own.
/// Client metadata never chooses it.
pub(crate) fn charge_session(protocol: &str, metadata: &Value, session_id: &str) -> String {
    if protocol == Protocol::Agent.as_str()
        && let Some(parent) = metadata.get(PARENT_SESSION).and_then(Value::as_str)
    {
        return parent.to_owned();
    }
    session_id.to_owned()
}

/// The metadata key naming a delegated request's charged session.
pub(crate) const PARENT_SESSION: &str = "parentSessionId";

/// A new id: a prefix and a time-ordered UUID (v7), so ids sort by creation.
pub fn new_id(prefix: &str) -> String {
    crate::ids::prefixed(prefix)
}

/// The prefix of the ids of calls handed to the client: only such ids are looked up when a
/// client's call brings results.
pub const CLIENT_CALL_PREFIX: &str = "call_sh_";

/// A new id for a call the client will run, unique across runs.
pub fn client_call_id() -> String {
    format!(
        "{CLIENT_CALL_PREFIX}{}",
        crate::ids::time_ordered().simple()
    )
}

/// Which surface submitted a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    V1,
    Runtime,
    Cli,
    /// Delegated by another agent's run (a subagent call).
    Agent,
}

impl Protocol {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::V1 => "v1",
            Self::Runtime => "runtime",
            Self::Cli => "cli",
            Self::Agent => "agent",
        }
    }
}

/// A request as a surface hands it over.
#[derive(Debug, Clone)]
pub struct NewRequest {
    /// `None`: the workspace's default agent (unless `workflow` is set).
    pub agent_id: Option<String>,
    /// Run this workflow instead of an agent (the request's `agentId` is then its name).
    pub workflow: Option<String>,
    /// `None`: a new session.
    pub session_id: Option<String>,
    /// What the request's transcript continues from in the session.
    pub history: History,
    /// Messages the transcript starts with, before any history (a Responses turn's
    /// instructions): stored with the request, never in the session.
    pub leading: Vec<Value>,
    /// A request whose input holds `leading` already, the same messages: of the same
    /// session (a Responses chain's turn before, or the one it names, [`held_leading`]), or
    /// with no session the one holding the transcript's first messages, which the runtime
    /// sets (`NamedTranscript::held_leading`). The input names it instead of holding them
    /// again ([`LEADING_OF`]).
    pub leading_held_by: Option<HeldLeading>,
    /// A later request may continue from this one's transcript (a stored Responses turn):
    /// when all its messages are stored in the session, its input names where they end
    /// ([`TRANSCRIPT_THROUGH`]).
    pub chainable: bool,
    /// The client key identity submitting it (SPEC section 4, ownership): it owns the
    /// request and, when new, the session.
    pub owner: String,
    /// OpenAI-style messages: with `sent` carrying on the turn before's, those after them.
    pub messages: Vec<Value>,
    /// A chat turn's messages as the client sent them, and what it carries on from the turn
    /// before whose sent messages its own start with, parsed (docs/profiling.md, the
    /// eighty-seventh pass; in a session, the eighty-eighth: those carried on hold the
    /// turn's `leading` messages).
    pub sent: Option<SentTranscript>,
    /// How many of the last messages (the carried ones included) are new to the session
    /// (they are stored in it).
    pub new_messages: usize,
    /// Generation options passed to the adapter (temperature, max_tokens, ...).
    pub options: Map<String, Value>,
    pub metadata: Value,
    pub protocol: Protocol,
    /// Wait for the request to be committed before `submit` returns. Surfaces that answer
    /// before the run ends need it; `/v1` answers after, and the journal keeps order anyway.
    pub durable_before_return: bool,
    /// The tools the client supplies and the results of calls it ran (`/v1` only).
    pub client: ClientTurn,
    /// Surface-specific data stored with the request's input (`/v1/responses`: the
    /// response's own fields), under `input.surface`.
    pub surface: Option<Value>,
}

impl NewRequest {
    /// The messages a chat turn carries on from the turn before put back before its own.
    pub fn take_back_carried(&mut self) {
        if let Some(mut sent) = self.sent.take() {
            self.messages = sent.take_back(std::mem::take(&mut self.messages));
        }
    }
}

/// What a request's transcript continues from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum History {
    /// Nothing: the request brings its whole transcript (`/v1/chat/completions` is
    /// stateless).
    Stateless,
    /// The session's newest leaf (the native API): the session must exist.
    SessionLeaf,
    /// The path through this message (a Responses chain: where the previous response's
    /// transcript ends). Whoever names it has checked it is the caller's.
    Through(String),
    /// The session's newest path as far as the request's messages begin with it
    /// ([`history::matching_prefix`]): a `/v1` client in a session sends its whole transcript
    /// each turn, and what the session holds already is named, not stored again. The rest
    /// of the messages are the request's own, stored under where the match ends (a branch
    /// where the client's transcript leaves the path); a transcript that shares nothing with
    /// the path is stored as [`History::Stateless`] stores it. The run is sent the messages
    /// as the client sent them.
    SessionPrefix,
}

/// What `submit` accepted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Submitted {
    pub request_id: String,
    pub run_id: String,
    pub session_id: String,
    pub agent_id: String,
    /// `running` when a slot was free at once, else `queued`.
    pub status: RunStatus,
}

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("agent `{0}` not found")]
    AgentNotFound(String),
    #[error("workflow `{0}` not found")]
    WorkflowNotFound(String),
    #[error("no agent given and the workspace has no defaultAgent")]
    NoDefaultAgent,
    #[error(
        "{running} runs are executing and {running} more are waiting (limits.maxConcurrentRuns); try again shortly"
    )]
    Busy { running: u32 },
    #[error("request `{0}` not found")]
    RequestNotFound(String),
    #[error("session `{0}` not found")]
    SessionNotFound(String),
    #[error("the store cannot write at the moment; try again shortly")]
    StoreUnavailable,
    #[error("approval `{0}` not found")]
    ApprovalNotFound(String),
    #[error("approval `{id}` was already decided: it is {status}")]
    ApprovalDecided { id: String, status: &'static str },
    #[error("request `{id}` has ended ({status}): there is nothing to cancel")]
    RequestEnded { id: String, status: &'static str },
    #[error("request `{id}` is {status}: only a failed or cancelled request can be retried")]
    NotRetryable { id: String, status: &'static str },
    #[error("message `{message}` is not in session `{session}`'s history")]
    MessageNotFound { session: String, message: String },
    #[error("the runtime is shutting down")]
    ShuttingDown,
    /// A budget or rate limit refused the request (429).
    #[error(transparent)]
    Spend(#[from] crate::spend::SpendError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Journal(#[from] JournalError),
}

/// The lifecycle service; clone it freely.
#[derive(Clone, Debug)]
pub struct Runtime {
    inner: Arc<Inner>,
}

/// The compiled workspace and what is built from it. A reload swaps it whole; a run keeps the
/// one it started with.
#[derive(Debug)]
pub struct Inventory {
    pub workspace: Arc<CompiledWorkspace>,
    pub gateway: ToolGateway,
}

#[derive(Debug)]
struct Inner {
    inventory: std::sync::RwLock<Arc<Inventory>>,
    store: Arc<dyn Store>,
    journal: Journal,
    /// Budgets and rate limits against the store's ledger.
    spend: crate::spend::Spend,
    hub: Arc<EventHub>,
    adapters: Adapters,
    /// Remote agents' tool callbacks: the live runs' tokens and call queues.
    callbacks: Arc<crate::gateway::callbacks::Callbacks>,
    /// The upstream HTTP client (health probes share it with the adapters).
    http: reqwest::Client,
    approvals: Arc<ApprovalWaiters>,
    /// Runs executing plus runs waiting for a slot.
    admission: Arc<Semaphore>,
    /// Runs parked on an approval, which give their admission place back
    /// (`limits.maxParkedRuns`).
    parked: Arc<Semaphore>,
    /// Runs executing.
    slots: Arc<Semaphore>,
    tasks: TaskTracker,
    /// Cancelled when the server starts shutting down: new requests are refused from then on
    /// (runs already admitted go on; see [`Runtime::stop_admitting`]).
    admitting_stopped: CancellationToken,
    shutdown: CancellationToken,
    /// The runs executing or waiting here, by request id.
    live: Mutex<IdMap<String, LiveRun>>,
    /// Cancelled at shutdown, once the leases were given back: the lease loop ends.
    leasing: CancellationToken,
    /// Held by a store maintenance pass (prune, backup): one at a time.
    maintenance: tokio::sync::Mutex<()>,
    /// Held while a retry checks a request's state and starts its run: one at a time here
    /// (across instances, the store's unique attempt number refuses a second).
    retrying: tokio::sync::Mutex<()>,
    /// Held by a reload: one at a time.
    reloading: tokio::sync::Mutex<()>,
    /// The newest history paths of recently continued sessions (up to eight branches of one).
    histories: history::Histories,
    /// Recent conversations' turns, for their next turns to go on from: digest states of
    /// those with no session, chat turns' messages as sent and parsed.
    carried_digests: carried_digests::CarriedDigests,
}

/// How long shutdown waits for handed-over runs to stop before giving their leases back.
const HAND_OVER_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// A run executing or waiting in this process.
#[derive(Debug)]
struct LiveRun {
    run_id: String,
    cancel: CancellationToken,
    /// Set when the run is given up here (its lease lost, or handed over at shutdown): from
    /// then on it writes nothing, so whoever claims it next starts from the stored state.
    handed_over: Arc<std::sync::atomic::AtomicBool>,
    /// Who cancelled the run (set once, before `cancel` fires); the run ends `cancelled`.
    cancelled_by: Arc<std::sync::OnceLock<String>>,
}

impl LiveRun {
    /// Stops the run here without a write: another instance (or the next start) resumes it.
    fn hand_over(&self) {
        self.handed_over
            .store(true, std::sync::atomic::Ordering::SeqCst);
        self.cancel.cancel();
    }

    /// Stops the run on an operator's word: it ends `cancelled`.
    fn cancel(&self, by: &str) {
        let _ = self.cancelled_by.set(by.to_owned());
        self.cancel.cancel();
    }
}

impl std::fmt::Debug for dyn Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe())
    }
}

impl Runtime {
    pub fn new(
        workspace: Arc<CompiledWorkspace>,
        store: Arc<dyn Store>,
        http: reqwest::Client,
    ) -> Self {
        let tasks = TaskTracker::new();
        let hub = Arc::new(EventHub::default());
        let redactor = Redactor::from_workspace(&workspace);
        let limit = workspace.runtime.limits.max_concurrent_runs as usize;
        let slots = Arc::new(Semaphore::new(limit));
        let journal = Journal::start_serving(
            Arc::clone(&store),
            Arc::clone(&hub),
            redactor.clone(),
            &tasks,
            journal::Executing {
                slots: Arc::clone(&slots),
                limit,
            },
        );
        let approvals = Arc::new(ApprovalWaiters::default());
        let gateway = ToolGateway::new(
            Arc::clone(&workspace),
            Arc::clone(&store),
            http.clone(),
            Arc::clone(&approvals),
            redactor,
        );
        let changes = store.changes();
        let runtime = Self {
            inner: Arc::new(Inner {
                leasing: CancellationToken::new(),
                adapters: Adapters::new(http.clone()),
                callbacks: Arc::default(),
                http,
                approvals,
                admission: Arc::new(Semaphore::new(limit.saturating_mul(2))),
                parked: Arc::new(Semaphore::new(
                    workspace.runtime.limits.max_parked_runs as usize,
                )),
                retrying: tokio::sync::Mutex::new(()),
                reloading: tokio::sync::Mutex::new(()),
                histories: history::Histories::within(workspace.runtime.limits.kept_history_bytes),
                // Chat turns keep their parsed messages as sessions' kept paths do: as much
                // again as those may hold.
                carried_digests: carried_digests::CarriedDigests::within(
                    workspace.runtime.limits.kept_history_bytes,
                ),
                slots,
                inventory: std::sync::RwLock::new(Arc::new(Inventory { workspace, gateway })),
                spend: crate::spend::Spend::new(Arc::clone(&store)),
                store,
                journal,
                hub,
                tasks,
                admitting_stopped: CancellationToken::new(),
                shutdown: CancellationToken::new(),
                live: Mutex::new(IdMap::default()),
                maintenance: tokio::sync::Mutex::new(()),
            }),
        };
        if let Some(changes) = changes {
            fanout::start(&runtime, changes);
        }
        runtime
    }

    /// The inventory new requests start with.
    pub fn inventory(&self) -> Arc<Inventory> {
        match self.inner.inventory.read() {
            Ok(inventory) => Arc::clone(&inventory),
            Err(poisoned) => Arc::clone(&poisoned.into_inner()),
        }
    }

    /// The workspace new requests start with.
    pub fn workspace(&self) -> Arc<CompiledWorkspace> {
        Arc::clone(&self.inventory().workspace)
    }

    /// The client to call out with from here: this thread's own on an HTTP shard
    /// ([`crate::net::client_here`]).
    pub fn http(&self) -> reqwest::Client {
        crate::net::client_here(&self.inner.http)
    }

    /// Remote agents' tool callbacks (the HTTP surface authorizes and queues them).
    pub fn callbacks(&self) -> &Arc<crate::gateway::callbacks::Callbacks> {
        &self.inner.callbacks
    }

    /// The tool gateway of the current inventory.
    pub fn with_gateway<T>(&self, use_it: impl FnOnce(&ToolGateway) -> T) -> T {
        use_it(&self.inventory().gateway)
    }

    pub fn store(&self) -> &Arc<dyn Store> {
        &self.inner.store
    }

    /// Budgets and rate limits (the admin API reads their state).
    pub fn spend(&self) -> &crate::spend::Spend {
        &self.inner.spend
    }

    /// The session history paths kept in memory and their estimated size (for `/metrics`).
    pub fn kept_histories(&self) -> (usize, usize) {
        self.inner.histories.held()
    }

    /// What the turn before of `owner` and `agent` carries on to a chat turn whose messages,
    /// as sent, start with its own, and where they end in `sent` ([`carried_digests`]).
    pub fn take_carried_transcript(
        &self,
        owner: &str,
        agent: &str,
        sent: &str,
    ) -> Option<(usize, CarriedTranscript)> {
        self.inner.carried_digests.take_sent(owner, agent, sent)
    }

    /// What is kept for conversations' next turns (digest states of those with no session,
    /// chat turns' messages), and its memory, estimated (for `/metrics`).
    pub fn carried_digests(&self) -> (usize, usize) {
        self.inner.carried_digests.held()
    }

    /// Whether the store accepts writes (for `/readyz`).
    pub fn store_available(&self) -> bool {
        self.inner.journal.is_available()
    }

    /// Persists a request and its first run, and starts the run.
    #[tracing::instrument(skip_all, fields(agent = request.agent_id.as_deref(), protocol = request.protocol.as_str()))]
    pub async fn submit(&self, request: NewRequest) -> Result<Submitted, RuntimeError> {
        Ok(self.submit_inner(request, None, false).await?.0)
    }

    async fn submit_inner(
        &self,
        mut request: NewRequest,
        follow: Option<Following>,
        await_view: bool,
    ) -> Result<(Submitted, Option<Subscription>, Option<AwaitedView>), RuntimeError> {
        let inner = &self.inner;
        // A run already executing may still hand work to a subagent during the drain: refusing
        // it would fail a run that the shutdown is waiting on to finish.
        if inner.admitting_stopped.is_cancelled() && request.protocol != Protocol::Agent {
            return Err(RuntimeError::ShuttingDown);
        }
        let workspace = self.workspace();
        // A chat turn carries messages on with no session (as its digest does) and in a
        // session whose path its transcript is matched with; any other takes the carried
        // ones back among its own.
        let carries = match request.history {
            History::Stateless => request.session_id.is_none(),
            History::SessionPrefix => true,
            History::SessionLeaf | History::Through(_) => false,
        };
        if !carries {
            request.take_back_carried();
        }
        // A chat turn in a session: its whole transcript as sent (its leading messages
        // first), shared with its run and kept with those bytes for the conversation's next
        // turn, which parses only what it adds (docs/profiling.md, the eighty-eighth pass).
        // One too short to be kept (4 KiB, as with no session) has nothing carried on to it
        // either, and is taken as it is.
        let sent_whole = match request.history {
            History::SessionPrefix => request.sent.take().and_then(|mut sent| {
                if sent.carried.is_none() && sent.sent.len() < named_transcripts::NAMED_FROM_BYTES {
                    return None;
                }
                let whole = sent.whole(&request.leading, std::mem::take(&mut request.messages));
                Some((sent.sent, whole))
            }),
            _ => None,
        };
        let leading_count = request.leading.len();
        // The transcript after its leading messages.
        let sent_messages: &[Value] = match &sent_whole {
            Some((_, whole)) => whole.history.get(leading_count..).unwrap_or_default(),
            None => &request.messages,
        };
        // Where the carried messages after the leading ones end in this session, when the
        // turn before kept where: the session's path through there is they.
        let marked = sent_whole
            .as_ref()
            .and_then(|(_, whole)| match &whole.carried {
                Some((count, Some(mark)))
                    if request.session_id.as_deref() == Some(&*mark.session)
                        && *count == leading_count.saturating_add(mark.len) =>
                {
                    Some(mark)
                }
                _ => None,
            });
        // A workflow request is named by its workflow; its runs are its nodes.
        let workflow = match &request.workflow {
            Some(name) => Some(
                workspace
                    .workflows
                    .get(name)
                    .ok_or_else(|| RuntimeError::WorkflowNotFound(name.clone()))?,
            ),
            None => None,
        };
        let agent_id = match (workflow, request.agent_id) {
            (Some(workflow), _) => workflow.name.clone(),
            (None, Some(agent_id)) => agent_id,
            (None, None) => workspace
                .runtime
                .default_agent
                .clone()
                .ok_or(RuntimeError::NoDefaultAgent)?,
        };
        if workflow.is_none() && !workspace.agents.contains_key(&agent_id) {
            return Err(RuntimeError::AgentNotFound(agent_id));
        }
        if !inner.journal.is_available() {
            return Err(RuntimeError::StoreUnavailable);
        }
        // A session belongs to whoever created it: to anyone else it does not exist. Only a
        // surface that continues a stored history needs it to exist already.
        let with_history = match request.history {
            History::SessionLeaf => true,
            History::SessionPrefix => answered(sent_messages),
            History::Stateless | History::Through(_) => false,
        };
        let store = inner.store.as_ref();
        let mut session_history = None;
        let mut known_len = None;
        if let Some(id) = &request.session_id {
            let marked_id = marked.map(|mark| mark.through.as_str());
            match session_read(
                store,
                &inner.histories,
                id,
                &request.owner,
                with_history,
                marked_id,
            )
            .await?
            {
                (Some(session), ..) if session.owner != request.owner => {
                    return Err(RuntimeError::SessionNotFound(id.clone()));
                }
                (None, ..) if request.history == History::SessionLeaf => {
                    return Err(RuntimeError::SessionNotFound(id.clone()));
                }
                (_, history, marked_len) => {
                    session_history = history;
                    // The carried messages are the path as far as the mark: only what
                    // follows is compared.
                    known_len = marked
                        .map(|mark| mark.len)
                        .filter(|len| marked_len == Some(*len));
                }
            }
        }
        let permit = Arc::clone(&inner.admission)
            .try_acquire_owned()
            .map_err(|_| RuntimeError::Busy {
                running: workspace.runtime.limits.max_concurrent_runs,
            })?;

        let now = Utc::now();
        let fresh_session = request.session_id.is_none();
        let session_id = request.session_id.unwrap_or_else(|| new_id("ses"));
        let charge_session =
            charge_session(request.protocol.as_str(), &request.metadata, &session_id);
        // Budgets with no room left and exhausted rate limits refuse the request before
        // anything is stored.
        if workspace.runtime.has_spend_limits() {
            let key_labels = workspace.key_labels(&request.owner);
            let payer = crate::spend::Payer {
                key: &request.owner,
                key_labels: &key_labels,
                agent: &agent_id,
                session: &charge_session,
            };
            inner
                .spend
                .admit(&workspace, &payer, request.protocol != Protocol::Agent)
                .await?;
        }
        // The history is the path from the session's newest leaf (a new session has none):
        // a concurrent turn of the same session is a sibling branch, never part of it.
        let (leaf, history, own_from) = match (&request.history, session_history) {
            // The history is shared with the path kept for the session's next turn, not
            // copied for the run (docs/profiling.md, the eightieth pass).
            (History::SessionLeaf, Some((leaf, history))) => (Some(leaf), Some(history), 0),
            (History::Through(through), _) => {
                let history = inner
                    .histories
                    .shared_path(store, &session_id, through)
                    .await?;
                (Some(through.clone()), Some(history), 0)
            }
            (History::SessionPrefix, Some(newest)) => {
                let histories = &inner.histories;
                let (leaf, path) = (newest.0.clone(), Arc::clone(&newest.1));
                // Carried messages known to be the path's first compare only what follows.
                let known = known_len.unwrap_or(0);
                crate::metrics::session_transcript_match(if known > 0 {
                    "carried"
                } else {
                    "whole"
                });
                match matching_path(store, histories, &session_id, newest, sent_messages, known)
                    .await?
                {
                    Some((through, matched)) => {
                        // A transcript continuing from the newest path's end is the next
                        // turn of the request that stored its last message: its leading
                        // messages, when they are that turn's, are named, not stored again.
                        if through == leaf
                            && matched == path.len()
                            && let Some(previous) = path.last_request()
                        {
                            // A failed read only stores them again.
                            request.leading_held_by = leading_held_before(
                                store,
                                previous,
                                &session_id,
                                &request.leading,
                            )
                            .await
                            .unwrap_or_else(|error| {
                                tracing::warn!(%error, previous, "could not read the request a turn's leading messages may be held by");
                                None
                            });
                        }
                        (Some(through), None, matched)
                    }
                    None => (None, None, 0),
                }
            }
            _ => (None, None, 0),
        };
        // The request's own messages; those before them are the history the session holds
        // (a session's chat turn's stay in its whole transcript, below).
        let mut own = match &sent_whole {
            Some(_) => Vec::new(),
            None => request.messages.split_off(own_from),
        };
        // A conversation with no session names the request holding its transcript's first
        // messages when an earlier turn stored them (docs/profiling.md, the eighty-third
        // pass), and its run shares the messages with their text, written once.
        let (named, own_shared) = match (&request.history, fresh_session) {
            (History::Stateless, true) => {
                let window = workspace
                    .agents
                    .get(&agent_id)
                    .and_then(|agent| agent.retention)
                    .or(workspace.runtime.retention.requests);
                let (owner, own) = (&request.owner, std::mem::take(&mut own));
                let leading = &request.leading;
                let carried = &inner.carried_digests;
                let sent = request.sent.take();
                let (named, shared) = named_transcripts::named(
                    store, carried, owner, &agent_id, window, leading, own, sent,
                )
                .await;
                // Its leading messages are named where its first messages are, when the same
                // (the eighty-fourth pass).
                request.leading_held_by = named.held_leading();
                (Some(named), Some(shared))
            }
            _ => (None, None),
        };
        // A session's chat turn's whole transcript is its run's (and is kept, below).
        let (whole, to_keep) = match sent_whole {
            Some((sent, whole)) => (
                Some(Arc::new(whole.history)),
                Some((sent, whole.parsed_bytes)),
            ),
            None => (None, None),
        };
        let mut parent_id = leaf;
        let mut rest = std::mem::take(&mut request.messages);
        let messages = match (&own_shared, &whole) {
            (Some(shared), _) => {
                Transcript::new(request.leading.clone(), Some(Arc::clone(shared)), rest)
            }
            // Its leading messages are its first.
            (None, Some(whole)) => Transcript::new(Vec::new(), Some(Arc::clone(whole)), rest),
            (None, None) => {
                rest.extend(own.iter().cloned());
                Transcript::new(request.leading.clone(), history, rest)
            }
        };
        let own: &[Value] = match (&own_shared, &whole) {
            (Some(shared), _) => shared,
            (None, Some(whole)) => whole
                .get(leading_count.saturating_add(own_from)..)
                .unwrap_or_default(),
            (None, None) => &own,
        };

        let request_id = new_id("req");
        let run_id = new_id("run");
        // With a slot free the run starts now: store it as running and skip a status update.
        let slot = Arc::clone(&inner.slots).try_acquire_owned().ok();
        let status = if slot.is_some() {
            RunStatus::Running
        } else {
            RunStatus::Queued
        };
        let mut ops = vec![WriteOp::TouchSession(SessionRecord {
            id: session_id.clone(),
            agent_id: agent_id.clone(),
            owner: request.owner.clone(),
            metadata: json!({}),
            created_at: now,
            updated_at: now,
        })];
        // The input is what the request brought; history the session holds already is named
        // by its last message, never copied (a long session would store it again per turn).
        let mut input = match &parent_id {
            Some(through) => {
                json!({ "messages": own, "options": request.options, HISTORY_THROUGH: through })
            }
            None => json!({ "options": request.options }),
        };
        if parent_id.is_none() {
            let held = named.as_ref().map_or(0, |named| named.store_in(&mut input));
            input["messages"] = json!(&own[held..]);
        }
        match request.leading_held_by {
            _ if request.leading.is_empty() => {}
            Some(held) => {
                input[LEADING_OF] = Value::String(held.request);
                input[LEADING_DIGEST] = Value::String(held.digest);
            }
            None => input[LEADING] = Value::Array(request.leading),
        }
        // The ids of the messages stored in the session, known before the input names the
        // last of them.
        // A transcript matched with the session's path is new to it after the match; one that
        // shares nothing with it is stored as a chat with no session is (the session holds
        // only its last turn, from a new root), never twice.
        let first_new = if request.history == History::SessionPrefix && parent_id.is_some() {
            0
        } else {
            own.len().saturating_sub(request.new_messages)
        };
        let stored_ids: Vec<String> = own[first_new..].iter().map(|_| new_id("msg")).collect();
        if request.chainable && first_new == 0 {
            let end = stored_ids.last().or(parent_id.as_ref());
            if let Some(end) = end {
                input[TRANSCRIPT_THROUGH] = Value::String(end.clone());
            }
        }
        request.client.store_in(&mut input);
        if let Some(workflow) = workflow {
            input["workflow"] = Value::String(workflow.name.clone());
        }
        if let Some(surface) = request.surface {
            input["surface"] = surface;
        }
        let metadata = request.metadata.clone();
        ops.push(WriteOp::InsertRequest(RequestRecord {
            id: request_id.clone(),
            session_id: session_id.clone(),
            agent_id: agent_id.clone(),
            protocol: request.protocol.as_str().to_owned(),
            owner: request.owner.clone(),
            status,
            input,
            output: None,
            error: None,
            usage: None,
            metadata: request.metadata,
            created_at: now,
            updated_at: now,
        }));
        for (message, id) in own[first_new..].iter().zip(stored_ids) {
            ops.push(WriteOp::InsertMessage(MessageRecord {
                id: id.clone(),
                session_id: session_id.clone(),
                parent_id: parent_id.replace(id),
                request_id: Some(request_id.clone()),
                role: message
                    .get("role")
                    .and_then(Value::as_str)
                    .unwrap_or("user")
                    .to_owned(),
                content: message.clone(),
                created_at: now,
            }));
        }
        // A session's chat turn's whole transcript is kept for the conversation's next turn
        // to carry on; with where its messages end in the session when all its own are stored
        // below the path they matched (the path through the last is they).
        if let (Some(whole), Some((sent, parsed_bytes))) = (&whole, to_keep) {
            // A message the store keeps redacted is not what was sent: matched whole, the
            // next turn leaves the path there, and so it must with the mark.
            let stored_as_sent = || first_new == 0 && !inner.journal.would_redact(own);
            let mark = parent_id
                .clone()
                .filter(|_| stored_as_sent())
                .map(|through| SessionMark {
                    session: session_id.as_str().into(),
                    through,
                    len: whole.len().saturating_sub(leading_count),
                });
            inner.carried_digests.keep_sent(
                &request.owner,
                &agent_id,
                sent,
                Arc::clone(whole),
                parsed_bytes,
                None,
                mark,
            );
        }
        // A workflow starts at its entry node, with the request's input; an agent's run
        // takes the transcript as it is.
        let entry = workflow.and_then(|w| w.node(&w.entry));
        let (node, run_messages) = match workflow {
            None => (None, messages),
            Some(workflow) => {
                let job = workflow::NodeJob {
                    workflow: workflow.name.clone(),
                    node: workflow.entry.clone(),
                    step: 1,
                    last_output: None,
                    original: messages.into_vec(),
                };
                let input = match entry {
                    Some(entry) if workflow::node_agent(entry).is_some() => job.input(entry),
                    _ => Vec::new(),
                };
                (Some(job), Transcript::from(input))
            }
        };
        let run_agent = match entry.and_then(workflow::node_agent) {
            Some(agent) => agent.to_owned(),
            None => agent_id.clone(),
        };
        ops.push(WriteOp::InsertRun(RunRecord {
            state: node.as_ref().map(|job| job.state(&run_messages)),
            started_at: slot.is_some().then_some(now),
            ..RunRecord::new(run_id.clone(), request_id.clone(), 1, status, now)
        }));
        if let Some(job) = &node {
            let event = |event_type: &str, data: Value| {
                WriteOp::AppendEvent(EventRecord {
                    id: new_id("evt"),
                    request_id: request_id.as_str().into(),
                    run_id: run_id.as_str().into(),
                    session_id: session_id.as_str().into(),
                    agent_id: agent_id.as_str().into(),
                    seq: 0,
                    event_type: event_type.to_owned(),
                    at: now,
                    data,
                })
            };
            ops.push(event(
                workflow::WORKFLOW_STARTED,
                json!({ "workflowId": job.workflow, "entry": job.node }),
            ));
            ops.push(event(
                workflow::NODE_STARTED,
                json!({ "workflowId": job.workflow, "node": job.node, "step": 1, "runId": run_id }),
            ));
        }
        // A live follower is known before the first write, so that every write of the
        // request commits as it comes.
        let streamed = (follow == Some(Following::Live)).then(|| inner.hub.stream(&request_id));
        // Subscribed before the first write, too: if the store refuses a submit nobody waits
        // on, the journal closes the request's channel, and the follower must hold it by then.
        let live = follow.map(|_| inner.hub.subscribe(&request_id));
        // The view at the end is read next to its commit, with every other view awaited at
        // the ends that commit with it: in one hop to the embedded store's writer, in one
        // statement on PostgreSQL, where each waiter read its own (the fortieth pass).
        let view = await_view.then(|| inner.hub.await_view(&request_id));
        // Session, request, messages and run commit in one transaction. Surfaces that answer
        // before the run ends (202) wait for that commit: accepted means durable. The others
        // hold it for the run's first write that commits: a request whose model answers at
        // once is one transaction, not two (the submit's commit, on a core the upstream
        // needed, cost more than it overlapped: docs/profiling.md, the ninth pass).
        let written = if request.durable_before_return {
            inner.journal.commit(Some(&request_id), ops).await
        } else {
            inner.journal.write_submit(Some(&request_id), ops).await
        };
        if let Err(error) = written {
            drop(live);
            inner.hub.release(&request_id);
            return Err(error.into());
        }

        let submitted = Submitted {
            request_id,
            run_id,
            session_id,
            agent_id,
            status,
        };
        let live = live.map(|live| Subscription { live, streamed });
        let own_from = run_messages.len();
        self.start_run(run::RunJob {
            submitted: Submitted {
                agent_id: run_agent,
                ..submitted.clone()
            },
            messages: run_messages,
            own_from,
            node,
            options: request.options,
            client: request.client,
            parent_message_id: parent_id,
            metadata,
            owner: request.owner,
            charge_session,
            resumed: false,
            attempt: 1,
            cancel_by: None,
            cannot_resume: None,
            permit: Some(permit),
            slot,
        });
        Ok((submitted, live, view))
    }

    fn start_run(&self, job: run::RunJob) {
        let run = LiveRun {
            run_id: job.submitted.run_id.clone(),
            cancel: self.inner.shutdown.child_token(),
            handed_over: Arc::new(std::sync::atomic::AtomicBool::new(false)),
            cancelled_by: Arc::new(std::sync::OnceLock::new()),
        };
        // A run claimed only to be ended: it stops before it does anything.
        if let Some(by) = &job.cancel_by {
            run.cancel(by);
        }
        let stop = run::Stop {
            cancel: run.cancel.clone(),
            handed_over: Arc::clone(&run.handed_over),
            cancelled_by: Arc::clone(&run.cancelled_by),
        };
        if let Ok(mut live) = self.inner.live.lock() {
            live.insert(job.submitted.request_id.clone(), run);
        }
        let runtime = self.clone();
        let inventory = self.inventory();
        // Boxed: a run's future is large, and a task's future is moved whole into the task,
        // and its stage overwritten whole when it ends (memcpy was ~1% of a request's CPU).
        self.inner.tasks.spawn(Box::pin(async move {
            let request_id = job.submitted.request_id.clone();
            let run_id = job.submitted.run_id.clone();
            run::execute(&runtime, &inventory, job, stop).await;
            // Only this run's entry: a retry may already have put the next attempt's there.
            if let Ok(mut live) = runtime.inner.live.lock()
                && live
                    .get(&request_id)
                    .is_some_and(|live| live.run_id == run_id)
            {
                live.remove(&request_id);
            }
        }));
    }

    /// Stored events of a request after `after`, then live ones, ending after the terminal
    /// event. Subscribes before reading the store, so nothing falls between the two.
    pub fn follow(&self, request_id: &str, after: i64, following: Following) -> EventStream {
        let subscription = self.subscribe(request_id, following);
        self.follow_with(request_id, after, subscription, true)
    }

    fn subscribe(&self, request_id: &str, following: Following) -> Subscription {
        Subscription {
            live: self.inner.hub.subscribe(request_id),
            streamed: (following == Following::Live).then(|| self.inner.hub.stream(request_id)),
        }
    }

    /// Submits a request and follows its events from the first one. The subscription is taken
    /// before the run starts, so every event arrives live and the store is only read to
    /// recover from a lagging subscriber.
    pub async fn submit_and_follow(
        &self,
        request: NewRequest,
        following: Following,
    ) -> Result<(Submitted, EventStream), RuntimeError> {
        let (submitted, events, _) = self.submit_following(request, following, false).await?;
        Ok((submitted, events))
    }

    /// [`Runtime::submit_and_follow`] to the end, with the request's view as it stands right
    /// after the commit of its end, read by the journal beside that commit (`None` when
    /// another instance committed the end, or the read failed). Take it once the events
    /// ended: the view is delivered before the terminal event is published.
    pub async fn submit_and_await_view(
        &self,
        request: NewRequest,
    ) -> Result<(Submitted, EventStream, Option<AwaitedView>), RuntimeError> {
        self.submit_following(request, Following::ToEnd, true).await
    }

    /// Submits and follows the request from its first event, with its view awaited at the
    /// end when `await_view`.
    async fn submit_following(
        &self,
        request: NewRequest,
        following: Following,
        await_view: bool,
    ) -> Result<(Submitted, EventStream, Option<AwaitedView>), RuntimeError> {
        let (submitted, subscription, view) = self
            .submit_inner(request, Some(following), await_view)
            .await?;
        let subscription =
            subscription.unwrap_or_else(|| self.subscribe(&submitted.request_id, following));
        let events = self.follow_with(&submitted.request_id, 0, subscription, false);
        Ok((submitted, events, view))
    }

    fn follow_with(
        &self,
        request_id: &str,
        after: i64,
        subscription: Subscription,
        replay_store: bool,
    ) -> EventStream {
        let inner = Arc::clone(&self.inner);
        let request_id = request_id.to_owned();
        let Subscription { mut live, streamed } = subscription;
        Box::pin(async_stream::try_stream! {
            let _release = ReleaseOnDrop { hub: Arc::clone(&inner.hub), request_id: request_id.clone() };
            let _streamed = streamed;
            let mut last = after;
            let mut ended = false;
            // Catch up from the store (unless subscribed before the run started).
            let mut replaying = replay_store;
            while replaying {
                let page = inner.store.events(&request_id, last, 500).await?;
                replaying = !page.is_empty();
                for event in page {
                    last = event.seq;
                    ended = events::is_terminal(&event.event_type);
                    yield Arc::new(event);
                }
            }
            while !ended {
                // Other instances write to a shared store: read it now and then, so a lost
                // notification costs latency, never an event.
                let received = if inner.store.is_shared() {
                    tokio::time::timeout(crate::store::SHARED_POLL, live.recv()).await.ok()
                } else {
                    Some(live.recv().await)
                };
                let Some(received) = received else {
                    // Nothing announced for a while: read the store in case a notification
                    // from another instance was lost.
                    for event in inner.store.events(&request_id, last, 500).await? {
                        last = event.seq;
                        ended = events::is_terminal(&event.event_type);
                        yield Arc::new(event);
                    }
                    continue;
                };
                let event = match received {
                    Ok(event) => event,
                    Err(error) => {
                        // Fell behind (`Lagged`), or the channel closed after the terminal
                        // event was published: either way the store has everything.
                        let closed = matches!(error, tokio::sync::broadcast::error::RecvError::Closed);
                        for event in inner.store.events(&request_id, last, 10_000).await? {
                            last = event.seq;
                            ended = events::is_terminal(&event.event_type);
                            yield Arc::new(event);
                        }
                        if closed && !ended {
                            // Closed with no end stored: the store refused the request.
                            Err(StoreError::Writer(REQUEST_NOT_STORED.to_owned()))?;
                        }
                        if closed { break; }
                        continue;
                    }
                };
                if event.seq <= last { continue; }
                if event.seq > last + 1 {
                    // Published out of order with a concurrent catch-up: fill the gap from the store.
                    for missed in inner.store.events(&request_id, last, event.seq - last - 1).await? {
                        yield Arc::new(missed);
                    }
                }
                last = event.seq;
                ended = events::is_terminal(&event.event_type);
                yield event;
            }
        })
    }

    /// Waits for a request to end, however long it waits on approvals, up to `limit`.
    pub async fn wait_until_ended(
        &self,
        request_id: &str,
        limit: std::time::Duration,
    ) -> Result<RequestRecord, RuntimeError> {
        self.wait_watching(request_id, limit, limit).await
    }

    /// Follows `events` (a request's, from [`Runtime::submit_and_follow`]) until the request
    /// ends, `limit` passes, or a call of it has waited `protocols.openai.approvalWait` on an
    /// approval. Reads nothing from the store.
    pub async fn wait_followed(
        &self,
        events: EventStream,
        limit: std::time::Duration,
    ) -> Result<(), RuntimeError> {
        let approval_wait = self.workspace().runtime.openai.approval_wait;
        watch_to_end(ApprovalWatch::new(events, approval_wait), limit).await
    }

    /// Follows a request until it ends, `limit` passes, or a call has waited `approval_wait`
    /// on an approval; then reads its record.
    async fn wait_watching(
        &self,
        request_id: &str,
        limit: std::time::Duration,
        approval_wait: std::time::Duration,
    ) -> Result<RequestRecord, RuntimeError> {
        let events =
            ApprovalWatch::new(self.follow(request_id, 0, Following::ToEnd), approval_wait);
        watch_to_end(events, limit).await?;
        self.inner
            .store
            .request(request_id)
            .await?
            .ok_or_else(|| RuntimeError::RequestNotFound(request_id.to_owned()))
    }

    /// Refuses new requests from now on: `submit` answers [`RuntimeError::ShuttingDown`]
    /// (503 `shutting_down`). Runs already admitted go on. Called at the shutdown signal,
    /// before HTTP drains, so a request still in flight cannot start a run the shutdown would
    /// then wait on. Idempotent.
    pub fn stop_admitting(&self) {
        self.inner.admitting_stopped.cancel();
    }

    /// Stops admitting requests and waits up to `grace` for the runs actively executing (those
    /// holding an execution slot) to finish. A run parked on an approval holds no slot and is
    /// not waited on: it stays `waiting_approval` in the store, as do runs still going when the
    /// grace runs out (`running`) or still waiting for a slot (`queued`). Those are handed
    /// over: stopped here without a write, their leases given back, so another instance (or
    /// the next start) resumes them at once. Everything queued for the store is committed
    /// before this returns.
    pub async fn shutdown(&self, grace: std::time::Duration) {
        self.stop_admitting();
        self.inner.tasks.close();
        let slots = self.workspace().runtime.limits.max_concurrent_runs as usize;
        let idle = async {
            // A slot given back goes straight to a run waiting for one, so every slot free
            // means nothing is executing and nothing is about to.
            while self.inner.slots.available_permits() < slots {
                tokio::time::sleep(std::time::Duration::from_millis(25)).await;
            }
        };
        if tokio::time::timeout(grace, idle).await.is_err() {
            tracing::warn!("runs still executing at shutdown; they resume at the next start");
        }
        // What still runs here (parked on approvals, or past the grace) is handed over: it
        // stops without writing, and its lease is given back below.
        self.hand_over_live_runs();
        let stopped = async {
            while self.live_runs() > 0 {
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
        };
        let _ = tokio::time::timeout(HAND_OVER_WAIT, stopped).await;
        if let Err(error) = self.inner.journal.flush().await {
            tracing::error!(%error, "could not flush the store journal at shutdown");
        }
        self.release_leases().await;
    }

    /// Approves or denies a pending approval, and wakes the call waiting on it (the run
    /// resumes from the store on whichever instance holds it). Deciding twice is an error.
    pub async fn decide_approval(
        &self,
        approval_id: &str,
        approve: bool,
        reason: Option<String>,
        decided_by: &str,
    ) -> Result<ApprovalRecord, RuntimeError> {
        // An approval is inserted through the journal: commit what is queued so that a
        // decision right after `runtime.approval.requested` finds it.
        self.inner.journal.flush().await?;
        let approval = self
            .inner
            .store
            .approval(approval_id)
            .await?
            .ok_or_else(|| RuntimeError::ApprovalNotFound(approval_id.to_owned()))?;
        let decision = ApprovalDecision {
            id: approval_id.to_owned(),
            status: if approve {
                ApprovalStatus::Approved
            } else {
                ApprovalStatus::Denied
            },
            reason,
            decided_by: decided_by.to_owned(),
            at: Utc::now(),
        };
        self.decide(&approval, decision).await
    }

    /// Takes `decision` about `approval`: the approval row and its `runtime.approval.resolved`
    /// event commit in one transaction, through the journal, and only while the approval is
    /// still pending (else [`RuntimeError::ApprovalDecided`]). The waiting call is woken.
    pub(crate) async fn decide(
        &self,
        approval: &ApprovalRecord,
        decision: ApprovalDecision,
    ) -> Result<ApprovalRecord, RuntimeError> {
        let event = EventRecord {
            id: new_id("evt"),
            request_id: approval.request_id.as_str().into(),
            run_id: approval.run_id.as_str().into(),
            session_id: approval.session_id.as_str().into(),
            agent_id: approval.agent_id.as_str().into(),
            seq: 0,
            event_type: events::APPROVAL_RESOLVED.to_owned(),
            at: decision.at,
            data: json!({
                "approvalId": approval.id,
                "kind": approval.kind,
                "toolId": approval.tool_id,
                "toolCallId": approval.tool_call_id,
                "callKey": approval.call_key,
                "decision": decision.status,
                "reason": decision.reason,
                "decidedBy": decision.decided_by,
            }),
        };
        let mut decided = approval.clone();
        decided.status = decision.status;
        decided.reason = decision.reason.clone();
        decided.decided_by = Some(decision.decided_by.clone());
        decided.decided_at = Some(decision.at);
        let ops = vec![
            WriteOp::DecideApproval(decision),
            WriteOp::AppendEvent(event),
        ];
        match self.inner.journal.commit(None, ops).await {
            Ok(()) => {}
            Err(JournalError::Conflict(_)) => {
                let status = match self.inner.store.approval(&approval.id).await? {
                    Some(current) => current.status.as_str(),
                    None => "gone",
                };
                return Err(RuntimeError::ApprovalDecided {
                    id: approval.id.clone(),
                    status,
                });
            }
            Err(error) => return Err(error.into()),
        }
        self.inner.approvals.notify(&approval.id);
        Ok(decided)
    }

    /// The number of runs executing or waiting (for health and tests).
    pub fn live_runs(&self) -> usize {
        self.inner.live.lock().map(|live| live.len()).unwrap_or(0)
    }
}

/// Takes a request's events until it ends, `limit` passes or a call waited on an approval.
async fn watch_to_end(
    mut events: ApprovalWatch,
    limit: std::time::Duration,
) -> Result<(), RuntimeError> {
    let finished = tokio::time::timeout(limit, async {
        loop {
            match events.next().await {
                Watched::Event(_) => {}
                Watched::Ended | Watched::StillPending(_) => return Ok(()),
                Watched::Failed(error) => return Err(error),
            }
        }
    })
    .await;
    Ok(finished.unwrap_or(Ok(()))?)
}

/// What a follower of a request needs of its events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Following {
    /// Each event as soon as it is stored (a stream shown as it comes): the request's writes
    /// commit as they come.
    Live,
    /// The end (an answer rendered whole, a wait): the request's writes that nobody waits
    /// on may wait for its next commit, so that most requests commit once.
    ToEnd,
}

/// A follower's live subscription, and the mark that makes its request streamed.
struct Subscription {
    live: tokio::sync::broadcast::Receiver<Arc<EventRecord>>,
    streamed: Option<Streamed>,
}

struct ReleaseOnDrop {
    hub: Arc<EventHub>,
    request_id: String,
}

impl Drop for ReleaseOnDrop {
    fn drop(&mut self) {
        self.hub.release(&self.request_id);
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::{HeldLeading, LEADING, LEADING_DIGEST, LEADING_OF, held_leading, leading_digest};
    use crate::store::test_records::request;

    /// A turn's leading messages are held by the turn before when its input holds the same,
    /// or by the request that one names in its session when their digests agree; anything
    /// else is its own.
    #[test]
    fn leading_messages_are_held_by_the_turn_before_or_the_request_it_names() {
        let rules = vec![json!({ "role": "system", "content": "Be brief." })];
        let other = vec![json!({ "role": "system", "content": "Be long." })];
        let mut holder = request("req_1", "ses_1");
        holder.input = json!({ LEADING: rules });
        let held = held_leading(&holder, &rules);
        assert_eq!(
            held,
            Some(HeldLeading {
                request: "req_1".into(),
                digest: leading_digest(&rules),
            })
        );
        assert_eq!(held_leading(&holder, &other), None);
        assert_eq!(held_leading(&holder, &[]), None);

        let mut naming = request("req_2", "ses_1");
        naming.input = json!({ LEADING_OF: "req_1", LEADING_DIGEST: leading_digest(&rules) });
        assert_eq!(
            held_leading(&naming, &rules).map(|h| h.request),
            Some("req_1".into())
        );
        assert_eq!(held_leading(&naming, &other), None);
        assert_eq!(held_leading(&request("req_3", "ses_1"), &rules), None);
        // A turn with no session naming them where its first messages are (another
        // session's request) is not followed: nothing would keep that one for this session.
        naming.input[crate::store::PREFIX_OF] = json!("req_1");
        assert_eq!(held_leading(&naming, &rules), None);
        assert_ne!(leading_digest(&rules), leading_digest(&other));
        assert_eq!(leading_digest(&rules).len(), 64);
        // The digest of the messages' text as serde writes it, as earlier builds stored it.
        let odd = vec![json!({ "role": "system", "content": "q\"\\ \n\u{1} é", "n": 1.5 })];
        let text = serde_json::to_string(&odd).unwrap();
        assert_eq!(leading_digest(&odd), crate::memory::sha256_hex(&text));
    }
}
