//! Backoff between attempts: exponential from `initial`, capped at `max`, with full jitter
//! in the upper half so synchronized clients spread out without ever waiting less than half.

use std::time::Duration;

/// Delay before attempt `attempt + 1` (attempt counts from 1).
pub fn backoff_delay(attempt: u32, initial: Duration, max: Duration) -> Duration {
    let exponent = attempt.saturating_sub(1).min(20);
    let base = initial.saturating_mul(1u32 << exponent).min(max);
    let half = base / 2;
    let jitter = half.mul_f64(fastrand::f64());
    (half + jitter).min(max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_exponentially_with_jitter_and_cap() {
        let initial = Duration::from_millis(100);
        let max = Duration::from_secs(1);
        for _ in 0..100 {
            let first = backoff_delay(1, initial, max);
            assert!(
                first >= Duration::from_millis(50) && first <= Duration::from_millis(100),
                "{first:?}"
            );
            let third = backoff_delay(3, initial, max);
            assert!(
                third >= Duration::from_millis(200) && third <= Duration::from_millis(400),
                "{third:?}"
            );
            let late = backoff_delay(30, initial, max);
            assert!(
                late >= Duration::from_millis(500) && late <= max,
                "{late:?}"
            );
        }
    }
}
