//! Server-sent events as the streaming surfaces send them: each event written straight into
//! one buffer (its `id:` and `event:` lines, one `data:` line, the blank line that ends it),
//! which becomes the body's frame as it is, and a comment whenever a stream has been quiet for
//! its keep-alive interval.
//!
//! Why not axum's `Sse`: its `Event` copies an event's data into a `BytesMut` grown as it
//! goes, a field and a line at a time, which cost more than writing a chunk's JSON (~1,100
//! instructions an event; docs/profiling.md, the fiftieth pass). The bytes sent are the ones
//! it sent, tested against it below.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use futures::Stream;
use serde::Serialize;
use tokio::time::{Instant, Sleep};

/// Most events are a chunk or a Responses event of a few hundred bytes.
const FRAME_CAPACITY: usize = 320;

/// The comment a quiet stream sends to keep its connection alive.
const KEEP_ALIVE: &[u8] = b":\n\n";

/// One whole event, as sent.
#[derive(Debug)]
pub(super) struct Frame(Bytes);

impl Frame {
    /// An unnamed event (a client reads it as `message`) whose data `write` writes.
    pub fn data(write: impl FnOnce(&mut String)) -> Self {
        Self::written(None, None, write)
    }

    /// The event `event` whose data `write` writes.
    pub fn named(event: &str, write: impl FnOnce(&mut String)) -> Self {
        Self::written(None, Some(event), write)
    }

    /// The event `event`, numbered `id` (what a client resumes from with `Last-Event-ID`),
    /// whose data `data` serializes.
    pub fn numbered(id: i64, event: &str, data: &impl Serialize) -> Self {
        Self::serialized(Some(id), Some(event), data)
    }

    /// An event whose data `data` serializes, named `event` when given. What a stream sends
    /// serializes (string-keyed maps and structs): should that ever fail, the stream sends a
    /// comment in its place and says why in the log.
    pub fn json(event: Option<&str>, data: &impl Serialize) -> Self {
        Self::serialized(None, event, data)
    }

    fn serialized(id: Option<i64>, event: Option<&str>, data: &impl Serialize) -> Self {
        match serde_json::to_string(data) {
            Ok(text) => Self::written(id, event, |out| out.push_str(&text)),
            Err(error) => {
                tracing::error!(%error, "a stream's event did not serialize");
                Self(Bytes::from_static(
                    b": an event was left out: it did not serialize\n\n",
                ))
            }
        }
    }

    /// The frame: its `id:` and `event:` lines when given, then its data as one `data:` line.
    /// JSON written compactly holds no line break; should a data ever hold one, each of its
    /// lines gets a `data:` line of its own, as SSE asks (a client joins them with `\n`).
    fn written(id: Option<i64>, event: Option<&str>, write: impl FnOnce(&mut String)) -> Self {
        let mut frame = String::with_capacity(FRAME_CAPACITY);
        if let Some(id) = id {
            frame.push_str("id: ");
            frame.push_str(itoa::Buffer::new().format(id));
            frame.push('\n');
        }
        if let Some(event) = event {
            frame.push_str("event: ");
            if memchr::memchr2(b'\n', b'\r', event.as_bytes()).is_some() {
                // Every name here is one of ours; a line break in one would start a field
                // of its own (axum's `Event` panicked), so it is sent as a space.
                frame.extend(
                    event
                        .chars()
                        .map(|c| if matches!(c, '\n' | '\r') { ' ' } else { c }),
                );
            } else {
                frame.push_str(event);
            }
            frame.push('\n');
        }
        frame.push_str("data: ");
        let data_at = frame.len();
        write(&mut frame);
        if memchr::memchr2(
            b'\n',
            b'\r',
            frame.as_bytes().get(data_at..).unwrap_or_default(),
        )
        .is_some()
        {
            let data = frame.split_off(data_at);
            frame.truncate(data_at - "data: ".len());
            for line in lines(&data) {
                frame.push_str("data: ");
                frame.push_str(line);
                frame.push('\n');
            }
            frame.push('\n');
        } else {
            frame.push_str("\n\n");
        }
        Self(Bytes::from(frame))
    }
}

/// The lines of `text` as SSE reads them: ended by `\r\n`, `\n` or `\r`.
fn lines(text: &str) -> impl Iterator<Item = &str> {
    let mut rest = Some(text);
    std::iter::from_fn(move || {
        let text = rest?;
        match memchr::memchr2(b'\n', b'\r', text.as_bytes()) {
            None => {
                rest = None;
                Some(text)
            }
            Some(at) => {
                let after = if text[at..].starts_with("\r\n") {
                    at + 2
                } else {
                    at + 1
                };
                rest = Some(&text[after..]);
                Some(&text[..at])
            }
        }
    })
}

/// `frames` as a `text/event-stream` answer, with a comment sent whenever no frame was sent
/// for `keep_alive`.
pub(super) fn response<S>(frames: S, keep_alive: Duration) -> Response
where
    S: Stream<Item = Frame> + Send + 'static,
{
    let body = KeptAlive {
        frames: Box::pin(frames),
        interval: keep_alive,
        timer: Box::pin(tokio::time::sleep(keep_alive)),
        last_sent: Instant::now(),
    };
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        Body::from_stream(body),
    )
        .into_response()
}

/// The frames of a stream, and a comment whenever none was sent for `interval`. The timer is
/// moved on only when it fires early (a frame was sent since it was set), not at every frame.
struct KeptAlive<S> {
    frames: Pin<Box<S>>,
    interval: Duration,
    timer: Pin<Box<Sleep>>,
    last_sent: Instant,
}

impl<S: Stream<Item = Frame>> Stream for KeptAlive<S> {
    type Item = Result<Bytes, Infallible>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        match this.frames.as_mut().poll_next(cx) {
            Poll::Ready(Some(Frame(bytes))) => {
                this.last_sent = Instant::now();
                return Poll::Ready(Some(Ok(bytes)));
            }
            Poll::Ready(None) => return Poll::Ready(None),
            Poll::Pending => {}
        }
        loop {
            ready!(this.timer.as_mut().poll(cx));
            let due = this.last_sent + this.interval;
            let now = Instant::now();
            if now >= due {
                this.last_sent = now;
                return Poll::Ready(Some(Ok(Bytes::from_static(KEEP_ALIVE))));
            }
            this.timer.as_mut().reset(due);
        }
    }
}

#[cfg(test)]
mod tests {
    use axum::response::sse::{Event, Sse};
    use http_body_util::BodyExt;
    use serde_json::json;

    use super::*;

    async fn body_text(response: Response) -> String {
        let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .expect("the body is read");
        String::from_utf8(bytes.to_vec()).expect("the body is text")
    }

    /// Every kind of frame the streams send, byte for byte as axum's `Event` wrote it:
    /// named, numbered and unnamed, serialized or written.
    #[tokio::test]
    async fn frames_are_the_bytes_axum_sent() {
        let value = json!({ "a": "x\ny", "b": [1, 2.5, null] });
        let ours = vec![
            Frame::named("response.created", |out| out.push_str("{\"k\":1}")),
            Frame::numbered(42, "runtime.request.started", &value),
            Frame::json(None, &value),
            Frame::json(Some("error"), &value),
            Frame::data(|out| out.push_str("[DONE]")),
        ];
        let theirs = vec![
            Event::default().event("response.created").data("{\"k\":1}"),
            Event::default()
                .id("42")
                .event("runtime.request.started")
                .json_data(&value)
                .expect("serializes"),
            Event::default().json_data(&value).expect("serializes"),
            Event::default()
                .event("error")
                .json_data(&value)
                .expect("serializes"),
            Event::default().data("[DONE]"),
        ];
        let ours = body_text(response(
            futures::stream::iter(ours),
            Duration::from_secs(15),
        ))
        .await;
        let theirs = body_text(
            Sse::new(futures::stream::iter(
                theirs.into_iter().map(Ok::<_, Infallible>),
            ))
            .into_response(),
        )
        .await;
        assert_eq!(ours, theirs);
    }

    /// A data with line breaks (never JSON's) is sent a line per `data:` line, each of
    /// `\r\n`, `\n` and `\r` ending one, so that a client reads it back with `\n`s.
    #[test]
    fn a_data_with_line_breaks_is_sent_line_by_line() {
        let sent = |text: &str| Frame::named("x", |out| out.push_str(text)).0;
        assert_eq!(sent("one\ntwo"), "event: x\ndata: one\ndata: two\n\n");
        assert_eq!(
            sent("a\r\nb\rc\n"),
            "event: x\ndata: a\ndata: b\ndata: c\ndata: \n\n"
        );
        assert_eq!(sent(""), "event: x\ndata: \n\n");
        let named = Frame::named("a\nid: 7\r", |out| out.push('1')).0;
        assert_eq!(
            named, "event: a id: 7 \ndata: 1\n\n",
            "a name cannot start a field"
        );
    }

    /// The answer's headers are those of an event stream, not to be cached.
    #[tokio::test]
    async fn the_answer_is_an_event_stream() {
        let answer = response(futures::stream::empty(), Duration::from_secs(1));
        let header = |name| answer.headers().get(name).and_then(|v| v.to_str().ok());
        assert_eq!(header(header::CONTENT_TYPE), Some("text/event-stream"));
        assert_eq!(header(header::CACHE_CONTROL), Some("no-cache"));
    }

    /// A quiet stream gets a comment once per interval of quiet, counted from the last frame
    /// sent, and none while frames keep coming.
    #[tokio::test(start_paused = true)]
    async fn a_quiet_stream_is_kept_alive() {
        let interval = Duration::from_secs(10);
        let frames = async_stream::stream! {
            // Frames 6 s apart: never 10 s of quiet.
            for n in 0..3 {
                tokio::time::sleep(Duration::from_secs(6)).await;
                yield Frame::data(|out| out.push_str(itoa::Buffer::new().format(n)));
            }
            // Then 25 s of quiet before the end: two comments, at 10 s and 20 s.
            tokio::time::sleep(Duration::from_secs(25)).await;
        };
        let started = Instant::now();
        let mut body = response(frames, interval).into_body();
        let mut sent = Vec::new();
        while let Some(frame) = body.frame().await {
            let data = frame.expect("no error").into_data().expect("data frames");
            let at = started.elapsed().as_secs();
            sent.push((at, String::from_utf8(data.to_vec()).expect("text")));
        }
        let expected: Vec<(u64, String)> = vec![
            (6, "data: 0\n\n".into()),
            (12, "data: 1\n\n".into()),
            (18, "data: 2\n\n".into()),
            (28, ":\n\n".into()),
            (38, ":\n\n".into()),
        ];
        assert_eq!(sent, expected);
    }
}
