//! Times as RFC 3339 text in UTC, written the way chrono writes them, without chrono's general
//! formatter: a request writes about twenty times to its store and a view shows several, and
//! that formatter took ~3,400 instructions a time (docs/profiling.md, the thirteenth and the
//! nineteenth pass). Times in the usual range (years 0 to 9999, no leap second) go through a
//! fixed layout here; any other through chrono, which gives the same text.

use std::cell::Cell;
use std::fmt;
use std::ops::Deref;

use chrono::{DateTime, Datelike, NaiveDate, SecondsFormat, Timelike, Utc};
use serde::Serializer;

/// The longest text of the fixed layout: `2026-11-27T16:04:41.123456789Z`.
const LONGEST: usize = "2026-11-27T16:04:41.123456789Z".len();

/// The layout up to its seconds: `2026-11-27T16:04:41`.
const TO_SECONDS: usize = "2026-11-27T16:04:41".len();

thread_local! {
    /// The second this thread wrote last, as its date and its second of the day, and its text
    /// up to the seconds. A request's times fall in a few seconds, so most times written
    /// only add their fraction to a text already made (docs/profiling.md, the thirty-second
    /// pass).
    static LAST_SECOND: Cell<(NaiveDate, u32, [u8; TO_SECONDS])> =
        const { Cell::new((NaiveDate::MIN, u32::MAX, [0; TO_SECONDS])) };
}

/// A time's RFC 3339 text, held in place: making one allocates nothing, and a store binds it
/// or a serializer writes it as it is (docs/profiling.md, the thirty-third pass). A time
/// outside the fixed layout (a year outside 0-9999, a leap second) holds chrono's text.
pub struct TimeText(Text);

enum Text {
    /// ASCII digits and separators, `len` of them.
    Fixed {
        bytes: [u8; LONGEST],
        len: u8,
    },
    Chrono(String),
}

impl TimeText {
    pub fn as_str(&self) -> &str {
        match &self.0 {
            // Only ASCII digits and separators are ever written into `bytes`, so this never
            // falls back to the empty text.
            Text::Fixed { bytes, len } => {
                std::str::from_utf8(bytes.get(..usize::from(*len)).unwrap_or_default())
                    .unwrap_or_default()
            }
            Text::Chrono(text) => text,
        }
    }

    /// The text's bytes, without looking at them again (a store binds them as text).
    pub fn as_bytes(&self) -> &[u8] {
        match &self.0 {
            Text::Fixed { bytes, len } => bytes.get(..usize::from(*len)).unwrap_or_default(),
            Text::Chrono(text) => text.as_bytes(),
        }
    }
}

impl Deref for TimeText {
    type Target = str;

    fn deref(&self) -> &str {
        self.as_str()
    }
}

impl fmt::Debug for TimeText {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl serde::Serialize for TimeText {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl From<TimeText> for String {
    fn from(text: TimeText) -> String {
        match text.0 {
            Text::Chrono(text) => text,
            Text::Fixed { .. } => text.as_str().to_owned(),
        }
    }
}

impl PartialEq<String> for TimeText {
    fn eq(&self, other: &String) -> bool {
        self.as_str() == other
    }
}

/// `value` as `value.to_rfc3339_opts(seconds, true)` writes it.
pub fn rfc3339(value: &DateTime<Utc>, seconds: SecondsFormat) -> String {
    text(value, seconds).into()
}

/// [`rfc3339`] held in place ([`TimeText`]).
pub fn text(value: &DateTime<Utc>, seconds: SecondsFormat) -> TimeText {
    let naive = value.naive_utc();
    let (date, time) = (naive.date(), naive.time());
    let (year, nanos) = (date.year(), time.nanosecond());
    let chrono = || TimeText(Text::Chrono(value.to_rfc3339_opts(seconds, true)));
    let fraction_digits: usize = match seconds {
        SecondsFormat::Secs => 0,
        SecondsFormat::Millis => 3,
        SecondsFormat::Micros => 6,
        SecondsFormat::Nanos => 9,
        // Every sub-second digit that is not zero, in groups of three.
        SecondsFormat::AutoSi if nanos == 0 => 0,
        SecondsFormat::AutoSi if nanos % 1_000_000 == 0 => 3,
        SecondsFormat::AutoSi if nanos % 1_000 == 0 => 6,
        SecondsFormat::AutoSi => 9,
        _ => return chrono(),
    };
    // chrono represents a leap second as a nanosecond count past one second.
    if !(0..=9999).contains(&year) || nanos >= 1_000_000_000 {
        return chrono();
    }
    let mut bytes = [0u8; LONGEST];
    let second = time.num_seconds_from_midnight();
    let (last_date, last_second, mut prefix) = LAST_SECOND.get();
    if (last_date, last_second) != (date, second) {
        // `year` is within 0..=9999, checked above.
        put_digits(&mut prefix[0..4], year.unsigned_abs());
        put_digits(&mut prefix[5..7], date.month());
        put_digits(&mut prefix[8..10], date.day());
        put_digits(&mut prefix[11..13], time.hour());
        put_digits(&mut prefix[14..16], time.minute());
        put_digits(&mut prefix[17..19], time.second());
        for (at, separator) in [(4, b'-'), (7, b'-'), (10, b'T'), (13, b':'), (16, b':')] {
            prefix[at] = separator;
        }
        LAST_SECOND.set((date, second, prefix));
    }
    bytes[..TO_SECONDS].copy_from_slice(&prefix);
    let mut len = TO_SECONDS;
    if fraction_digits > 0 {
        bytes[len] = b'.';
        // `fraction_digits` is 3, 6 or 9: the exponent is 6, 3 or 0.
        put_digits(
            &mut bytes[len + 1..len + 1 + fraction_digits],
            nanos / 10u32.pow(9 - fraction_digits as u32),
        );
        len += 1 + fraction_digits;
    }
    bytes[len] = b'Z';
    len += 1;
    // At most `LONGEST` (30), so it fits in a `u8`.
    TimeText(Text::Fixed {
        bytes,
        len: len as u8,
    })
}

/// Writes `number`'s last `slots.len()` decimal digits into `slots`, as ASCII.
fn put_digits(slots: &mut [u8], mut number: u32) {
    for slot in slots.iter_mut().rev() {
        *slot = b'0' + (number % 10) as u8;
        number /= 10;
    }
}

/// Serializes a time as chrono's `Serialize` does (RFC 3339, sub-seconds as needed, `Z`), for
/// `#[serde(serialize_with = "crate::time::serialize")]`.
pub fn serialize<S: Serializer>(value: &DateTime<Utc>, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_str(text(value, SecondsFormat::AutoSi).as_str())
}

/// Appends `value` as a JSON string, the bytes [`serialize`] writes (a time's text needs no
/// escapes).
pub fn write_json(out: &mut String, value: &DateTime<Utc>) {
    out.push('"');
    out.push_str(text(value, SecondsFormat::AutoSi).as_str());
    out.push('"');
}

/// [`write_json`] for a time that may be absent (`null`).
pub fn write_json_optional(out: &mut String, value: Option<&DateTime<Utc>>) {
    match value {
        Some(value) => write_json(out, value),
        None => out.push_str("null"),
    }
}

/// [`serialize`] for a time that may be absent (`null`).
pub fn serialize_optional<S: Serializer>(
    value: &Option<DateTime<Utc>>,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    match value {
        Some(value) => serialize(value, serializer),
        None => serializer.serialize_none(),
    }
}

#[cfg(test)]
mod tests {
    use chrono::{NaiveDate, TimeZone};

    use super::*;

    #[test]
    fn times_are_written_as_chrono_writes_them() {
        let formats = [
            SecondsFormat::Secs,
            SecondsFormat::Millis,
            SecondsFormat::Micros,
            SecondsFormat::Nanos,
            SecondsFormat::AutoSi,
        ];
        let mut checked = 0;
        for year in [0, 1, 9, 999, 1970, 2000, 2024, 2026, 9999] {
            for (month, day) in [(1, 1), (2, 28), (2, 29), (6, 30), (12, 31)] {
                let Some(date) = NaiveDate::from_ymd_opt(year, month, day) else {
                    continue;
                };
                for (hour, minute, second) in [(0, 0, 0), (9, 5, 7), (23, 59, 59)] {
                    for nanos in [
                        0,
                        1,
                        999,
                        1_000,
                        40_500_000,
                        123_000_000,
                        123_456_000,
                        123_456_789,
                        999_999_999,
                    ] {
                        let value = date
                            .and_hms_nano_opt(hour, minute, second, nanos)
                            .expect("a valid time")
                            .and_utc();
                        for format in formats {
                            let chrono = value.to_rfc3339_opts(format, true);
                            assert_eq!(rfc3339(&value, format), chrono);
                            // Held in place, as a store binds it and a serializer writes it.
                            let held = text(&value, format);
                            assert_eq!(held.as_bytes(), chrono.as_bytes());
                            assert_eq!(
                                serde_json::to_string(&held).expect("serialized"),
                                serde_json::to_string(&chrono).expect("serialized")
                            );
                        }
                        // And as chrono's serde writes it.
                        let mut ours = Vec::new();
                        serialize(&value, &mut serde_json::Serializer::new(&mut ours))
                            .expect("serialized");
                        assert_eq!(
                            String::from_utf8(ours).expect("UTF-8"),
                            serde_json::to_string(&value).expect("serialized")
                        );
                        checked += 1;
                    }
                }
            }
        }
        assert!(checked > 1_000, "{checked}");
    }

    #[test]
    fn a_second_written_before_is_not_taken_for_another() {
        // The same second of the day on two dates, the next second, and back: each time
        // written after another's must be its own.
        let at = |year, day, second, nanos| {
            NaiveDate::from_ymd_opt(year, 1, day)
                .and_then(|date| date.and_hms_nano_opt(12, 0, second, nanos))
                .expect("a valid time")
                .and_utc()
        };
        let times = [
            at(2026, 1, 5, 1_000),
            at(2026, 2, 5, 1_000),
            at(2026, 2, 6, 999_999_999),
            at(2026, 2, 6, 0),
            at(2025, 2, 6, 5),
            at(2026, 1, 5, 123_456_789),
        ];
        for _ in 0..2 {
            for value in times {
                for format in [
                    SecondsFormat::Micros,
                    SecondsFormat::AutoSi,
                    SecondsFormat::Secs,
                ] {
                    assert_eq!(rfc3339(&value, format), value.to_rfc3339_opts(format, true));
                }
            }
        }
        // Another thread keeps its own.
        std::thread::spawn(move || {
            for value in times.iter().rev() {
                assert_eq!(
                    rfc3339(value, SecondsFormat::Micros),
                    value.to_rfc3339_opts(SecondsFormat::Micros, true)
                );
            }
        })
        .join()
        .expect("the thread's times match");
    }

    #[test]
    fn times_out_of_the_layout_are_written_by_chrono() {
        let leap = NaiveDate::from_ymd_opt(2016, 12, 31)
            .and_then(|date| date.and_hms_nano_opt(23, 59, 59, 1_500_000_000))
            .expect("a leap second")
            .and_utc();
        let far = Utc.with_ymd_and_hms(12_000, 1, 1, 0, 0, 0).unwrap();
        let before = Utc.with_ymd_and_hms(-1, 1, 1, 0, 0, 0).unwrap();
        for value in [leap, far, before] {
            for format in [SecondsFormat::AutoSi, SecondsFormat::Micros] {
                let chrono = value.to_rfc3339_opts(format, true);
                assert_eq!(rfc3339(&value, format), chrono);
                assert_eq!(text(&value, format).as_bytes(), chrono.as_bytes());
            }
        }
    }
}
