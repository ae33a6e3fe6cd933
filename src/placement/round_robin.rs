//! `round_robin`: rotate over eligible backends, ignoring keys and load (a baseline).

use super::decision::{decision, Decision, Reason};
use super::snapshot::Snapshot;

#[inline]
pub(super) fn choose(
    snap: &Snapshot,
    eligible: &dyn Fn(usize) -> bool,
    ticket: u64,
) -> Option<Decision> {
    let n = snap.backends.len();
    let start = (ticket % n as u64) as usize;
    let backend = (0..n).map(|k| (start + k) % n).find(|&i| eligible(i))?;
    Some(decision(snap, backend, Reason::RoundRobin, None))
}
