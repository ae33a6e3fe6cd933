//! The placement decision: a pure function of a fleet snapshot and a request profile.
//!
//! No clock, no I/O, no shared state: the same inputs give the same backend, so every policy is
//! unit-testable without a network and benchable with criterion. Round robin's rotation comes in
//! as a `ticket` the caller draws from a counter.

use crate::request::RequestProfile;

mod bounded_hash;
mod decision;
pub mod disagg;
pub mod exact;
pub(crate) mod index;
mod kv_aware;
mod least_load;
mod pool;
mod ring;
mod round_robin;
mod session_hash;
mod snapshot;
mod unseen;

pub use crate::config::PolicyKind;
pub use decision::{Decision, Params, Reason};
pub use exact::{pick_rank, ExactIndex, Stored, SyncState};
pub use index::PrefixIndex;
pub use kv_aware::{backlog_s, est_ttft_s, Terms};
pub use pool::{choose_in, Pool};
pub use ring::{capacity, Ring};
pub use snapshot::{BackendLoad, Snapshot, UNMEASURED_RATE_SPREAD};
pub use unseen::credit_unseen_history;

/// Choose a backend, or `None` when no backend is healthy and untried.
///
/// `excluded`: backends that already failed this request.
pub fn choose(
    params: &Params,
    profile: &RequestProfile,
    snap: &Snapshot,
    excluded: &[usize],
    ticket: u64,
) -> Option<Decision> {
    let eligible = |i: usize| {
        let b = &snap.backends[i];
        b.healthy
            && !excluded.contains(&i)
            && b.inflight < params.backend_max_inflight.saturating_mul(b.weight as u64)
    };
    let n = snap.backends.len();
    if n == 0 || !(0..n).any(eligible) {
        return None;
    }
    match params.policy {
        PolicyKind::RoundRobin => round_robin::choose(snap, &eligible, ticket),
        PolicyKind::LeastLoad => least_load::choose(snap, &eligible, ticket, Reason::LeastLoad),
        PolicyKind::SessionHash => session_hash::choose(profile.session_key, snap, &eligible),
        PolicyKind::BoundedHash => {
            bounded_hash::choose(params, profile.session_key, snap, &eligible, ticket)
        }
        PolicyKind::KvAware => kv_aware::choose(params, profile, snap, &eligible, ticket),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::{Endpoint, SessionSource};
    use proptest::prelude::*;
    use std::net::SocketAddr;

    fn ring(n: usize) -> Ring {
        let v: Vec<(SocketAddr, u32)> = (0..n)
            .map(|i| (SocketAddr::from(([127, 0, 0, 1], 9000 + i as u16)), 1))
            .collect();
        Ring::new(&v)
    }

    fn req(key: u64) -> RequestProfile {
        RequestProfile {
            endpoint: Endpoint::Chat,
            model: "m".into(),
            stream: false,
            include_usage: false,
            has_stream_options: false,
            has_handover_fields: false,
            session_key: key,
            session_source: SessionSource::Content,
            has_history: false,
            history_blocks: 0,
            prefix_blocks: vec![],
            tail: None,
            prompt_bytes: 0,
            est_prompt_tokens: 0,
            est_output_tokens: 0,
            cache_salt: None,
            previous_response_id: None,
        }
    }

    fn idle(n: usize) -> Vec<BackendLoad> {
        vec![BackendLoad::idle(); n]
    }

    fn params(policy: PolicyKind) -> Params {
        Params::new(policy, 0.5, 1)
    }

    #[test]
    fn bounded_picks_owner_when_idle() {
        let r = ring(4);
        let loads = idle(4);
        let snap = Snapshot {
            backends: &loads,
            ring: &r,
            matched: &[],
            later_turns: 1.0,
        };
        for key in 0..100 {
            let owner = r.walk(key, 1).next().unwrap();
            let d = choose(&params(PolicyKind::BoundedHash), &req(key), &snap, &[], 0).unwrap();
            assert_eq!((d.backend, d.reason), (owner, Reason::Affinity));
        }
    }

    #[test]
    fn bounded_spills_to_next_ring_position() {
        let r = ring(4);
        let key = 42;
        let order: Vec<usize> = r.walk(key, 4).collect();
        let mut loads = idle(4);
        loads[order[0]].inflight = 10; // cap = ceil(1.5 * 11/4) + 1 = 6
        let snap = Snapshot {
            backends: &loads,
            ring: &r,
            matched: &[],
            later_turns: 1.0,
        };
        let d = choose(&params(PolicyKind::BoundedHash), &req(key), &snap, &[], 0).unwrap();
        assert_eq!(
            (d.backend, d.reason, d.bound),
            (order[1], Reason::Spill, Some(6))
        );
        // session_hash ignores load.
        let d = choose(&params(PolicyKind::SessionHash), &req(key), &snap, &[], 0).unwrap();
        assert_eq!(d.backend, order[0]);
    }

    #[test]
    fn unhealthy_and_excluded_fail_over() {
        let r = ring(3);
        let key = 7;
        let order: Vec<usize> = r.walk(key, 3).collect();
        let mut loads = idle(3);
        loads[order[0]].healthy = false;
        let snap = Snapshot {
            backends: &loads,
            ring: &r,
            matched: &[],
            later_turns: 1.0,
        };
        for p in [PolicyKind::BoundedHash, PolicyKind::SessionHash] {
            let d = choose(&params(p), &req(key), &snap, &[], 0).unwrap();
            assert_eq!((d.backend, d.reason), (order[1], Reason::Failover));
            let d = choose(&params(p), &req(key), &snap, &[order[1]], 0).unwrap();
            assert_eq!(d.backend, order[2]);
            assert!(choose(&params(p), &req(key), &snap, &[order[1], order[2]], 0).is_none());
        }
    }

    #[test]
    fn round_robin_rotates_and_least_load_picks_min() {
        let r = ring(3);
        let mut loads = idle(3);
        let snap = Snapshot {
            backends: &loads,
            ring: &r,
            matched: &[],
            later_turns: 1.0,
        };
        let picks: Vec<usize> = (0..6)
            .map(|t| {
                choose(&params(PolicyKind::RoundRobin), &req(0), &snap, &[], t)
                    .unwrap()
                    .backend
            })
            .collect();
        assert_eq!(picks, vec![0, 1, 2, 0, 1, 2]);
        loads[0].inflight = 5;
        loads[1].inflight = 2;
        loads[2].inflight = 3;
        loads[2].weight = 2; // 1.5 per weight unit beats 2
        let snap = Snapshot {
            backends: &loads,
            ring: &r,
            matched: &[],
            later_turns: 1.0,
        };
        let d = choose(&params(PolicyKind::LeastLoad), &req(0), &snap, &[], 0).unwrap();
        assert_eq!(d.backend, 2);
    }

    #[test]
    fn backends_at_the_hard_cap_are_not_eligible() {
        let r = ring(2);
        let key = 4;
        let order: Vec<usize> = r.walk(key, 2).collect();
        let mut loads = idle(2);
        loads[order[0]].inflight = 3;
        let snap = Snapshot {
            backends: &loads,
            ring: &r,
            matched: &[],
            later_turns: 1.0,
        };
        for p in [
            PolicyKind::SessionHash,
            PolicyKind::BoundedHash,
            PolicyKind::KvAware,
            PolicyKind::LeastLoad,
        ] {
            let mut params = params(p);
            params.backend_max_inflight = 3;
            let d = choose(&params, &req(key), &snap, &[], 0).unwrap();
            assert_eq!(d.backend, order[1], "{p:?}");
        }
        loads[order[1]].inflight = 3;
        let snap = Snapshot {
            backends: &loads,
            ring: &r,
            matched: &[],
            later_turns: 1.0,
        };
        let mut params = params(PolicyKind::BoundedHash);
        params.backend_max_inflight = 3;
        assert!(choose(&params, &req(key), &snap, &[], 0).is_none());
    }

    proptest! {
        /// Place a stream of requests (some finishing) with bounded_hash: the chosen backend is
        /// always under the bound computed at placement, so no backend ever exceeds it.
        #[test]
        fn bound_never_exceeded(n in 2usize..10, keys in proptest::collection::vec(0u64..20, 1..300),
                                finish in proptest::collection::vec(any::<bool>(), 300)) {
            let r = ring(n);
            let mut loads = idle(n);
            let mut placed: Vec<usize> = Vec::new();
            for (step, key) in keys.iter().enumerate() {
                let total: u64 = loads.iter().map(|b| b.inflight).sum();
                let snap = Snapshot { backends: &loads, ring: &r, matched: &[], later_turns: 1.0 };
                let d = choose(&params(PolicyKind::BoundedHash), &req(*key), &snap, &[], 0).unwrap();
                prop_assert_ne!(d.reason, Reason::Fallback);
                let cap = capacity(total, 1, n as u64, 0.5, 1);
                prop_assert!(loads[d.backend].inflight < cap, "placed over the bound");
                loads[d.backend].inflight += 1;
                placed.push(d.backend);
                if finish[step] && !placed.is_empty() {
                    let done = placed.remove(step % placed.len());
                    loads[done].inflight -= 1;
                }
            }
        }
    }
}
