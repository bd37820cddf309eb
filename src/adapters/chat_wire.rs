//! What the `openai` adapter reads of an upstream's chat completion or stream chunk, parsed
//! in place: strings borrowed from the body, everything else skipped without being built.
//!
//! Why not a `serde_json::Value`: every chunk of every stream passes here, and building a
//! tree of maps for an `id`, a `model` and one `delta.content`, then dropping it, was 3–5% of
//! the server's CPU at concurrency 32 (the adapter's own share fell from 9.0% to 6.4%).
//!
//! The reading is as forgiving as the adapter's rules: a field of another type than expected
//! counts as absent (a `content` that is not a string is no text), never as a malformed
//! answer. A body that is not JSON is malformed, and so is one that repeats a key this reads
//! within one object (JSON asks names to be unique; a `Value` kept the last one).

use std::borrow::Cow;
use std::fmt;
use std::marker::PhantomData;

use serde::de::value::MapAccessDeserializer;
use serde::de::{Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, de};
use serde_json::Value;

use super::Usage;

/// A completion, or one chunk of a stream (the same fields, `message` or `delta`).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(super) struct ChunkView<'a> {
    /// `choices`, each an object or nothing (usually one).
    #[serde(borrow)]
    pub choices: Array<Object<ChoiceView<'a>>>,
    /// `usage` as sent (rare: once per call); see [`ChunkView::reported_usage`].
    pub usage: Option<Value>,
    /// `error`, present even when `null` (an upstream reporting an error mid-stream).
    pub error: Present,
}

impl<'a> ChunkView<'a> {
    /// The first choice, whatever it is: none when `choices` is not a non-empty array.
    pub fn first_choice(&self) -> Option<&Object<ChoiceView<'a>>> {
        self.choices.0.as_ref()?.first()
    }

    /// The first choice, when it is an object.
    pub fn choice(&self) -> Option<&ChoiceView<'a>> {
        self.first_choice()?.0.as_ref()
    }

    /// The usage reported, when `usage` reads as one (absent, `null` or malformed: none).
    pub fn reported_usage(&self) -> Option<Usage> {
        self.usage
            .as_ref()
            .filter(|usage| !usage.is_null())
            .and_then(|usage| Usage::deserialize(usage).ok())
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(super) struct ChoiceView<'a> {
    #[serde(borrow)]
    pub message: Object<MessageView<'a>>,
    #[serde(borrow)]
    pub delta: Object<MessageView<'a>>,
    #[serde(borrow)]
    pub finish_reason: Str<'a>,
}

/// A choice's `message` (a completion) or `delta` (a chunk).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(super) struct MessageView<'a> {
    #[serde(borrow)]
    pub content: Str<'a>,
    /// Tool calls (or their fragments) as sent: rare, and their errors quote them.
    pub tool_calls: Array<Value>,
}

/// `T` when the value is an object, else nothing.
#[derive(Debug)]
pub(super) struct Object<T>(pub Option<T>);

impl<T> Default for Object<T> {
    fn default() -> Self {
        Self(None)
    }
}

/// The elements when the value is an array, else nothing.
#[derive(Debug)]
pub(super) struct Array<T>(pub Option<Vec<T>>);

impl<T> Default for Array<T> {
    fn default() -> Self {
        Self(None)
    }
}

/// The string when the value is one (borrowed unless it had escapes), else nothing.
#[derive(Debug, Default)]
pub(super) struct Str<'a>(pub Option<Cow<'a, str>>);

impl Str<'_> {
    pub fn as_str(&self) -> Option<&str> {
        self.0.as_deref()
    }
}

/// Whether a field was there, with its value (`null` included).
#[derive(Debug, Default)]
pub(super) struct Present(pub Option<Value>);

impl<'de> Deserialize<'de> for Present {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        Value::deserialize(deserializer).map(|value| Self(Some(value)))
    }
}

/// The shared part of the lenient visitors: a scalar of the wrong type is nothing; an array
/// or object of the wrong type is skipped whole (so the parse goes on after it).
macro_rules! nothing_for_other_types {
    () => {
        fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
            Ok(Default::default())
        }
        fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
            Ok(Default::default())
        }
        fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
            Ok(Default::default())
        }
        fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
            Ok(Default::default())
        }
        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(Default::default())
        }
        fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(Default::default())
        }
    };
}

macro_rules! skip_strings {
    () => {
        fn visit_str<E: de::Error>(self, _: &str) -> Result<Self::Value, E> {
            Ok(Default::default())
        }
    };
}

macro_rules! skip_arrays {
    () => {
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            while seq.next_element::<IgnoredAny>()?.is_some() {}
            Ok(Default::default())
        }
    };
}

macro_rules! skip_objects {
    () => {
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
            Ok(Default::default())
        }
    };
}

struct ObjectVisitor<T>(PhantomData<T>);

impl<'de, T: Deserialize<'de>> Visitor<'de> for ObjectVisitor<T> {
    type Value = Object<T>;

    fn expecting(&self, formatter: &mut fmt::Formatter) -> fmt::Result {
        formatter.write_str("any JSON value")
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        T::deserialize(MapAccessDeserializer::new(map)).map(|value| Object(Some(value)))
    }

    nothing_for_other_types!();
    skip_strings!();
    skip_arrays!();
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Object<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(ObjectVisitor(PhantomData))
    }
}

struct ArrayVisitor<T>(PhantomData<T>);

impl<'de, T: Deserialize<'de>> Visitor<'de> for ArrayVisitor<T> {
    type Value = Array<T>;

    fn expecting(&self, formatter: &mut fmt::Formatter) -> fmt::Result {
        formatter.write_str("any JSON value")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut elements = Vec::new();
        while let Some(element) = seq.next_element()? {
            elements.push(element);
        }
        Ok(Array(Some(elements)))
    }

    nothing_for_other_types!();
    skip_strings!();
    skip_objects!();
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Array<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(ArrayVisitor(PhantomData))
    }
}

struct StrVisitor;

impl<'de> Visitor<'de> for StrVisitor {
    type Value = Str<'de>;

    fn expecting(&self, formatter: &mut fmt::Formatter) -> fmt::Result {
        formatter.write_str("any JSON value")
    }

    fn visit_borrowed_str<E: de::Error>(self, text: &'de str) -> Result<Self::Value, E> {
        Ok(Str(Some(Cow::Borrowed(text))))
    }

    fn visit_str<E: de::Error>(self, text: &str) -> Result<Self::Value, E> {
        Ok(Str(Some(Cow::Owned(text.to_owned()))))
    }

    fn visit_string<E: de::Error>(self, text: String) -> Result<Self::Value, E> {
        Ok(Str(Some(Cow::Owned(text))))
    }

    nothing_for_other_types!();
    skip_arrays!();
    skip_objects!();
}

impl<'de: 'a, 'a> Deserialize<'de> for Str<'a> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(StrVisitor)
    }
}

/// A completion or chunk's body: `Ok(None)` when it is JSON but not an object.
pub(super) fn parse(body: &str) -> Result<Option<ChunkView<'_>>, serde_json::Error> {
    serde_json::from_str::<Object<ChunkView<'_>>>(body).map(|view| view.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(view: &ChunkView<'_>) -> Option<String> {
        let choice = view.choice()?;
        let message = choice.delta.0.as_ref().or(choice.message.0.as_ref())?;
        message.content.as_str().map(str::to_owned)
    }

    #[test]
    fn reads_the_first_choice_and_borrows_plain_text() {
        let body = r#"{"id":"c1","object":"chat.completion.chunk","created":1,"model":"m",
            "choices":[{"index":0,"delta":{"role":"assistant","content":"Hel"},"finish_reason":null},
                       {"index":1,"delta":{"content":"ignored"}}]}"#;
        let view = parse(body).unwrap().unwrap();
        let choice = view.choice().unwrap();
        let delta = choice.delta.0.as_ref().unwrap();
        assert!(matches!(delta.content.0, Some(Cow::Borrowed("Hel"))));
        assert_eq!(choice.finish_reason.as_str(), None);
        assert!(view.usage.is_none());
        assert!(view.error.0.is_none());
    }

    #[test]
    fn unescapes_text_with_escapes() {
        let view = parse(r#"{"choices":[{"message":{"content":"a\"b\n\u00e9"}}]}"#)
            .unwrap()
            .unwrap();
        assert_eq!(text(&view).as_deref(), Some("a\"b\né"));
    }

    #[test]
    fn fields_of_another_type_are_absent_and_the_parse_goes_on() {
        let body = r#"{"choices":[{"delta":{"content":["not","text"],"tool_calls":{"a":1}},
            "finish_reason":7}],"usage":{"prompt_tokens":3}}"#;
        let view = parse(body).unwrap().unwrap();
        let choice = view.choice().unwrap();
        let delta = choice.delta.0.as_ref().unwrap();
        assert_eq!(delta.content.as_str(), None);
        assert!(delta.tool_calls.0.is_none());
        assert_eq!(choice.finish_reason.as_str(), None);
        assert_eq!(view.usage.unwrap()["prompt_tokens"], 3);

        // A first choice that is not an object is there, with nothing in it.
        let view = parse(r#"{"choices":[42]}"#).unwrap().unwrap();
        assert!(view.first_choice().is_some());
        assert!(view.choice().is_none());
        // `choices` that is not an array, or an empty one: no first choice.
        let view = parse(r#"{"choices":{"0":{}}}"#).unwrap().unwrap();
        assert!(view.first_choice().is_none());
        let view = parse(r#"{"choices":[]}"#).unwrap().unwrap();
        assert!(view.first_choice().is_none());
    }

    #[test]
    fn an_error_counts_even_when_null_and_tool_calls_are_kept_as_sent() {
        let view = parse(r#"{"error":null}"#).unwrap().unwrap();
        assert_eq!(view.error.0, Some(Value::Null));
        let body =
            r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"name":"f"}},"x"]}}]}"#;
        let view = parse(body).unwrap().unwrap();
        let delta = view.choice().unwrap().delta.0.as_ref().unwrap();
        let calls = delta.tool_calls.0.as_ref().unwrap();
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[1], Value::String("x".into()));
    }

    #[test]
    fn json_that_is_not_an_object_is_none_and_broken_json_is_an_error() {
        assert!(parse("[1,2]").unwrap().is_none());
        assert!(parse("\"text\"").unwrap().is_none());
        assert!(parse("{\"choices\":[").is_err());
        assert!(parse("not json").is_err());
        assert!(parse(r#"{"choices":[],"choices":[]}"#).is_err());
        // A repeated key this does not read is skipped like any other.
        assert!(parse(r#"{"id":"a","id":"b"}"#).unwrap().is_some());
    }
}
