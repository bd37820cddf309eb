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
//!
//! A body is read twice only when it is unusual: first by a one-pass scanner of its own
//! ([`Scan`]), which gives the same view `serde_json`'s visitors give or gives up, then, if it
//! gave up, by those visitors. Tests hold the two to the same view, on the usual bodies and on
//! thousands of bodies changed at random.

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
    /// The first of `choices`, an object or nothing (the others are read and dropped).
    #[serde(borrow)]
    pub choices: First<Object<ChoiceView<'a>>>,
    /// `usage` as it reads (rare: once per call); see [`ChunkView::reported_usage`].
    pub usage: ReportedUsage,
    /// `error`, present even when `null` (an upstream reporting an error mid-stream).
    pub error: Present,
}

impl<'a> ChunkView<'a> {
    /// The first choice, whatever it is: none when `choices` is not a non-empty array.
    pub fn first_choice(&self) -> Option<&Object<ChoiceView<'a>>> {
        self.choices.0.as_ref()
    }

    /// The first choice, when it is an object.
    pub fn choice(&self) -> Option<&ChoiceView<'a>> {
        self.first_choice()?.0.as_ref()
    }

    /// The usage reported, when `usage` reads as one (absent, `null` or malformed: none).
    pub fn reported_usage(&self) -> Option<Usage> {
        self.usage.0
    }
}

/// A chunk's `usage`: a [`Usage`] when it reads as one, as a `Value` holding it reads (a key
/// given twice counts as its last); absent, `null`, or of another shape, none.
#[derive(Debug, Default)]
pub(super) struct ReportedUsage(pub Option<Usage>);

impl ReportedUsage {
    /// The usage `value` reads as, if any.
    fn of(value: &Value) -> Self {
        Self(Usage::deserialize(value).ok())
    }
}

impl<'de> Deserialize<'de> for ReportedUsage {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        Value::deserialize(deserializer).map(|value| Self::of(&value))
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

/// The first element when the value is a non-empty array, else nothing. The elements after
/// it are read like it (a malformed one makes the body malformed) and dropped: the adapter reads
/// one choice, and no vector is allocated for it.
#[derive(Debug)]
pub(super) struct First<T>(pub Option<T>);

impl<T> Default for First<T> {
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

struct FirstVisitor<T>(PhantomData<T>);

impl<'de, T: Deserialize<'de>> Visitor<'de> for FirstVisitor<T> {
    type Value = First<T>;

    fn expecting(&self, formatter: &mut fmt::Formatter) -> fmt::Result {
        formatter.write_str("any JSON value")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let first = seq.next_element()?;
        while seq.next_element::<T>()?.is_some() {}
        Ok(First(first))
    }

    nothing_for_other_types!();
    skip_strings!();
    skip_objects!();
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for First<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(FirstVisitor(PhantomData))
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
    match Scan::new(body).chunk() {
        Some(view) => Ok(Some(view)),
        None => by_serde_json(body),
    }
}

/// The reading of reference: `serde_json`'s visitors, for what [`Scan`] gives up on.
fn by_serde_json(body: &str) -> Result<Option<ChunkView<'_>>, serde_json::Error> {
    serde_json::from_str::<Object<ChunkView<'_>>>(body).map(|view| view.0)
}

/// Nesting past this depth is left to `serde_json` (whose own limit, 128, is then the one that
/// applies).
const MAX_DEPTH: u32 = 64;

/// The fast reading of a body: one pass over its bytes that gives what `serde_json` gives, or
/// gives up (`None`) wherever it is not sure to, and the body is then read by `serde_json`,
/// which also words the error of a malformed one. It gives up on: a body that is not an
/// object, malformed JSON, a control character in a string, an escape it does not know or a
/// lone surrogate, a number that could be out of range (an exponent of three digits or more,
/// more than 20 integer digits), nesting past [`MAX_DEPTH`], and a key it reads given twice.
///
/// Why: every chunk of every stream is read here, and `serde_json`'s visitors took 3,880
/// instructions for the load benchmark's chunk and 5,610 for one of OpenAI's; this takes
/// 2,260 and 3,290 (docs/profiling.md, the thirtieth pass). The values kept as sent (`usage`,
/// `error`, tool calls) are rare: their text is found here and parsed by `serde_json`, so
/// they are the same `Value`s.
struct Scan<'a> {
    text: &'a str,
    at: usize,
}

/// The bit of a field already read in an object (a key read twice leaves it to `serde_json`).
fn first_time(seen: &mut u8, field: u8) -> Option<()> {
    if *seen & field != 0 {
        return None;
    }
    *seen |= field;
    Some(())
}

impl<'a> Scan<'a> {
    fn new(text: &'a str) -> Self {
        Self { text, at: 0 }
    }

    /// The chunk, when the body is one object and nothing after it.
    fn chunk(&mut self) -> Option<ChunkView<'a>> {
        let mut view = ChunkView::default();
        let mut seen = 0u8;
        self.entries(1, |scan, key| match key {
            b"choices" => {
                first_time(&mut seen, 1)?;
                view.choices = scan.first_choice(2)?;
                Some(())
            }
            b"usage" => {
                first_time(&mut seen, 2)?;
                view.usage = scan.usage(2)?;
                Some(())
            }
            b"error" => {
                first_time(&mut seen, 4)?;
                view.error = Present(Some(scan.value(2)?));
                Some(())
            }
            _ => scan.skip(2),
        })?;
        self.peek().is_none().then_some(view)
    }

    /// `choices`: the first when it is a non-empty array, the others read like it and dropped.
    fn first_choice(&mut self, depth: u32) -> Option<First<Object<ChoiceView<'a>>>> {
        if self.peek()? != b'[' {
            return self.skip(depth).map(|()| First(None));
        }
        let mut first = None;
        self.elements(depth, |scan| {
            let choice = scan.object(depth + 1, Scan::choice)?;
            first.get_or_insert(choice);
            Some(())
        })?;
        Some(First(first))
    }

    fn choice(&mut self, depth: u32) -> Option<ChoiceView<'a>> {
        let mut choice = ChoiceView::default();
        let mut seen = 0u8;
        self.entries(depth, |scan, key| match key {
            b"message" => {
                first_time(&mut seen, 1)?;
                choice.message = scan.object(depth + 1, Scan::message)?;
                Some(())
            }
            b"delta" => {
                first_time(&mut seen, 2)?;
                choice.delta = scan.object(depth + 1, Scan::message)?;
                Some(())
            }
            b"finish_reason" => {
                first_time(&mut seen, 4)?;
                choice.finish_reason = scan.text(depth + 1)?;
                Some(())
            }
            _ => scan.skip(depth + 1),
        })?;
        Some(choice)
    }

    fn message(&mut self, depth: u32) -> Option<MessageView<'a>> {
        let mut message = MessageView::default();
        let mut seen = 0u8;
        self.entries(depth, |scan, key| match key {
            b"content" => {
                first_time(&mut seen, 1)?;
                message.content = scan.text(depth + 1)?;
                Some(())
            }
            b"tool_calls" => {
                first_time(&mut seen, 2)?;
                message.tool_calls = scan.values(depth + 1)?;
                Some(())
            }
            _ => scan.skip(depth + 1),
        })?;
        Some(message)
    }

    /// `read` of the next value when it is an object, else nothing (the value skipped).
    #[inline]
    fn object<T>(
        &mut self,
        depth: u32,
        read: fn(&mut Self, u32) -> Option<T>,
    ) -> Option<Object<T>> {
        if self.peek()? == b'{' {
            return read(self, depth).map(|value| Object(Some(value)));
        }
        self.skip(depth).map(|()| Object(None))
    }

    /// The elements of the next value as `Value`s when it is an array, else nothing.
    fn values(&mut self, depth: u32) -> Option<Array<Value>> {
        if self.peek()? != b'[' {
            return self.skip(depth).map(|()| Array(None));
        }
        let mut elements = Vec::new();
        self.elements(depth, |scan| {
            elements.push(scan.value(depth + 1)?);
            Some(())
        })?;
        Some(Array(Some(elements)))
    }

    /// The next value when it is a string, else nothing.
    #[inline]
    fn text(&mut self, depth: u32) -> Option<Str<'a>> {
        if self.peek()? == b'"' {
            return self.string().map(|text| Str(Some(text)));
        }
        self.skip(depth).map(|()| Str(None))
    }

    /// The next value as a usage: read by `serde_json` straight into a [`Usage`], no `Value`
    /// built on the way (its maps were most of a usage chunk's reading). Where that refuses
    /// (a count given twice, which a `Value` reads as its last; a value of another shape),
    /// the `Value` is read and the usage taken from it, as [`ReportedUsage`] reads it. A value
    /// this scan passed over is one `serde_json` reads (its numbers in range, its strings
    /// whole), so the two readings agree wherever the first gives a usage.
    ///
    /// Only an object or an array can be a usage (a struct reads from either); any other value
    /// is none, and is passed over without `serde_json`. OpenAI sends `"usage":null` in every
    /// chunk but the last of a stream that asks for usage, and `serde_json` refusing it built
    /// an error, its message formatted, before the `Value` was read: most of a chunk's
    /// reading (docs/profiling.md, the fifty-first pass).
    fn usage(&mut self, depth: u32) -> Option<ReportedUsage> {
        if !matches!(self.peek()?, b'{' | b'[') {
            return self.skip(depth).map(|()| ReportedUsage(None));
        }
        let text = self.value_text(depth)?;
        if let Ok(usage) = serde_json::from_str::<Usage>(text) {
            return Some(ReportedUsage(Some(usage)));
        }
        let value: Value = serde_json::from_str(text).ok()?;
        Some(ReportedUsage::of(&value))
    }

    /// The next value as `serde_json` gives it: its text found here, parsed there.
    fn value(&mut self, depth: u32) -> Option<Value> {
        serde_json::from_str(self.value_text(depth)?).ok()
    }

    /// The text of the next value, checked and passed over.
    fn value_text(&mut self, depth: u32) -> Option<&'a str> {
        self.peek()?;
        let start = self.at;
        self.skip(depth)?;
        self.text.get(start..self.at)
    }

    /// The next byte past whitespace, not taken.
    #[inline]
    fn peek(&mut self) -> Option<u8> {
        let bytes = self.text.as_bytes();
        loop {
            let byte = *bytes.get(self.at)?;
            // Past the space, no byte is whitespace: one comparison for the usual case.
            if byte > b' ' || !matches!(byte, b' ' | b'\t' | b'\n' | b'\r') {
                return Some(byte);
            }
            self.at += 1;
        }
    }

    /// Takes `byte` when it comes next.
    #[inline]
    fn eat(&mut self, byte: u8) -> bool {
        let next = self.peek() == Some(byte);
        if next {
            self.at += 1;
        }
        next
    }

    /// An object's entries (it must come next), each value read by `entry` given its key.
    /// A key is matched as its bytes: one with an escape (which no upstream writes) is left
    /// to `serde_json`.
    #[inline]
    fn entries(
        &mut self,
        depth: u32,
        mut entry: impl FnMut(&mut Self, &[u8]) -> Option<()>,
    ) -> Option<()> {
        if depth > MAX_DEPTH || !self.eat(b'{') {
            return None;
        }
        if self.eat(b'}') {
            return Some(());
        }
        let bytes = self.text.as_bytes();
        loop {
            if self.peek()? != b'"' {
                return None;
            }
            let start = self.at + 1;
            let end = self.run_end(start)?;
            if bytes[end] != b'"' {
                return None;
            }
            self.at = end + 1;
            if !self.eat(b':') {
                return None;
            }
            entry(self, &bytes[start..end])?;
            if !self.eat(b',') {
                return self.eat(b'}').then_some(());
            }
        }
    }

    /// An array's elements (it must come next), each read by `element`.
    #[inline]
    fn elements(
        &mut self,
        depth: u32,
        mut element: impl FnMut(&mut Self) -> Option<()>,
    ) -> Option<()> {
        if depth > MAX_DEPTH || !self.eat(b'[') {
            return None;
        }
        if self.eat(b']') {
            return Some(());
        }
        loop {
            element(self)?;
            if !self.eat(b',') {
                return self.eat(b']').then_some(());
            }
        }
    }

    /// Any value, checked and passed over.
    fn skip(&mut self, depth: u32) -> Option<()> {
        match self.peek()? {
            b'"' => self.skip_string(),
            b'{' => self.entries(depth, |scan, _| scan.skip(depth + 1)),
            b'[' => self.elements(depth, |scan| scan.skip(depth + 1)),
            b't' => self.literal(b"true"),
            b'f' => self.literal(b"false"),
            b'n' => self.literal(b"null"),
            _ => self.number(),
        }
    }

    #[inline]
    fn literal(&mut self, word: &[u8]) -> Option<()> {
        self.text
            .as_bytes()
            .get(self.at..)?
            .starts_with(word)
            .then(|| {
                self.at += word.len();
            })
    }

    /// A number within `f64`'s range whatever its digits: `-?(0|[1-9][0-9]{0,19})(.[0-9]+)?`,
    /// then an exponent of one or two digits.
    fn number(&mut self) -> Option<()> {
        let bytes = self.text.as_bytes();
        let digits = |from: usize| {
            bytes.get(from..).map_or(0, |rest| {
                rest.iter().take_while(|byte| byte.is_ascii_digit()).count()
            })
        };
        let mut at = self.at + usize::from(bytes.get(self.at) == Some(&b'-'));
        let integer = digits(at);
        if integer == 0 || integer > 20 || (integer > 1 && bytes.get(at) == Some(&b'0')) {
            return None;
        }
        at += integer;
        if bytes.get(at) == Some(&b'.') {
            let fraction = digits(at + 1);
            if fraction == 0 {
                return None;
            }
            at += 1 + fraction;
        }
        if matches!(bytes.get(at), Some(b'e' | b'E')) {
            at += 1 + usize::from(matches!(bytes.get(at + 1), Some(b'+' | b'-')));
            let exponent = digits(at);
            if exponent == 0 || exponent > 2 {
                return None;
            }
            at += exponent;
        }
        self.at = at;
        Some(())
    }

    /// A string (it must come next): borrowed from the body unless it has escapes.
    #[inline]
    fn string(&mut self) -> Option<Cow<'a, str>> {
        let bytes = self.text.as_bytes();
        let start = self.at + 1;
        let end = self.run_end(start)?;
        if bytes[end] == b'"' {
            self.at = end + 1;
            return self.text.get(start..end).map(Cow::Borrowed);
        }
        self.escaped_string(start, end).map(Cow::Owned)
    }

    /// The rest of a string with escapes, from `run` (its start), its first escape at `end`.
    fn escaped_string(&mut self, mut run: usize, mut end: usize) -> Option<String> {
        let bytes = self.text.as_bytes();
        let mut owned = String::new();
        loop {
            owned.push_str(self.text.get(run..end)?);
            if bytes[end] == b'"' {
                self.at = end + 1;
                return Some(owned);
            }
            // `bytes[end]` is a backslash.
            let (unescaped, length) = unescape(bytes.get(end + 1..)?)?;
            owned.push(unescaped);
            run = end + 1 + length;
            end = self.run_end(run)?;
        }
    }

    /// A string (it must come next), checked and passed over.
    #[inline]
    fn skip_string(&mut self) -> Option<()> {
        let bytes = self.text.as_bytes();
        let mut end = self.run_end(self.at + 1)?;
        while bytes[end] == b'\\' {
            let (_, length) = unescape(bytes.get(end + 1..)?)?;
            end = self.run_end(end + 1 + length)?;
        }
        self.at = end + 1;
        Some(())
    }

    /// Where the run of plain characters from `from` ends: the next quote or backslash. A
    /// control character before it (which JSON refuses in a string) leaves it to `serde_json`.
    /// Found as the JSON writer finds the next byte to escape, eight bytes at a time.
    #[inline]
    fn run_end(&self, from: usize) -> Option<usize> {
        let bytes = self.text.as_bytes();
        crate::json::next_to_escape(bytes, from).filter(|&at| matches!(bytes[at], b'"' | b'\\'))
    }
}

/// The character of the escape `rest` starts with (after its backslash), and the escape's
/// length; none for one JSON does not have, or a surrogate that is not a pair's.
fn unescape(rest: &[u8]) -> Option<(char, usize)> {
    let simple = match *rest.first()? {
        b'"' => '"',
        b'\\' => '\\',
        b'/' => '/',
        b'b' => '\u{8}',
        b'f' => '\u{c}',
        b'n' => '\n',
        b'r' => '\r',
        b't' => '\t',
        b'u' => {
            let unit = hex4(rest.get(1..5)?)?;
            if !(0xD800..0xDC00).contains(&unit) {
                // A lone low surrogate is no `char`.
                return Some((char::from_u32(unit)?, 5));
            }
            if rest.get(5..7)? != b"\\u" {
                return None;
            }
            let low = hex4(rest.get(7..11)?)?;
            if !(0xDC00..0xE000).contains(&low) {
                return None;
            }
            let code = 0x10000 + ((unit - 0xD800) << 10) + (low - 0xDC00);
            return Some((char::from_u32(code)?, 11));
        }
        _ => return None,
    };
    Some((simple, 1))
}

/// Four hex digits' value.
fn hex4(digits: &[u8]) -> Option<u32> {
    digits.iter().try_fold(0u32, |value, &digit| {
        Some(value * 16 + char::from(digit).to_digit(16)?)
    })
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
        assert!(view.usage.0.is_none());
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
        assert_eq!(view.reported_usage().map(|u| u.prompt_tokens), Some(3));

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

    /// A usage is read straight into its counts, and where that reading refuses one, as the
    /// `Value` holding it reads: the last of a count given twice, none for a count of
    /// another type; unknown fields (OpenAI's details) are passed over.
    #[test]
    fn a_usage_reads_as_the_value_holding_it_reads() {
        let usage = |body: &str| parse(body).unwrap().unwrap().reported_usage();
        let counts = |prompt, completion, total| Usage {
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: total,
        };
        let details = r#"{"usage":{"prompt_tokens":11,"completion_tokens":20,"total_tokens":31,
            "prompt_tokens_details":{"cached_tokens":0,"audio_tokens":0}}}"#;
        assert_eq!(usage(details), Some(counts(11, 20, 31)));
        let twice = r#"{"usage":{"prompt_tokens":1,"completion_tokens":2,"prompt_tokens":5}}"#;
        assert_eq!(usage(twice), Some(counts(5, 2, 0)));
        assert_eq!(usage(r#"{"usage":[4,5,9]}"#), Some(counts(4, 5, 9)));
        assert_eq!(usage(r#"{"usage":{"prompt_tokens":-1}}"#), None);
        // A value that is neither an object nor an array is no usage, read fast or not.
        for other in ["null", r#""17""#, "17", "-1.5e3", "true", "false"] {
            let body = format!(r#"{{"usage":{other},"choices":[]}}"#);
            assert_eq!(usage(&body), None, "{body}");
            assert!(Scan::new(&body).chunk().is_some(), "read fast: {body}");
        }
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

    /// Everything a view holds, with which of its strings are borrowed from the body.
    fn described(view: &ChunkView<'_>) -> String {
        let borrowed = |text: &Str<'_>| matches!(text.0, Some(Cow::Borrowed(_)));
        let mut described = format!("{view:?}");
        if let Some(choice) = view.choice() {
            for message in [&choice.message, &choice.delta] {
                if let Some(message) = &message.0 {
                    described += &format!(" borrowed:{}", borrowed(&message.content));
                }
            }
            described += &format!(" borrowed:{}", borrowed(&choice.finish_reason));
        }
        described
    }

    /// The fast reading of `body`, checked against `serde_json`'s when it gives one.
    fn fast_and_checked(body: &str) -> Option<String> {
        let fast = described(&Scan::new(body).chunk()?);
        match by_serde_json(body) {
            Ok(Some(view)) => assert_eq!(fast, described(&view), "{body}"),
            other => panic!("the fast reading took {body:?}, serde_json gave {other:?}"),
        }
        Some(fast)
    }

    /// Bodies as upstreams send them, each of which the fast reading takes.
    const USUAL: &[&str] = &[
        // The load benchmark's upstream (keys sorted).
        r#"{"choices":[{"delta":{"content":"tok0 "},"finish_reason":null,"index":0}],"created":1,"id":"chatcmpl-mock","model":"bench-upstream","object":"chat.completion.chunk"}"#,
        // OpenAI's, with the fields it adds.
        r#"{"id":"chatcmpl-AbC","object":"chat.completion.chunk","created":1732000000,"model":"gpt-4o-mini-2024-07-18","service_tier":"default","system_fingerprint":"fp_0ba0d124f1","choices":[{"index":0,"delta":{"content":" world"},"logprobs":null,"finish_reason":null}],"usage":null,"obfuscation":"Qx7bT"}"#,
        r#"{"id":"c","choices":[{"index":0,"delta":{"role":"assistant","content":"","refusal":null},"logprobs":{"content":[{"token":"a","logprob":-1.25e-05,"bytes":[97],"top_logprobs":[]}]},"finish_reason":null}]}"#,
        r#"{"id":"c","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}"#,
        r#"{"id":"c","choices":[],"usage":{"prompt_tokens":11,"completion_tokens":20,"total_tokens":31,"prompt_tokens_details":{"cached_tokens":0}}}"#,
        // Text with escapes, a character outside the basic plane among them.
        r#"{"choices":[{"delta":{"content":"line\nnext \"quoted\" \u00e9 \ud83d\ude00 \\ \/ \t\r\b\f"}}]}"#,
        r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"id":"call_1","type":"function","function":{"name":"lookup","arguments":"{\"q\": 1}"}}]}}]}"#,
        // A whole completion, laid out with whitespace.
        "{\n  \"id\": \"c\",\n  \"choices\": [ {\"index\": 0, \"message\": {\"role\": \"assistant\", \"content\": \"Hi\"}, \"finish_reason\": \"stop\"} ],\n  \"usage\": {\"prompt_tokens\": 3, \"completion_tokens\": 1.5e2}\r\n}\t ",
        r#"{"error":{"message":"overloaded","type":"server_error","code":null}}"#,
        r#"{"error":null,"choices":[42,"x",null,{"delta":"text","message":[1,2],"finish_reason":7}]}"#,
        r#"{"choices":{"0":{}},"usage":[true,false,-0,0.5]}"#,
        // Usages a `Usage` is read from as a `Value` holding them reads: a count given twice
        // (its last), a list of the three counts, a count of another type.
        r#"{"usage":{"prompt_tokens":1,"completion_tokens":2,"prompt_tokens":5}}"#,
        r#"{"usage":[4,5,9]}"#,
        r#"{"usage":{"prompt_tokens":-1,"total_tokens":3}}"#,
    ];

    #[test]
    fn the_fast_reading_takes_the_usual_bodies_as_serde_json_reads_them() {
        for body in USUAL {
            assert!(fast_and_checked(body).is_some(), "not taken fast: {body}");
        }
        let view = parse(USUAL[5]).unwrap().unwrap();
        assert_eq!(
            text(&view).as_deref(),
            Some("line\nnext \"quoted\" é 😀 \\ / \t\r\u{8}\u{c}")
        );
    }

    #[test]
    fn what_the_fast_reading_is_not_sure_of_is_read_by_serde_json() {
        let deep = format!(r#"{{"x":{}1{}}}"#, "[".repeat(70), "]".repeat(70));
        let given_up = [
            // Not an object, or not JSON.
            "[1,2]",
            "not json",
            r#"{"choices":[]} x"#,
            r#"{"choices":[],}"#,
            r#"{"choices":[1,]}"#,
            r#"{"a":01}"#,
            r#"{"a":1.}"#,
            r#"{"a":+1}"#,
            // A number that could be out of range, wherever it is.
            r#"{"created":1e999}"#,
            r#"{"choices":[{"delta":{"content":1e400}}]}"#,
            r#"{"n":123456789012345678901}"#,
            // A control character in a string; an escape JSON does not have; lone surrogates.
            "{\"choices\":[{\"delta\":{\"content\":\"a\u{1}b\"}}]}",
            r#"{"choices":[{"delta":{"content":"\x41"}}]}"#,
            r#"{"choices":[{"delta":{"content":"\ud800"}}]}"#,
            r#"{"choices":[{"delta":{"content":"\udc00"}}]}"#,
            r#"{"id":"\ud800x"}"#,
            // A key it reads, twice, in the first choice or in one after it.
            r#"{"choices":[],"choices":[]}"#,
            r#"{"choices":[{"delta":{"content":"a","content":"b"}}]}"#,
            r#"{"choices":[{"delta":{}},{"delta":{"content":"a","content":"b"}}]}"#,
            // Deeper than it goes.
            deep.as_str(),
        ];
        for body in given_up {
            assert!(Scan::new(body).chunk().is_none(), "taken fast: {body}");
            assert_eq!(
                format!("{:?}", parse(body)),
                format!("{:?}", by_serde_json(body)),
                "{body}"
            );
        }
        // What serde_json takes of them, it still does.
        assert!(parse(&deep).unwrap().is_some());
        assert!(parse(r#"{"id":"\ud800x"}"#).unwrap().is_some());
        assert!(parse(r#"{"n":123456789012345678901}"#).unwrap().is_some());
    }

    #[test]
    fn a_run_of_plain_characters_ends_at_the_first_quote_backslash_or_control_character() {
        // Eight bytes at a time and the tail a byte at a time, against the rule spelled out.
        const CHARACTERS: &[char] = &['a', '"', '\\', '\u{1}', '\u{1f}', ' ', '\u{7f}', 'é', '😀'];
        let mut random = fastrand::Rng::with_seed(8);
        for _ in 0..5_000 {
            let text: String = (0..random.usize(0..40))
                .map(|_| CHARACTERS[random.usize(..CHARACTERS.len())])
                .collect();
            let from = random.usize(..=text.len());
            let expected = text.as_bytes()[from..]
                .iter()
                .position(|&byte| byte < 0x20 || byte == b'"' || byte == b'\\')
                .filter(|&at| matches!(text.as_bytes()[from + at], b'"' | b'\\'))
                .map(|at| from + at);
            assert_eq!(
                Scan::new(&text).run_end(from),
                expected,
                "{text:?} from {from}"
            );
        }
    }

    #[test]
    fn the_fast_reading_agrees_with_serde_json_on_mutated_bodies() {
        // Bodies changed at random a few characters at a time, among the characters that
        // matter to JSON: whatever the fast reading takes, serde_json reads the same.
        const ALPHABET: &[char] = &[
            '{', '}', '[', ']', '"', ',', ':', '\\', ' ', '\n', '0', '1', '9', '-', '.', 'e', 'E',
            '+', 'u', 'd', '8', 'n', 't', 'f', 'l', 'a', 's', 'é', '\u{1}', '/', 'b',
        ];
        let mut random = fastrand::Rng::with_seed(16);
        let (mut taken, mut given_up) = (0, 0);
        for round in 0..20_000 {
            let mut body: Vec<char> = USUAL[round % USUAL.len()].chars().collect();
            for _ in 0..random.usize(1..4) {
                let at = random.usize(..=body.len());
                match random.u8(..4) {
                    0 if at < body.len() => {
                        body.remove(at);
                    }
                    1 if at < body.len() => body[at] = ALPHABET[random.usize(..ALPHABET.len())],
                    2 => {
                        let end = (at + random.usize(1..12)).min(body.len());
                        let copy: Vec<char> = body[at..end].to_vec();
                        body.splice(at..at, copy);
                    }
                    _ => body.insert(at, ALPHABET[random.usize(..ALPHABET.len())]),
                }
            }
            let body: String = body.into_iter().collect();
            match fast_and_checked(&body) {
                Some(_) => taken += 1,
                None => given_up += 1,
            }
        }
        // Both ways were taken many times (the check above ran on the first).
        assert!(
            taken > 2_000 && given_up > 2_000,
            "{taken} taken, {given_up} given up"
        );
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
