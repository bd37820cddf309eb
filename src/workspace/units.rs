//! Value syntaxes of workspace documents: names, environment variable names, durations
//! (`200ms`, `120s`, `1h30m`) and byte sizes (`4MiB`).

use std::time::Duration;

/// Whether `name` is a valid workspace name: `[a-z0-9][a-z0-9._-]*`, at most 128 characters.
pub fn is_valid_name(name: &str) -> bool {
    let mut chars = name.chars();
    let Some(first) = chars.next() else {
        return false;
    };
    name.len() <= 128
        && (first.is_ascii_lowercase() || first.is_ascii_digit())
        && chars
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '.' | '_' | '-'))
}

/// Whether `name` is a portable environment variable name: `[A-Za-z_][A-Za-z0-9_]*`.
pub fn is_valid_env_var(name: &str) -> bool {
    let mut chars = name.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// The longest duration any workspace field accepts: 30 days. Capping at compile time means
/// no `Instant`/`chrono` addition with a configured duration can overflow later.
pub const MAX_DURATION: Duration = Duration::from_secs(30 * 86_400);

/// The longest retention window: ten years (pruning does its date arithmetic with this cap).
pub const MAX_RETENTION: Duration = Duration::from_secs(3_650 * 86_400);
/// `store.leaseDuration`: the default (SPEC section 8) and its bounds.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);
pub const MIN_LEASE: Duration = Duration::from_secs(1);
pub const MAX_LEASE: Duration = Duration::from_secs(86_400);

/// Parses a duration: one or more `<integer><unit>` parts, units `ms`, `s`, `m`, `h`, `d`.
/// Arithmetic saturates, so absurd values come out huge (for the caller's cap), never wrapped.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    if text.is_empty() {
        return Err("empty duration; write e.g. `30s`".to_owned());
    }
    let mut total = Duration::ZERO;
    let mut rest = text;
    while !rest.is_empty() {
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            return Err(format!(
                "invalid duration `{text}`: expected a number before `{rest}`"
            ));
        }
        let (number, tail) = rest.split_at(digits);
        let tail = tail.trim_start();
        let unit_len = tail.bytes().take_while(u8::is_ascii_alphabetic).count();
        let (unit, tail) = tail.split_at(unit_len);
        let amount: u64 = number
            .parse()
            .map_err(|_| format!("invalid duration `{text}`: number too large"))?;
        let part = match unit {
            "ms" => Duration::from_millis(amount),
            "s" => Duration::from_secs(amount),
            "m" => Duration::from_secs(amount.saturating_mul(60)),
            "h" => Duration::from_secs(amount.saturating_mul(3_600)),
            "d" => Duration::from_secs(amount.saturating_mul(86_400)),
            "" => {
                return Err(format!(
                    "invalid duration `{text}`: missing unit (ms, s, m, h, d); write e.g. `{number}s`"
                ));
            }
            other => {
                return Err(format!(
                    "invalid duration `{text}`: unknown unit `{other}` (use ms, s, m, h or d)"
                ));
            }
        };
        total = total.saturating_add(part);
        rest = tail;
    }
    Ok(total)
}

/// Parses a byte size: an integer with an optional unit `B`, `KB`, `MB`, `GB` (powers of 1000)
/// or `KiB`, `MiB`, `GiB` (powers of 1024).
pub fn parse_byte_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let digits = text.bytes().take_while(u8::is_ascii_digit).count();
    if digits == 0 {
        return Err(format!(
            "invalid size `{text}`: expected a number such as `4MiB`"
        ));
    }
    let (number, unit) = text.split_at(digits);
    let amount: u64 = number
        .parse()
        .map_err(|_| format!("invalid size `{text}`: number too large"))?;
    let multiplier: u64 = match unit.trim_start() {
        "" | "B" => 1,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        other => {
            return Err(format!(
                "invalid size `{text}`: unknown unit `{other}` (use B, KB, MB, GB, KiB, MiB or GiB)"
            ));
        }
    };
    amount
        .checked_mul(multiplier)
        .ok_or_else(|| format!("invalid size `{text}`: too large"))
}

/// A duration as YAML writes it, in its largest exact unit (`86400s` -> `1d`).
pub fn format_duration(duration: Duration) -> String {
    let seconds = duration.as_secs();
    match seconds {
        0 => format!("{}ms", duration.as_millis()),
        s if s.is_multiple_of(86_400) => format!("{}d", s / 86_400),
        s if s.is_multiple_of(3_600) => format!("{}h", s / 3_600),
        s if s.is_multiple_of(60) => format!("{}m", s / 60),
        s => format!("{s}s"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("200ms"), Ok(Duration::from_millis(200)));
        assert_eq!(parse_duration("120s"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("24h"), Ok(Duration::from_secs(86_400)));
        assert_eq!(parse_duration("1h30m"), Ok(Duration::from_secs(5_400)));
        assert_eq!(parse_duration("2d"), Ok(Duration::from_secs(172_800)));
        assert!(parse_duration("120").unwrap_err().contains("missing unit"));
        assert!(
            parse_duration("5 minutes")
                .unwrap_err()
                .contains("unknown unit")
        );
        assert!(parse_duration("").is_err());
        assert!(parse_duration("s").is_err());
        // Huge numbers are an error or saturate; they never panic or wrap around.
        assert!(
            parse_duration("99999999999999999999s")
                .unwrap_err()
                .contains("number too large")
        );
        assert!(parse_duration("18446744073709551615d").unwrap() > MAX_DURATION);
        assert!(parse_duration("18446744073709551615d18446744073709551615ms").is_ok());
    }

    #[test]
    fn byte_sizes() {
        assert_eq!(parse_byte_size("4MiB"), Ok(4 * 1024 * 1024));
        assert_eq!(parse_byte_size("512KiB"), Ok(512 * 1024));
        assert_eq!(parse_byte_size("1000"), Ok(1000));
        assert_eq!(parse_byte_size("2MB"), Ok(2_000_000));
        assert!(parse_byte_size("4mb").unwrap_err().contains("unknown unit"));
        assert!(parse_byte_size("MiB").is_err());
        assert!(parse_byte_size("99999999999999999999GiB").is_err());
    }

    #[test]
    fn names() {
        for ok in ["assistant", "weather.lookup", "a", "0x", "gpt-4o_mini"] {
            assert!(is_valid_name(ok), "{ok}");
        }
        for bad in ["", "Assistant", "-x", ".x", "a b", "a/b", "ü"] {
            assert!(!is_valid_name(bad), "{bad}");
        }
        assert!(is_valid_env_var("OPENAI_API_KEY"));
        assert!(!is_valid_env_var("1KEY"));
        assert!(!is_valid_env_var("A-B"));
    }
}
