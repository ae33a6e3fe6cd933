//! The placement decision: a pure function of a fleet snapshot and a request profile.
//!
//! No clock, no I/O, no shared state: the same inputs give the same backend, so every policy is
//! unit-testable without a network and benchable with criterion. Round robin's rotation comes in
//! as a `ticket` the caller draws from a counter.

use serde::Deserialize;

use crate::request::RequestProfile;
use crate::ring::{capacity, Ring};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PolicyKind {
    /// Rotate over healthy backends, ignoring keys and load (baseline).
    RoundRobin,
    /// Fewest in-flight requests per unit of weight (baseline).
    LeastLoad,
    /// Plain consistent hashing on the session key, no load bound (sticky sessions).
    SessionHash,
    /// Consistent hashing with bounded loads: the owner unless it is over its bound, then the
    /// next ring positions.
    BoundedHash,
    /// Bounded hashing with the bound in work, plus the prefix index and a cost model: the
    /// admissible candidate with the lowest estimated time to first token.
    KvAware,
}

impl PolicyKind {
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyKind::RoundRobin => "round_robin",
            PolicyKind::LeastLoad => "least_load",
            PolicyKind::SessionHash => "session_hash",
            PolicyKind::BoundedHash => "bounded_hash",
            PolicyKind::KvAware => "kv_aware",
        }
    }
}

/// What placement sees of one backend.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BackendLoad {
    pub healthy: bool,
    pub weight: u32,
    /// Requests dispatched and not yet finished.
    pub inflight: u64,
    /// Estimated prompt tokens dispatched and not yet prefilled (no first byte back yet).
    pub queued_prefill: u64,
    /// Requests streaming output (first byte seen, not finished).
    pub decoding: u64,
    /// Prefill throughput, tokens per second.
    pub prefill_rate: f64,
    /// Requests the engine reports running + waiting (fresh telemetry only).
    pub engine_load: Option<u64>,
    /// KV cache in use as the engine reports it, 0..1 (fresh telemetry only).
    pub kv_usage: Option<f64>,
}

impl BackendLoad {
    /// A healthy, idle backend of weight 1 (tests and benchmarks).
    pub fn idle() -> BackendLoad {
        BackendLoad {
            healthy: true,
            weight: 1,
            inflight: 0,
            queued_prefill: 0,
            decoding: 0,
            prefill_rate: 25_000.0,
            engine_load: None,
            kv_usage: None,
        }
    }
}

/// An immutable view of the fleet for one decision. `backends[i]` is ring index `i`.
pub struct Snapshot<'a> {
    pub backends: &'a [BackendLoad],
    pub ring: &'a Ring,
    /// Per backend, how many of this request's prefix blocks its index holds (empty when the
    /// policy does not use the index).
    pub matched: &'a [u32],
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Params {
    pub policy: PolicyKind,
    pub epsilon: f64,
    pub slack: u32,
    /// Estimated tokens per prefix block.
    pub block_tokens: u64,
    /// Prompt tokens that count as one more request of load (the bound's work unit).
    pub work_unit_tokens: u64,
    /// Ring positions considered besides backends holding a long prefix match.
    pub candidates: usize,
    /// Above this many uncached prompt tokens a request is placed by cost over every backend.
    pub heavy_prefill_tokens: u64,
    /// Seconds of cost per second of prefill per stream decoding on the backend: the stall a
    /// prefill imposes on the streams sharing its engine steps.
    pub decode_stall_weight: f64,
    /// Engine-reported KV usage above which a backend is a last resort.
    pub kv_usage_ceiling: f64,
    /// Hard cap of in-flight requests per unit of weight: a backend at it is not eligible.
    pub backend_max_inflight: u64,
    /// A cached prefix elsewhere must save this many prompt tokens over the key owner's match
    /// to make a backend a candidate.
    pub min_prefix_saving_tokens: u64,
}

impl Params {
    pub fn new(policy: PolicyKind, epsilon: f64, slack: u32) -> Params {
        Params {
            policy,
            epsilon,
            slack,
            block_tokens: 64,
            work_unit_tokens: 4096,
            candidates: 3,
            heavy_prefill_tokens: 8192,
            decode_stall_weight: 0.02,
            kv_usage_ceiling: 0.9,
            backend_max_inflight: u64::MAX,
            min_prefix_saving_tokens: 1024,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// The key's owner (first ring position) took it.
    Affinity,
    /// The owner was over its load bound; a later ring position took it.
    Spill,
    /// The owner was unhealthy or had already failed this request.
    Failover,
    RoundRobin,
    LeastLoad,
    /// Every eligible ring position was over its bound (cannot happen with the MTZ bound; kept
    /// so a future bound change degrades to least-load instead of failing).
    Fallback,
    /// kv_aware: a backend holding a longer cached prefix than the owner.
    CachedPrefix,
    /// kv_aware: the owner could take it, but another candidate was estimated faster.
    LeastCost,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Affinity => "affinity",
            Reason::Spill => "spill",
            Reason::Failover => "failover",
            Reason::RoundRobin => "round_robin",
            Reason::LeastLoad => "least_load",
            Reason::Fallback => "fallback",
            Reason::CachedPrefix => "cached_prefix",
            Reason::LeastCost => "least_cost",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Decision {
    pub backend: usize,
    pub reason: Reason,
    /// Load bound that applied to the chosen backend, for bounded policies.
    pub bound: Option<u64>,
    /// The chosen backend's in-flight count before this request.
    pub load: u64,
    /// Prompt tokens the index believes the chosen backend holds (kv_aware).
    pub predicted_cached_tokens: u64,
    /// Estimated time to first token on the chosen backend, seconds (kv_aware).
    pub est_ttft_s: f64,
}

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
        PolicyKind::RoundRobin => {
            let start = (ticket % n as u64) as usize;
            let backend = (0..n).map(|k| (start + k) % n).find(|&i| eligible(i))?;
            Some(decision(snap, backend, Reason::RoundRobin, None))
        }
        PolicyKind::LeastLoad => least_load(snap, &eligible, ticket, Reason::LeastLoad),
        PolicyKind::SessionHash => {
            let mut walk = snap.ring.walk(profile.session_key, n);
            let owner = walk.next()?;
            if eligible(owner) {
                return Some(decision(snap, owner, Reason::Affinity, None));
            }
            let backend = walk.find(|&i| eligible(i))?;
            Some(decision(snap, backend, Reason::Failover, None))
        }
        PolicyKind::BoundedHash => bounded(params, profile.session_key, snap, &eligible, ticket),
        PolicyKind::KvAware => crate::kv_aware::choose(params, profile, snap, &eligible, ticket),
    }
}

pub(crate) fn decision(
    snap: &Snapshot,
    backend: usize,
    reason: Reason,
    bound: Option<u64>,
) -> Decision {
    Decision {
        backend,
        reason,
        bound,
        load: snap.backends[backend].inflight,
        predicted_cached_tokens: 0,
        est_ttft_s: 0.0,
    }
}

fn bounded(
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
    least_load(snap, eligible, ticket, Reason::Fallback)
}

pub(crate) fn least_load(
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
            session_key: key,
            session_source: SessionSource::Content,
            prefix_blocks: vec![],
            prompt_bytes: 0,
            est_prompt_tokens: 0,
            est_output_tokens: 0,
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
                let snap = Snapshot { backends: &loads, ring: &r, matched: &[] };
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
