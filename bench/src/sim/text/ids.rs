//! Random ids for answers and items (`resp_...`, `msg_...`). Random rather than numbered by
//! server and sequence, as real engines make them: a client may only learn which server
//! answered from the `x-kvbench-server` header, never from an id.

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// `prefix` then 32 hex digits: unique within the process (a counter) and unpredictable
/// across processes (a per-process random seed and the clock).
pub fn random_id(prefix: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    static SEED: OnceLock<u64> = OnceLock::new();
    let seed = *SEED.get_or_init(|| std::collections::hash_map::RandomState::new().hash_one(0u8));
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let a = xxh3_64_with_seed(&n.to_le_bytes(), seed ^ nanos);
    let b = xxh3_64_with_seed(&nanos.to_le_bytes(), seed.rotate_left(17) ^ n);
    format!("{prefix}{a:016x}{b:016x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_prefixed_and_distinct() {
        let a = random_id("resp_");
        let b = random_id("resp_");
        assert!(a.starts_with("resp_") && a.len() == 5 + 32);
        assert_ne!(a, b);
    }
}
