//! Rows of `events` that hold several events, on both stores (SQLite's migration 0012,
//! PostgreSQL's 0010): a batch's consecutive events of one run go in one row, its first
//! event in the row's columns and the others in `more`, numbered on from the first. A row
//! costs one table entry, one index entry (and on PostgreSQL one foreign-key check) instead
//! of one of each per event.
//!
//! Shared here: how many events a row may hold, the shape of an event in `more`, and how a
//! read after a cursor picks its events out of rows.

use chrono::{DateTime, Utc};
use serde_json::Value;

use super::{EventRecord, StoreError};

/// Most events one row holds.
pub(super) const EVENTS_PER_ROW: usize = 16;

/// Whether `event` may join a row that holds `held` events and starts with an event of
/// `request` and `run`: only one run's consecutive events share a row, at most
/// [`EVENTS_PER_ROW`] of them, which is what the readers ([`EventRows`]) rely on. Each
/// store's writer adds its own bound on the row's bytes.
pub(super) fn may_join(request: &str, run: &str, held: usize, event: &EventRecord) -> bool {
    *event.request_id == *request && *event.run_id == *run && held < EVENTS_PER_ROW
}

/// An event after the first of its row, as `events.more` holds it: `S` is its id's and
/// type's text, `T` its time's (as the store writes times), `V` its data.
#[derive(serde::Serialize, serde::Deserialize)]
pub(super) struct LaterEvent<S, T, V> {
    pub id: S,
    #[serde(rename = "type")]
    pub event_type: S,
    pub at: T,
    pub data: V,
}

impl LaterEvent<&str, crate::time::TimeText, &Value> {
    /// Appends this event to `out` as `events.more` holds it: the text serde_json writes for
    /// it, fields in order, written by [`crate::json`], whose strings are escaped eight bytes
    /// at a time (serde_json's serializer escapes a byte at a time: ~1% of a request's
    /// instructions, on the embedded store's writer).
    pub(super) fn write(&self, out: &mut String) {
        out.push_str("{\"id\":");
        crate::json::write_str(out, self.id);
        out.push_str(",\"type\":");
        crate::json::write_str(out, self.event_type);
        out.push_str(",\"at\":");
        crate::json::write_str(out, &self.at);
        out.push_str(",\"data\":");
        crate::json::write(out, self.data);
        out.push('}');
    }
}

/// An event after the first of its row, as read back.
pub(super) type StoredLaterEvent = LaterEvent<String, String, Value>;

/// The events of a row: `first`, then `later`, numbered on from it, with its request, run,
/// session and agent; `parse_at` reads a later event's time as the store writes it.
pub(super) fn unpack(
    first: EventRecord,
    later: Vec<StoredLaterEvent>,
    parse_at: impl Fn(&str) -> Result<DateTime<Utc>, StoreError>,
) -> Result<Vec<EventRecord>, StoreError> {
    let mut events = Vec::with_capacity(later.len().saturating_add(1));
    for (offset, event) in (1_i64..).zip(later) {
        events.push(EventRecord {
            id: event.id,
            request_id: first.request_id.clone(),
            run_id: first.run_id.clone(),
            session_id: first.session_id.clone(),
            agent_id: first.agent_id.clone(),
            seq: first.seq.saturating_add(offset),
            event_type: event.event_type,
            at: parse_at(&event.at)?,
            data: event.data,
        });
    }
    events.insert(0, first);
    Ok(events)
}

/// What a read of events after a cursor asks of the rows, and how it keeps the events.
pub(super) struct EventRows {
    pub after: i64,
    pub limit: i64,
}

impl EventRows {
    /// Every event of the rows read (an archive's).
    pub const EVERY: Self = Self {
        after: 0,
        limit: -1,
    };

    /// The lowest first number a row holding an event after the cursor can have: a row
    /// starts at most [`EVENTS_PER_ROW`] - 1 events before the event it holds.
    pub fn lowest_first_seq(&self) -> i64 {
        self.after.saturating_sub(EVENTS_PER_ROW as i64 - 1)
    }

    /// Rows enough for `limit` events after the cursor: up to [`EVENTS_PER_ROW`] - 1 rows
    /// read may hold only events at or before it. A negative limit is no limit, as SQLite
    /// reads one (PostgreSQL's readers never pass one).
    pub fn rows(&self) -> i64 {
        if self.limit < 0 {
            self.limit
        } else {
            self.limit.saturating_add(EVENTS_PER_ROW as i64 - 1)
        }
    }

    /// The events of `rows` after the cursor, at most `limit`; `unpack_row` gives a row's
    /// events in order.
    pub fn keep<R>(
        &self,
        rows: &[R],
        unpack_row: impl Fn(&R) -> Result<Vec<EventRecord>, StoreError>,
    ) -> Result<Vec<EventRecord>, StoreError> {
        self.keep_unpacked(rows.iter().map(unpack_row))
    }

    /// [`EventRows::keep`] of rows unpacked as they are read: none is unpacked past the
    /// `limit`-th event.
    pub fn keep_unpacked(
        &self,
        rows: impl IntoIterator<Item = Result<Vec<EventRecord>, StoreError>>,
    ) -> Result<Vec<EventRecord>, StoreError> {
        let most = usize::try_from(self.limit).unwrap_or(usize::MAX);
        let mut events = Vec::new();
        for row in rows {
            for event in row? {
                if events.len() == most {
                    return Ok(events);
                }
                if event.seq > self.after {
                    events.push(event);
                }
            }
        }
        Ok(events)
    }
}

/// How many of what a prune takes from `table` there are (`rows`: a `FROM`-clause of
/// `owned_by_sessions`, or the rows a delete of them returned): rows, or for `events`, whose
/// rows hold several events each, the events. `array_length` is the store's function for a
/// JSON array's length.
pub(super) fn count_owned_sql(table: &str, rows: &str, array_length: &str) -> String {
    if table == "events" {
        format!("SELECT COALESCE(SUM(1 + COALESCE({array_length}(more), 0)), 0) FROM {rows}")
    } else {
        format!("SELECT COUNT(*) FROM {rows}")
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::LaterEvent;

    #[test]
    fn a_later_event_is_written_as_serde_json_writes_it() {
        let when =
            chrono::DateTime::from_timestamp_micros(1_790_000_000_123_456).unwrap_or_default();
        for data in [
            json!(null),
            json!({}),
            json!({ "event": { "phase": "agent.output.delta", "text": "tok0 tok1 " } }),
            json!({ "quote\"key": "a \\ back\nslash\t\u{1}\u{1f}", "n": [1, -2, 3.5, 1e300] }),
            json!({ "text": "naïve — 東京 🚀", "nested": [[{ "deep": [true, false, null] }]] }),
        ] {
            let later = LaterEvent {
                id: "evt_01\"odd\\id",
                event_type: "runtime.adapter.event",
                at: crate::time::text(&when, chrono::SecondsFormat::Micros),
                data: &data,
            };
            let mut written = String::new();
            later.write(&mut written);
            assert_eq!(written, serde_json::to_string(&later).unwrap_or_default());
            let read: super::StoredLaterEvent =
                serde_json::from_str(&written).unwrap_or_else(|e| panic!("{e}: {written}"));
            assert_eq!(read.data, data);
        }
    }
}
