//! Where a request's transcript is held when another request holds its first messages: the
//! members of a request's input that say so, the store's lookup of the request a turn
//! continues ([`super::Store::input_holder`]), and a stored request's messages read back
//! whole. A chat with no session stores each turn as what it adds to an earlier request's
//! transcript (`runtime::named_transcripts`, docs/profiling.md, the eighty-third pass).
//!
//! The rules every store keeps: a request named holds its messages whole (it names none),
//! is the same key's and agent's, and is never removed while a request of another session
//! names it (the prune's condition), so a read back is one read and always finds it. A
//! turn's leading messages (a Responses turn's instructions) are named across sessions
//! only where its first messages are ([`joined_leading`]), so the same condition keeps
//! them.

use serde_json::Value;

use super::{RequestRecord, Store, StoreError};

/// The member of a request's input holding the messages its transcript starts with, before
/// any history: they are the request's own and never stored in the session (a Responses
/// turn's `instructions`).
pub const LEADING: &str = "leading";

/// The member of a request's input naming, instead of holding them, the request whose input
/// holds its leading messages ([`LEADING`]), the same as its own: the turn before in its
/// session (a Responses chain's turn, docs/profiling.md, the eighty-first pass), or with no
/// session the request its [`PREFIX_OF`] names (the eighty-fourth pass).
pub const LEADING_OF: &str = "leadingOf";

/// The member of a request's input holding the SHA-256 of its leading messages, where a
/// later turn compares its own with them, reading nothing: beside [`LEADING_OF`], and
/// beside [`LEADING`] in a request a later turn with no session may name for them (one
/// with an [`INPUT_DIGEST`] that names no other, [`joined_leading`]).
pub const LEADING_DIGEST: &str = "leadingDigest";

/// The member of a request's input holding the digest of the transcript it brought (its
/// `messages`, whole), where a later turn of a chat with no session finds it by
/// ([`Store::input_holder`]). It, [`PREFIX_OF`], [`PREFIX_LEN`] and [`LEADING_DIGEST`] are
/// repeated in columns on the embedded store, where the lookup and the prune read no
/// input; PostgreSQL indexes the first two and the lookup reads the found row's input.
pub const INPUT_DIGEST: &str = "inputDigest";
/// The member of a request's input naming the request whose input holds, whole, the first
/// messages of its transcript ([`PREFIX_LEN`] of them): its own `messages` are the rest.
pub const PREFIX_OF: &str = "prefixOf";
/// How many of its transcript's first messages a request names ([`PREFIX_OF`]).
pub const PREFIX_LEN: &str = "prefixLen";

/// What a request's input says of where its transcript is held ([`INPUT_DIGEST`],
/// [`PREFIX_OF`], [`PREFIX_LEN`], and for a request a later turn may find, its
/// [`LEADING_DIGEST`]), as the embedded store writes it beside the input.
#[derive(Debug)]
pub struct NamedInput<'a> {
    pub input_digest: Option<&'a str>,
    pub prefix_of: Option<&'a str>,
    pub prefix_len: Option<i64>,
    pub leading_digest: Option<&'a str>,
}

impl<'a> NamedInput<'a> {
    pub fn of(input: &'a Value) -> Self {
        let input_digest = input.get(INPUT_DIGEST).and_then(Value::as_str);
        Self {
            input_digest,
            prefix_of: input.get(PREFIX_OF).and_then(Value::as_str),
            prefix_len: input.get(PREFIX_LEN).and_then(Value::as_i64),
            // Only a request the lookup may find needs it beside the digest.
            leading_digest: input_digest
                .and(input.get(LEADING_DIGEST))
                .and_then(Value::as_str),
        }
    }
}

/// The newest request whose transcript had a digest a later turn looked up
/// ([`Store::input_holder`]), when it was last written (how near the prune it is), where
/// its first messages are held, if another request holds them ([`PREFIX_OF`]), and the
/// digest of the leading messages the request holding them holds, when they are this
/// one's ([`LEADING_DIGEST`]).
#[derive(Debug)]
pub struct InputHolder {
    pub request_id: String,
    pub updated_at: chrono::DateTime<chrono::Utc>,
    pub prefix_of: Option<String>,
    pub prefix_len: Option<i64>,
    pub leading_digest: Option<String>,
}

/// A stored request's messages: those its input holds, after the first ones of the request
/// it names ([`PREFIX_OF`]), read here.
pub async fn stored_messages(
    store: &dyn Store,
    request: &RequestRecord,
) -> Result<Vec<Value>, StoreError> {
    joined_messages(request, holder_of(store, request).await?.as_ref())
}

/// The request `request` names for its transcript's first messages ([`PREFIX_OF`]), read;
/// `None` when it names none or that one is not there.
pub async fn holder_of(
    store: &dyn Store,
    request: &RequestRecord,
) -> Result<Option<RequestRecord>, StoreError> {
    match NamedInput::of(&request.input).prefix_of {
        Some(holder) => store.request(holder).await,
        None => Ok(None),
    }
}

/// `request`'s messages given the request its input names (`holder`, read by the caller;
/// `None` when it names none or that one is not there). The holder must be the same key's
/// and agent's and hold them; a request that names what is not there (nothing this server
/// writes) fails its read rather than give a run, a response or an archive another
/// transcript.
pub fn joined_messages(
    request: &RequestRecord,
    holder: Option<&RequestRecord>,
) -> Result<Vec<Value>, StoreError> {
    let own = request.input.get("messages").and_then(Value::as_array);
    let named = NamedInput::of(&request.input);
    let Some(holder_id) = named.prefix_of else {
        return Ok(own.cloned().unwrap_or_default());
    };
    let first = holder
        .filter(|held| holds_for(held, request, holder_id))
        .and_then(|held| {
            let messages = held.input.get("messages")?.as_array()?;
            messages.get(..usize::try_from(named.prefix_len?).ok()?)
        });
    let Some(first) = first else {
        return Err(StoreError::Corrupt(format!(
            "request {} names request {holder_id} for the first messages of its transcript, and that request does not hold them",
            request.id
        )));
    };
    let mut messages = Vec::with_capacity(first.len() + own.map_or(0, Vec::len));
    messages.extend_from_slice(first);
    messages.extend(own.into_iter().flatten().cloned());
    Ok(messages)
}

/// Whether `holder` is the request `id` that `request` names and may hold what it names
/// (its first messages, its leading ones): the same key's and agent's, naming none itself,
/// so that a read back is this one read.
fn holds_for(holder: &RequestRecord, request: &RequestRecord, id: &str) -> bool {
    holder.id == id
        && holder.owner == request.owner
        && holder.agent_id == request.agent_id
        && holder.input.get(PREFIX_OF).is_none()
}

/// Whether `request` names its leading messages ([`LEADING_OF`]) where its first messages
/// are held ([`PREFIX_OF`]): the one name of a leading request that may cross sessions.
pub fn names_leading_with_prefix(request: &RequestRecord) -> bool {
    let input = &request.input;
    input.get(LEADING_OF).is_some() && input.get(LEADING_OF) == input.get(PREFIX_OF)
}

/// The leading messages of `request`, which names them where its first messages are held
/// ([`names_leading_with_prefix`]), given that request (`holder`, read by the caller;
/// `None` when it is not there): it must hold them, with the digest `request` keeps. A
/// request naming what is not there (nothing this server writes) fails its read, as
/// [`joined_messages`] does, rather than give a run or a response no instructions.
pub fn joined_leading<'h>(
    request: &RequestRecord,
    holder: Option<&'h RequestRecord>,
) -> Result<&'h Vec<Value>, StoreError> {
    let input = &request.input;
    let named = input
        .get(LEADING_OF)
        .and_then(Value::as_str)
        .unwrap_or_default();
    let digest = input
        .get(LEADING_DIGEST)
        .filter(|digest| digest.is_string());
    holder
        .filter(|held| {
            holds_for(held, request, named)
                && digest.is_some()
                && held.input.get(LEADING_DIGEST) == digest
        })
        .and_then(|held| held.input.get(LEADING)?.as_array())
        .ok_or_else(|| {
            StoreError::Corrupt(format!(
                "request {} names request {named} for its leading messages, and that request does not hold them",
                request.id
            ))
        })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::{
        LEADING, LEADING_DIGEST, LEADING_OF, PREFIX_LEN, PREFIX_OF, joined_leading,
        names_leading_with_prefix,
    };
    use crate::store::test_records::request;

    /// Leading messages named across sessions are read only from the request holding the
    /// first messages, of the same key and agent, naming none, with the same digest; any
    /// other is a failed read, never a run with no instructions.
    #[test]
    fn leading_messages_named_with_the_prefix_are_read_only_from_their_holder() {
        let rules = json!([{ "role": "system", "content": "Be brief." }]);
        let mut holder = request("req_1", "ses_1");
        holder.input = json!({ "messages": [], LEADING: rules, LEADING_DIGEST: "l1" });
        let mut naming = request("req_2", "ses_2");
        naming.input = json!({ "messages": [], PREFIX_OF: "req_1", PREFIX_LEN: 0,
            LEADING_OF: "req_1", LEADING_DIGEST: "l1" });
        assert!(names_leading_with_prefix(&naming));
        let read = |holder: &crate::store::RequestRecord| {
            joined_leading(&naming, Some(holder)).ok().cloned()
        };
        assert_eq!(read(&holder).map(serde_json::Value::Array), Some(rules));
        assert!(joined_leading(&naming, None).is_err());
        let altered: [fn(&mut crate::store::RequestRecord); 5] = [
            |held| held.input[LEADING_DIGEST] = json!("l2"),
            |held| held.owner = "another key".into(),
            |held| held.agent_id = "another agent".into(),
            |held| held.input[PREFIX_OF] = json!("req_0"),
            |held| held.id = "req_3".into(),
        ];
        for alter in altered {
            let mut other = holder.clone();
            alter(&mut other);
            assert_eq!(read(&other), None, "{other:?}");
        }
        // Named in its session (a chain's turn), or nothing named: not this rule.
        naming.input[LEADING_OF] = json!("req_0");
        assert!(!names_leading_with_prefix(&naming));
        naming.input.as_object_mut().unwrap().remove(LEADING_OF);
        assert!(!names_leading_with_prefix(&naming));
    }
}
