//! A Responses call's `input`: parsed straight into the members its conversion reads, then
//! turned into a Chat Completions transcript.
//!
//! An agent's loop sends its whole conversation as input items every call. Parsed into a
//! JSON tree, each item was a map with a key string and a node per member (every `id`,
//! `status`, `annotations` and `logprobs` built and dropped), then copied into a chat
//! message: most of a long loop's CPU (docs/profiling.md, the eighty-fifth pass). Here an
//! item is parsed into the members the conversion reads (its type, role, texts and call
//! fields); the others are parsed and dropped as they are read, never built.
//!
//! Parsing never judges an item: a member of an unexpected type is read as such, and the
//! conversion makes of it what it made of the tree's (a message's role or content, or a
//! call's id or name, refused naming the item; other members passed over or taken as
//! empty). A member given twice keeps its last value, as a JSON tree keeps it. Members not
//! read are still parsed, and dropped at once ([`Skipped`]): a body this parse takes is one
//! the tree's would take.

use std::collections::HashSet;
use std::fmt;

use serde::de::{Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Value, json};

use super::v1::v1_error;
use crate::error::{ApiError, ErrorCode};
use crate::json::object;

/// `input`: a string, a list of items, or anything else (absent, null, a number, an object),
/// which the conversion refuses. It is read as any member is.
pub type ResponseInput = Member<InputItem>;

/// A member of an item or of a part, as far as the conversion reads it: a string, a list of
/// `P`, or something else. A member read only as text is a `Member<Skipped>`, its list's
/// elements parsed and dropped.
#[derive(Debug, Default, PartialEq)]
pub enum Member<P> {
    #[default]
    Absent,
    Text(String),
    List(Vec<P>),
    /// Present but neither: null, a boolean, a number or an object.
    Other,
}

/// A member read only as text.
type Text = Member<Skipped>;

impl<P> Member<P> {
    fn into_text(self) -> Option<String> {
        match self {
            Member::Text(text) => Some(text),
            _ => None,
        }
    }
}

/// One input item: a message, a `function_call`, a `function_call_output`, or an item the
/// conversion passes over (`reasoning`, an unknown type, or no object at all). Its type and
/// role are read as what they name, no string kept: a long input holds thousands of items.
#[derive(Debug, Default)]
pub struct InputItem {
    kind: ItemKind,
    role: Role,
    content: Member<Part>,
    call_id: Text,
    name: Text,
    /// Any JSON value, present (null included) or not.
    arguments: Option<Value>,
    output: Member<Part>,
}

/// What an item's `type` names.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
enum ItemKind {
    /// Absent or not a string: the item is a message when it has a role.
    #[default]
    Unnamed,
    Message,
    FunctionCall,
    FunctionCallOutput,
    /// A type this surface passes over (`reasoning`, `item_reference`, ...).
    Other,
}

/// A message's role, in Chat Completions' names.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
enum Role {
    #[default]
    Absent,
    System,
    User,
    Assistant,
    /// Present, but none of the roles a Responses message may have (or not a string).
    Invalid,
}

/// What a part's `type` names.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
enum PartKind {
    /// Absent, another type (`input_file`, ...), or not a string: the part is left out.
    #[default]
    Other,
    Text,
    Image,
}

/// A member read as one of a few names; `NOT_TEXT` is what a value that is no string reads
/// as.
trait Named: Sized {
    const NOT_TEXT: Self;
    fn named(text: &str) -> Self;
}

impl Named for ItemKind {
    const NOT_TEXT: Self = ItemKind::Unnamed;
    fn named(text: &str) -> Self {
        match text {
            "message" => ItemKind::Message,
            "function_call" => ItemKind::FunctionCall,
            "function_call_output" => ItemKind::FunctionCallOutput,
            _ => ItemKind::Other,
        }
    }
}

impl Named for Role {
    const NOT_TEXT: Self = Role::Invalid;
    fn named(text: &str) -> Self {
        match text {
            "developer" | "system" => Role::System,
            "user" => Role::User,
            "assistant" => Role::Assistant,
            _ => Role::Invalid,
        }
    }
}

impl Named for PartKind {
    const NOT_TEXT: Self = PartKind::Other;
    fn named(text: &str) -> Self {
        match text {
            "input_text" | "output_text" | "text" => PartKind::Text,
            "input_image" => PartKind::Image,
            _ => PartKind::Other,
        }
    }
}

/// A part of a message's content or of a call's output.
#[derive(Debug, Default, PartialEq)]
pub struct Part {
    kind: PartKind,
    text: Text,
    image_url: Text,
    /// Any JSON value, present (null included) or not.
    detail: Option<Value>,
}

/// The members an item or a part is read for; every other key's value is skipped.
enum Key {
    Type,
    Role,
    Content,
    CallId,
    Name,
    Arguments,
    Output,
    Text,
    ImageUrl,
    Detail,
    Other,
}

impl<'de> Deserialize<'de> for Key {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct KeyVisitor;
        impl Visitor<'_> for KeyVisitor {
            type Value = Key;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a member's name")
            }
            fn visit_str<E: serde::de::Error>(self, key: &str) -> Result<Key, E> {
                Ok(match key {
                    "type" => Key::Type,
                    "role" => Key::Role,
                    "content" => Key::Content,
                    "call_id" => Key::CallId,
                    "name" => Key::Name,
                    "arguments" => Key::Arguments,
                    "output" => Key::Output,
                    "text" => Key::Text,
                    "image_url" => Key::ImageUrl,
                    "detail" => Key::Detail,
                    _ => Key::Other,
                })
            }
        }
        deserializer.deserialize_identifier(KeyVisitor)
    }
}

/// The visitor methods of a value that is neither a string, a list nor an object, each
/// giving `$other`: what a visitor reading any JSON value makes of the rest.
macro_rules! scalars_give {
    ($other:expr) => {
        fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<Self::Value, E> {
            Ok($other)
        }
        fn visit_i64<E: serde::de::Error>(self, _: i64) -> Result<Self::Value, E> {
            Ok($other)
        }
        fn visit_u64<E: serde::de::Error>(self, _: u64) -> Result<Self::Value, E> {
            Ok($other)
        }
        fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<Self::Value, E> {
            Ok($other)
        }
        fn visit_unit<E: serde::de::Error>(self) -> Result<Self::Value, E> {
            Ok($other)
        }
    };
}

/// A value read and dropped. It is parsed as a JSON tree's would be (its numbers' range,
/// its strings' escapes and UTF-8, its depth), so that a body this parse takes is one a tree
/// would take; serde's `IgnoredAny` checks none of them. Nothing of it is kept.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct Skipped;

impl<'de> Deserialize<'de> for Skipped {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct SkippedVisitor;
        impl<'de> Visitor<'de> for SkippedVisitor {
            type Value = Skipped;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("any JSON value")
            }
            scalars_give!(Skipped);
            fn visit_str<E: serde::de::Error>(self, _: &str) -> Result<Skipped, E> {
                Ok(Skipped)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Skipped, A::Error> {
                skip_list(seq).map(|()| Skipped)
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Skipped, A::Error> {
                skip_map(map).map(|()| Skipped)
            }
        }
        deserializer.deserialize_any(SkippedVisitor)
    }
}

/// Reads a list's elements as `T`.
fn read_list<'de, T: Deserialize<'de>, A: SeqAccess<'de>>(mut seq: A) -> Result<Vec<T>, A::Error> {
    let mut list = Vec::new();
    while let Some(element) = seq.next_element()? {
        list.push(element);
    }
    Ok(list)
}

/// Parses a list's elements and drops them.
fn skip_list<'de, A: SeqAccess<'de>>(mut seq: A) -> Result<(), A::Error> {
    while seq.next_element::<Skipped>()?.is_some() {}
    Ok(())
}

/// Skips an object's members.
fn skip_map<'de, A: MapAccess<'de>>(mut map: A) -> Result<(), A::Error> {
    while map.next_entry::<Skipped, Skipped>()?.is_some() {}
    Ok(())
}

impl<'de, P: Deserialize<'de>> Deserialize<'de> for Member<P> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct MemberVisitor<P>(std::marker::PhantomData<P>);
        impl<'de, P: Deserialize<'de>> Visitor<'de> for MemberVisitor<P> {
            type Value = Member<P>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("any JSON value")
            }
            scalars_give!(Member::Other);
            fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<Member<P>, E> {
                Ok(Member::Text(text.to_owned()))
            }
            fn visit_string<E: serde::de::Error>(self, text: String) -> Result<Member<P>, E> {
                Ok(Member::Text(text))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Member<P>, A::Error> {
                read_list(seq).map(Member::List)
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Member<P>, A::Error> {
                skip_map(map).map(|()| Member::Other)
            }
        }
        deserializer.deserialize_any(MemberVisitor(std::marker::PhantomData))
    }
}

/// Reads a [`Named`] member from any JSON value.
struct NamedVisitor<T>(std::marker::PhantomData<T>);

impl<'de, T: Named> Visitor<'de> for NamedVisitor<T> {
    type Value = T;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }
    scalars_give!(T::NOT_TEXT);
    fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<T, E> {
        Ok(T::named(text))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<T, A::Error> {
        skip_list(seq).map(|()| T::NOT_TEXT)
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
        skip_map(map).map(|()| T::NOT_TEXT)
    }
}

macro_rules! deserialize_named {
    ($($named:ty),*) => {$(
        impl<'de> Deserialize<'de> for $named {
            fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                deserializer.deserialize_any(NamedVisitor(std::marker::PhantomData))
            }
        }
    )*};
}

deserialize_named!(ItemKind, Role, PartKind);

/// The visitor of an item or a part: an object's members are read by [`Key`] into its
/// fields (`$read` says where each goes); any other value is an item of no fields.
macro_rules! object_visitor {
    ($visitor:ident, $target:ty, $expecting:literal, |$object:ident, $map:ident, $key:ident| $read:expr) => {
        struct $visitor;
        impl<'de> Visitor<'de> for $visitor {
            type Value = $target;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str($expecting)
            }
            scalars_give!(<$target>::default());
            fn visit_str<E: serde::de::Error>(self, _: &str) -> Result<$target, E> {
                Ok(<$target>::default())
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<$target, A::Error> {
                skip_list(seq).map(|()| <$target>::default())
            }
            fn visit_map<A: MapAccess<'de>>(self, mut $map: A) -> Result<$target, A::Error> {
                let mut $object = <$target>::default();
                while let Some($key) = $map.next_key::<Key>()? {
                    $read;
                }
                Ok($object)
            }
        }
    };
}

object_visitor!(
    ItemVisitor,
    InputItem,
    "an input item",
    |item, map, key| match key {
        Key::Type => item.kind = map.next_value()?,
        Key::Role => item.role = map.next_value()?,
        Key::Content => item.content = map.next_value()?,
        Key::CallId => item.call_id = map.next_value()?,
        Key::Name => item.name = map.next_value()?,
        Key::Arguments => item.arguments = Some(map.next_value()?),
        Key::Output => item.output = map.next_value()?,
        _ => {
            map.next_value::<Skipped>()?;
        }
    }
);

object_visitor!(
    PartVisitor,
    Part,
    "a content part",
    |part, map, key| match key {
        Key::Type => part.kind = map.next_value()?,
        Key::Text => part.text = map.next_value()?,
        Key::ImageUrl => part.image_url = map.next_value()?,
        Key::Detail => part.detail = Some(map.next_value()?),
        _ => {
            map.next_value::<Skipped>()?;
        }
    }
);

impl<'de> Deserialize<'de> for InputItem {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(ItemVisitor)
    }
}

impl<'de> Deserialize<'de> for Part {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(PartVisitor)
    }
}

/// The text of a content or an output that is a string or a list of parts (its parts'
/// texts, joined), taken from it; empty for anything else.
fn parts_text(content: Member<Part>) -> String {
    match content {
        Member::Text(text) => text,
        Member::List(parts) => parts
            .into_iter()
            .filter_map(|part| part.text.into_text())
            .collect(),
        _ => String::new(),
    }
}

/// A user or system message's parts in Chat Completions parts (text and images); parts of
/// another type are left out.
fn chat_parts(parts: Vec<Part>) -> Value {
    let parts = parts
        .into_iter()
        .filter_map(|part| match part.kind {
            PartKind::Text => {
                let text = part.text.into_text().unwrap_or_default();
                Some(object([("type", "text".into()), ("text", text.into())]))
            }
            PartKind::Image => {
                let detail = part.detail.unwrap_or_else(|| json!("auto"));
                let url = part.image_url.into_text()?;
                let image = object([("url", url.into()), ("detail", detail)]);
                Some(object([("type", "image_url".into()), ("image_url", image)]))
            }
            PartKind::Other => None,
        })
        .collect();
    Value::Array(parts)
}

/// The ids of the function calls among `messages`.
fn call_ids(messages: &[Value]) -> impl Iterator<Item = &str> {
    messages
        .iter()
        .filter_map(|m| m.get("tool_calls").and_then(Value::as_array))
        .flatten()
        .filter_map(|call| call.get("id").and_then(Value::as_str))
}

/// Every function call of the transcript must have its output before the model is asked
/// again (OpenAI refuses it too; the upstream would, as a 502).
pub fn check_calls_answered(messages: &[Value]) -> Result<(), ApiError> {
    let answered: HashSet<&str> = messages
        .iter()
        .filter_map(|m| m.get("tool_call_id").and_then(Value::as_str))
        .collect();
    match call_ids(messages).find(|id| !answered.contains(id)) {
        Some(id) => Err(v1_error(
            ErrorCode::InvalidParameter,
            format!("no function_call_output was given for the function call `{id}`"),
        )
        .param("input")),
        None => Ok(()),
    }
}

/// Turns Responses input items into a Chat Completions transcript, appended to `messages`.
/// A `function_call` joins the assistant message just before it (the turn it belongs to); a
/// `function_call_output` must answer a call made earlier in the context. `reasoning` and
/// unknown item types are ignored. The items' texts are moved into the messages; the place
/// of an item (`input[7]`) is written only for an error.
pub fn append_items(
    messages: &mut Vec<Value>,
    items: Vec<InputItem>,
    field: &str,
) -> Result<(), ApiError> {
    messages.reserve(items.len());
    // The calls made so far, for each output to find its own in one look.
    let mut calls_made: Option<HashSet<String>> = None;
    for (index, item) in items.into_iter().enumerate() {
        let at = || format!("{field}[{index}]");
        let kind = match item.kind {
            ItemKind::Unnamed if item.role != Role::Absent => ItemKind::Message,
            kind => kind,
        };
        match kind {
            ItemKind::Message => {
                let role = match item.role {
                    Role::System => "system",
                    Role::User => "user",
                    Role::Assistant => "assistant",
                    Role::Absent | Role::Invalid => {
                        return Err(v1_error(
                            ErrorCode::InvalidMessage,
                            format!(
                                "{}.role must be one of user, assistant, system, developer",
                                at()
                            ),
                        )
                        .param(format!("{}.role", at())));
                    }
                };
                let content = match item.content {
                    Member::Absent | Member::Other => {
                        return Err(v1_error(
                            ErrorCode::InvalidMessage,
                            format!("{}.content must be a string or a list of parts", at()),
                        )
                        .param(format!("{}.content", at())));
                    }
                    content if role == "assistant" => Value::String(parts_text(content)),
                    Member::Text(text) => Value::String(text),
                    Member::List(parts) => chat_parts(parts),
                };
                messages.push(object([("role", role.into()), ("content", content)]));
            }
            ItemKind::FunctionCall => {
                let (Member::Text(call_id), Member::Text(name)) = (item.call_id, item.name) else {
                    return Err(v1_error(
                        ErrorCode::InvalidParameter,
                        format!("{}: a function_call needs `call_id` and `name`", at()),
                    )
                    .param(at()));
                };
                let arguments = match item.arguments {
                    Some(Value::String(text)) => text,
                    None | Some(Value::Null) => "{}".to_owned(),
                    Some(other) => other.to_string(),
                };
                if let Some(calls) = &mut calls_made {
                    calls.insert(call_id.clone());
                }
                let function = object([("name", name.into()), ("arguments", arguments.into())]);
                let call = object([
                    ("id", call_id.into()),
                    ("type", "function".into()),
                    ("function", function),
                ]);
                match messages.last_mut() {
                    Some(last) if last.get("role").and_then(Value::as_str) == Some("assistant") => {
                        if let Some(calls) =
                            last.get_mut("tool_calls").and_then(Value::as_array_mut)
                        {
                            calls.push(call);
                        } else {
                            last["tool_calls"] = Value::Array(vec![call]);
                            if last["content"].as_str() == Some("") {
                                last["content"] = Value::Null;
                            }
                        }
                    }
                    _ => messages.push(object([
                        ("role", "assistant".into()),
                        ("content", Value::Null),
                        ("tool_calls", Value::Array(vec![call])),
                    ])),
                }
            }
            ItemKind::FunctionCallOutput => {
                let call_id = item.call_id.into_text().unwrap_or_default();
                let calls = calls_made
                    .get_or_insert_with(|| call_ids(messages).map(str::to_owned).collect());
                if !calls.contains(&call_id) {
                    return Err(v1_error(
                        ErrorCode::InvalidParameter,
                        format!("{}: no function call with call_id `{call_id}` is in the input or the stored chain", at()),
                    )
                    .param(format!("{}.call_id", at())));
                }
                let output = parts_text(item.output);
                messages.push(object([
                    ("role", "tool".into()),
                    ("tool_call_id", call_id.into()),
                    ("content", output.into()),
                ]));
            }
            // `reasoning`, `item_reference` and item types this surface does not know.
            ItemKind::Unnamed | ItemKind::Other => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::{InputItem, Member, ResponseInput, append_items};

    /// The items of `input`, parsed from its text as a body is.
    fn items(input: Value) -> Vec<InputItem> {
        let text = serde_json::to_vec(&input).unwrap();
        match serde_json::from_slice(&text).expect("the input parses") {
            Member::List(items) => items,
            other => panic!("not a list of items: {other:?}"),
        }
    }

    fn converted(input: Value) -> Result<Value, Option<String>> {
        let mut messages = Vec::new();
        append_items(&mut messages, items(input), "input")
            .map(|()| Value::Array(messages))
            .map_err(|error| error.param)
    }

    /// Every kind of item the conversion reads, and what it makes of each: roles, text and
    /// image parts, an assistant's parts joined, a call's object arguments, an output's
    /// parts, reasoning and unknown parts passed over.
    #[test]
    fn input_items_become_chat_messages() {
        let input = json!([
            { "role": "developer", "content": "Be brief." },
            { "type": "message", "role": "user", "content": [
                { "type": "input_text", "text": "Look:" },
                { "type": "input_image", "image_url": "https://example.com/a.png", "detail": "low" },
                { "type": "input_image", "image_url": "https://example.com/b.png" },
                { "type": "input_file", "file_id": "f_1" },
            ] },
            { "type": "reasoning", "summary": [] },
            { "id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
              "content": [{ "type": "output_text", "text": "Let me ", "annotations": [] },
                          { "type": "output_text", "text": "check.", "annotations": [] }] },
            { "type": "function_call", "call_id": "call_1", "name": "read", "arguments": { "path": "a" } },
            { "type": "function_call_output", "call_id": "call_1",
              "output": [{ "type": "input_text", "text": "line" }] },
        ]);
        assert_eq!(
            converted(input),
            Ok(json!([
                { "role": "system", "content": "Be brief." },
                { "role": "user", "content": [
                    { "type": "text", "text": "Look:" },
                    { "type": "image_url", "image_url": { "url": "https://example.com/a.png", "detail": "low" } },
                    { "type": "image_url", "image_url": { "url": "https://example.com/b.png", "detail": "auto" } },
                ] },
                { "role": "assistant", "content": "Let me check.", "tool_calls": [
                    { "id": "call_1", "type": "function",
                      "function": { "name": "read", "arguments": r#"{"path":"a"}"# } },
                ] },
                { "role": "tool", "tool_call_id": "call_1", "content": "line" },
            ]))
        );
    }

    /// What a JSON tree made of odd members, the typed read makes the same: a null `detail`
    /// is kept, a non-string text is empty,
    /// members of other types are refused naming the item, and items that are no objects
    /// are passed over.
    #[test]
    fn odd_members_are_read_as_a_tree_read_them() {
        assert_eq!(
            converted(json!([
                "not an item",
                7,
                { "role": "user", "content": [
                    { "type": "input_text", "text": 5 },
                    { "type": "input_image", "image_url": "u", "detail": null },
                    { "type": "input_image", "image_url": { "url": "u" } },
                    "loose text",
                ] },
                { "type": 3, "role": "user", "content": "typed by its role" },
                { "type": "function_call", "call_id": "c", "name": "n" },
                { "type": "function_call", "call_id": "d", "name": "n", "arguments": null },
                { "type": "function_call_output", "call_id": "c", "output": { "x": 1 } },
                { "type": "function_call_output", "call_id": "d" },
            ])),
            Ok(json!([
                { "role": "user", "content": [
                    { "type": "text", "text": "" },
                    { "type": "image_url", "image_url": { "url": "u", "detail": null } },
                ] },
                { "role": "user", "content": "typed by its role" },
                { "role": "assistant", "content": null, "tool_calls": [
                    { "id": "c", "type": "function", "function": { "name": "n", "arguments": "{}" } },
                    { "id": "d", "type": "function", "function": { "name": "n", "arguments": "{}" } },
                ] },
                { "role": "tool", "tool_call_id": "c", "content": "" },
                { "role": "tool", "tool_call_id": "d", "content": "" },
            ]))
        );
        let refused = |item: Value| converted(json!([{ "role": "user", "content": "a" }, item]));
        assert_eq!(
            refused(json!({ "role": null, "content": "x" })),
            Err(Some("input[1].role".into()))
        );
        assert_eq!(
            refused(json!({ "role": "tool", "content": "x" })),
            Err(Some("input[1].role".into()))
        );
        assert_eq!(
            refused(json!({ "role": "user" })),
            Err(Some("input[1].content".into()))
        );
        // A message's role is judged before its content, and the first bad item is named.
        assert_eq!(
            refused(json!({ "role": "wizard" })),
            Err(Some("input[1].role".into()))
        );
        assert_eq!(
            converted(json!([
                { "role": "user" },
                { "type": "function_call_output", "call_id": "none" },
            ])),
            Err(Some("input[0].content".into()))
        );
        assert_eq!(
            refused(json!({ "role": "user", "content": null })),
            Err(Some("input[1].content".into()))
        );
        assert_eq!(
            refused(json!({ "type": "function_call", "call_id": 1, "name": "n" })),
            Err(Some("input[1]".into()))
        );
        assert_eq!(
            refused(json!({ "type": "function_call_output", "call_id": "none" })),
            Err(Some("input[1].call_id".into()))
        );
    }

    /// An output answers a call made before it, in the input or among the messages already
    /// there (a stored chain's), and no call made after it.
    #[test]
    fn an_output_answers_a_call_made_before_it() {
        let mut messages = vec![
            json!({ "role": "assistant", "content": null, "tool_calls": [
            { "id": "stored", "type": "function", "function": { "name": "n", "arguments": "{}" } },
        ] }),
        ];
        let outputs = items(json!([
            { "type": "function_call_output", "call_id": "stored", "output": "a" },
        ]));
        assert!(append_items(&mut messages, outputs, "input").is_ok());
        assert_eq!(messages.len(), 2);
        assert_eq!(
            converted(json!([
                { "role": "user", "content": "go" },
                { "type": "function_call_output", "call_id": "later", "output": "a" },
                { "type": "function_call", "call_id": "later", "name": "n" },
            ])),
            Err(Some("input[1].call_id".into()))
        );
    }

    /// The input itself: text, items, or anything else.
    #[test]
    fn an_input_is_text_items_or_other() {
        let read = |input: Value| serde_json::from_value::<ResponseInput>(input).unwrap();
        assert!(matches!(read(json!("hi")), Member::Text(text) if text == "hi"));
        assert!(matches!(read(json!([])), Member::List(items) if items.is_empty()));
        for other in [
            json!(null),
            json!(1),
            json!(true),
            json!({ "role": "user" }),
        ] {
            assert!(matches!(read(other), Member::Other));
        }
        // Parsed from text, as a body is: escapes in a key and a value, and a member given
        // twice keeping its last value, as a JSON tree keeps it.
        let parsed: ResponseInput = serde_json::from_str(
            r#"[{"rol\u0065":"user","content":"a \"quoted\" word","role":"assistant"}]"#,
        )
        .unwrap();
        let Member::List(items) = parsed else {
            panic!("a list of items")
        };
        assert_eq!(items[0].role, super::Role::Assistant);
        assert_eq!(items[0].content, Member::Text("a \"quoted\" word".into()));
    }

    /// A value the parse skips is parsed all the same: a body is refused where a JSON tree
    /// refuses it (a number out of range, a lone surrogate, bytes that are no UTF-8, nesting
    /// past serde_json's limit), and taken where it takes it.
    #[test]
    fn skipped_values_are_parsed_as_a_tree_parses_them() {
        let deep = format!("{}{}", "[".repeat(200), "]".repeat(200));
        let item = |skipped: &str| {
            format!(r#"[{{"role":"user","content":"hi","id":{skipped}}},{{"type":"reasoning","summary":{skipped}}}]"#)
                .into_bytes()
        };
        let mut not_utf8 = item(r#""ab""#);
        let at = not_utf8.iter().position(|byte| *byte == b'b').unwrap();
        not_utf8[at] = 0xFF;
        let refused = [
            item("1e400"),
            item(r#""\ud800""#),
            item(r#""\udc00x""#),
            not_utf8,
            item(&deep),
            item(r#"{"k":[1,{"x":1e999}]}"#),
        ];
        for body in refused {
            assert!(serde_json::from_slice::<Value>(&body).is_err());
            assert!(
                serde_json::from_slice::<ResponseInput>(&body).is_err(),
                "{}",
                String::from_utf8_lossy(&body)
            );
        }
        for taken in [
            r#"{"k":[1,{"x":null},"z",true,-2.5e3]}"#,
            r#""\u00e9\n""#,
            "[]",
        ] {
            let body = item(taken);
            assert!(serde_json::from_slice::<Value>(&body).is_ok());
            let Member::List(items) = serde_json::from_slice::<ResponseInput>(&body).unwrap()
            else {
                panic!("a list of items")
            };
            assert_eq!(items.len(), 2);
        }
    }
}
