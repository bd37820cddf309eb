//! The history a run starts from: a session's path through a message, read from the store,
//! with the newest path of each recently continued session kept in memory.
//!
//! A path never changes once written: messages are immutable and only pruned with their
//! whole session. So a kept path is as good as one read, and the next turn of the same
//! conversation reads only the messages below it (its own, and the answer before it) instead
//! of the whole conversation again: a turn's history costs what the turn added, not what the
//! conversation holds (docs/profiling.md, the seventy-eighth pass). Several instances keep
//! their own; none can be stale, since what a path holds never changes.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::store::{PathBelow, Store, StoreError};

/// The most the kept paths hold, by their estimated size in memory.
const BUDGET_BYTES: usize = 16 << 20;
/// The most one path may hold: a longer one is read whole each time, so that two sessions'
/// paths at least fit.
const MOST_BYTES_A_PATH: usize = BUDGET_BYTES / 2;
/// The most sessions whose paths are kept.
const MOST_PATHS: usize = 1024;
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
    idle_before_replaced: Duration,
}

impl Default for Histories {
    fn default() -> Self {
        Self {
            kept: Mutex::default(),
            idle_before_replaced: IDLE_BEFORE_REPLACED,
        }
    }
}

#[derive(Default)]
struct Kept {
    paths: HashMap<String, KeptPath>,
    bytes: usize,
    clock: u64,
}

struct KeptPath {
    /// The message the path goes through (its last).
    through: String,
    messages: Arc<Vec<Value>>,
    bytes: usize,
    /// When it was last used, in order and in time.
    used: u64,
    used_at: Instant,
}

/// A kept path as a turn takes it: where it ends, its messages and their estimated size.
pub(crate) type KeptPrefix = (String, Arc<Vec<Value>>, usize);

/// Where a kept path ends: the message a read of what is below it stops at.
pub(crate) fn known(kept: &Option<KeptPrefix>) -> Option<&str> {
    kept.as_ref().map(|(through, _, _)| through.as_str())
}

impl Histories {
    /// The contents of the path through `through`, root first, shared with what is kept: the
    /// part below the path kept for `session` read from the store, when the path passes
    /// through it, else all of it. The result is kept for the session's next turn.
    pub(crate) async fn shared_path(
        &self,
        store: &dyn Store,
        session: &str,
        through: &str,
    ) -> Result<Arc<Vec<Value>>, StoreError> {
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
    ) -> Arc<Vec<Value>> {
        let was_kept = kept.is_some();
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
            _ => (Vec::new(), 0),
        };
        let below_from = messages.len();
        messages.extend(read.messages.into_iter().map(|m| m.content));
        if messages.len() < LEAST_KEPT {
            return Arc::new(messages);
        }
        // Sized only when it may be kept: a short history is not.
        let bytes = messages[below_from..]
            .iter()
            .map(estimated_bytes)
            .fold(prefix_bytes, usize::saturating_add);
        if bytes > MOST_BYTES_A_PATH {
            return Arc::new(messages);
        }
        self.keep(session, through, Arc::new(messages), bytes, was_kept)
            .unwrap_or_else(|refused| refused)
    }

    /// The kept paths, locked (a panic elsewhere while it was held left nothing half-done:
    /// each change is whole before the lock is let go).
    fn lock(&self) -> std::sync::MutexGuard<'_, Kept> {
        self.kept
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Takes out the path kept for `session` if it is still the one through `known`.
    fn forget(&self, session: &str, known: &str) {
        let mut kept = self.lock();
        if kept
            .paths
            .get(session)
            .is_some_and(|path| path.through == known)
            && let Some(gone) = kept.paths.remove(session)
        {
            kept.bytes = kept.bytes.saturating_sub(gone.bytes);
        }
    }

    /// The path kept for `session`: where it ends, its messages and their estimated size.
    pub(crate) fn kept_path(&self, session: &str) -> Option<KeptPrefix> {
        let mut kept = self.lock();
        kept.clock += 1;
        let now = kept.clock;
        let path = kept.paths.get_mut(session)?;
        path.used = now;
        path.used_at = Instant::now();
        Some((path.through.clone(), Arc::clone(&path.messages), path.bytes))
    }

    /// Keeps `messages` as the path of `session`, the least recently used paths making room;
    /// a session not kept before takes only the room of paths idle for
    /// [`IDLE_BEFORE_REPLACED`], else it is refused and its messages handed back. What is
    /// kept is handed back too, shared.
    fn keep(
        &self,
        session: &str,
        through: &str,
        messages: Arc<Vec<Value>>,
        bytes: usize,
        was_kept: bool,
    ) -> Result<Arc<Vec<Value>>, Arc<Vec<Value>>> {
        // Paths let go of are freed after the lock (declared first, dropped last).
        let mut gone = Vec::new();
        let mut kept = self.lock();
        if !was_kept && !kept.room_for(session, bytes, self.idle_before_replaced) {
            return Err(messages);
        }
        kept.clock += 1;
        let used = kept.clock;
        if let Some(old) = kept.paths.remove(session) {
            kept.bytes = kept.bytes.saturating_sub(old.bytes);
            gone.push(old);
        }
        while !kept.paths.is_empty()
            && (kept.paths.len() >= MOST_PATHS || kept.bytes.saturating_add(bytes) > BUDGET_BYTES)
        {
            let Some(oldest) = kept
                .paths
                .iter()
                .min_by_key(|(_, path)| path.used)
                .map(|(session, _)| session.clone())
            else {
                break;
            };
            if let Some(evicted) = kept.paths.remove(&oldest) {
                kept.bytes = kept.bytes.saturating_sub(evicted.bytes);
                gone.push(evicted);
            }
        }
        kept.bytes = kept.bytes.saturating_add(bytes);
        kept.paths.insert(
            session.to_owned(),
            KeptPath {
                through: through.to_owned(),
                messages: Arc::clone(&messages),
                bytes,
                used,
                used_at: Instant::now(),
            },
        );
        Ok(messages)
    }

    /// The paths kept and their estimated size (for tests).
    #[cfg(test)]
    fn held(&self) -> (usize, usize) {
        let kept = self.lock();
        (kept.paths.len(), kept.bytes)
    }
}

impl Kept {
    /// Whether a path of `bytes` for `session` fits, once the least recently used paths
    /// idle for at least `idle` (and its own) make room.
    fn room_for(&self, session: &str, bytes: usize, idle: Duration) -> bool {
        let own = self.paths.get(session).map_or(0, |path| path.bytes);
        let mut paths = self
            .paths
            .len()
            .saturating_sub(usize::from(self.paths.contains_key(session)));
        let mut held = self.bytes.saturating_sub(own);
        let fits = |paths: usize, held: usize| {
            paths < MOST_PATHS && held.saturating_add(bytes) <= BUDGET_BYTES
        };
        if fits(paths, held) {
            return true;
        }
        let mut oldest: Vec<&KeptPath> = self
            .paths
            .iter()
            .filter(|(id, _)| id.as_str() != session)
            .map(|(_, path)| path)
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
            .field("paths", &kept.paths.len())
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

fn same_message(stored: &Value, sent: &Value) -> bool {
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

/// A message's size in memory, estimated from above: its text, and for each value the
/// allocation that holds it (an object's map node holds eleven entries however few it has).
fn estimated_bytes(value: &Value) -> usize {
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

    use serde_json::json;

    use super::{BUDGET_BYTES, Histories, MOST_PATHS, estimated_bytes, matching_prefix};

    /// Kept paths that any other session may replace at once.
    fn replaced_at_once() -> Histories {
        Histories {
            idle_before_replaced: Duration::ZERO,
            ..Histories::default()
        }
    }

    #[test]
    fn kept_paths_stay_within_their_bounds_and_the_least_recently_used_go_first() {
        let histories = replaced_at_once();
        let path = Arc::new(vec![json!({ "role": "user", "content": "hi" })]);
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
        let path = Arc::new(vec![json!({ "role": "user", "content": "hi" })]);
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
