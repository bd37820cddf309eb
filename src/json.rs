//! JSON on the request path: nested fields read by key, and values written as text.
//!
//! Reading: `serde_json::Value::pointer` parses its path and allocates a `String` per segment
//! on every call: per streamed chunk and per event, that showed in profiles (2% of the
//! workers' CPU). [`at`] and its siblings walk a fixed path of object keys instead.
//!
//! Writing: `serde_json` looks up every byte of a string in its table of escapes, and a
//! request's text is written several times over (its input and its transcript's messages
//! stored, its call to the upstream): with a long conversation that was a fifth of the
//! server's instructions (docs/profiling.md, the forty-third pass). [`to_text`] writes the
//! same bytes as `serde_json::to_string`, finding the next byte to escape eight at a time.
//!
//! Building: `serde_json::json!` serializes each value it is given into a new one, a copy
//! of every text; [`object`] moves them in.

use serde_json::Value;

/// An object of `members`, each value moved in, not copied as `json!` copies it.
pub fn object<const N: usize>(members: [(&str, Value); N]) -> Value {
    Value::Object(
        members
            .into_iter()
            .map(|(key, value)| (key.to_owned(), value))
            .collect(),
    )
}

/// The value under `value` at `path`, a list of object keys.
pub fn at<'a>(value: &'a Value, path: &[&str]) -> Option<&'a Value> {
    path.iter().try_fold(value, |value, key| value.get(key))
}

/// The string under `value` at `path`.
pub fn str_at<'a>(value: &'a Value, path: &[&str]) -> Option<&'a str> {
    at(value, path).and_then(Value::as_str)
}

/// [`at`], mutably.
pub fn at_mut<'a>(value: &'a mut Value, path: &[&str]) -> Option<&'a mut Value> {
    path.iter().try_fold(value, |value, key| value.get_mut(key))
}

/// `value` as JSON text: byte for byte what `serde_json::to_string` writes (compact, keys in
/// the map's order, the same escapes), faster on long strings.
pub fn to_text(value: &Value) -> String {
    // As serde_json starts: most values written on the request path are short.
    let mut out = String::with_capacity(128);
    write(&mut out, value);
    out
}

/// Appends `value` as JSON text to `out`.
pub fn write(out: &mut String, value: &Value) {
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(true) => out.push_str("true"),
        Value::Bool(false) => out.push_str("false"),
        Value::Number(number) => write_number(out, number),
        Value::String(text) => write_str(out, text),
        Value::Array(items) => write_array(out, items, write),
        Value::Object(entries) => write_object(out, entries, write),
    }
}

/// `number` as serde_json writes it: an integer's digits by `itoa`, a float's shortest
/// digits by `zmij`, the crates its own writer calls (through `Display`, whose formatter
/// machinery cost ~120 instructions a number on the request path: the forty-eighth pass).
fn write_number(out: &mut String, number: &serde_json::Number) {
    if let Some(unsigned) = number.as_u64() {
        out.push_str(itoa::Buffer::new().format(unsigned));
    } else if let Some(signed) = number.as_i64() {
        out.push_str(itoa::Buffer::new().format(signed));
    } else if let Some(float) = number.as_f64() {
        // A `Value`'s float is finite: serde_json makes no `Number` of NaN or infinity.
        out.push_str(zmij::Buffer::new().format_finite(float));
    }
}

/// `text` as a JSON string, or `null`.
pub fn write_str_or_null(out: &mut String, text: Option<&str>) {
    match text {
        Some(text) => write_str(out, text),
        None => out.push_str("null"),
    }
}

/// `items` as a JSON array, each written by `write`: how every array a writer by hand sends
/// is written.
pub fn write_array<T>(
    out: &mut String,
    items: impl IntoIterator<Item = T>,
    write: impl FnMut(&mut String, T),
) {
    out.push('[');
    write_items(out, 0, items, write);
    out.push(']');
}

/// `items` as JSON array items, comma-separated, each written by `write`, after the `before`
/// items `out` holds already: an array written in parts (a shared history's text, extended
/// turn by turn).
pub fn write_items<T>(
    out: &mut String,
    before: usize,
    items: impl IntoIterator<Item = T>,
    mut write: impl FnMut(&mut String, T),
) {
    for (index, item) in items.into_iter().enumerate() {
        if before > 0 || index > 0 {
            out.push(',');
        }
        write(out, item);
    }
}

/// `entries` as a JSON object, keys in the order given, each value written by `write`: how
/// a `Value`'s maps and an upstream request are written.
pub fn write_object<K: AsRef<str>, T>(
    out: &mut String,
    entries: impl IntoIterator<Item = (K, T)>,
    mut write: impl FnMut(&mut String, T),
) {
    out.push('{');
    for (index, (key, item)) in entries.into_iter().enumerate() {
        if index > 0 {
            out.push(',');
        }
        write_str(out, key.as_ref());
        out.push(':');
        write(out, item);
    }
    out.push('}');
}

/// `value` as JSON, or `null`: what serde_json writes for an `Option<Value>`.
pub fn write_or_null(out: &mut String, value: Option<&Value>) {
    match value {
        Some(value) => write(out, value),
        None => out.push_str("null"),
    }
}

/// `value` as serde_json writes an `Option<f64>`: its shortest digits (by `zmij`, as
/// [`write`] writes a float), `null` when absent or not finite.
pub fn write_f64_or_null(out: &mut String, value: Option<f64>) {
    match value {
        Some(value) if value.is_finite() => {
            out.push_str(zmij::Buffer::new().format_finite(value));
        }
        _ => out.push_str("null"),
    }
}

/// `text` as a JSON string, escaped as serde_json escapes: a quote, a backslash and the
/// control characters, nothing else. The runs between escapes are copied whole.
pub fn write_str(out: &mut String, text: &str) {
    out.push('"');
    let mut start = 0;
    while let Some(at) = next_to_escape(text.as_bytes(), start) {
        // A byte to escape is ASCII, never inside a character: both ends are boundaries.
        out.push_str(&text[start..at]);
        escape(out, text.as_bytes()[at]);
        start = at + 1;
    }
    out.push_str(&text[start..]);
    out.push('"');
}

/// Where the next byte to escape (a quote, a backslash, a control character) is at or after
/// `from`: eight bytes at a time, the last fewer than eight read as one word padded with
/// plain bytes (most keys are that short). Also how `chat_wire` finds a string's end.
#[inline]
pub(crate) fn next_to_escape(bytes: &[u8], from: usize) -> Option<usize> {
    let mut at = from;
    while let Some(eight) = bytes.get(at..at.saturating_add(8)) {
        let Ok(word) = <[u8; 8]>::try_from(eight) else {
            break;
        };
        let found = ends_a_run(u64::from_le_bytes(word));
        if found != 0 {
            // The lowest flag is exact (see `ends_a_run`).
            return Some(at + (found.trailing_zeros() / 8) as usize);
        }
        at += 8;
    }
    let rest = bytes.get(at..).filter(|rest| !rest.is_empty())?;
    // A space is plain: the padding never flags, and the lowest flag is still exact.
    let mut last = [b' '; 8];
    last.get_mut(..rest.len())?.copy_from_slice(rest);
    let found = ends_a_run(u64::from_le_bytes(last));
    (found != 0).then(|| at + (found.trailing_zeros() / 8) as usize)
}

/// The escape of `byte` (one [`next_to_escape`] found), as serde_json writes it.
fn escape(out: &mut String, byte: u8) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let short = match byte {
        b'"' => "\\\"",
        b'\\' => "\\\\",
        0x08 => "\\b",
        0x0C => "\\f",
        b'\n' => "\\n",
        b'\r' => "\\r",
        b'\t' => "\\t",
        _ => {
            out.push_str("\\u00");
            out.push(char::from(HEX[usize::from(byte >> 4)]));
            out.push(char::from(HEX[usize::from(byte & 0x0F)]));
            return;
        }
    };
    out.push_str(short);
}

/// The high bit of each byte of `word` (read little-endian) that ends a run of plain
/// characters in a JSON string: a quote, a backslash, or a control character (which JSON
/// escapes there). A byte after a flagged one may be flagged wrongly (a borrow carries into
/// it), never one before it, so the lowest flag is exact.
#[inline]
fn ends_a_run(word: u64) -> u64 {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGHS: u64 = 0x8080_8080_8080_8080;
    // A byte below `n` (at most 0x80) sets its high bit in `x - n` while its own is clear.
    let below = |x: u64, n: u64| x.wrapping_sub(ONES * n) & !x & HIGHS;
    below(word, 0x20) | below(word ^ (ONES * 0x22), 1) | below(word ^ (ONES * 0x5C), 1)
}

/// Any JSON value nested a few levels, its strings drawn from `text` and its keys from
/// `keys`: for the property tests of what reads or writes JSON.
#[cfg(test)]
pub(crate) fn any_json(
    text: proptest::strategy::BoxedStrategy<String>,
    keys: proptest::strategy::BoxedStrategy<String>,
) -> impl proptest::strategy::Strategy<Value = Value> {
    use proptest::prelude::*;
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>().prop_map(Value::from),
        text.prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 32, 6, move |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            proptest::collection::btree_map(keys.clone(), inner, 0..6)
                .prop_map(|map| Value::Object(map.into_iter().collect())),
        ]
    })
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use serde_json::json;

    use super::*;

    /// `object` builds what `json!` builds, a later member of the same key winning.
    #[test]
    fn an_object_holds_its_members() {
        let text = "a text".to_owned();
        assert_eq!(
            object([("role", "user".into()), ("content", text.into())]),
            json!({ "role": "user", "content": "a text" })
        );
        assert_eq!(
            object([("k", 1.into()), ("k", Value::Null)]),
            json!({ "k": null })
        );
        assert_eq!(object([]), json!({}));
    }

    /// Text drawn from every kind of character, escaped or not.
    fn any_text() -> BoxedStrategy<String> {
        proptest::string::string_regex("[\\x00-\\x1f\"\\\\/a-z\\x7fé€😀 ]{0,40}")
            .expect("a valid pattern")
            .boxed()
    }

    proptest! {
        #[test]
        fn writes_what_serde_json_writes(value in any_json(any_text(), any_text())) {
            let expected = serde_json::to_string(&value).expect("serializes");
            prop_assert_eq!(to_text(&value), expected);
        }
    }

    #[test]
    fn escapes_at_every_offset_of_a_word() {
        // A byte to escape at each position of the eight-byte words and of the tail.
        for escaped in ["\"", "\\", "\n", "\u{1}", "\u{1f}"] {
            for at in 0..20 {
                let text = format!("{}{escaped}{}", "a".repeat(at), "é".repeat(at % 3));
                let value = Value::String(text);
                assert_eq!(
                    to_text(&value),
                    serde_json::to_string(&value).expect("serializes")
                );
            }
        }
    }

    #[test]
    fn walks_object_keys_and_misses_anything_else() {
        let mut value = json!({ "delta": { "content": "hi", "list": [1] }, "n": 3 });
        assert_eq!(str_at(&value, &["delta", "content"]), Some("hi"));
        assert_eq!(at(&value, &["n"]), Some(&json!(3)));
        assert_eq!(at(&value, &[]), Some(&value));
        assert_eq!(at(&value, &["delta", "missing"]), None);
        assert_eq!(at(&value, &["n", "deeper"]), None);
        // Keys only: an array's element is not reached by its index written as a key.
        assert_eq!(at(&value, &["delta", "list", "0"]), None);
        if let Some(Value::String(text)) = at_mut(&mut value, &["delta", "content"]) {
            text.push('!');
        }
        assert_eq!(str_at(&value, &["delta", "content"]), Some("hi!"));
    }
}
