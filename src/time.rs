//! Times as RFC 3339 text in UTC, written the way chrono writes them, without chrono's general
//! formatter: a request writes about twenty times to its store and a view shows several, and
//! that formatter took ~3,400 instructions a time (docs/profiling.md, the thirteenth and the
//! nineteenth pass). Times in the usual range (years 0 to 9999, no leap second) go through a
//! fixed layout here; any other through chrono, which gives the same text.

use chrono::{DateTime, Datelike, SecondsFormat, Timelike, Utc};
use serde::Serializer;

/// The longest text of the fixed layout: `2026-11-27T16:04:41.123456789Z`.
const LONGEST: usize = "2026-11-27T16:04:41.123456789Z".len();

/// `value` as `value.to_rfc3339_opts(seconds, true)` writes it.
pub fn rfc3339(value: &DateTime<Utc>, seconds: SecondsFormat) -> String {
    let (date, time) = (value.date_naive(), value.time());
    let (year, nanos) = (date.year(), time.nanosecond());
    let fraction_digits = match seconds {
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
    let mut text = [0u8; LONGEST];
    let mut put = |at: usize, digits: usize, mut number: u32| {
        for slot in text[at..at + digits].iter_mut().rev() {
            *slot = b'0' + (number % 10) as u8;
            number /= 10;
        }
    };
    // `year` is within 0..=9999, checked above.
    put(0, 4, year.unsigned_abs());
    put(5, 2, date.month());
    put(8, 2, date.day());
    put(11, 2, time.hour());
    put(14, 2, time.minute());
    put(17, 2, time.second());
    let mut end = 19;
    if fraction_digits > 0 {
        // `fraction_digits` is 3, 6 or 9: the exponent is 6, 3 or 0.
        put(
            20,
            fraction_digits,
            nanos / 10u32.pow(9 - fraction_digits as u32),
        );
        end = 20 + fraction_digits;
    }
    for (at, separator) in [(4, b'-'), (7, b'-'), (10, b'T'), (13, b':'), (16, b':')] {
        text[at] = separator;
    }
    text[19] = b'.';
    text[end] = b'Z';
    // Every byte written is ASCII, so the check passes (and is a few instructions).
    String::from_utf8(text[..=end].to_vec())
        .unwrap_or_else(|_| value.to_rfc3339_opts(seconds, true))
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
