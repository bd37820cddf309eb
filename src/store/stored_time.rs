//! How a store writes and reads a time as text: RFC 3339 in UTC with microseconds
//! (`2026-11-27T16:04:41.123456Z`), always the same width, so that the text order of two
//! stored times is their order in time (listings, cursors and the prune compare them in SQL).
//! Every time the SQLite store keeps is such text; PostgreSQL keeps its times as
//! `timestamptz`, but the times inside a row of events' `more` (JSON) as this text too.
//!
//! A chat request writes about twenty times and a view reads a few: chrono's general
//! formatter and parser took ~15,000 instructions of a request (~2%). Times are written by
//! [`crate::time`]; those in the fixed layout are read here directly, anything else (a year
//! outside 0-9999, a leap second, text another writer left with an offset or fewer digits)
//! through chrono, which reads every RFC 3339 form.

use chrono::{DateTime, NaiveDate, SecondsFormat, Utc};

use super::StoreError;
use crate::time::TimeText;

/// The stored text's length in the fixed layout.
const WIDTH: usize = "2026-11-27T16:04:41.123456Z".len();

/// Where the layout's separators stand, between its digits.
const SEPARATORS: [(usize, u8); 7] = [
    (4, b'-'),
    (7, b'-'),
    (10, b'T'),
    (13, b':'),
    (16, b':'),
    (19, b'.'),
    (WIDTH - 1, b'Z'),
];

/// The current time as the store writes it.
pub(super) fn now() -> TimeText {
    text(&Utc::now())
}

/// `value` as the store writes it, held in place (bound as it is: no allocation).
pub(super) fn text(value: &DateTime<Utc>) -> TimeText {
    crate::time::text(value, SecondsFormat::Micros)
}

/// A time that may be absent as the store writes it, owned: for the reader pool's binds
/// (sqlx), which take a `String`, in a listing's or a report's time filters.
pub(super) fn owned(value: Option<&DateTime<Utc>>) -> Option<String> {
    value.map(|value| text(value).into())
}

/// Binds a time's text to a statement of the embedded store's writer without copying it.
impl rusqlite::ToSql for TimeText {
    fn to_sql(&self) -> rusqlite::Result<rusqlite::types::ToSqlOutput<'_>> {
        Ok(rusqlite::types::ToSqlOutput::Borrowed(
            rusqlite::types::ValueRef::Text(self.as_bytes()),
        ))
    }
}

/// A stored time: the fixed layout read directly, any other RFC 3339 text through chrono.
pub(super) fn parse(text: &str) -> Result<DateTime<Utc>, StoreError> {
    match parse_fixed(text.as_bytes()) {
        Some(time) => Ok(time),
        None => DateTime::parse_from_rfc3339(text)
            .map(|time| time.with_timezone(&Utc))
            .map_err(|e| StoreError::Corrupt(format!("timestamp `{text}`: {e}"))),
    }
}

/// A stored time that may be absent.
pub(super) fn parse_opt(text: Option<String>) -> Result<Option<DateTime<Utc>>, StoreError> {
    text.as_deref().map(parse).transpose()
}

/// The fixed layout, or `None` when `text` is not in it or names no valid time.
fn parse_fixed(text: &[u8]) -> Option<DateTime<Utc>> {
    if text.len() != WIDTH
        || SEPARATORS
            .iter()
            .any(|&(at, separator)| text[at] != separator)
    {
        return None;
    }
    let number = |at: usize, digits: usize| {
        text[at..at + digits]
            .iter()
            .try_fold(0u32, |number, &byte| {
                byte.is_ascii_digit()
                    .then(|| number * 10 + u32::from(byte - b'0'))
            })
    };
    let date = NaiveDate::from_ymd_opt(
        i32::try_from(number(0, 4)?).ok()?,
        number(5, 2)?,
        number(8, 2)?,
    )?;
    let time = date.and_hms_micro_opt(
        number(11, 2)?,
        number(14, 2)?,
        number(17, 2)?,
        number(20, 6)?,
    )?;
    Some(time.and_utc())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chrono_text(value: &DateTime<Utc>) -> String {
        value.to_rfc3339_opts(SecondsFormat::Micros, true)
    }

    #[test]
    fn times_are_written_as_chrono_writes_them_and_read_back() {
        let mut checked = 0;
        // Every month's edges over years from 0 to 9999, at microseconds of every width.
        for year in [0, 1, 9, 999, 1970, 2000, 2024, 2026, 9999] {
            for month in 1..=12 {
                for day in [1, 9, 28, 29, 30, 31] {
                    let Some(date) = NaiveDate::from_ymd_opt(year, month, day) else {
                        continue;
                    };
                    for (hour, minute, second, micro) in [
                        (0, 0, 0, 0),
                        (9, 5, 7, 1),
                        (23, 59, 59, 999_999),
                        (12, 30, 1, 40_500),
                    ] {
                        let value = date
                            .and_hms_micro_opt(hour, minute, second, micro)
                            .expect("a valid time")
                            .and_utc();
                        let stored = text(&value);
                        assert_eq!(stored, chrono_text(&value));
                        assert_eq!(parse(&stored).expect("parses"), value);
                        checked += 1;
                    }
                }
            }
        }
        assert!(checked > 2_000, "{checked}");
    }

    #[test]
    fn times_outside_the_fixed_layout_go_through_chrono() {
        // Nanoseconds are cut to microseconds, as chrono cuts them.
        let value = DateTime::from_timestamp(1_795_000_000, 123_456_789).expect("valid");
        assert_eq!(text(&value), chrono_text(&value));
        assert!(text(&value).ends_with(":40.123456Z"), "{:?}", text(&value));
        for value in [DateTime::<Utc>::MIN_UTC, DateTime::<Utc>::MAX_UTC] {
            assert_eq!(text(&value), chrono_text(&value));
        }
        let leap = NaiveDate::from_ymd_opt(2016, 12, 31)
            .and_then(|date| date.and_hms_micro_opt(23, 59, 59, 1_500_000))
            .expect("a leap second")
            .and_utc();
        assert_eq!(text(&leap), chrono_text(&leap));
        assert_eq!(parse(&text(&leap)).expect("parses"), leap);
        // Other RFC 3339 forms are read; the fixed layout with an impossible date is not.
        assert_eq!(
            parse("2026-11-27T18:04:41+02:00").expect("parses"),
            parse("2026-11-27T16:04:41.000000Z").expect("parses")
        );
        assert_eq!(
            parse("2026-11-27T16:04:41.5Z").expect("parses"),
            parse("2026-11-27T16:04:41.500000Z").expect("parses")
        );
        for bad in [
            "2026-02-30T16:04:41.000000Z",
            "2026-11-27T24:04:41.000000Z",
            "2026-11-27T16:04:4x.000000Z",
            "",
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }
}
