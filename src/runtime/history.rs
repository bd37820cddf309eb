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

use serde_json::Value;

use crate::store::{Store, StoreError};

/// The most the kept paths hold, by their estimated size in memory.
const BUDGET_BYTES: usize = 16 << 20;
/// The most one path may hold: a longer one is read whole each time, so that two sessions'
/// paths at least fit.
const MOST_BYTES_A_PATH: usize = BUDGET_BYTES / 2;
/// The most sessions whose paths are kept.
const MOST_PATHS: usize = 1024;
/// Shorter paths are read whole each time: a few rows, cheaper than keeping them.
const LEAST_KEPT: usize = 32;

/// The kept paths, by session; the least recently used go first when a bound is reached.
#[derive(Default)]
pub(crate) struct Histories {
    kept: Mutex<Kept>,
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
    used: u64,
}

impl Histories {
    /// The contents of the path through `through`, root first: the part below the path kept
    /// for `session` read from the store, when the path passes through it, else all of it.
    /// The result is kept for the session's next turn.
    pub(crate) async fn path(
        &self,
        store: &dyn Store,
        session: &str,
        through: &str,
    ) -> Result<Vec<Value>, StoreError> {
        let kept = self.kept_path(session);
        let known = kept.as_ref().map(|(id, _, _)| id.as_str());
        let read = store.message_path_below(through, known).await?;
        let below: Vec<Value> = read.messages.into_iter().map(|m| m.content).collect();
        let below_bytes = below.iter().map(estimated_bytes).sum::<usize>();
        let (mut messages, bytes) = match kept {
            Some((known, prefix, prefix_bytes)) if read.below_known => {
                if below.is_empty() {
                    // The kept path itself: nothing to keep anew.
                    return Ok(prefix.as_ref().clone());
                }
                // The kept path is extended into the new one: taken out, and when no other
                // turn holds it, extended where it is instead of copied.
                self.forget(session, &known);
                let messages = Arc::try_unwrap(prefix).unwrap_or_else(|shared| (*shared).clone());
                (messages, prefix_bytes.saturating_add(below_bytes))
            }
            _ => (Vec::new(), below_bytes),
        };
        messages.extend(below);
        if messages.len() < LEAST_KEPT || bytes > MOST_BYTES_A_PATH {
            return Ok(messages);
        }
        let kept = Arc::new(messages);
        self.keep(session, through, Arc::clone(&kept), bytes);
        Ok((*kept).clone())
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
    fn kept_path(&self, session: &str) -> Option<(String, Arc<Vec<Value>>, usize)> {
        let mut kept = self.lock();
        kept.clock += 1;
        let now = kept.clock;
        let path = kept.paths.get_mut(session)?;
        path.used = now;
        Some((path.through.clone(), Arc::clone(&path.messages), path.bytes))
    }

    fn keep(&self, session: &str, through: &str, messages: Arc<Vec<Value>>, bytes: usize) {
        // Paths let go of are freed after the lock (declared first, dropped last).
        let mut gone = Vec::new();
        let mut kept = self.lock();
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
                messages,
                bytes,
                used,
            },
        );
    }

    /// The paths kept and their estimated size (for tests).
    #[cfg(test)]
    fn held(&self) -> (usize, usize) {
        let kept = self.lock();
        (kept.paths.len(), kept.bytes)
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

    use serde_json::json;

    use super::{BUDGET_BYTES, Histories, MOST_PATHS, estimated_bytes};

    #[test]
    fn kept_paths_stay_within_their_bounds_and_the_least_recently_used_go_first() {
        let histories = Histories::default();
        let path = Arc::new(vec![json!({ "role": "user", "content": "hi" })]);
        for n in 0..MOST_PATHS + 10 {
            histories.keep(&format!("ses_{n}"), "msg", Arc::clone(&path), 100);
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
        histories.keep("large_1", "msg", Arc::clone(&path), large);
        histories.keep("large_2", "msg", Arc::clone(&path), large);
        let (paths, bytes) = histories.held();
        assert!(bytes <= BUDGET_BYTES, "{bytes}");
        assert!(paths < MOST_PATHS, "{paths}");
        assert!(
            histories.kept_path("large_1").is_some() && histories.kept_path("large_2").is_some()
        );
        // A session's path kept again replaces its own.
        histories.keep("large_2", "msg_2", Arc::clone(&path), 10);
        assert_eq!(
            histories.kept_path("large_2").map(|kept| kept.0),
            Some("msg_2".into())
        );
        assert!(histories.held().1 <= large + 10 + paths * 100);
    }

    #[test]
    fn a_message_is_estimated_at_no_less_than_its_text_and_its_map() {
        let message = json!({ "role": "assistant", "content": "x".repeat(1000) });
        let estimate = estimated_bytes(&message);
        assert!(estimate >= 1000 + 640, "{estimate}");
        assert!(estimate < 1000 + 2000, "{estimate}");
    }
}
