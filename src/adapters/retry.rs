//! The recovery policy between attempts at an upstream (a model, a remote agent service):
//! which failures are retried, and the backoff — exponential from `initial`, capped at `max`,
//! with full jitter in the upper half so synchronized clients spread out without ever waiting
//! less than half. An attempt that already delivered output is never retried.

use std::time::Duration;

use serde_json::json;

use super::{AdapterContext, AdapterError, FailureKind};
use crate::net::CallFailure;
use crate::runtime::events::RETRY_SCHEDULED;
use crate::workspace::RetryKind;

/// The longest `retry-after` an upstream may ask for.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(60);

/// A failed attempt, with what the retry policy needs to know about it.
pub(super) struct AttemptError {
    pub error: AdapterError,
    /// Output (or a tool call) reached the run already: the attempt is never repeated.
    pub delivered_text: bool,
    pub retry_after: Option<Duration>,
    /// The upstream took the call (it may bill it): it was sent, and failed after (a
    /// timeout, a 5xx, a broken or malformed answer), as opposed to finding no connection or
    /// being refused outright (4xx, 429).
    pub upstream_took: bool,
    /// Bytes of text that reached the run before it failed.
    pub written: usize,
}

impl From<AdapterError> for AttemptError {
    fn from(error: AdapterError) -> Self {
        Self {
            error,
            delivered_text: false,
            retry_after: None,
            upstream_took: false,
            written: 0,
        }
    }
}

impl AttemptError {
    /// A failure after the upstream took the call.
    pub fn taken(error: AdapterError) -> Self {
        Self {
            upstream_took: true,
            ..Self::from(error)
        }
    }
}

/// After failed attempt number `attempt` at `target`: `Err` when it may not be tried again
/// (a kind `recovery.retryOn` does not name, or output was delivered), else waits out the
/// backoff (or the upstream's `retry-after`), announced as `runtime.retry.scheduled`, when
/// attempts remain.
pub(super) async fn settle(
    context: &AdapterContext<'_>,
    failure: &AttemptError,
    attempt: u32,
    target: &str,
) -> Result<(), AdapterError> {
    let recovery = &context.workspace.runtime.recovery;
    let retryable = recovery
        .retry_on
        .iter()
        .any(|kind| kind_matches(*kind, failure.error.kind));
    if failure.delivered_text || !retryable {
        return Err(failure.error.clone());
    }
    if attempt >= recovery.max_attempts {
        return Ok(());
    }
    let delay = failure
        .retry_after
        .map(|after| after.min(MAX_RETRY_AFTER))
        .unwrap_or_else(|| backoff_delay(attempt, recovery.backoff_initial, recovery.backoff_max));
    context
        .events
        .emit(
            RETRY_SCHEDULED,
            json!({
                "attempt": attempt + 1,
                "delayMs": delay.as_millis() as u64,
                "errorKind": failure.error.kind.as_str(),
                "model": target,
                "error": failure.error.message,
            }),
        )
        .await;
    tokio::select! {
        () = context.cancel.cancelled() => Err(AdapterError::new(FailureKind::Cancelled, "the run was cancelled")),
        () = tokio::time::sleep(delay) => Ok(()),
    }
}

fn kind_matches(configured: RetryKind, kind: FailureKind) -> bool {
    matches!(
        (configured, kind),
        (RetryKind::Timeout, FailureKind::Timeout)
            | (RetryKind::Upstream5xx, FailureKind::Upstream5xx)
            | (RetryKind::RateLimited, FailureKind::RateLimited)
            | (RetryKind::Connection, FailureKind::Connection)
    )
}

/// The failed attempt an error status is: 429 rate limited, 5xx, else refused — with an
/// excerpt of the body `who` answered and its `retry-after`.
pub(super) async fn refused<E: std::fmt::Display>(
    status: http::StatusCode,
    retry_after: Option<Duration>,
    body: impl futures::Stream<Item = Result<bytes::Bytes, E>>,
    who: &str,
    timeout: Duration,
) -> AttemptError {
    let text = super::openai::read_limited(body, 2048, timeout)
        .await
        .unwrap_or_default();
    let kind = if status.as_u16() == 429 {
        FailureKind::RateLimited
    } else if status.is_server_error() {
        FailureKind::Upstream5xx
    } else {
        FailureKind::UpstreamRejected
    };
    let mut error = AdapterError::new(
        kind,
        format!(
            "{who} returned {}: {}",
            status.as_u16(),
            crate::text::excerpt(&text)
        ),
    );
    error.upstream_status = Some(status.as_u16());
    AttemptError {
        error,
        delivered_text: false,
        retry_after,
        // A 5xx came from an upstream that took the call; a 4xx or 429 refused it.
        upstream_took: status.is_server_error(),
        written: 0,
    }
}

/// A call that failed in transport, as `who`'s error: `timeout` or `connection`, in words
/// without the URL (it may carry credentials in a query) or the address.
pub(super) fn transport_failure(who: &str, error: &impl CallFailure) -> AdapterError {
    let kind = if error.is_timeout() {
        FailureKind::Timeout
    } else {
        FailureKind::Connection
    };
    let what = if error.is_connect() {
        crate::net::connect_failure(error)
    } else if error.is_timeout() {
        "timed out"
    } else {
        "connection failed"
    };
    AdapterError::new(kind, format!("{who}: {what}"))
}

/// An upstream's `retry-after` in seconds.
pub(super) fn retry_after(headers: &http::HeaderMap) -> Option<Duration> {
    let value = headers.get(http::header::RETRY_AFTER)?.to_str().ok()?;
    value
        .trim()
        .parse::<f64>()
        .ok()
        .filter(|s| s.is_finite() && *s >= 0.0)
        .map(Duration::from_secs_f64)
}

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
