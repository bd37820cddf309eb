//! The history a run starts from: a session's path through a message, read from the store,
//! with the newest path of each recently continued session kept in memory.
//!
//! A path never changes once written: messages are immutable and only pruned with their
//! whole session. So a kept path is as good as one read, and the next turn of the same
//! conversation reads only the messages below it (its own, and the answer before it) instead
//! of the whole conversation again: a turn's history costs what the turn added, not what the
//! conversation holds (docs/profiling.md, the seventy-eighth pass). Several instances keep
//! their own; none can be stale, since what a path holds never changes.
//!
//! A session may hold several conversations at once (one `user` with two chats open, each
//! client sending its whole transcript): each is a branch of the session's message tree, and
//! a few branches of a session are kept, so that a transcript that leaves the session's
//! newest path is matched with the branch it continues (the eighty-first pass).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::adapters::SharedHistory;
use crate::store::{PathBelow, Store, StoreError};

/// The most the kept paths hold by default (`limits.keptHistoryBytes`), by their estimated
/// size in memory, their messages' JSON text included (a third of it: 16 MiB held the
/// messages alone before their text was kept). One path may hold half of it at most: a
/// longer one is read whole each time, so that two sessions' paths at least fit.
pub const DEFAULT_KEPT_HISTORY_BYTES: u64 = 24 << 20;
/// The most paths kept, all sessions' branches together.
const MOST_PATHS: usize = 1024;
/// The most branches of one session kept: its conversations going on at once (one more
/// than the conversations taking turns, since a turn's read keeps the newest path as well).
const MOST_BRANCHES: usize = 8;
/// Shorter paths are read whole each time: a few rows, cheaper than keeping them.
const LEAST_KEPT: usize = 32;
/// How long a kept path must have gone unused before a session not kept may take its place.
/// More conversations going on at once than the budget holds would otherwise take each
/// other's places turn after turn, each turn reading its whole history and copying it once
/// more to keep it: the conversations kept stay kept while they go on.
const IDLE_BEFORE_REPLACED: Duration = Duration::from_secs(30);

/// The kept paths, by session; the least recently used go first when a bound is reached.
pub(crate) struct Histories {
    kept: Mutex<Kept>,
    /// The most the kept paths hold, by their estimated size.
    budget_bytes: usize,
    idle_before_replaced: Duration,
}

impl Default for Histories {
    fn default() -> Self {
        Self::within(DEFAULT_KEPT_HISTORY_BYTES)
    }
}

#[derive(Default)]
struct Kept {
    /// By session: its branches, at most [`MOST_BRANCHES`].
    paths: HashMap<String, Vec<KeptPath>>,
    /// The branches kept, all sessions' together, and their estimated size.
    count: usize,
    bytes: usize,
    clock: u64,
}

struct KeptPath {
    /// The message the path goes through (its last).
    through: String,
    messages: Arc<SharedHistory>,
    bytes: usize,
    /// When it was last used, in order and in time.
    used: u64,
    used_at: Instant,
}

/// A kept path as a turn takes it: where it ends, its messages and their estimated size.
pub(crate) type KeptPrefix = (String, Arc<SharedHistory>, usize);

/// Where a kept path ends: the message a read of what is below it stops at.
pub(crate) fn known(kept: &Option<KeptPrefix>) -> Option<&str> {
    kept.as_ref().map(|(through, _, _)| through.as_str())
}

impl Histories {
    /// Kept paths holding at most `budget_bytes`, by their estimated size.
    pub(crate) fn within(budget_bytes: u64) -> Self {
        Self {
            kept: Mutex::default(),
            budget_bytes: usize::try_from(budget_bytes).unwrap_or(usize::MAX),
            idle_before_replaced: IDLE_BEFORE_REPLACED,
        }
    }

    /// The contents of the path through `through`, root first, shared with what is kept: the
    /// part below the path kept for `session` read from the store, when the path passes
    /// through it, else all of it. The result is kept for the session's next turn.
    pub(crate) async fn shared_path(
        &self,
        store: &dyn Store,
        session: &str,
        through: &str,
    ) -> Result<Arc<SharedHistory>, StoreError> {
        let kept = self.kept_path(session);
        let read = store.message_path_below(through, known(&kept)).await?;
        Ok(self.joined(session, through, kept, read))
    }

    /// The path through `through`: `read` below the `kept` path ([`Histories::kept_path`]
    /// before the read) when it passes through it, else `read` alone; kept for the session's
    /// next turn when it may be.
    pub(crate) fn joined(
        &self,
        session: &str,
        through: &str,
        kept: Option<KeptPrefix>,
        read: PathBelow,
    ) -> Arc<SharedHistory> {
        // Only a kept path extended takes its own place; a new branch must find room.
        let was_kept = kept.is_some() && read.below_known;
        let (mut messages, prefix_bytes) = match kept {
            Some((known, prefix, prefix_bytes)) if read.below_known => {
                if read.messages.is_empty() {
                    // The kept path itself: nothing to keep anew.
                    return prefix;
                }
                // The kept path is extended into the new one: taken out, and when no other
                // turn holds it, extended where it is instead of copied.
                self.forget(session, &known);
                let messages = Arc::unwrap_or_clone(prefix);
                (messages, prefix_bytes)
            }
            _ => (SharedHistory::default(), 0),
        };
        let below_from = messages.len();
        if let Some(last) = read.messages.last() {
            messages.set_last_request(last.request_id.clone());
        }
        messages.extend(read.messages.into_iter().map(|m| m.content));
        if messages.len() < LEAST_KEPT {
            return Arc::new(messages);
        }
        // Sized only when it may be kept: a short history is not.
        let bytes = messages[below_from..]
            .iter()
            .map(kept_bytes)
            .fold(prefix_bytes, usize::saturating_add);
        if bytes > self.budget_bytes / 2 {
            crate::metrics::history_not_kept("too_long");
            return Arc::new(messages);
        }
        self.keep(session, through, Arc::new(messages), bytes, was_kept)
            .unwrap_or_else(|refused| {
                crate::metrics::history_not_kept("no_room");
                refused
            })
    }

    /// The kept paths, locked (a panic elsewhere while it was held left nothing half-done:
    /// each change is whole before the lock is let go).
    fn lock(&self) -> std::sync::MutexGuard<'_, Kept> {
        self.kept
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Takes out the branch of `session` through `known`, if it is still kept.
    fn forget(&self, session: &str, known: &str) {
        let mut kept = self.lock();
        drop(kept.remove(session, |path| path.through == known));
    }

    /// The branch of `session` used last (most often its newest path, which a turn
    /// continuing the session's newest leaf reads below): where it ends, its messages and
    /// their estimated size.
    pub(crate) fn kept_path(&self, session: &str) -> Option<KeptPrefix> {
        self.lock().take_branch(session, |branches| {
            branches
                .iter()
                .max_by_key(|path| path.used)
                .map(|path| path.through.clone())
        })
    }

    /// The longest branch of `session` that `sent` starts with whole ([`matching_prefix`]):
    /// the conversation a client's transcript continues, when it is one of those kept. The
    /// branches are compared outside the lock, which every session's turns share.
    pub(crate) fn kept_branch_under(&self, session: &str, sent: &[Value]) -> Option<KeptPrefix> {
        let branches: Vec<(String, Arc<SharedHistory>)> = self
            .lock()
            .paths
            .get(session)?
            .iter()
            .map(|path| (path.through.clone(), Arc::clone(&path.messages)))
            .collect();
        let (through, _) = branches
            .into_iter()
            .filter(|(_, messages)| {
                !messages.is_empty() && matching_prefix(messages, sent) == messages.len()
            })
            .max_by_key(|(_, messages)| messages.len())?;
        self.lock().take_branch(session, |_| Some(through))
    }

    /// Keeps `messages` as the path of `session`, the least recently used paths making room;
    /// a session not kept before takes only the room of paths idle for
    /// [`IDLE_BEFORE_REPLACED`], else it is refused and its messages handed back. What is
    /// kept is handed back too, shared.
    fn keep(
        &self,
        session: &str,
        through: &str,
        messages: Arc<SharedHistory>,
        bytes: usize,
        was_kept: bool,
    ) -> Result<Arc<SharedHistory>, Arc<SharedHistory>> {
        // Paths let go of are freed after the lock (declared first, dropped last).
        let mut gone = Vec::new();
        let mut kept = self.lock();
        let (budget, idle) = (self.budget_bytes, self.idle_before_replaced);
        if !was_kept && !kept.room_for(session, through, bytes, budget, idle) {
            return Err(messages);
        }
        kept.clock += 1;
        let used = kept.clock;
        // The same path kept before, and the session's least recently used branch when it
        // has as many as it may keep, make room first.
        gone.extend(kept.remove(session, |path| path.through == through));
        if kept.paths.get(session).map_or(0, Vec::len) >= MOST_BRANCHES {
            gone.extend(kept.remove_oldest(Some(session)));
        }
        while kept.count > 0
            && (kept.count >= MOST_PATHS || kept.bytes.saturating_add(bytes) > self.budget_bytes)
        {
            match kept.remove_oldest(None) {
                Some(evicted) => gone.push(evicted),
                None => break,
            }
        }
        kept.bytes = kept.bytes.saturating_add(bytes);
        kept.count += 1;
        kept.paths
            .entry(session.to_owned())
            .or_default()
            .push(KeptPath {
                through: through.to_owned(),
                messages: Arc::clone(&messages),
                bytes,
                used,
                used_at: Instant::now(),
            });
        Ok(messages)
    }

    /// The paths kept and their estimated size.
    pub(crate) fn held(&self) -> (usize, usize) {
        let kept = self.lock();
        (kept.count, kept.bytes)
    }
}

impl Kept {
    /// The branch of `session` through the message `pick` names among its branches, marked
    /// used: where it ends, its messages and their estimated size.
    fn take_branch(
        &mut self,
        session: &str,
        pick: impl FnOnce(&[KeptPath]) -> Option<String>,
    ) -> Option<KeptPrefix> {
        self.clock += 1;
        let now = self.clock;
        let branches = self.paths.get_mut(session)?;
        let through = pick(branches)?;
        let path = branches.iter_mut().find(|path| path.through == through)?;
        path.used = now;
        path.used_at = Instant::now();
        Some((path.through.clone(), Arc::clone(&path.messages), path.bytes))
    }

    /// Takes out the first branch of `session` that `which` says, if any.
    fn remove(&mut self, session: &str, which: impl Fn(&KeptPath) -> bool) -> Option<KeptPath> {
        let branches = self.paths.get_mut(session)?;
        let at = branches.iter().position(which)?;
        let gone = branches.swap_remove(at);
        if branches.is_empty() {
            self.paths.remove(session);
        }
        self.count = self.count.saturating_sub(1);
        self.bytes = self.bytes.saturating_sub(gone.bytes);
        Some(gone)
    }

    /// Takes out the least recently used branch of `session`, or of all sessions.
    fn remove_oldest(&mut self, session: Option<&str>) -> Option<KeptPath> {
        let (owner, used) = self
            .paths
            .iter()
            .filter(|(id, _)| session.is_none_or(|session| session == id.as_str()))
            .flat_map(|(id, branches)| branches.iter().map(move |path| (id, path.used)))
            .min_by_key(|(_, used)| *used)
            .map(|(id, used)| (id.clone(), used))?;
        self.remove(&owner, |path| path.used == used)
    }

    /// Whether a path of `bytes` through `through` for `session` fits within `budget`, once
    /// the branch of the session it replaces, its least recently used branch if it keeps as
    /// many as it may, and the least recently used branches of others idle for at least
    /// `idle` make room.
    fn room_for(
        &self,
        session: &str,
        through: &str,
        bytes: usize,
        budget: usize,
        idle: Duration,
    ) -> bool {
        let own = self.paths.get(session).map_or(&[][..], Vec::as_slice);
        let replaced = own.iter().find(|path| path.through == through);
        let oldest_own = (own.len() >= MOST_BRANCHES)
            .then(|| own.iter().min_by_key(|path| path.used))
            .flatten();
        let freed = match (replaced, oldest_own) {
            (Some(replaced), _) => Some(replaced),
            (None, oldest) => oldest,
        };
        let mut paths = self.count.saturating_sub(usize::from(freed.is_some()));
        let mut held = self
            .bytes
            .saturating_sub(freed.map_or(0, |path| path.bytes));
        let fits =
            |paths: usize, held: usize| paths < MOST_PATHS && held.saturating_add(bytes) <= budget;
        if fits(paths, held) {
            return true;
        }
        let mut oldest: Vec<&KeptPath> = self
            .paths
            .iter()
            .filter(|(id, _)| id.as_str() != session)
            .flat_map(|(_, branches)| branches)
            .collect();
        oldest.sort_unstable_by_key(|path| path.used);
        for path in oldest {
            if path.used_at.elapsed() < idle {
                return false;
            }
            paths = paths.saturating_sub(1);
            held = held.saturating_sub(path.bytes);
            if fits(paths, held) {
                return true;
            }
        }
        false
    }
}

impl std::fmt::Debug for Histories {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kept = self.lock();
        f.debug_struct("Histories")
            .field("paths", &kept.count)
            .field("bytes", &kept.bytes)
            .finish()
    }
}

/// How many of the first messages a client sent are the path's first messages, as a chat
/// client sends back what it was answered: a member set to `null` counts as absent, and so do
/// an empty `content` (an answer of calls alone is stored with `""` and answered with `null`)
/// and an empty `tool_calls`. Nothing else is passed over: a message stored redacted, or
/// changed by the client in any other way, ends the match.
pub(crate) fn matching_prefix(path: &[Value], sent: &[Value]) -> usize {
    path.iter()
        .zip(sent)
        .take_while(|(stored, sent)| same_message(stored, sent))
        .count()
}

/// Whether the path a read gives ([`Histories::joined`]: `read` below `kept` when it passes
/// through it, else `read` alone) is `sent`, message for message, `kept` being a branch that
/// `sent` starts with ([`Histories::kept_branch_under`]).
pub(crate) fn read_path_is(kept: &Option<KeptPrefix>, read: &PathBelow, sent: &[Value]) -> bool {
    let prefix: &[Value] = match kept {
        Some((_, prefix, _)) if read.below_known => prefix,
        _ => &[],
    };
    prefix.len().saturating_add(read.messages.len()) == sent.len()
        && read
            .messages
            .iter()
            .zip(&sent[prefix.len()..])
            .all(|(stored, sent)| same_message(&stored.content, sent))
}

/// [`matching_prefix`] when the first `known` messages of both are known to be the same (a
/// carried transcript whose end the session holds): only what follows those is compared. A
/// known part past either's end is not taken.
pub(crate) fn matching_prefix_after(path: &[Value], sent: &[Value], known: usize) -> usize {
    match (path.get(known..), sent.get(known..)) {
        (Some(path), Some(sent)) => known + matching_prefix(path, sent),
        _ => matching_prefix(path, sent),
    }
}

/// How long the path a read gives ([`Histories::joined`]: `read` below `kept` when it passes
/// through it, else `read` alone) is through `message`, when it passes through it.
pub(crate) fn length_through(
    kept: &Option<KeptPrefix>,
    read: &PathBelow,
    message: &str,
) -> Option<usize> {
    let above = match kept {
        Some((through, path, _)) if read.below_known => {
            if through == message {
                return Some(path.len());
            }
            path.len()
        }
        _ => 0,
    };
    read.messages
        .iter()
        .position(|stored| stored.id == message)
        .map(|at| above + at + 1)
}

/// Whether `sent` says what `stored` says, as [`matching_prefix`] compares them.
pub(crate) fn same_message(stored: &Value, sent: &Value) -> bool {
    if stored == sent {
        return true;
    }
    let (Some(stored), Some(sent)) = (stored.as_object(), sent.as_object()) else {
        return false;
    };
    // Every member that says anything is in the other, the same: each compared once.
    stored
        .iter()
        .all(|(key, value)| says_nothing(key, value) || sent.get(key) == Some(value))
        && sent.iter().all(|(key, value)| {
            says_nothing(key, value)
                || stored
                    .get(key)
                    .is_some_and(|stored| !says_nothing(key, stored))
        })
}

fn says_nothing(key: &str, value: &Value) -> bool {
    match value {
        Value::Null => true,
        Value::String(text) => key == "content" && text.is_empty(),
        Value::Array(items) => key == "tool_calls" && items.is_empty(),
        _ => false,
    }
}

/// A kept message's size in memory, estimated: the message from above, and its JSON text
/// once a model call has written it ([`SharedHistory`]), as long as its strings (the text's
/// buffer may hold as much again while it grows).
fn kept_bytes(value: &Value) -> usize {
    estimated_bytes(value).saturating_add(text_bytes(value))
}

/// A value's JSON text, estimated: its strings' length (escapes, rare in a conversation's
/// text, apart) and punctuation; a number or a literal at most 24 bytes.
fn text_bytes(value: &Value) -> usize {
    match value {
        Value::String(text) => text.len().saturating_add(2),
        Value::Array(items) => items.iter().map(text_bytes).fold(2, usize::saturating_add),
        Value::Object(fields) => fields
            .iter()
            .map(|(key, value)| key.len() + 4 + text_bytes(value))
            .fold(2, usize::saturating_add),
        _ => 24,
    }
}

/// Messages' size in memory, estimated from above ([`estimated_bytes`] each).
pub(super) fn estimated_messages_bytes(messages: &[Value]) -> usize {
    messages.iter().map(estimated_bytes).sum()
}

/// A message's size in memory, estimated from above: its text, and for each value the
/// allocation that holds it (an object's map node holds eleven entries however few it has).
pub(super) fn estimated_bytes(value: &Value) -> usize {
    match value {
        Value::String(text) => 32 + text.len(),
        Value::Array(items) => 32 + items.iter().map(estimated_bytes).sum::<usize>(),
        Value::Object(fields) => {
            let nodes = fields.len().div_ceil(11).max(1);
            32 + 640 * nodes
                + fields
                    .iter()
                    .map(|(key, value)| key.len() + estimated_bytes(value))
                    .sum::<usize>()
        }
        _ => 32,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use serde_json::{Value, json};

    use super::{
        DEFAULT_KEPT_HISTORY_BYTES, Histories, MOST_BRANCHES, MOST_PATHS, PathBelow, SharedHistory,
        estimated_bytes, known, length_through, matching_prefix, matching_prefix_after,
        read_path_is,
    };

    /// Kept paths that any other session may replace at once.
    fn replaced_at_once() -> Histories {
        Histories {
            idle_before_replaced: Duration::ZERO,
            ..Histories::default()
        }
    }

    const BUDGET_BYTES: usize = DEFAULT_KEPT_HISTORY_BYTES as usize;

    #[test]
    fn kept_paths_stay_within_their_bounds_and_the_least_recently_used_go_first() {
        let histories = replaced_at_once();
        let path = Arc::new(SharedHistory::from(vec![
            json!({ "role": "user", "content": "hi" }),
        ]));
        for n in 0..MOST_PATHS + 10 {
            assert!(
                histories
                    .keep(&format!("ses_{n}"), "msg", Arc::clone(&path), 100, false)
                    .is_ok()
            );
            if n == MOST_PATHS - 1 {
                // Used since: it outlives the others kept before it.
                assert!(histories.kept_path("ses_0").is_some());
            }
        }
        assert_eq!(histories.held(), (MOST_PATHS, MOST_PATHS * 100));
        assert!(histories.kept_path("ses_0").is_some(), "used last");
        assert!(
            histories.kept_path("ses_1").is_none(),
            "the least recently used"
        );
        // By size: a path as large as half the budget evicts until it fits.
        let large = BUDGET_BYTES / 2;
        assert!(
            histories
                .keep("large_1", "msg", Arc::clone(&path), large, false)
                .is_ok()
        );
        assert!(
            histories
                .keep("large_2", "msg", Arc::clone(&path), large, false)
                .is_ok()
        );
        let (paths, bytes) = histories.held();
        assert!(bytes <= BUDGET_BYTES, "{bytes}");
        assert!(paths < MOST_PATHS, "{paths}");
        assert!(
            histories.kept_path("large_1").is_some() && histories.kept_path("large_2").is_some()
        );
        // A session's path kept again replaces its own.
        assert!(
            histories
                .keep("large_2", "msg_2", Arc::clone(&path), 10, false)
                .is_ok()
        );
        assert_eq!(
            histories.kept_path("large_2").map(|kept| kept.0),
            Some("msg_2".into())
        );
        assert!(histories.held().1 <= large + 10 + paths * 100);
    }

    #[test]
    fn a_session_not_kept_takes_no_place_of_a_path_in_use_and_a_kept_one_grows() {
        let histories = Histories::default();
        let path = Arc::new(SharedHistory::from(vec![
            json!({ "role": "user", "content": "hi" }),
        ]));
        let half = BUDGET_BYTES / 2;
        assert!(
            histories
                .keep("a", "msg", Arc::clone(&path), half, false)
                .is_ok()
        );
        assert!(
            histories
                .keep("b", "msg", Arc::clone(&path), half, false)
                .is_ok()
        );
        // Full of paths in use: a third session is refused, and handed its messages back.
        let refused = histories.keep("c", "msg", Arc::clone(&path), 10, false);
        assert!(refused.is_err());
        assert!(histories.kept_path("c").is_none());
        assert_eq!(histories.held(), (2, BUDGET_BYTES));
        // A session kept grows, the least recently used making room.
        assert!(
            histories
                .keep("b", "msg_2", Arc::clone(&path), half + 10, true)
                .is_ok()
        );
        assert!(histories.kept_path("a").is_none());
        assert_eq!(histories.held(), (1, half + 10));
    }

    /// A session keeps a few branches: the one used last is its newest path, a transcript
    /// is matched with the longest it starts with whole, the same path kept again replaces
    /// its own, and past the most a session keeps its least recently used branch goes.
    #[test]
    fn a_session_keeps_a_few_branches_and_a_transcript_finds_the_one_it_continues() {
        let histories = Histories::default();
        let said = |text: &str| json!({ "role": "user", "content": text });
        let path = |texts: &[&str]| {
            Arc::new(SharedHistory::from(
                texts.iter().map(|t| said(t)).collect::<Vec<_>>(),
            ))
        };
        let keep = |through: &str, texts: &[&str]| {
            assert!(
                histories
                    .keep("s", through, path(texts), 100, false)
                    .is_ok()
            );
        };
        keep("a2", &["a1", "a2"]);
        keep("b3", &["b1", "b2", "b3"]);
        keep("a1", &["a1"]);
        assert_eq!(histories.held(), (3, 300));
        assert_eq!(known(&histories.kept_path("s")), Some("a1"), "used last");
        let sent = [said("a1"), said("a2"), said("a3")];
        let under = histories.kept_branch_under("s", &sent);
        assert_eq!(
            known(&under),
            Some("a2"),
            "the longest it starts with whole"
        );
        assert_eq!(known(&histories.kept_path("s")), Some("a2"));
        assert!(histories.kept_branch_under("s", &[said("c1")]).is_none());
        assert!(histories.kept_branch_under("t", &sent).is_none());
        keep("a2", &["a1", "a2"]);
        assert_eq!(histories.held(), (3, 300), "kept again, not twice");
        for n in 0..MOST_BRANCHES - 2 {
            keep(&format!("c{n}"), &["c"]);
        }
        let (branches, _) = histories.held();
        assert_eq!(branches, MOST_BRANCHES);
        assert!(
            histories
                .kept_branch_under("s", &[said("b1"), said("b2"), said("b3")])
                .is_none(),
            "the least recently used went"
        );
        histories.forget("s", "a2");
        assert_eq!(histories.held().0, MOST_BRANCHES - 1);
    }

    /// The text a model call wrote of a kept path goes on with it: the next turn's path, read
    /// below it, holds the text of the messages it had, and only what was read is written
    /// anew, and names the request that stored its last message; a path too long for the
    /// budget is not kept, its text with it.
    #[test]
    fn a_kept_paths_text_goes_on_with_it_and_a_path_past_half_the_budget_is_not_kept() {
        let record = |n: usize| crate::store::MessageRecord {
            id: format!("msg_{n}"),
            session_id: "s".into(),
            parent_id: None,
            request_id: Some(format!("req_{}", n / 2)),
            role: "user".into(),
            content: json!({ "role": "user", "content": format!("message {n}") }),
            created_at: chrono::Utc::now(),
        };
        let read = |from: usize, to: usize, below_known: bool| PathBelow {
            messages: (from..to).map(record).collect(),
            below_known,
        };
        let histories = Histories::default();
        let first = histories.joined("s", "msg_39", None, read(0, 40, false));
        let transcript = crate::adapters::Transcript::new(Vec::new(), Some(first), Vec::new());
        transcript.write_array(&mut String::new(), []);
        drop(transcript);
        let kept = histories.kept_path("s");
        assert!(
            kept.as_ref()
                .is_some_and(|(_, path, _)| path.written_len().0 == 40)
        );
        let next = histories.joined("s", "msg_41", kept, read(40, 42, true));
        assert_eq!((next.len(), next.written_len().0), (42, 40));
        // And the request that stored its last message, from the read.
        assert_eq!(next.last_request(), Some("req_20"));
        let again = histories.kept_path("s");
        let same = histories.joined("s", "msg_41", again, read(42, 42, true));
        assert_eq!(same.last_request(), Some("req_20"), "the kept path itself");
        let mut written = String::new();
        crate::adapters::Transcript::new(Vec::new(), Some(Arc::clone(&next)), Vec::new())
            .write_array(&mut written, []);
        let all: Vec<Value> = (0..42).map(|n| record(n).content).collect();
        assert_eq!(written, serde_json::to_string(&all).unwrap());
        assert_eq!(histories.held().0, 1);

        // Within a budget of 4 KiB, 40 messages (~1.4 KB each, estimated) are not kept.
        let small = Histories::within(4 << 10);
        drop(small.joined("s", "msg_39", None, read(0, 40, false)));
        assert_eq!(small.held(), (0, 0));
        assert!(small.kept_path("s").is_none());
    }

    /// A path read is the transcript's start when the kept branch it was read below (if it
    /// passed through it) and what was read are the transcript, message for message.
    #[test]
    fn a_path_read_below_a_kept_branch_is_the_transcript_only_when_all_of_it_says_the_same() {
        let said = |text: &str| json!({ "role": "user", "content": text });
        let record = |text: &str| crate::store::MessageRecord {
            id: format!("msg_{text}"),
            session_id: "s".into(),
            parent_id: None,
            request_id: None,
            role: "user".into(),
            content: said(text),
            created_at: chrono::Utc::now(),
        };
        let read = |texts: &[&str], below_known: bool| PathBelow {
            messages: texts.iter().map(|t| record(t)).collect(),
            below_known,
        };
        let kept = Some((
            "msg_a2".to_owned(),
            Arc::new(SharedHistory::from(vec![said("a1"), said("a2")])),
            100,
        ));
        let sent = [said("a1"), said("a2"), said("a3"), said("a4")];
        assert!(read_path_is(&kept, &read(&["a3", "a4"], true), &sent));
        assert!(!read_path_is(&kept, &read(&["a3", "b4"], true), &sent));
        assert!(!read_path_is(&kept, &read(&["a3"], true), &sent));
        assert!(!read_path_is(
            &kept,
            &read(&["a3", "a4", "a5"], true),
            &sent
        ));
        // Not below the kept branch: what was read is the whole path.
        assert!(read_path_is(
            &kept,
            &read(&["a1", "a2", "a3", "a4"], false),
            &sent
        ));
        assert!(!read_path_is(&kept, &read(&["a3", "a4"], false), &sent));
        assert!(read_path_is(
            &None,
            &read(&["a1", "a2", "a3", "a4"], true),
            &sent
        ));

        // How long the path is through a message: at the kept branch's end, below it, in a
        // whole path read, and not at all when the path does not pass through it.
        let below = read(&["a3", "a4"], true);
        assert_eq!(length_through(&kept, &below, "msg_a2"), Some(2));
        assert_eq!(length_through(&kept, &below, "msg_a3"), Some(3));
        assert_eq!(length_through(&kept, &below, "msg_a4"), Some(4));
        assert_eq!(
            length_through(&kept, &below, "msg_a1"),
            None,
            "not looked for"
        );
        let whole = read(&["a1", "a2", "b3"], false);
        assert_eq!(length_through(&kept, &whole, "msg_a2"), Some(2));
        assert_eq!(length_through(&kept, &whole, "msg_a3"), None);
        let alone = read(&["a3", "a4"], false);
        assert_eq!(length_through(&None, &alone, "msg_a4"), Some(2));
    }

    /// A transcript whose first messages are known to be the path's is compared after them
    /// alone, and continues the path only when it goes on from all of it.
    #[test]
    fn a_transcript_known_to_start_a_path_is_compared_after_its_known_part() {
        let said = |text: &str| json!({ "role": "user", "content": text });
        let path = [said("a1"), said("a2"), said("a3")];
        // The known part is taken as it is, even where it would not compare the same.
        let sent = [said("x1"), said("x2"), said("a3"), said("a4")];
        assert_eq!(matching_prefix_after(&path, &sent, 2), path.len());
        assert_eq!(matching_prefix_after(&path, &sent, 1), 1, "a2 is not x2");
        assert_eq!(matching_prefix_after(&path, &sent[..2], 2), 2, "shorter");
        assert_eq!(matching_prefix_after(&path, &sent, 3), path.len());
        assert_eq!(matching_prefix_after(&path, &sent, 4), 0, "past the path");
        let changed = [said("x1"), said("x2"), said("b3"), said("a4")];
        assert_eq!(matching_prefix_after(&path, &changed, 2), 2);
    }

    #[test]
    fn a_sent_transcript_matches_a_path_as_far_as_its_messages_say_the_same() {
        let path = [
            json!({ "role": "system", "content": "Be brief." }),
            json!({ "role": "user", "content": "hi" }),
            json!({ "role": "assistant", "content": "", "tool_calls": [{ "id": "call_1" }] }),
            json!({ "role": "tool", "tool_call_id": "call_1", "content": "42" }),
            json!({ "role": "assistant", "content": "hello" }),
        ];
        // As an OpenAI SDK sends back what it was answered: `null`s, and no `""` content.
        let mut sent = vec![
            path[0].clone(),
            path[1].clone(),
            json!({ "role": "assistant", "content": null, "refusal": null, "tool_calls": [{ "id": "call_1" }] }),
            path[3].clone(),
            json!({ "role": "assistant", "content": "hello", "refusal": null, "tool_calls": [] }),
            json!({ "role": "user", "content": "again" }),
        ];
        assert_eq!(matching_prefix(&path, &sent), 5);
        assert_eq!(
            matching_prefix(&path, &sent[..2]),
            2,
            "a shorter transcript"
        );
        // Anything said otherwise ends the match: a changed text, a member more or less.
        sent[4]["content"] = json!("hello!");
        assert_eq!(matching_prefix(&path, &sent), 4);
        sent[3]["name"] = json!("lookup");
        assert_eq!(matching_prefix(&path, &sent), 3);
        sent[2]["tool_calls"] = json!([]);
        assert_eq!(matching_prefix(&path, &sent), 2);
        sent[1] = json!({ "role": "user", "content": [{ "type": "text", "text": "hi" }] });
        assert_eq!(matching_prefix(&path, &sent), 1);
        assert_eq!(matching_prefix(&[], &sent), 0);
        assert_eq!(matching_prefix(&path, &[json!("hi")]), 0);
    }

    #[test]
    fn a_message_is_estimated_at_no_less_than_its_text_and_its_map() {
        let message = json!({ "role": "assistant", "content": "x".repeat(1000) });
        let estimate = estimated_bytes(&message);
        assert!(estimate >= 1000 + 640, "{estimate}");
        assert!(estimate < 1000 + 2000, "{estimate}");
    }
}
