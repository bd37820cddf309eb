//! The incremental Server-Sent Events decoder for upstream Chat Completions streams: bytes in,
//! the `data` of each complete event out, in one pass and within a fixed memory bound.
//!
//! It follows the WHATWG event-stream rules that matter for a client that only wants `data`:
//! lines end with `\n`, `\r\n` or a bare `\r` (a `\r\n` split across two reads is one line
//! end); a blank line dispatches the event; `:` starts a comment; a field without `:` has an
//! empty value; one space after the colon is dropped; `data` lines are joined with `\n`; an
//! event with no `data` line dispatches nothing; one leading byte-order mark is ignored. Other
//! fields (`event`, `id`, `retry`) are skipped: Chat Completions streams carry everything in
//! `data`. Bytes are decoded as UTF-8 per event with replacement, so where a read splits a
//! character never changes the result.
//!
//! Why not a crate: `eventsource-stream` and `sse-stream` (both already in the lock file through
//! other dependencies) buffer a line or an event without any bound and cannot be told one, and
//! bounding them from outside would mean finding the blank lines ourselves, which is the whole
//! job. `eventsource-stream` also re-parses a partial line from its start on every read.
//!
//! Linear: every byte is looked at once. The decoder keeps only the current line and the
//! current event's data; once the bytes read since the last blank line pass
//! [`MAX_EVENT_BYTES`], [`SseDecoder::feed`] fails with [`SseError::EventTooLarge`] and the
//! decoder stays failed (it holds nothing more).

/// Largest event accepted, counting every byte since the previous blank line (its lines,
/// comments and line ends, a `\r\n` as one). A hostile or broken upstream that never ends an event is refused
/// here instead of growing a buffer without end.
pub const MAX_EVENT_BYTES: usize = 8 << 20;

/// The UTF-8 byte-order mark, ignored once at the start of a stream.
const BOM: &[u8] = b"\xEF\xBB\xBF";

/// Largest buffer kept for the next event once one is done with: a rare large event's
/// memory is given back instead of held for the rest of the stream.
const KEPT_CAPACITY: usize = 64 << 10;

/// Why a stream cannot be decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SseError {
    /// The upstream sent more than `limit` bytes without ending the event with a blank line.
    #[error("an SSE event larger than {limit} bytes")]
    EventTooLarge { limit: usize },
}

/// The `data` of the events one or more reads completed, in order: their texts one after
/// another in one buffer, kept when cleared between reads (but a large one's). A read's
/// events cost no allocation each, where each was a `String` of its own, allocated and
/// freed at the next read (docs/profiling.md, the fifty-first pass).
#[derive(Debug, Default)]
pub struct Events {
    text: String,
    /// Where each event's text ends in `text`.
    ends: Vec<usize>,
}

impl Events {
    /// Forgets the events, keeping their buffer unless it grew past [`KEPT_CAPACITY`].
    pub fn clear(&mut self) {
        emptied(&mut self.text, String::capacity, String::clear);
        self.ends.clear();
    }

    /// The events' data, oldest first.
    pub fn iter(&self) -> impl Iterator<Item = &str> {
        self.ends.iter().scan(0, |start, &end| {
            let text = self.text.get(*start..end);
            *start = end;
            text
        })
    }

    fn push(&mut self, data: &str) {
        self.text.push_str(data);
        self.ends.push(self.text.len());
    }
}

/// Decodes an SSE byte stream read in arbitrary pieces into the `data` of its events.
#[derive(Debug)]
pub struct SseDecoder {
    limit: usize,
    /// The current, unfinished line.
    line: Vec<u8>,
    /// The current event's `data` lines, each followed by `\n`: empty before its first
    /// (kept from event to event).
    data: Vec<u8>,
    /// Bytes read since the last blank line, including the ones still in `line` (a line end
    /// counts as one).
    event_bytes: usize,
    /// The last byte read was a `\r`: a `\n` right after it ends no further line.
    after_cr: bool,
    /// No line has ended yet: the first one may start with a byte-order mark.
    first_line: bool,
    failed: Option<SseError>,
}

impl Default for SseDecoder {
    fn default() -> Self {
        Self::with_limit(MAX_EVENT_BYTES)
    }
}

impl SseDecoder {
    /// A decoder refusing events larger than `limit` bytes.
    pub fn with_limit(limit: usize) -> Self {
        Self {
            limit,
            line: Vec::new(),
            data: Vec::new(),
            event_bytes: 0,
            after_cr: false,
            first_line: true,
            failed: None,
        }
    }

    /// Reads `bytes`, appending the data of every event they complete to `events`. Events
    /// completed before an error are still appended; after an error the decoder stays failed.
    pub fn feed(&mut self, mut bytes: &[u8], events: &mut Events) -> Result<(), SseError> {
        if let Some(error) = self.failed {
            return Err(error);
        }
        if bytes.is_empty() {
            return Ok(());
        }
        // The events these bytes complete hold at most these bytes and the event begun before
        // them: room for them is made once.
        events.text.reserve(bytes.len().min(self.limit));
        if std::mem::replace(&mut self.after_cr, false) && bytes[0] == b'\n' {
            bytes = &bytes[1..];
        }
        while !bytes.is_empty() {
            match memchr::memchr2(b'\n', b'\r', bytes) {
                None => {
                    self.count(bytes.len())?;
                    self.line.extend_from_slice(bytes);
                    return Ok(());
                }
                Some(end) => {
                    let terminator = match (bytes[end], bytes.get(end + 1)) {
                        (b'\r', Some(b'\n')) => 2,
                        (b'\r', None) => {
                            // A `\n` may follow in the next read: it belongs to this line end.
                            self.after_cr = true;
                            1
                        }
                        _ => 1,
                    };
                    // A line end counts as one byte whatever its form, so that the count
                    // (and where the limit strikes) never depends on how reads were cut.
                    self.count(end + 1)?;
                    if self.line.is_empty() {
                        // The whole line is in this read: no copy into `self.line`.
                        self.end_line(&bytes[..end], events);
                    } else {
                        let mut line = std::mem::take(&mut self.line);
                        line.extend_from_slice(&bytes[..end]);
                        self.end_line(&line, events);
                        // Keep the allocation for the next split line.
                        line.clear();
                        self.line = line;
                    }
                    bytes = &bytes[end + terminator..];
                }
            }
        }
        Ok(())
    }

    /// Bytes held right now (the current line and event data): never more than the limit.
    #[cfg(test)]
    fn held(&self) -> usize {
        self.line.len() + self.data.len()
    }

    /// Counts `bytes` more into the current event, failing once it passes the limit.
    fn count(&mut self, bytes: usize) -> Result<(), SseError> {
        self.event_bytes = self.event_bytes.saturating_add(bytes);
        if self.event_bytes > self.limit {
            let error = SseError::EventTooLarge { limit: self.limit };
            self.failed = Some(error);
            self.line = Vec::new();
            self.data = Vec::new();
            return Err(error);
        }
        Ok(())
    }

    /// Interprets a completed line (without its line end).
    fn end_line(&mut self, mut line: &[u8], events: &mut Events) {
        if std::mem::replace(&mut self.first_line, false) {
            line = line.strip_prefix(BOM).unwrap_or(line);
        }
        if line.is_empty() {
            self.event_bytes = 0;
            // Without the `\n` after the last data line; none without a data line.
            if let Some(data) = self.data.strip_suffix(b"\n") {
                match std::str::from_utf8(data) {
                    Ok(text) => events.push(text),
                    Err(_) => events.push(&String::from_utf8_lossy(data)),
                }
                emptied(&mut self.data, Vec::capacity, Vec::clear);
            }
        } else if let Some(value) = data_value(line) {
            self.data.extend_from_slice(value);
            self.data.push(b'\n');
        }
    }
}

/// Empties `buffer` by `clear`, keeping its allocation for what comes next, or gives the
/// allocation back when it grew past [`KEPT_CAPACITY`].
fn emptied<T: Default>(buffer: &mut T, capacity: fn(&T) -> usize, clear: fn(&mut T)) {
    if capacity(buffer) > KEPT_CAPACITY {
        *buffer = T::default();
    } else {
        clear(buffer);
    }
}

/// The value of a `data` field line; `None` for comments and other fields.
fn data_value(line: &[u8]) -> Option<&[u8]> {
    let (name, value) = match memchr::memchr(b':', line) {
        Some(0) => return None,
        Some(colon) => (&line[..colon], &line[colon + 1..]),
        None => (line, &line[line.len()..]),
    };
    if name != b"data" {
        return None;
    }
    Some(value.strip_prefix(b" ").unwrap_or(value))
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::{Events, SseDecoder, SseError};

    fn decode_all(decoder: &mut SseDecoder, bytes: &[u8]) -> (Vec<String>, Result<(), SseError>) {
        let mut events = Events::default();
        let result = decoder.feed(bytes, &mut events);
        (texts(&events), result)
    }

    fn texts(events: &Events) -> Vec<String> {
        events.iter().map(str::to_owned).collect()
    }

    #[test]
    fn decodes_split_events_and_crlf() {
        let mut decoder = SseDecoder::default();
        let mut events = Events::default();
        decoder.feed(b"data: {\"a\"", &mut events).unwrap();
        assert!(texts(&events).is_empty());
        decoder
            .feed(b":1}\n\n: keep-alive\n\ndata: [DONE]\r\n\r\n", &mut events)
            .unwrap();
        assert_eq!(texts(&events), vec!["{\"a\":1}", "[DONE]"]);
        events.clear();
        decoder
            .feed(b"event: x\ndata: one\ndata: two\n\n", &mut events)
            .unwrap();
        assert_eq!(texts(&events), vec!["one\ntwo"]);
        assert_eq!(decoder.held(), 0);
    }

    #[test]
    fn follows_the_event_stream_rules() {
        let cases: &[(&[u8], &[&str])] = &[
            // Bare `\r` line ends, and a `\r\n` is one line end, not two.
            (b"data: a\rdata: b\r\rdata: c\r\n\r\n", &["a\nb", "c"]),
            // Only one space after the colon is dropped; no colon means an empty value.
            (
                b"data:  two spaces\n\ndata\n\ndata:\n\n",
                &[" two spaces", "", ""],
            ),
            // Comments, other fields and fields that merely start with `data` carry nothing.
            (b": hi\nevent: e\nid: 1\nretry: 5\ndatax: no\n\n", &[]),
            // A leading byte-order mark is ignored once.
            (
                b"\xEF\xBB\xBFdata: first\n\n\xEF\xBB\xBFdata: x\n\n",
                &["first"],
            ),
            // Invalid UTF-8 is replaced, never an error.
            (b"data: \xFF\n\n", &["\u{FFFD}"]),
            // An event without its blank line is not dispatched.
            (b"data: unfinished\n", &[]),
        ];
        for (input, expected) in cases {
            let (events, result) = decode_all(&mut SseDecoder::default(), input);
            assert_eq!(result, Ok(()));
            assert_eq!(&events, expected, "{:?}", String::from_utf8_lossy(input));
        }
    }

    #[test]
    fn a_crlf_split_between_reads_is_one_line_end() {
        let mut decoder = SseDecoder::default();
        let mut events = Events::default();
        decoder.feed(b"data: a\r", &mut events).unwrap();
        decoder.feed(b"", &mut events).unwrap();
        decoder.feed(b"\n", &mut events).unwrap();
        assert!(texts(&events).is_empty(), "{events:?}");
        decoder.feed(b"\r", &mut events).unwrap();
        assert_eq!(texts(&events), vec!["a"]);
    }

    #[test]
    fn an_event_past_the_limit_fails_and_stays_failed() {
        let mut decoder = SseDecoder::with_limit(16);
        let mut events = Events::default();
        // Events before the error in the same read are kept.
        let result = decoder.feed(b"data: ok\n\ndata: 0123456789abcdef", &mut events);
        assert_eq!(result, Err(SseError::EventTooLarge { limit: 16 }));
        assert_eq!(texts(&events), vec!["ok"]);
        assert_eq!(decoder.held(), 0);
        assert!(decoder.feed(b"\n\n", &mut events).is_err());
        // Comment lines without a blank line count too: the limit is per event, not per line.
        let mut decoder = SseDecoder::with_limit(16);
        assert!(
            decoder
                .feed(b": ping\n: ping\n: ping\n", &mut events)
                .is_err()
        );
        // A blank line resets the count.
        let mut decoder = SseDecoder::with_limit(16);
        for _ in 0..10 {
            decoder.feed(b"data: 0123456\n\n", &mut events).unwrap();
        }
    }

    /// Events and the event being read keep their buffers from read to read, each holding
    /// only its own event's data, but give a large event's back.
    #[test]
    fn buffers_are_kept_from_read_to_read_but_a_large_events() {
        let mut decoder = SseDecoder::default();
        let mut events = Events::default();
        decoder
            .feed(b"data: a longer first event\n\n", &mut events)
            .unwrap();
        events.clear();
        decoder
            .feed(b"data: short\n\ndata: two\n\n", &mut events)
            .unwrap();
        assert_eq!(texts(&events), vec!["short", "two"]);
        assert!(events.text.capacity() >= "a longer first event".len());

        let large = format!("data: {}\n\n", "x".repeat(2 * super::KEPT_CAPACITY));
        events.clear();
        decoder.feed(large.as_bytes(), &mut events).unwrap();
        assert_eq!(texts(&events)[0].len(), 2 * super::KEPT_CAPACITY);
        assert!(decoder.data.capacity() <= super::KEPT_CAPACITY);
        events.clear();
        assert!(events.text.capacity() <= super::KEPT_CAPACITY);
        decoder.feed(b"data: after\n\n", &mut events).unwrap();
        assert_eq!(texts(&events), vec!["after"]);
    }

    #[test]
    fn error_message_names_the_limit() {
        let error = SseError::EventTooLarge { limit: 8 << 20 };
        assert_eq!(error.to_string(), "an SSE event larger than 8388608 bytes");
    }

    /// Cases per property: few by default so `cargo test` stays fast; `PROPTEST_CASES` sets it.
    fn config() -> ProptestConfig {
        let mut config = ProptestConfig::default();
        if std::env::var_os("PROPTEST_CASES").is_none() {
            config.cases = 256;
        }
        config
    }

    /// Bytes that look like an event stream more often than random bytes would.
    fn stream_bytes() -> impl Strategy<Value = Vec<u8>> {
        let piece = prop_oneof![
            Just(b"data: ".to_vec()),
            Just(b"data:".to_vec()),
            Just(b": comment".to_vec()),
            Just(b"event: x".to_vec()),
            Just(b"\n".to_vec()),
            Just(b"\r".to_vec()),
            Just(b"\r\n".to_vec()),
            Just(b"\n\n".to_vec()),
            Just(b"[DONE]".to_vec()),
            Just(b"\xEF\xBB\xBF".to_vec()),
            Just("é€😀".as_bytes().to_vec()),
            proptest::collection::vec(any::<u8>(), 0..48),
        ];
        proptest::collection::vec(piece, 0..64).prop_map(|pieces| pieces.concat())
    }

    proptest! {
        #![proptest_config(config())]

        /// Whatever the bytes and however they are cut, `feed` never panics, never holds more
        /// than its limit, and yields the same events (and the same error) as one single read.
        #[test]
        fn any_split_decodes_the_same(
            bytes in prop_oneof![stream_bytes(), proptest::collection::vec(any::<u8>(), 0..512)],
            cuts in proptest::collection::vec(
                (any::<prop::sample::Index>(), any::<bool>(), any::<bool>()),
                0..12,
            ),
            limit in prop_oneof![Just(super::MAX_EVENT_BYTES), 1usize..96],
        ) {
            let (whole, whole_result) = decode_all(&mut SseDecoder::with_limit(limit), &bytes);

            // Half the cuts fall right after a `\r` (the one place where a cut changes what a
            // byte means); each cut may also bring an empty read, as a body stream can.
            let after_cr: Vec<usize> =
                (0..bytes.len()).filter(|i| bytes[*i] == b'\r').map(|i| i + 1).collect();
            let mut cuts: Vec<(usize, bool)> = cuts
                .iter()
                .map(|(i, at_cr, empty)| match (at_cr, after_cr.is_empty()) {
                    (true, false) => (after_cr[i.index(after_cr.len())], *empty),
                    _ => (i.index(bytes.len() + 1), *empty),
                })
                .collect();
            cuts.sort_unstable();
            let mut decoder = SseDecoder::with_limit(limit);
            let mut pieces = Events::default();
            let mut result = Ok(());
            let mut start = 0;
            for (end, empty) in cuts.into_iter().chain([(bytes.len(), false)]) {
                result = decoder.feed(&bytes[start..end], &mut pieces);
                if empty && result.is_ok() {
                    result = decoder.feed(&[], &mut pieces);
                }
                prop_assert!(decoder.held() <= limit);
                if result.is_err() {
                    break;
                }
                start = end;
            }
            prop_assert_eq!(&texts(&pieces), &whole);
            prop_assert_eq!(result, whole_result);
        }
    }
}
