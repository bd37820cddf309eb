//! Where a request's transcript is held when another request holds its first messages: the
//! members of a request's input that say so, the store's lookup of the request a turn
//! continues ([`super::Store::input_holder`]), and a stored request's messages read back
//! whole. A chat with no session stores each turn as what it adds to an earlier request's
//! transcript (`runtime::named_transcripts`, docs/profiling.md, the eighty-third pass).
//!
//! The rules every store keeps: a request named holds its messages whole (it names none),
//! is the same key's and agent's, and is never removed while a request of another session
//! names it (the prune's condition), so a read back is one read and always finds it.

use serde_json::Value;

use super::{RequestRecord, Store, StoreError};

/// The member of a request's input holding the digest of the transcript it brought (its
/// `messages`, whole), where a later turn of a chat with no session finds it by
/// ([`Store::input_holder`]). It and [`PREFIX_OF`], [`PREFIX_LEN`] are repeated in columns
/// (the embedded store) or indexed (PostgreSQL), so a lookup or a prune finds its rows
/// without reading any input.
pub const INPUT_DIGEST: &str = "inputDigest";
/// The member of a request's input naming the request whose input holds, whole, the first
/// messages of its transcript ([`PREFIX_LEN`] of them): its own `messages` are the rest.
pub const PREFIX_OF: &str = "prefixOf";
/// How many of its transcript's first messages a request names ([`PREFIX_OF`]).
pub const PREFIX_LEN: &str = "prefixLen";

/// What a request's input says of where its transcript is held ([`INPUT_DIGEST`],
/// [`PREFIX_OF`], [`PREFIX_LEN`]), as the embedded store writes it beside the input.
#[derive(Debug)]
pub struct NamedInput<'a> {
    pub input_digest: Option<&'a str>,
    pub prefix_of: Option<&'a str>,
    pub prefix_len: Option<i64>,
}

impl<'a> NamedInput<'a> {
    pub fn of(input: &'a Value) -> Self {
        Self {
            input_digest: input.get(INPUT_DIGEST).and_then(Value::as_str),
            prefix_of: input.get(PREFIX_OF).and_then(Value::as_str),
            prefix_len: input.get(PREFIX_LEN).and_then(Value::as_i64),
        }
    }
}

/// The newest request whose transcript had a digest a later turn looked up
/// ([`Store::input_holder`]), when it was last written (how near the prune it is), and where
/// its first messages are held, if another request holds them ([`PREFIX_OF`]).
#[derive(Debug)]
pub struct InputHolder {
    pub request_id: String,
    pub updated_at: chrono::DateTime<chrono::Utc>,
    pub prefix_of: Option<String>,
    pub prefix_len: Option<i64>,
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
