//! A run's transcript: the messages its adapter is given and adds to.
//!
//! Why not a `Vec`: a long session's history is most of a run's transcript, and the server
//! keeps each recently continued session's history in memory (`runtime::history`). A run
//! that owned its transcript had that history copied for it (every message's map cloned)
//! and dropped after it: at 3,000 turns ~27% of the server's CPU a turn (docs/profiling.md,
//! the eightieth pass). Here the history is shared, never changed: what comes before it
//! (a request's leading system messages) and what follows it (the request's own messages,
//! then what the run adds) are the transcript's own.
//!
//! The shared history carries its JSON text too, written by the first model call that sends
//! it and extended by later ones: the next turn of the conversation serializes only what it
//! added, not the whole history again, though the model is sent all of it (at 5,000
//! messages, serializing it was ~30% of the server's CPU a turn: docs/profiling.md, the
//! eighty-second pass).
use std::borrow::Cow;
use std::ops::Deref;
use std::sync::{Arc, Mutex};

use serde::ser::{Serialize, Serializer};
use serde_json::Value;

/// OpenAI-style messages in order: `leading`, then the shared `history`, then `rest`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Transcript {
    leading: Vec<Value>,
    /// `None` for a request that continues no history (most): nothing allocated for it.
    history: Option<Arc<SharedHistory>>,
    rest: Vec<Value>,
}

impl Transcript {
    /// `leading`, the shared `history` (if any) and `rest`, in that order.
    pub fn new(leading: Vec<Value>, history: Option<Arc<SharedHistory>>, rest: Vec<Value>) -> Self {
        Self {
            leading,
            history,
            rest,
        }
    }

    pub fn len(&self) -> usize {
        self.leading.len() + self.history_len() + self.rest.len()
    }

    fn history_len(&self) -> usize {
        self.history.as_ref().map_or(0, |history| history.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every message, in order.
    pub fn iter(&self) -> impl DoubleEndedIterator<Item = &Value> + Clone + '_ {
        self.leading
            .iter()
            .chain(self.history.iter().flat_map(|history| history.iter()))
            .chain(self.rest.iter())
    }

    /// Adds `message` at the end.
    pub fn push(&mut self, message: Value) {
        self.rest.push(message);
    }

    /// The messages from `index` on (none past the end): borrowed when they all follow the
    /// shared history, as a run's own messages always do; else copied.
    pub fn tail_from(&self, index: usize) -> Cow<'_, [Value]> {
        let before_rest = self.leading.len() + self.history_len();
        match index.checked_sub(before_rest) {
            Some(at) => Cow::Borrowed(self.rest.get(at..).unwrap_or_default()),
            None => Cow::Owned(self.iter().skip(index).cloned().collect()),
        }
    }

    /// The messages as a `Vec` of their own (the history copied unless nothing else holds
    /// it).
    pub fn into_vec(self) -> Vec<Value> {
        let mut messages = self.leading;
        if let Some(history) = self.history {
            // Held elsewhere (kept), only the messages are copied, not the text beside them.
            match Arc::try_unwrap(history) {
                Ok(history) => messages.extend(history.messages),
                Err(shared) => messages.extend_from_slice(&shared.messages),
            }
        }
        messages.extend(self.rest);
        messages
    }
}

impl From<Vec<Value>> for Transcript {
    fn from(messages: Vec<Value>) -> Self {
        Self {
            rest: messages,
            ..Self::default()
        }
    }
}

impl Transcript {
    /// The JSON array of `first`, then the messages: what serializing them gives, the
    /// shared history's part written from its text ([`SharedHistory::write_items`]).
    pub fn write_array<'a>(&'a self, out: &mut String, first: impl IntoIterator<Item = &'a Value>) {
        // A comma before every item but the first.
        fn separated(out: &mut String, empty: &mut bool) {
            if !std::mem::replace(empty, false) {
                out.push(',');
            }
        }
        let mut empty = true;
        out.push('[');
        for message in first.into_iter().chain(&self.leading) {
            separated(out, &mut empty);
            crate::json::write(out, message);
        }
        if let Some(history) = self.history.as_ref().filter(|history| !history.is_empty()) {
            separated(out, &mut empty);
            history.write_items(out);
        }
        for message in &self.rest {
            separated(out, &mut empty);
            crate::json::write(out, message);
        }
        out.push(']');
    }

    /// The bytes the messages' JSON text takes, estimated from their contents: what a
    /// buffer writing them is sized for.
    pub fn estimated_text_bytes(&self) -> usize {
        let history = self
            .history
            .as_ref()
            .map_or(0, |history| history.estimated_text_bytes());
        estimated_text_bytes(&self.leading)
            .saturating_add(history)
            .saturating_add(estimated_text_bytes(&self.rest))
    }
}

/// The bytes `messages`' JSON text takes, estimated from their `content`.
pub fn estimated_text_bytes<'a>(messages: impl IntoIterator<Item = &'a Value>) -> usize {
    messages
        .into_iter()
        .map(|message| {
            message
                .get("content")
                .and_then(Value::as_str)
                .map_or(0, str::len)
                .saturating_add(64)
        })
        .fold(0, usize::saturating_add)
}

/// A history shared by the runs that continue it and the kept paths (`runtime::history`):
/// its messages, never changed once shared, and the JSON text of as many of them as a model
/// call has written. The history of a conversation's next turn is this one extended
/// ([`SharedHistory::extend`]), its text with it: only the added messages are written.
#[derive(Default)]
pub struct SharedHistory {
    messages: Vec<Value>,
    /// The request that stored the last message, when the history was read from the store.
    last_request: Option<String>,
    written: Mutex<WrittenText>,
}

/// The JSON text of a history's first `messages` messages, comma-separated, no brackets;
/// shared with what keeps it past the run (`runtime::carried_digests`), copied only if
/// still shared when more messages are written.
#[derive(Debug, Default, Clone)]
struct WrittenText {
    text: Arc<String>,
    messages: usize,
}

impl SharedHistory {
    /// `messages` with their JSON text written already: `text` must be what writing them as
    /// array items gives (comma-separated, no brackets), as a turn with no session writes it
    /// for its digest (`runtime::named_transcripts`, tested there); a model call sends it as
    /// it is.
    pub(crate) fn written(messages: Vec<Value>, text: Arc<String>) -> Self {
        let count = messages.len();
        Self {
            messages,
            last_request: None,
            written: Mutex::new(WrittenText {
                text,
                messages: count,
            }),
        }
    }

    /// Adds messages at the end; the text written so far stays the text of the messages it
    /// was written from.
    pub fn extend(&mut self, messages: impl IntoIterator<Item = Value>) {
        self.messages.extend(messages);
    }

    /// Adds `messages` at the end with their text, written on after the text of those held
    /// (copied first only if something else still shares it), and gives where the text of
    /// the messages before `mark` ends, when `mark` is at or past the first added (none
    /// otherwise: that text was written before).
    pub(crate) fn append_written(
        &mut self,
        messages: Vec<Value>,
        mark: Option<usize>,
    ) -> Option<usize> {
        let WrittenText {
            text,
            messages: written,
        } = self
            .written
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let text = Arc::make_mut(text);
        // Any held but unwritten first, so the text covers every message before the new.
        let unwritten = self.messages.get(*written..).unwrap_or_default();
        crate::json::write_items(text, *written, unwritten, crate::json::write);
        let held = self.messages.len();
        let split = mark
            .and_then(|mark| mark.checked_sub(held))
            .map_or(0, |split| split.min(messages.len()));
        let (first, rest) = messages.split_at(split);
        crate::json::write_items(text, held, first, crate::json::write);
        let mark_end = mark.filter(|mark| *mark >= held).map(|_| text.len());
        crate::json::write_items(text, held + split, rest, crate::json::write);
        self.messages.extend(messages);
        *written = self.messages.len();
        mark_end
    }

    /// `read` applied to the text written so far.
    pub(crate) fn read_text<T>(&self, read: impl FnOnce(&str) -> T) -> T {
        read(&self.text().text)
    }

    /// How many of the first messages the text holds, and its length.
    pub(crate) fn written_len(&self) -> (usize, usize) {
        let written = self.text();
        (written.messages, written.text.len())
    }

    /// The messages, taken out.
    pub(crate) fn into_messages(self) -> Vec<Value> {
        self.messages
    }

    /// The text written so far, shared.
    pub(crate) fn written_text(&self) -> Arc<String> {
        Arc::clone(&self.text().text)
    }

    /// The memory the written text holds (its capacity).
    pub(crate) fn text_capacity(&self) -> usize {
        self.text().text.capacity()
    }

    /// The request that stored the last message (as read from the store), if known.
    pub fn last_request(&self) -> Option<&str> {
        self.last_request.as_deref()
    }

    /// Names the request that stored the last message, once messages read are added.
    pub fn set_last_request(&mut self, request: Option<String>) {
        self.last_request = request;
    }

    /// The written text, locked.
    fn text(&self) -> std::sync::MutexGuard<'_, WrittenText> {
        crate::threads::locked(&self.written)
    }

    /// Writes the messages as JSON array items, comma-separated: their text written before,
    /// and the messages after it written now and added to it, once.
    fn write_items(&self, out: &mut String) {
        let mut written = self.text();
        let WrittenText { text, messages } = &mut *written;
        let unwritten = self.messages.get(*messages..).unwrap_or_default();
        if !unwritten.is_empty() {
            let text = Arc::make_mut(text);
            crate::json::write_items(text, *messages, unwritten, crate::json::write);
            *messages += unwritten.len();
        }
        out.push_str(text);
    }

    /// The bytes the messages' text takes: as written, and estimated for those not yet.
    fn estimated_text_bytes(&self) -> usize {
        let written = self.text();
        let unwritten = self.messages.get(written.messages..).unwrap_or_default();
        estimated_text_bytes(unwritten).saturating_add(written.text.len())
    }
}

/// The messages' count and the text's length: the messages themselves may be megabytes.
impl std::fmt::Debug for SharedHistory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let written = self.text();
        f.debug_struct("SharedHistory")
            .field("messages", &self.messages.len())
            .field("written_messages", &written.messages)
            .field("written_bytes", &written.text.len())
            .finish()
    }
}

impl Clone for SharedHistory {
    fn clone(&self) -> Self {
        Self {
            messages: self.messages.clone(),
            last_request: self.last_request.clone(),
            written: Mutex::new(self.text().clone()),
        }
    }
}

impl PartialEq for SharedHistory {
    fn eq(&self, other: &Self) -> bool {
        self.messages == other.messages
    }
}

impl Deref for SharedHistory {
    type Target = [Value];

    fn deref(&self) -> &[Value] {
        &self.messages
    }
}

impl From<Vec<Value>> for SharedHistory {
    fn from(messages: Vec<Value>) -> Self {
        Self {
            messages,
            last_request: None,
            written: Mutex::default(),
        }
    }
}

/// A JSON array of the messages, as the `Vec` would be (a checkpoint, a remote agent's run).
impl Serialize for Transcript {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(self.iter())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn said(transcript: &Transcript) -> Vec<&str> {
        transcript
            .iter()
            .map(|m| m["content"].as_str().unwrap_or_default())
            .collect()
    }

    fn message(text: &str) -> Value {
        json!({ "role": "user", "content": text })
    }

    /// The parts read as one list, in order, whichever are empty; what is pushed comes last;
    /// the history is shared with whoever holds it, never copied, and the whole serializes
    /// as the `Vec` it stands for.
    #[test]
    fn a_transcript_reads_as_its_parts_in_order_sharing_its_history() {
        let history = Arc::new(SharedHistory::from(vec![message("h1"), message("h2")]));
        let mut transcript = Transcript::new(
            vec![message("lead")],
            Some(Arc::clone(&history)),
            vec![message("own")],
        );
        transcript.push(message("added"));
        assert_eq!(said(&transcript), ["lead", "h1", "h2", "own", "added"]);
        assert_eq!(transcript.len(), 5);
        assert_eq!(
            transcript
                .iter()
                .next_back()
                .and_then(|m| m["content"].as_str()),
            Some("added")
        );
        let shared = transcript.history.as_ref();
        assert!(
            shared.is_some_and(|shared| Arc::ptr_eq(&history, shared)),
            "shared, not copied"
        );
        let whole: Vec<Value> = transcript.iter().cloned().collect();
        assert_eq!(
            serde_json::to_value(&transcript).unwrap(),
            Value::Array(whole.clone())
        );

        // The tail after the history is borrowed; one reaching into it is copied; past the
        // end there is none.
        assert!(matches!(transcript.tail_from(3), Cow::Borrowed(tail) if tail.len() == 2));
        assert_eq!(transcript.tail_from(2).as_ref(), &whole[2..]);
        assert_eq!(transcript.tail_from(0).as_ref(), whole.as_slice());
        assert!(transcript.tail_from(5).is_empty());
        assert!(transcript.tail_from(9).is_empty());

        // As a `Vec`: the same messages, whether or not another holds the history.
        assert_eq!(transcript.clone().into_vec(), whole);
        drop(history);
        assert_eq!(transcript.into_vec(), whole);
        assert!(Transcript::from(Vec::new()).is_empty());
        assert_eq!(said(&Transcript::from(vec![message("a")])), ["a"]);
    }

    fn written(transcript: &Transcript, first: &[Value]) -> String {
        let mut out = String::new();
        transcript.write_array(&mut out, first);
        out
    }

    /// The messages are written as serializing them writes them, whichever parts are empty;
    /// the shared history's text is written once and extended with what is added to it, a
    /// copy of it carrying it along.
    #[test]
    fn a_transcript_is_written_as_its_messages_serialize_its_history_text_once() {
        let odd = json!({ "role": "assistant", "content": "q\"\\ \n\u{1} é", "refusal": null });
        let lead = vec![json!({ "role": "system", "content": "s" })];
        for first in [vec![], vec![message("first")]] {
            for leading in [vec![], lead.clone()] {
                for history in [vec![], vec![message("h1"), odd.clone()]] {
                    for rest in [vec![], vec![message("own")]] {
                        let shared = Arc::new(SharedHistory::from(history.clone()));
                        let transcript =
                            Transcript::new(leading.clone(), Some(shared), rest.clone());
                        let all: Vec<&Value> = first.iter().chain(transcript.iter()).collect();
                        let expected = serde_json::to_string(&all).unwrap();
                        assert_eq!(written(&transcript, &first), expected);
                        assert_eq!(written(&transcript, &first), expected, "from its text");
                    }
                }
            }
        }

        let transcript = Transcript::new(
            Vec::new(),
            Some(Arc::new(SharedHistory::from(vec![message("h1"), odd]))),
            Vec::new(),
        );
        written(&transcript, &[]);
        let Some(shared) = transcript.history else {
            panic!("a shared history")
        };
        let text = serde_json::to_string(&*shared.messages).unwrap();
        assert_eq!(shared.text().text.as_str(), &text[1..text.len() - 1]);
        assert_eq!(shared.estimated_text_bytes(), text.len() - 2);
        // The next turn's history: this one, its text carried by a copy, then extended.
        let mut history = (*shared).clone();
        history.extend([message("h3")]);
        assert_eq!(
            history.text().messages,
            2,
            "the copy carries the text written"
        );
        let next = Transcript::new(Vec::new(), Some(Arc::new(history)), vec![message("own")]);
        let expected = serde_json::to_string(&next.iter().collect::<Vec<_>>()).unwrap();
        assert_eq!(written(&next, &[]), expected);
    }
}
