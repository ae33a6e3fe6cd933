//! `session_hash`: plain consistent hashing on the session key, no load bound (sticky sessions).

use super::decision::{decision, Decision, Reason};
use super::snapshot::Snapshot;

#[inline]
pub(super) fn choose(
    key: u64,
    snap: &Snapshot,
    eligible: &dyn Fn(usize) -> bool,
) -> Option<Decision> {
    let mut walk = snap.ring.walk(key, snap.backends.len());
    let owner = walk.next()?;
    if eligible(owner) {
        return Some(decision(snap, owner, Reason::Affinity, None));
    }
    let backend = walk.find(|&i| eligible(i))?;
    Some(decision(snap, backend, Reason::Failover, None))
}
