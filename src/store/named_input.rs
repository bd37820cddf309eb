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
//! only where its first messages are ([`leading_held_by`]), so the same condition keeps
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
/// with an [`INPUT_DIGEST`] that names no other, [`leading_held_by`]).
pub const LEADING_DIGEST: &str = "leadingDigest";

/// The member of a request's input holding the digest of the transcript it brought (its
/// `messages`, whole), where a later turn of a chat with no session finds it by
/// ([`Store::input_holder`]). It, [`PREFIX_OF`], [`PREFIX_LEN`] and [`LEADING_DIGEST`] are
/// repeated in columns
/// (the embedded store) or indexed (PostgreSQL), so a lookup or a prune finds its rows
/// without reading any input.
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
    let holder = match NamedInput::of(&request.input).prefix_of {
        Some(holder) => store.request(holder).await?,
        None => None,
    };
    joined_messages(request, holder.as_ref())
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
    // A holder names none: a read back is this one read.
    let first = holder
        .filter(|held| {
            held.id == holder_id
                && held.owner == request.owner
                && held.agent_id == request.agent_id
                && held.input.get(PREFIX_OF).is_none()
        })
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

/// The leading messages of `request` that `holder` holds for it, when `request` names them
/// across sessions ([`LEADING_OF`] naming its [`PREFIX_OF`]): the same key's and agent's
/// request, naming none, holding them with the digest `request` keeps. `None` when
/// `request` names none so, or `holder` is not the one or does not hold them.
pub fn leading_held_by<'h>(
    request: &RequestRecord,
    holder: &'h RequestRecord,
) -> Option<&'h Vec<Value>> {
    let input = &request.input;
    let named = input.get(LEADING_OF).and_then(Value::as_str)?;
    (NamedInput::of(input).prefix_of == Some(named)
        && holder.id == named
        && holder.owner == request.owner
        && holder.agent_id == request.agent_id
        && holder.input.get(PREFIX_OF).is_none()
        && holder.input.get(LEADING_DIGEST).is_some()
        && holder.input.get(LEADING_DIGEST) == input.get(LEADING_DIGEST))
    .then(|| holder.input.get(LEADING)?.as_array())?
}
