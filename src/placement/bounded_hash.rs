//! `bounded_hash`: consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam): the
//! key's owner unless it is over its bound, then the next ring positions.

use super::decision::{decision, Decision, Params, Reason};
use super::least_load;
use super::ring::capacity;
use super::snapshot::Snapshot;

#[inline]
pub(super) fn choose(
    params: &Params,
    key: u64,
    snap: &Snapshot,
    eligible: &dyn Fn(usize) -> bool,
    ticket: u64,
) -> Option<Decision> {
    let (mut total_load, mut total_weight) = (0u64, 0u64);
    for (i, b) in snap.backends.iter().enumerate() {
        if eligible(i) {
            total_load += b.inflight;
            total_weight += b.weight as u64;
        }
    }
    let n = snap.backends.len();
    let mut owner_eligible = None;
    for (rank, i) in snap.ring.walk(key, n).enumerate() {
        if !eligible(i) {
            if rank == 0 {
                owner_eligible = Some(false);
            }
            continue;
        }
        owner_eligible.get_or_insert(rank == 0);
        let b = snap.backends[i];
        let cap = capacity(
            total_load,
            b.weight,
            total_weight,
            params.epsilon,
            params.slack,
        );
        if b.inflight < cap {
            let reason = match (rank, owner_eligible) {
                (0, _) => Reason::Affinity,
                (_, Some(false)) => Reason::Failover,
                _ => Reason::Spill,
            };
            return Some(decision(snap, i, reason, Some(cap)));
        }
    }
    least_load::choose(snap, eligible, ticket, Reason::Fallback)
}
