//! The SHA-256 of a conversation's transcript carried from one turn to the next. A client
//! with no session sends its whole transcript every turn, and each turn of a long one took
//! the digest of all of it ([`super::named_transcripts`]): 8-14% of a chat turn's CPU at a
//! thousand turns (docs/profiling.md, the eighty-sixth pass). What a turn hashed is the next
//! turn's first messages, so the hasher's state after a turn's text is kept here with that
//! text; the next turn whose first messages are those bytes, compared whole, goes on from
//! the state and hashes only what it adds. The digest is the same SHA-256 of the same bytes
//! either way: a state is used only for the very text it covers, never on a match of
//! anything shorter (a length, a sample, a weaker hash).
//!
//! Kept by key and agent, the oldest first out of room: at most a budget of text (a quarter
//! of `limits.keptHistoryBytes`, counted by capacity; the text is the one the turn's model
//! call writes its request from), one text at most half of it, and [`MOST_CARRIED`]
//! conversations. Only a transcript long enough to have a digest (4 KiB) is kept. A turn
//! whose state is not here (evicted, another instance's, after a restart, a transcript the
//! client changed) hashes its whole text, as before. Unlike the kept histories, a state
//! newly kept always finds room: more long conversations at once than the budget holds (one
//! key's or many keys') take each other's places, and their turns hash whole again.

use std::sync::{Arc, Mutex};

use sha2::Sha256;

/// The most conversations whose state is kept: looked for one by one, by a number.
const MOST_CARRIED: usize = 256;

/// How many bytes at a text's end pick out its conversation's state among the kept ones,
/// with its length, its key and its agent (the whole text is compared before it is used).
const TAIL_BYTES: usize = 64;

/// The hasher states kept, each with the text it has hashed.
pub(crate) struct CarriedDigests {
    kept: Mutex<Kept>,
    budget_bytes: usize,
    picker: foldhash::fast::RandomState,
}

#[derive(Default)]
struct Kept {
    carried: Vec<Carried>,
    /// The memory their texts hold (their capacities).
    bytes: usize,
    /// Counts the states kept: the oldest has the lowest `kept_at`.
    clock: u64,
}

/// A turn's hasher state after `[` and its text's items, and that text (shared with the
/// turn's model call).
struct Carried {
    pick: u64,
    text: Arc<String>,
    state: Sha256,
    kept_at: u64,
}

impl CarriedDigests {
    /// States kept with at most `budget_bytes` of text.
    pub(crate) fn within(budget_bytes: u64) -> Self {
        Self {
            kept: Mutex::default(),
            budget_bytes: usize::try_from(budget_bytes).unwrap_or(usize::MAX),
            picker: foldhash::fast::RandomState::default(),
        }
    }

    /// The number a text is looked for by: its owner's, its agent's, its length and its
    /// last bytes, hashed with this process's seed.
    fn pick(&self, owner: &str, agent: &str, text: &str) -> u64 {
        use std::hash::BuildHasher;
        let tail = text.as_bytes();
        let tail = &tail[tail.len().saturating_sub(TAIL_BYTES)..];
        self.picker.hash_one((owner, agent, text.len(), tail))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Kept> {
        crate::threads::locked(&self.kept)
    }

    /// The state after `[` and `items`, when the turn before of the same key and agent kept
    /// it for these very bytes. It is taken: the turn keeps its own in its place.
    pub(crate) fn take(&self, owner: &str, agent: &str, items: &str) -> Option<Sha256> {
        let pick = self.pick(owner, agent, items);
        let carried = {
            let mut kept = self.lock();
            let at = kept
                .carried
                .iter()
                .position(|carried| carried.pick == pick)?;
            kept.remove(at)
        };
        // Compared outside the lock: a long text takes a while, though far less than hashing.
        (carried.text.as_str() == items).then_some(carried.state)
    }

    /// Keeps `state`, after `[` and `text`, for the next turn of the conversation, making
    /// room by dropping the oldest kept; a text past half the budget is not kept. A text
    /// counts the memory it holds, its capacity.
    pub(crate) fn keep(&self, owner: &str, agent: &str, text: Arc<String>, state: Sha256) {
        let held = text.capacity();
        if held > self.budget_bytes / 2 {
            return;
        }
        let pick = self.pick(owner, agent, &text);
        // What gives way is dropped after the lock is let go: a text may be megabytes.
        let mut gone = Vec::new();
        let mut kept = self.lock();
        // Another state for these bytes (a turn sent twice) gives way; so do the oldest,
        // until this one fits.
        if let Some(at) = kept.carried.iter().position(|carried| carried.pick == pick) {
            gone.push(kept.remove(at));
        }
        while !kept.carried.is_empty()
            && (kept.carried.len() >= MOST_CARRIED
                || kept.bytes.saturating_add(held) > self.budget_bytes)
        {
            let oldest = kept
                .carried
                .iter()
                .enumerate()
                .min_by_key(|(_, carried)| carried.kept_at)
                .map_or(0, |(at, _)| at);
            gone.push(kept.remove(oldest));
        }
        kept.clock = kept.clock.wrapping_add(1);
        kept.bytes = kept.bytes.saturating_add(held);
        let kept_at = kept.clock;
        kept.carried.push(Carried {
            pick,
            text,
            state,
            kept_at,
        });
        drop(kept);
        drop(gone);
    }

    /// How many states are kept and the memory their texts hold.
    pub(crate) fn held(&self) -> (usize, usize) {
        let kept = self.lock();
        (kept.carried.len(), kept.bytes)
    }
}

impl Kept {
    fn remove(&mut self, at: usize) -> Carried {
        let carried = self.carried.swap_remove(at);
        self.bytes = self.bytes.saturating_sub(carried.text.capacity());
        carried
    }
}

impl std::fmt::Debug for CarriedDigests {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (count, bytes) = self.held();
        f.debug_struct("CarriedDigests")
            .field("count", &count)
            .field("bytes", &bytes)
            .field("budget_bytes", &self.budget_bytes)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use sha2::{Digest, Sha256};

    use super::{CarriedDigests, MOST_CARRIED};

    fn state_after(items: &str) -> Sha256 {
        Sha256::new()
            .chain_update(b"[")
            .chain_update(items.as_bytes())
    }

    /// A state is given back only for the very bytes it covers, and only to its key and
    /// agent, once.
    #[test]
    fn a_state_is_taken_for_its_own_text_alone() {
        let carried = CarriedDigests::within(1 << 20);
        let text = format!("{{\"role\":\"user\",\"content\":\"{}\"}}", "a".repeat(300));
        carried.keep("k1", "agent", Arc::new(text.clone()), state_after(&text));
        assert!(carried.take("k2", "agent", &text).is_none(), "another key");
        assert!(
            carried.take("k1", "other", &text).is_none(),
            "another agent"
        );
        // The same length and the same last bytes, one byte apart at the start.
        let mut changed = text.clone().into_bytes();
        changed[3] = b'x';
        let changed = String::from_utf8(changed).unwrap();
        assert!(
            carried.take("k1", "agent", &changed).is_none(),
            "other bytes"
        );
        // The mismatch took it: the turn keeps its own in its place.
        assert!(carried.take("k1", "agent", &text).is_none());

        carried.keep("k1", "agent", Arc::new(text.clone()), state_after(&text));
        let state = carried.take("k1", "agent", &text).expect("the same bytes");
        assert_eq!(state.finalize(), state_after(&text).finalize());
        assert!(carried.take("k1", "agent", &text).is_none(), "taken once");
    }

    /// The texts kept stay within the budget and the count, the oldest dropped first; a text
    /// past half the budget is not kept.
    #[test]
    fn the_oldest_give_way_within_the_budget() {
        let carried = CarriedDigests::within(10_000);
        // Each text's capacity its length; they differ at their ends, as transcripts do.
        let text = |n: usize| {
            format!("{}{n:04}", "b".repeat(2_996))
                .into_boxed_str()
                .into_string()
        };
        for n in 0..5 {
            carried.keep("k", "a", Arc::new(text(n)), state_after(&text(n)));
            assert!(carried.held().1 <= 10_000);
        }
        assert_eq!(carried.held(), (3, 9_000));
        assert!(carried.take("k", "a", &text(1)).is_none(), "dropped");
        assert!(carried.take("k", "a", &text(2)).is_some(), "kept");
        let long = "c".repeat(5_001).into_boxed_str().into_string();
        carried.keep("k", "a", Arc::new(long), Sha256::new());
        assert_eq!(carried.held(), (2, 6_000), "past half the budget: not kept");

        let carried = CarriedDigests::within(u64::MAX);
        for n in 0..MOST_CARRIED + 10 {
            carried.keep("k", "a", Arc::new(n.to_string()), Sha256::new());
        }
        assert_eq!(carried.held().0, MOST_CARRIED);
        assert!(
            carried.take("k", "a", "9").is_none(),
            "the oldest went first"
        );
        assert!(
            carried
                .take("k", "a", &(MOST_CARRIED + 9).to_string())
                .is_some()
        );
    }
}
