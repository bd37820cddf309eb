//! Times as RFC 3339 text in UTC, written the way chrono writes them, without chrono's general
//! formatter: a request writes about twenty times to its store and a view shows several, and
//! that formatter took ~3,400 instructions a time (docs/profiling.md, the thirteenth and the
//! nineteenth pass). Times in the usual range (years 0 to 9999, no leap second) go through a
//! fixed layout here; any other through chrono, which gives the same text.

use std::cell::RefCell;

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
    static LAST_SECOND: RefCell<(NaiveDate, u32, String)> =
        const { RefCell::new((NaiveDate::MIN, u32::MAX, String::new())) };
}

/// `value` as `value.to_rfc3339_opts(seconds, true)` writes it.
pub fn rfc3339(value: &DateTime<Utc>, seconds: SecondsFormat) -> String {
    let naive = value.naive_utc();
    let (date, time) = (naive.date(), naive.time());
    let (year, nanos) = (date.year(), time.nanosecond());
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
        _ => return value.to_rfc3339_opts(seconds, true),
    };
    // chrono represents a leap second as a nanosecond count past one second.
    if !(0..=9999).contains(&year) || nanos >= 1_000_000_000 {
        return value.to_rfc3339_opts(seconds, true);
    }
    let mut text = String::with_capacity(LONGEST);
    let second = time.num_seconds_from_midnight();
    LAST_SECOND.with_borrow_mut(|(last_date, last_second, prefix)| {
        if (*last_date, *last_second) != (date, second) {
            let mut digits = [0u8; TO_SECONDS];
            // `year` is within 0..=9999, checked above.
            put_digits(&mut digits[0..4], year.unsigned_abs());
            put_digits(&mut digits[5..7], date.month());
            put_digits(&mut digits[8..10], date.day());
            put_digits(&mut digits[11..13], time.hour());
            put_digits(&mut digits[14..16], time.minute());
            put_digits(&mut digits[17..19], time.second());
            for (at, separator) in [(4, b'-'), (7, b'-'), (10, b'T'), (13, b':'), (16, b':')] {
                digits[at] = separator;
            }
            prefix.clear();
            prefix.extend(digits.iter().map(|&digit| char::from(digit)));
            (*last_date, *last_second) = (date, second);
        }
        text.push_str(prefix);
    });
    if fraction_digits > 0 {
        let mut digits = [0u8; 9];
        let digits = &mut digits[..fraction_digits];
        // `fraction_digits` is 3, 6 or 9: the exponent is 6, 3 or 0.
        put_digits(digits, nanos / 10u32.pow(9 - fraction_digits as u32));
        text.push('.');
        text.extend(digits.iter().map(|&digit| char::from(digit)));
    }
    text.push('Z');
    text
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
    serializer.serialize_str(&rfc3339(value, SecondsFormat::AutoSi))
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
                            assert_eq!(
                                rfc3339(&value, format),
                                value.to_rfc3339_opts(format, true)
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
                assert_eq!(rfc3339(&value, format), value.to_rfc3339_opts(format, true));
            }
        }
    }
}
