//! Ids: time-ordered UUIDs (version 7, RFC 9562), so that what is made later sorts later.
//!
//! Every event, request, run and journal batch takes one, so making one is on the request
//! path several times per request. `uuid::Uuid::now_v7` keeps its ordering behind a lock
//! shared by every thread and reseeds its counter from the random source each millisecond;
//! here one atomic word holds the last millisecond and a 12-bit counter (RFC 9562's
//! "fixed bit-length dedicated counter"), and the other 62 bits come from the same
//! cryptographically seeded generator that makes `uuid`'s random UUIDs.
//!
//! Guarantees: ids made by one process are strictly increasing (more than 4,096 in one
//! millisecond borrow the next millisecond, as the RFC allows); ids of different processes
//! differ by their 62 random bits and sort by their millisecond.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// A map keyed by ids this process made (or by positions in a batch), hashed with foldhash
/// instead of std's SipHash: nobody outside chooses these keys, so SipHash's resistance to
/// chosen keys buys nothing here, and its hashing was ~1% of a request's instructions
/// (docs/profiling.md, the thirteenth pass). foldhash's per-process seed is kept.
pub type IdMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

/// The last id's `millisecond << 12 | counter`.
static LAST: AtomicU64 = AtomicU64::new(0);

const COUNTER_BITS: u32 = 12;
const MILLIS_MASK: u64 = (1 << 48) - 1;
const RANDOM_MASK: u64 = (1 << 62) - 1;

/// A new time-ordered UUID.
pub fn time_ordered() -> uuid::Uuid {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|since| since.as_secs() * 1000 + u64::from(since.subsec_millis()))
        .unwrap_or(0)
        & MILLIS_MASK;
    let floor = now << COUNTER_BITS;
    let next = |last: u64| last.saturating_add(1).max(floor);
    // `fetch_update` returns the previous word; this id is the one it was replaced with.
    let stamp = match LAST.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |last| {
        Some(next(last))
    }) {
        Ok(last) | Err(last) => next(last),
    };
    let millis = u128::from(stamp >> COUNTER_BITS) & u128::from(MILLIS_MASK);
    let counter = u128::from(stamp & ((1 << COUNTER_BITS) - 1));
    let random = u128::from(uuid::Uuid::new_v4().as_u64_pair().1 & RANDOM_MASK);
    uuid::Uuid::from_u128(millis << 80 | 0x7 << 76 | counter << 64 | 0b10 << 62 | random)
}

/// `prefix`, `_`, and a new time-ordered UUID in 32 lowercase hex digits.
pub fn prefixed(prefix: &str) -> String {
    let mut id = String::with_capacity(prefix.len() + 1 + uuid::fmt::Simple::LENGTH);
    id.push_str(prefix);
    id.push('_');
    id.push_str(
        time_ordered()
            .simple()
            .encode_lower(&mut uuid::Uuid::encode_buffer()),
    );
    id
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_version_7_and_strictly_increasing_across_threads() {
        let made: Vec<Vec<uuid::Uuid>> = std::thread::scope(|scope| {
            let workers: Vec<_> = (0..4)
                .map(|_| scope.spawn(|| (0..5_000).map(|_| time_ordered()).collect::<Vec<_>>()))
                .collect();
            workers
                .into_iter()
                .map(|w| w.join().expect("a worker"))
                .collect()
        });
        for ids in &made {
            assert!(
                ids.windows(2).all(|pair| pair[0] < pair[1]),
                "one thread's ids go back"
            );
            for id in ids {
                assert_eq!(id.get_version_num(), 7);
                assert_eq!(id.get_variant(), uuid::Variant::RFC4122);
            }
        }
        let mut all: Vec<uuid::Uuid> = made.into_iter().flatten().collect();
        let count = all.len();
        all.sort();
        all.dedup();
        assert_eq!(all.len(), count, "an id was made twice");
        // The embedded millisecond is now's, as `uuid` reads it back.
        let (seconds, _) = time_ordered()
            .get_timestamp()
            .expect("a v7 timestamp")
            .to_unix();
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .expect("after 1970")
            .as_secs();
        assert!(seconds.abs_diff(now) <= 1, "{seconds} vs {now}");
    }

    #[test]
    fn a_prefixed_id_is_the_prefix_and_32_hex_digits() {
        let id = prefixed("evt");
        let (prefix, hex) = id.split_once('_').expect("a separator");
        assert_eq!(prefix, "evt");
        assert_eq!(hex.len(), 32);
        assert!(
            hex.bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
        );
        assert!(prefixed("evt") > id);
    }
}
