//! What a conversation carries from one turn to the next. A client with no
//! session sends its whole transcript every turn, and each turn of a long one took the
//! digest of all of it ([`super::named_transcripts`]): 8-14% of a chat turn's CPU at a
//! thousand turns (docs/profiling.md, the eighty-sixth pass). What a turn hashed is the next
//! turn's first messages, so the hasher's state after a turn's text is kept here with that
//! text; the next turn whose first messages are those bytes, compared whole, goes on from
//! the state and hashes only what it adds. The digest is the same SHA-256 of the same bytes
//! either way: a state is used only for the very text it covers, never on a match of
//! anything shorter (a length, a sample, a weaker hash).
//!
//! A chat turn keeps more: its messages as the client sent them and as parsed, with their
//! text. Parsing, checking and writing the whole transcript was ~60% of a chat turn's CPU at
//! a thousand turns (the eighty-seventh pass); the next turn whose messages, as sent, start
//! with those very bytes, compared whole, and go on after a `,` takes the parsed messages
//! and parses only the rest. What a run is given is what parsing the sent bytes gives
//! either way.
//!
//! A chat turn in a session keeps the same, its leading messages first and no hasher state
//! (no digest is taken in a session), and where its messages after the leading ones end in
//! the session ([`SessionMark`]): the next turn whose session's newest path passes through
//! there compares with the path only what follows them (the eighty-eighth pass).
//!
//! Kept by key and agent, the oldest first out of room: at most `limits.keptHistoryBytes`
//! by estimated size (a text by its capacity, the one the turn's model call writes its
//! request from; a chat turn's sent text and parsed messages besides), one entry at most
//! half of it (a chat turn past that keeps its text alone, a session's nothing), and
//! [`MOST_CARRIED`] conversations. Only a transcript long enough to have a digest (4 KiB)
//! is kept. A turn whose entry is not here (evicted, another instance's, after a restart, a
//! transcript the client changed) parses and hashes its whole transcript, as before. Unlike
//! the kept histories, an entry newly kept always finds room: more long conversations at
//! once than the budget holds (one key's or many keys') take each other's places, and their
//! turns parse and hash whole again.

use std::sync::{Arc, Mutex};

use serde_json::Value;
use sha2::Sha256;

use crate::adapters::SharedHistory;

/// The most conversations whose state is kept: looked for one by one, by a number.
const MOST_CARRIED: usize = 256;

/// How many bytes at a text's end pick out its conversation's state among the kept ones,
/// with its length, its key and its agent (the whole text is compared before it is used).
const TAIL_BYTES: usize = 64;

/// The turns kept for their conversations' next: hasher states, each with the text it has
/// hashed, and chat turns' messages (a session's with no state, their text written later).
pub(crate) struct CarriedDigests {
    kept: Mutex<Kept>,
    budget_bytes: usize,
    picker: foldhash::fast::RandomState,
}

#[derive(Default)]
struct Kept {
    carried: Vec<Carried>,
    /// The memory they hold, estimated ([`Carried::bytes`]).
    bytes: usize,
    /// Counts the states kept: the oldest has the lowest `kept_at`.
    clock: u64,
}

/// A turn's hasher state after `[` and its text's items, and what holds that text: the text
/// alone (shared with the turn's model call), or a chat turn's messages as sent and parsed
/// (a turn in a session has no digest, so no state).
struct Carried {
    pick: u64,
    held: Held,
    state: Option<Sha256>,
    /// The memory `held` holds: the text's capacity; and a chat turn's sent text and its
    /// parsed messages, estimated.
    bytes: usize,
    kept_at: u64,
}

enum Held {
    Text(Arc<String>),
    /// A chat turn's messages: the JSON array as the client sent it, and as parsed, with
    /// their text (the one the turn's model call wrote its request from), for its key and
    /// agent alone (compared whole: a number standing for them could be another's).
    Sent {
        owner: Box<str>,
        agent: Box<str>,
        sent: Box<str>,
        history: Arc<SharedHistory>,
        parsed_bytes: usize,
        mark: Option<SessionMark>,
    },
}

/// Where a session's chat turn's messages after its leading ones end in the session: the
/// path through `through` is those `len` messages as the session holds them (the turn's own
/// stored below the part of the path they matched, none of them changed by redaction). The
/// next turn that carries them on and whose session's newest path passes through `through`
/// compares only what follows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionMark {
    pub session: Box<str>,
    pub through: String,
    pub len: usize,
}

/// What a chat turn carries on from the turn before whose messages, as sent, its own start
/// with ([`CarriedDigests::take_sent`]): those messages parsed, with their text, and the
/// hasher's state after `[` and that text, if that turn took a digest.
#[derive(Debug, Clone)]
pub struct CarriedTranscript {
    pub history: Arc<SharedHistory>,
    pub state: Option<Sha256>,
    /// The parsed messages' memory, estimated (`history::estimated_bytes`).
    pub parsed_bytes: usize,
    /// Where they end in their session, for a session's turn.
    pub mark: Option<SessionMark>,
}

/// A session's chat turn's whole transcript ([`SentTranscript::whole`]).
pub(crate) struct WholeTranscript {
    pub history: SharedHistory,
    /// The messages' memory, estimated.
    pub parsed_bytes: usize,
    /// How many of them were carried on, and where those ended in their session.
    pub carried: Option<(usize, Option<SessionMark>)>,
}

/// A chat turn's messages as the client sent them (a JSON array), kept after the turn for
/// the next to carry its transcript on from, and what this turn carries on, if anything:
/// then the request's messages are only those after the carried ones.
#[derive(Debug, Clone)]
pub struct SentTranscript {
    pub sent: Box<str>,
    pub carried: Option<CarriedTranscript>,
}

impl SentTranscript {
    /// The carried messages, if any, before `messages`: the whole transcript. Nothing is
    /// carried on after.
    pub fn take_back(&mut self, messages: Vec<Value>) -> Vec<Value> {
        match self.carried.take() {
            Some(carried) => {
                let mut all = Arc::try_unwrap(carried.history)
                    .map_or_else(|shared| shared.to_vec(), SharedHistory::into_messages);
                all.extend(messages);
                all
            }
            None => messages,
        }
    }

    /// A session's chat turn's whole transcript, as sent: the carried messages (which hold
    /// its `leading` ones) then `messages`, or else `leading` then `messages`; with their
    /// memory, estimated. The carried messages keep their text: the turn's model call writes
    /// only what follows it.
    pub(crate) fn whole(&mut self, leading: &[Value], messages: Vec<Value>) -> WholeTranscript {
        let added = super::history::estimated_messages_bytes(&messages);
        match self.carried.take() {
            Some(carried) => {
                let mut history = Arc::unwrap_or_clone(carried.history);
                let count = history.len();
                history.extend(messages);
                WholeTranscript {
                    history,
                    parsed_bytes: carried.parsed_bytes.saturating_add(added),
                    carried: Some((count, carried.mark)),
                }
            }
            None => {
                let leading_bytes = super::history::estimated_messages_bytes(leading);
                let mut whole = leading.to_vec();
                whole.extend(messages);
                WholeTranscript {
                    history: SharedHistory::from(whole),
                    parsed_bytes: leading_bytes.saturating_add(added),
                    carried: None,
                }
            }
        }
    }
}

/// Where the items of the JSON array `sent` end: before its closing `]` and any white space
/// before it.
fn items_end(sent: &str) -> Option<usize> {
    let open = sent.trim_end().strip_suffix(']')?;
    Some(open.trim_end().len())
}

/// Whether `sent` may go on from the array `before`: longer, with the same bytes just before
/// where `before`'s items end, and a `,` after them. The whole is compared before use.
fn may_continue(before: &str, sent: &str) -> bool {
    let Some(end) = items_end(before) else {
        return false;
    };
    let (before, sent) = (before.as_bytes(), sent.as_bytes());
    let tail = end.saturating_sub(TAIL_BYTES)..end;
    sent.get(tail.clone()) == before.get(tail)
        && sent
            .get(end..)
            .and_then(|after| after.iter().find(|byte| !byte.is_ascii_whitespace()))
            == Some(&b',')
}

impl CarriedDigests {
    /// Entries kept within `budget_bytes`, by their estimated size.
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

    /// Takes the newest kept entry `which` picks out. The caller compares it with what the
    /// turn sent outside the lock (a long text takes a while to compare, though far less
    /// than hashing or parsing it); one that is not the same is dropped: most likely what
    /// the turn before of a conversation the client has since changed kept (the turn keeps
    /// its own in its place); put back, it would be found again, turn after turn.
    fn take_newest(&self, which: impl Fn(&Carried) -> bool) -> Option<Carried> {
        let mut kept = self.lock();
        let newest = kept
            .carried
            .iter()
            .enumerate()
            .filter(|(_, carried)| which(carried))
            .max_by_key(|(_, carried)| carried.kept_at)
            .map(|(at, _)| at)?;
        Some(kept.remove(newest))
    }

    /// The state after `[` and `items`, when the turn before of the same key and agent kept
    /// it for these very bytes. It is taken: the turn keeps its own in its place.
    pub(crate) fn take(&self, owner: &str, agent: &str, items: &str) -> Option<Sha256> {
        let pick = self.pick(owner, agent, items);
        let carried = self.take_newest(|carried| carried.pick == pick)?;
        let same = match &carried.held {
            Held::Text(text) => text.as_str() == items,
            Held::Sent { history, .. } => history.read_text(|text| text == items),
        };
        carried.state.filter(|_| same)
    }

    /// What the turn before of the same key and agent carries on to a chat turn whose
    /// messages, as sent, start with that turn's, byte for byte, and go on after a `,`; and
    /// where in `sent` those messages end. It is taken: the turn keeps its own in its place.
    pub(crate) fn take_sent(
        &self,
        owner: &str,
        agent: &str,
        sent: &str,
    ) -> Option<(usize, CarriedTranscript)> {
        let carried = self.take_newest(|carried| match &carried.held {
            Held::Sent {
                owner: of,
                agent: by,
                sent: before,
                ..
            } => **of == *owner && **by == *agent && may_continue(before, sent),
            Held::Text(_) => false,
        })?;
        let Held::Sent {
            sent: before,
            history,
            parsed_bytes,
            mark,
            ..
        } = carried.held
        else {
            return None;
        };
        let end = items_end(&before)?;
        (sent.as_bytes().get(..end) == before.as_bytes().get(..end)).then_some((
            end,
            CarriedTranscript {
                history,
                state: carried.state,
                parsed_bytes,
                mark,
            },
        ))
    }

    /// Keeps `state`, after `[` and `text`, for the next turn of the conversation, making
    /// room by dropping the oldest kept; a text past half the budget is not kept. A text
    /// counts the memory it holds, its capacity.
    pub(crate) fn keep(&self, owner: &str, agent: &str, text: Arc<String>, state: Sha256) {
        let (pick, bytes) = (self.pick(owner, agent, &text), text.capacity());
        self.insert(pick, Held::Text(text), bytes, Some(state));
    }

    /// Keeps `history`'s messages as parsed (their memory estimated at `parsed_bytes`) and
    /// as the client sent them (`sent`), for the conversation's next chat turn to carry on
    /// from ([`Self::take_sent`]); with `state`, after `[` and the messages' text, for any
    /// next turn to go on hashing from ([`Self::take`]). Past half the budget, only the
    /// state and the text are kept. Without a state (a session's turn, whose text its model
    /// call writes later, with where its messages end in the session: `mark`), the entry is
    /// picked out by the bytes sent and sized as if its text were as long.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn keep_sent(
        &self,
        owner: &str,
        agent: &str,
        sent: Box<str>,
        history: Arc<SharedHistory>,
        parsed_bytes: usize,
        state: Option<Sha256>,
        mark: Option<SessionMark>,
    ) {
        let pick = match state {
            Some(_) => history.read_text(|text| self.pick(owner, agent, text)),
            None => self.pick(owner, agent, &sent),
        };
        // A text written later (a session's turn's, by its model call) is counted as long as
        // the bytes sent.
        let text_bytes = match state {
            Some(_) => history.text_capacity(),
            None => history.text_capacity().max(sent.len()),
        };
        let bytes = sent
            .len()
            .saturating_add(text_bytes)
            .saturating_add(parsed_bytes);
        if bytes > self.budget_bytes / 2 {
            if state.is_some() {
                let text = history.written_text();
                self.insert(pick, Held::Text(Arc::clone(&text)), text.capacity(), state);
            }
            return;
        }
        let held = Held::Sent {
            owner: owner.into(),
            agent: agent.into(),
            sent,
            history,
            parsed_bytes,
            mark,
        };
        self.insert(pick, held, bytes, state);
    }

    /// Keeps an entry of `bytes`, picked by `pick`, unless past half the budget.
    fn insert(&self, pick: u64, held: Held, bytes: usize, state: Option<Sha256>) {
        if bytes > self.budget_bytes / 2 {
            return;
        }
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
                || kept.bytes.saturating_add(bytes) > self.budget_bytes)
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
        kept.bytes = kept.bytes.saturating_add(bytes);
        let kept_at = kept.clock;
        kept.carried.push(Carried {
            pick,
            held,
            state,
            bytes,
            kept_at,
        });
        drop(kept);
        drop(gone);
    }

    /// How many states are kept and the memory they hold.
    pub(crate) fn held(&self) -> (usize, usize) {
        let kept = self.lock();
        (kept.carried.len(), kept.bytes)
    }
}

impl Kept {
    fn remove(&mut self, at: usize) -> Carried {
        let carried = self.carried.swap_remove(at);
        self.bytes = self.bytes.saturating_sub(carried.bytes);
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

    use super::{CarriedDigests, MOST_CARRIED, SessionMark};
    use crate::adapters::SharedHistory;

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

    /// A chat turn's sent messages carry on only to a turn of the same key and agent whose
    /// own start with those very bytes and go on after a `,`, once; what it carries is the
    /// turn before's parsed messages and state.
    #[test]
    fn sent_messages_carry_on_to_the_turn_continuing_their_bytes() {
        let carried = CarriedDigests::within(1 << 24);
        let message = |n: usize| {
            format!(
                "{{\"content\":\"{}{n}\",\"role\":\"user\"}}",
                "z".repeat(300)
            )
        };
        let before = format!("[{},{}]", message(1), message(2));
        let parsed: Vec<serde_json::Value> = serde_json::from_str(&before).unwrap();
        let keep = || {
            let (text, _) = crate::runtime::named_transcripts::written_items(&parsed, None);
            let history = SharedHistory::written(parsed.clone(), Arc::new(text.clone()));
            carried.keep_sent(
                "k1",
                "agent",
                before.clone().into(),
                Arc::new(history),
                1_000,
                Some(state_after(&text)),
                None,
            );
        };
        keep();
        // Counted as its sent text, its text and its parsed messages' estimate.
        let (text, _) = crate::runtime::named_transcripts::written_items(&parsed, None);
        assert_eq!(carried.held(), (1, before.len() + text.len() + 1_000));
        let next = format!("[{},{}, {}]", message(1), message(2), message(3));
        assert!(
            carried.take_sent("k2", "agent", &next).is_none(),
            "another key"
        );
        assert!(
            carried.take_sent("k1", "other", &next).is_none(),
            "another agent"
        );
        assert!(
            carried.take_sent("k1", "agent", &before).is_none(),
            "nothing after"
        );
        let (end, taken) = carried.take_sent("k1", "agent", &next).expect("continued");
        assert_eq!(&next[..end], &before[..before.len() - 1]);
        assert_eq!(taken.history[..], parsed[..]);
        assert!(
            carried.take_sent("k1", "agent", &next).is_none(),
            "taken once"
        );
        // The same length and the same last bytes, one byte apart at the start: taken, and
        // not given (what a conversation the client changed kept before).
        keep();
        let changed = next.replacen("zzz", "zzy", 1);
        assert!(
            carried.take_sent("k1", "agent", &changed).is_none(),
            "other bytes"
        );
        assert_eq!(carried.held(), (0, 0));
        // Of two entries the turn may continue, the newest is given.
        let older = SharedHistory::written(parsed.clone(), Arc::new("older".to_owned()));
        let older_state = Sha256::new().chain_update(b"older");
        carried.keep_sent(
            "k1",
            "agent",
            before.clone().into(),
            Arc::new(older),
            1,
            Some(older_state),
            None,
        );
        keep();
        assert_eq!(carried.held().0, 2);
        let (_, taken) = carried.take_sent("k1", "agent", &next).expect("continued");
        let state = taken.state.expect("a turn with no session's state");
        assert_eq!(state.finalize(), state_after(&text).finalize());
        // A sent entry gives its state to a turn matching its text, as a text's does.
        keep();
        let (text, _) = crate::runtime::named_transcripts::written_items(&parsed, None);
        let state = carried.take("k1", "agent", &text).expect("the same text");
        assert_eq!(state.finalize(), state_after(&text).finalize());
    }

    /// A session's chat turns keep their messages with no state and no text yet (their model
    /// call writes it): picked out by the bytes sent, two conversations of one key and agent
    /// are both kept, each carried on to its own next turn, and no digest is taken from
    /// either.
    #[test]
    fn a_session_turn_carries_its_messages_on_with_no_state() {
        let carried = CarriedDigests::within(1 << 24);
        let mark_of = |conversation: &str| {
            Some(SessionMark {
                session: conversation.into(),
                through: format!("msg-{conversation}"),
                len: 2,
            })
        };
        let sent = |conversation: &str, turns: usize| {
            let messages: Vec<String> = (0..turns)
                .map(|n| format!("{{\"role\":\"user\",\"content\":\"{conversation} {n}\"}}"))
                .collect();
            format!("[{}]", messages.join(","))
        };
        for conversation in ["first", "second"] {
            let before = sent(conversation, 2);
            let parsed: Vec<serde_json::Value> = serde_json::from_str(&before).unwrap();
            let history = Arc::new(SharedHistory::from(parsed));
            let mark = mark_of(conversation);
            carried.keep_sent("k1", "agent", before.into(), history, 100, None, mark);
        }
        // Sized as the bytes sent twice (they and the text to come) and the estimate.
        let sized = 2 * sent("first", 2).len() + 2 * sent("second", 2).len() + 2 * 100;
        assert_eq!(carried.held(), (2, sized));
        for conversation in ["second", "first"] {
            let next = sent(conversation, 3);
            let (end, taken) = carried.take_sent("k1", "agent", &next).expect("continued");
            assert_eq!(&next[..end], &sent(conversation, 2)[..end]);
            assert_eq!(taken.history.len(), 2);
            assert!(taken.state.is_none());
            assert_eq!(taken.mark, mark_of(conversation), "its own mark");
        }
        assert_eq!(carried.held(), (0, 0));
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
