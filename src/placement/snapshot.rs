//! What a decision sees: one immutable view of the fleet.

use super::ring::Ring;

/// How far a prefill rate nothing has been measured of may be off, as a factor: engines of one
/// fleet differ by a few times (an L40S prefills about a third as fast as an H100), so a
/// backend priced at the fleet's median is not trusted to drain a queue faster than a quarter
/// of that.
pub const UNMEASURED_RATE_SPREAD: f64 = 4.0;

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
    /// How far `prefill_rate` may be off, as a factor (1: measured or configured). The work
    /// already queued there is priced that much slower: a backend known little of must not be
    /// flooded on a guess, while an idle one is still tried at the estimate.
    pub prefill_spread: f64,
    /// Seconds until the engine has a free slot for one more request (0: one is free now, or
    /// its slots are unknown): a request past its running batch waits for one to finish.
    pub slot_wait_s: f64,
    /// Seconds an engine step takes now (0 when unknown): the least a first token waits.
    pub decode_step_s: f64,
    /// Requests at the engine from every router: what other routers had there at the last
    /// fresh telemetry sample, plus this kvroute's in flight now (`None` without one).
    pub engine_load: Option<u64>,
    /// KV cache in use as the engine reports it, 0..1 (fresh telemetry only).
    pub kv_usage: Option<f64>,
    /// Seconds this request would wait here for its LoRA adapter to load (0: loaded, or not
    /// an adapter). Request-specific: set per decision.
    pub adapter_load_s: f64,
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
            prefill_spread: 1.0,
            slot_wait_s: 0.0,
            decode_step_s: 0.0,
            engine_load: None,
            kv_usage: None,
            adapter_load_s: 0.0,
        }
    }
}

/// An immutable view of the fleet for one decision. `backends[i]` is ring index `i`.
pub struct Snapshot<'a> {
    pub backends: &'a [BackendLoad],
    pub ring: &'a Ring,
    /// Per backend, how many of this request's prompt tokens it is believed to cache, from the
    /// exact or the approximate index (empty when the policy does not use them).
    pub matched: &'a [u64],
    /// Later turns a new conversation brings on recent traffic (1: as many as assume it
    /// does): the worth of keeping a first turn at its key's owner.
    pub later_turns: f64,
}
