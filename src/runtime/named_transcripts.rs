//! A conversation with no session, no longer stored whole every turn. A chat client sends
//! its whole transcript every turn; without a session each turn's request held it whole,
//! so a conversation's storage grew with the square of its length (114 MB after 600 turns
//! of 500 bytes). A turn whose transcript continues an earlier request's — the same key's
//! and agent's, found by the digest of that request's messages ([`INPUT_DIGEST`]) — names
//! the request holding its first messages whole ([`PREFIX_OF`], [`PREFIX_LEN`]) and stores
//! the rest. Nothing else changes: the turn keeps its own session, its budgets and its
//! memory; the model is sent the transcript as the client sent it.
//!
//! What a name may reach: a request of the same key and agent, holding its messages whole
//! (a name never names a request that names another, so reading one back is one read). A
//! turn names the holder only while what it adds is short beside what the holder holds
//! ([`names_holder`]); past that it holds its transcript whole and later turns name it. A
//! transcript under [`NAMED_FROM_BYTES`] is stored whole, as before. The prune keeps a
//! session while a request of another session names one of its requests.
//!
//! A turn's leading messages (a Responses turn's instructions, sent with every call of the
//! Agents SDK's loop) are named the same way, only where its first messages are: a holder
//! keeps their digest beside them ([`LEADING_DIGEST`]), a turn naming the holder's names
//! them too when its own have that digest, and the lookup reads the digest from the index
//! as it reads the rest. A turn whose instructions differ from the holder's (instructions
//! that change each turn) holds its own; its transcript is named all the same.

use chrono::{DateTime, Utc};
use serde_json::Value;
use sha2::{Digest, Sha256};

use std::sync::Arc;

use super::HeldLeading;
use super::carried_digests::{CarriedDigests, CarriedTranscript, SentTranscript};
use crate::adapters::SharedHistory;
use crate::store::{INPUT_DIGEST, InputHolder, LEADING_DIGEST, PREFIX_LEN, PREFIX_OF, Store};

/// A transcript's text shorter than this is stored whole, with no digest: naming saves
/// nothing there, and the digest's index entry, at a random place in its b-tree, would
/// cost every short chat request a page more of the store's log (docs/profiling.md, the
/// eighty-third pass). A conversation crosses it within its first turns.
pub(super) const NAMED_FROM_BYTES: usize = 4_096;

/// How a turn with no session stores its transcript: its digest, when the next turn may
/// find it by it, and, when an earlier request holds its first messages, that request and
/// how many; the digest of its leading messages, when it has any and a digest, and whether
/// that request holds them too.
#[derive(Debug)]
pub struct NamedTranscript {
    pub digest: Option<String>,
    pub prefix: Option<(String, usize)>,
    leading_digest: Option<String>,
    names_leading: bool,
}

impl NamedTranscript {
    /// The stored input's members for this transcript, and how many of its first messages
    /// the input does not hold. A holder keeps its leading messages' digest beside them,
    /// for the turns naming it to compare their own with.
    pub fn store_in(&self, input: &mut Value) -> usize {
        if let Some(digest) = &self.digest {
            input[INPUT_DIGEST] = Value::String(digest.clone());
        }
        match &self.prefix {
            Some((holder, len)) => {
                input[PREFIX_OF] = Value::String(holder.clone());
                input[PREFIX_LEN] = Value::from(*len);
                *len
            }
            None => {
                if let Some(digest) = &self.leading_digest {
                    input[LEADING_DIGEST] = Value::String(digest.clone());
                }
                0
            }
        }
    }

    /// The request holding this turn's leading messages, when it is the one holding its
    /// first messages and they are the same ([`super::LEADING_OF`]).
    pub fn held_leading(&self) -> Option<HeldLeading> {
        let (holder, _) = self.prefix.as_ref().filter(|_| self.names_leading)?;
        Some(HeldLeading {
            request: holder.clone(),
            digest: self.leading_digest.clone()?,
        })
    }
}

/// Whether a turn of `total` messages names the request holding its first `held`, or holds
/// them all itself. Each turn naming a holder stores what it adds since the holder; each
/// holder stores everything. With at most ~2·√held added, a conversation of n turns stores
/// O(n^1.5) messages, not O(n²), and a run's start reads the holder and the turn alone.
fn names_holder(held: usize, total: usize) -> bool {
    held > 0 && held <= total && total - held <= 8 + 2 * held.isqrt()
}

/// A JSON text's SHA-256 in hex, and its length.
#[derive(Debug, Clone, PartialEq, Eq)]
struct TextDigest {
    hex: String,
    bytes: usize,
}

/// `messages` as JSON array items (the crate's writer, comma-separated, no brackets: what
/// `crate::json::write_array` writes between them), and where the items of the first
/// `before` messages end.
pub(super) fn written_items(messages: &[Value], before: Option<usize>) -> (String, Option<usize>) {
    let before = before.filter(|at| *at <= messages.len());
    let mut text = String::with_capacity(crate::adapters::estimated_text_bytes(messages));
    let split = before.unwrap_or(0);
    let (first, rest) = messages.split_at(split);
    crate::json::write_items(&mut text, 0, first, crate::json::write);
    let before_end = before.map(|_| text.len());
    crate::json::write_items(&mut text, split, rest, crate::json::write);
    (text, before_end)
}

/// The digest of the JSON array of `items` ([`written_items`]), and of the array of its
/// first items, up to `before`'s end, from one pass over the text, and the hasher's state
/// after the items (before the closing `]`), for the next turn to go on from. `carried`,
/// when given, is the state after `[` and the items up to its end
/// ([`CarriedDigests::take`]): only the rest is hashed, unless it ends past `before`.
fn digests(
    items: &str,
    carried: Option<(usize, Sha256)>,
    before: Option<usize>,
) -> (TextDigest, Option<TextDigest>, Sha256) {
    let finished = |hasher: &Sha256, items: usize| TextDigest {
        hex: crate::text::hex(&hasher.clone().chain_update(b"]").finalize()),
        bytes: items + 2,
    };
    let bytes = items.as_bytes();
    let before = before.filter(|end| *end <= bytes.len());
    let carried = carried.filter(|(end, _)| *end <= before.unwrap_or(bytes.len()));
    let (mut hashed, mut hasher) = carried.unwrap_or_else(|| (0, Sha256::new().chain_update(b"[")));
    let first = before.map(|end| {
        hasher.update(&bytes[hashed..end]);
        hashed = end;
        finished(&hasher, end)
    });
    hasher.update(&bytes[hashed..]);
    (finished(&hasher, bytes.len()), first, hasher)
}

/// The digest of `messages` as their JSON text, in hex: the one way this crate writes a
/// digest of messages (a transcript's here, a request's leading messages').
pub(super) fn digest_of(messages: &[Value]) -> String {
    digests(&written_items(messages, None).0, None, None).0.hex
}

/// Whether a request last written at `updated_at` may be named (or the request it names, which
/// it keeps from the prune) under a retention `window`: while younger than half of it, so no
/// prune can take it before the turn naming it is stored and keeps it in turn (the lookup
/// and the turn's write are not one transaction). Without a window nothing is pruned.
fn safe_from_the_prune(
    updated_at: DateTime<Utc>,
    window: Option<std::time::Duration>,
    now: DateTime<Utc>,
) -> bool {
    let Some(window) = window else {
        return true;
    };
    let half = chrono::Duration::from_std(window / 2).unwrap_or(chrono::Duration::MAX);
    now.signed_duration_since(updated_at) < half
}

/// A transcript's messages with their text written, where the newest answer is (past the
/// first message) and where the text of the messages before it ends, and the hasher's state
/// after `[` and its first items, carried on from the turn before, with where they end; and
/// the parsed messages' memory, estimated, when carried on (counted on from the turn
/// before's, not walked again).
struct Written {
    history: SharedHistory,
    newest_answer: Option<usize>,
    before_end: Option<usize>,
    state: Option<(usize, Sha256)>,
    parsed_bytes: Option<usize>,
}

/// Where the newest answer of the transcript `held` then `added` is, past its first message.
fn newest_answer(held: &[Value], added: &[Value]) -> Option<usize> {
    added
        .iter()
        .rposition(super::is_answer)
        .map(|at| at + held.len())
        .or_else(|| held.iter().rposition(super::is_answer))
        .filter(|at| *at > 0)
}

/// `messages`, after those of `continued` if it is given, with their text: written whole, or
/// on after the carried text when the newest answer is past it (the carried messages are
/// taken over, copied only if something else still shares them).
fn written(messages: Vec<Value>, continued: Option<CarriedTranscript>) -> Written {
    let Some(CarriedTranscript {
        history,
        state,
        parsed_bytes,
        ..
    }) = continued
    else {
        let newest_answer = newest_answer(&[], &messages);
        let (text, before_end) = written_items(&messages, newest_answer);
        return Written {
            history: SharedHistory::written(messages, Arc::new(text)),
            newest_answer,
            before_end,
            state: None,
            parsed_bytes: None,
        };
    };
    let mut history = Arc::unwrap_or_clone(history);
    let held = history.len();
    let newest = newest_answer(&history, &messages);
    // An answer among the carried messages (a turn that sent no answer since): the whole is
    // written again.
    if newest.is_some_and(|at| at < held) {
        let mut all = history.into_messages();
        all.extend(messages);
        return written(all, None);
    }
    let (_, held_end) = history.written_len();
    let added = super::history::estimated_messages_bytes(&messages);
    let before_end = history.append_written(messages, newest);
    Written {
        history,
        newest_answer: newest,
        before_end,
        state: state.map(|state| (held_end, state)),
        parsed_bytes: Some(parsed_bytes.saturating_add(added)),
    }
}

/// How a turn with no session, of `owner` and `agent`, stores `messages` (its whole
/// transcript after its `leading` messages, or the part after what it carries on from the
/// turn before, `sent`), and the messages shared with their JSON text, written once here for
/// the digest and for the model call, which writes it into its request rather than
/// serializing the messages again. The request it continues is the one whose messages are
/// this transcript's before its newest answer, looked up by their digest (one indexed read)
/// when they are long enough to have one ([`NAMED_FROM_BYTES`]). A failed read only stores
/// the transcript whole. The digest goes on from the hasher's state kept after the turn
/// before, when it kept one for the same first messages, and this turn's is kept for the
/// next, with the messages as sent and parsed for a chat turn (`sent`).
#[allow(clippy::too_many_arguments)]
pub async fn named(
    store: &dyn Store,
    carried: &CarriedDigests,
    owner: &str,
    agent: &str,
    window: Option<std::time::Duration>,
    leading: &[Value],
    messages: Vec<Value>,
    sent: Option<SentTranscript>,
) -> (NamedTranscript, Arc<SharedHistory>) {
    let (sent, continued) = sent.map_or((None, None), |sent| (Some(sent.sent), sent.carried));
    let Written {
        history,
        newest_answer,
        before_end,
        mut state,
        parsed_bytes,
    } = written(messages, continued);
    let mut named = NamedTranscript {
        digest: None,
        prefix: None,
        leading_digest: None,
        names_leading: false,
    };
    // Nothing shorter has a digest or is looked up (what comes before the newest answer is
    // shorter still): a short request, the common one, hashes nothing.
    let (_, text_bytes) = history.written_len();
    let history = Arc::new(history);
    if text_bytes + 2 >= NAMED_FROM_BYTES {
        if state.is_none()
            && let Some(end) = before_end
        {
            let taken = history.read_text(|text| {
                text.get(..end)
                    .and_then(|first| carried.take(owner, agent, first))
            });
            state = taken.map(|taken| (end, taken));
        }
        crate::metrics::transcript_digest(if state.is_some() { "carried" } else { "whole" });
        let (whole, before, state) = history.read_text(|text| digests(text, state, before_end));
        match sent {
            Some(sent) => {
                let parsed_bytes = parsed_bytes
                    .unwrap_or_else(|| super::history::estimated_messages_bytes(&history));
                carried.keep_sent(
                    owner,
                    agent,
                    sent,
                    Arc::clone(&history),
                    parsed_bytes,
                    Some(state),
                    None,
                );
            }
            None => carried.keep(owner, agent, history.written_text(), state),
        }
        named.digest = Some(whole.hex);
        named.leading_digest = (!leading.is_empty()).then(|| digest_of(leading));
        if let (Some(continued), Some(before)) = (newest_answer, before)
            && before.bytes >= NAMED_FROM_BYTES
        {
            let total = history.len();
            let found = held_before(store, owner, agent, &before.hex)
                .await
                .filter(|previous| safe_from_the_prune(previous.updated_at, window, Utc::now()));
            // The digest it keeps is of what the request holding its first messages leads
            // with (a holder's own, or the one it names too): ours, when they agree.
            let same_leading = found.as_ref().is_some_and(|previous| {
                named.leading_digest.is_some() && previous.leading_digest == named.leading_digest
            });
            named.prefix = found
                .and_then(|previous| match (previous.prefix_of, previous.prefix_len) {
                    // It holds its transcript whole: all of it is this one's first messages.
                    (None, _) => Some((previous.request_id, continued)),
                    (Some(holder), Some(len)) => Some((holder, usize::try_from(len).ok()?)),
                    (Some(_), None) => None,
                })
                .filter(|(_, held)| *held <= continued && names_holder(*held, total));
            named.names_leading = same_leading && named.prefix.is_some();
        }
    }
    (named, history)
}

/// The newest request of `owner` and `agent` whose transcript has `digest`; none when the
/// read fails (the turn is then stored whole).
async fn held_before(
    store: &dyn Store,
    owner: &str,
    agent: &str,
    digest: &str,
) -> Option<InputHolder> {
    store
        .input_holder(owner, agent, digest)
        .await
        .unwrap_or_else(|error| {
            tracing::warn!(%error, "could not look up the request a transcript continues; stored whole");
            None
        })
}

#[cfg(test)]
mod tests {
    use serde_json::json;
    use sha2::Digest;

    use std::sync::Arc;

    use sha2::Sha256;

    use super::{
        CarriedTranscript, TextDigest, Written, digests, names_holder, safe_from_the_prune,
        written, written_items,
    };

    /// One pass gives the digest of the whole transcript and of its first messages, each
    /// the SHA-256 and the length of the same text the crate's array writer writes, from
    /// the items written once.
    #[test]
    fn digests_are_those_of_the_written_arrays() {
        let messages = vec![
            json!({ "role": "system", "content": "Be brief." }),
            json!({ "role": "user", "content": "Hi \"there\"" }),
            json!({ "role": "assistant", "content": "Hello." }),
            json!({ "role": "user", "content": "Again" }),
        ];
        let of = |items: &[serde_json::Value]| {
            let mut text = String::new();
            crate::json::write_array(&mut text, items, crate::json::write);
            TextDigest {
                hex: crate::memory::sha256_hex(&text),
                bytes: text.len(),
            }
        };
        for before in 0..=messages.len() {
            let (text, before_end) = written_items(&messages, Some(before));
            let (whole, first, state) = digests(&text, None, before_end);
            assert_eq!(whole, of(&messages));
            assert_eq!(first, Some(of(&messages[..before])));
            // The state after the items goes on as hashing the array from the start does.
            let (more, _) = written_items(&messages[..1], None);
            let joined = format!("{text},{more}");
            let from_start = digests(&joined, None, Some(text.len()));
            let carried = digests(&joined, Some((text.len(), state)), Some(text.len()));
            assert_eq!((carried.0, carried.1), (from_start.0, from_start.1));
            assert_eq!(carried.2.finalize(), from_start.2.finalize());
            // The text is the array's items.
            let mut array = String::new();
            crate::json::write_array(&mut array, &messages, crate::json::write);
            assert_eq!(format!("[{text}]"), array);
        }
        assert_eq!(
            digests(&written_items(&messages, None).0, None, None).1,
            None
        );
        assert_ne!(of(&messages[..2]), of(&messages[..3]));
    }

    /// A transcript written on from the messages carried from the turn before is written as
    /// the whole would be: the same text, the same newest answer and end of what precedes
    /// it, and the same digests from the carried state, wherever the carried part ends
    /// (before an answer, after it, or after questions with no answer between).
    #[test]
    fn a_transcript_written_on_from_carried_messages_is_written_as_whole() {
        let messages = vec![
            json!({ "role": "user", "content": "Hi \"there\"" }),
            json!({ "role": "assistant", "content": "Hello.", "refusal": null }),
            json!({ "role": "user", "content": "Again" }),
            json!({ "role": "user", "content": "And again" }),
            json!({ "role": "assistant", "content": "Yes." }),
            json!({ "role": "user", "content": "Last" }),
        ];
        let of = |written: &Written| {
            let text = written.history.read_text(str::to_owned);
            let (whole, first, state) = written
                .history
                .read_text(|text| digests(text, written.state.clone(), written.before_end));
            (
                text,
                written.newest_answer,
                written.before_end,
                whole,
                first,
                state.finalize(),
            )
        };
        let whole = of(&written(messages.clone(), None));
        for held in 1..messages.len() {
            let before = written(messages[..held].to_vec(), None);
            let (text, _) = written_items(&messages[..held], None);
            let state = Sha256::new()
                .chain_update(b"[")
                .chain_update(text.as_bytes());
            let continued = CarriedTranscript {
                history: Arc::new(before.history),
                state: Some(state),
                parsed_bytes: 0,
                mark: None,
            };
            let on = written(messages[held..].to_vec(), Some(continued));
            assert_eq!(on.history[..], messages[..], "held {held}");
            assert_eq!(on.state.is_some(), held <= 4, "held {held}");
            // The parsed messages' memory counted on from the carried ones' (none here).
            let added = messages[held..]
                .iter()
                .map(crate::runtime::history::estimated_bytes)
                .sum::<usize>();
            assert_eq!(on.parsed_bytes, (held <= 4).then_some(added), "held {held}");
            assert_eq!(of(&on), whole, "held {held}");
        }
    }

    /// A turn names its holder while what it adds is short beside what is held, and never
    /// names one that holds nothing or more than the turn has.
    #[test]
    fn a_turn_names_its_holder_while_it_adds_little() {
        assert!(names_holder(2, 12));
        assert!(!names_holder(2, 13));
        assert!(names_holder(400, 448));
        assert!(!names_holder(400, 449));
        assert!(!names_holder(0, 3));
        assert!(!names_holder(5, 4));
    }

    /// A request is named only while younger than half its retention window (so no prune
    /// takes it before the naming turn is stored), and always without a window.
    #[test]
    fn a_request_is_named_while_far_from_the_prune() {
        let now = chrono::Utc::now();
        let day = std::time::Duration::from_secs(86_400);
        let aged = |hours: i64| now - chrono::Duration::hours(hours);
        assert!(safe_from_the_prune(aged(11), Some(day), now));
        assert!(!safe_from_the_prune(aged(13), Some(day), now));
        assert!(safe_from_the_prune(aged(24 * 365), None, now));
        assert!(safe_from_the_prune(
            aged(1),
            Some(std::time::Duration::MAX),
            now
        ));
    }
}
