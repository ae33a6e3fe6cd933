//! `least_load`: fewest in-flight requests per unit of weight; also every policy's fallback.

use super::decision::{decision, Decision, Reason};
use super::snapshot::Snapshot;

/// The eligible backend with the least in-flight work per unit of weight, scanning from the
/// `ticket`'s position so ties rotate. `reason` says why this policy was used.
#[inline]
pub(super) fn choose(
    snap: &Snapshot,
    eligible: &dyn Fn(usize) -> bool,
    ticket: u64,
    reason: Reason,
) -> Option<Decision> {
    let n = snap.backends.len();
    let start = (ticket % n as u64) as usize;
    let mut best: Option<usize> = None;
    for i in (0..n).map(|k| (start + k) % n).filter(|&i| eligible(i)) {
        best = match best {
            None => Some(i),
            Some(j) => {
                let (a, b) = (snap.backends[i], snap.backends[j]);
                // inflight/weight compared without division.
                if (a.inflight as u128) * (b.weight as u128)
                    < (b.inflight as u128) * (a.weight as u128)
                {
                    Some(i)
                } else {
                    Some(j)
                }
            }
        };
    }
    best.map(|i| decision(snap, i, reason, None))
}
