//! The parameters a policy decides with and the decision it returns.

use super::snapshot::Snapshot;
use crate::config::{PolicyKind, RoutingConfig};

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
    /// Seconds of cost per second of prefill recomputing a prefix another backend holds.
    pub duplicate_prefill_weight: f64,
    /// Engine-reported KV usage above which a backend is a last resort.
    pub kv_usage_ceiling: f64,
    /// Hard cap of in-flight requests per unit of weight: a backend at it is not eligible.
    pub backend_max_inflight: u64,
    /// A cached prefix elsewhere must save this many prompt tokens over the key owner's match
    /// to make a backend a candidate.
    pub min_prefix_saving_tokens: u64,
    /// `routing.balance_new_conversations`.
    pub balance_new_conversations: bool,
    /// kvroute processes routing to the fleet without shared state (`routing.replicas`).
    pub replicas: u32,
}

impl Params {
    /// The parameters `routing` describes, with a hard cap of `backend_max_inflight` requests
    /// per unit of weight.
    pub fn from_config(routing: &RoutingConfig, backend_max_inflight: u64) -> Params {
        Params {
            policy: routing.policy,
            epsilon: routing.epsilon,
            slack: routing.slack,
            block_tokens: routing.block_tokens(),
            work_unit_tokens: routing.work_unit_tokens,
            candidates: routing.candidates,
            heavy_prefill_tokens: routing.heavy_prefill_tokens,
            decode_stall_weight: routing.decode_stall_weight,
            duplicate_prefill_weight: routing.duplicate_prefill_weight,
            kv_usage_ceiling: routing.kv_usage_ceiling,
            backend_max_inflight,
            min_prefix_saving_tokens: routing.min_prefix_saving_tokens,
            balance_new_conversations: routing.balance_new_conversations,
            replicas: routing.replicas,
        }
    }

    /// `policy` with the default knobs (tests and benchmarks) and no hard cap.
    pub fn new(policy: PolicyKind, epsilon: f64, slack: u32) -> Params {
        let routing = RoutingConfig {
            policy,
            epsilon,
            slack,
            ..RoutingConfig::default()
        };
        Params::from_config(&routing, u64::MAX)
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
    /// Not a routed request (no profile): any healthy backend, in rotation.
    Passthrough,
    /// A stored response's call or continuation: the backend that stored it.
    Stored,
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
            Reason::Passthrough => "passthrough",
            Reason::Stored => "stored",
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

/// A decision with no cost terms (the policies other than kv_aware).
// Small and on every decision, called from each policy's module.
#[inline]
pub(super) fn decision(
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
