//! A run's transcript: the messages its adapter is given and adds to.
//!
//! Why not a `Vec`: a long session's history is most of a run's transcript, and the server
//! keeps each recently continued session's history in memory (`runtime::history`). A run
//! that owned its transcript had that history copied for it (every message's map cloned)
//! and dropped after it: at 3,000 turns ~27% of the server's CPU a turn (docs/profiling.md,
//! the eightieth pass). Here the history is shared, never changed: what comes before it
//! (a request's leading system messages) and what follows it (the request's own messages,
//! then what the run adds) are the transcript's own.
use std::borrow::Cow;
use std::sync::Arc;

use serde::ser::{Serialize, Serializer};
use serde_json::Value;

/// OpenAI-style messages in order: `leading`, then the shared `history`, then `rest`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Transcript {
    leading: Vec<Value>,
    /// `None` for a request that continues no history (most): nothing allocated for it.
    history: Option<Arc<Vec<Value>>>,
    rest: Vec<Value>,
}

impl Transcript {
    /// `leading`, the shared `history` (if any) and `rest`, in that order.
    pub fn new(leading: Vec<Value>, history: Option<Arc<Vec<Value>>>, rest: Vec<Value>) -> Self {
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
            messages.extend(Arc::unwrap_or_clone(history));
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
        let history = Arc::new(vec![message("h1"), message("h2")]);
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
}
