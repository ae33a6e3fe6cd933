//! One backend's identity and live state, and the charge a request holds on it.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use arc_swap::ArcSwapOption;
use pingora::prelude::HttpPeer;
use pingora_load_balancing::Backend;

use super::adapters::{AdapterBelief, AdapterHold, AdapterSlot, LoadTimes, Reported};
use super::learn::{
    DecodeCounters, DecodeLearner, PrefillCounters, PrefillEstimate, PrefillLearner,
};
use super::models::{lists, ModelEntry};
use super::outlier::Outlier;
use super::telemetry::Slot;
use super::upstream::{http_peer, UpstreamTls};
use crate::config::{EngineKind, DEFAULT_KV_CAPACITY_TOKENS, DEFAULT_PREFILL_TOKENS_PER_S};
use crate::placement::UNMEASURED_RATE_SPREAD;

/// A configured prefill rate stands while it is at most this many times the learned estimate
/// (and not below the proven floor): the estimate reads low by about this much where only
/// short prompts came.
const CONFIGURED_RATE_TOLERANCE: f64 = 2.0;

/// What a backend accumulates while it runs. Shared by `Arc` between fleet generations and the
/// guards of requests in flight, so a reload neither loses nor double-counts load.
pub(super) struct Live {
    pub(super) telemetry: Slot,
    /// The engine's prefill rate as its own counters show it (f64 bits; 0 until learned).
    /// Read on every placement, written by the scrape loop.
    pub(super) learned_rate: AtomicU64,
    /// The lower bound those counters prove (f64 bits; 0 until learned).
    pub(super) learned_floor: AtomicU64,
    pub(super) learner: Mutex<PrefillLearner>,
    /// Seconds an engine step takes each decoding stream, as the engine shows it (f64 bits;
    /// 0 until learned).
    pub(super) decode_step: AtomicU64,
    pub(super) decode_learner: Mutex<DecodeLearner>,
    /// KV capacity the engine reported or showed (tokens; 0 until known). Kept past the
    /// telemetry sample's staleness: a cache does not change size while the engine runs.
    pub(super) learned_kv_capacity: AtomicU64,
    /// Requests the engine runs at once, as it reports (llama.cpp's slots); 0 until known.
    pub(super) slots: AtomicU64,
    /// How far the learned rate may be off (f64 bits; see `PrefillLearner::spread`).
    pub(super) learned_spread: AtomicU64,
    /// kvroute's requests in flight here and when each is expected to end (ms since
    /// [`epoch`]): when a request past the engine's slots would get one.
    pub(super) ends: Mutex<Vec<(u64, u64)>>,
    /// The warning that nothing says how large the KV cache is was given.
    pub(super) kv_unknown_said: std::sync::atomic::AtomicBool,
    pub(super) inflight: AtomicU64,
    pub(super) queued_prefill: AtomicU64,
    /// The part of `queued_prefill` pinned to each data-parallel rank.
    pub(super) rank_prefill: Box<[AtomicU64]>,
    pub(super) decoding: AtomicU64,
    pub(super) outlier: Mutex<Outlier>,
    /// End of the current ejection in ms since [`epoch`]: read on every placement without the
    /// outlier lock, which only responses take.
    pub(super) ejected_until_ms: AtomicU64,
    /// What the engine's `GET /v1/models` last listed (`None` until it answered one).
    pub(super) discovered_models: ArcSwapOption<Vec<ModelEntry>>,
    /// LoRA adapters loaded here and held by kvroute's requests, as kvroute believes.
    pub(super) adapters: Arc<Mutex<AdapterBelief>>,
    /// How long adapter loads took here, as requests showed.
    pub(super) adapter_loads: Mutex<LoadTimes>,
    /// Adapters the engine holds at once, as it reports (`max_lora`); 0 until reported.
    pub(super) max_loras: AtomicU64,
    /// The engine refused a continuation request (an unknown `continue_final_message`, say):
    /// not a migration target for as long as this kvroute runs (a reload keeps this).
    pub(super) refuses_continuation: std::sync::atomic::AtomicBool,
}

/// Adapters an engine is assumed to hold until it says: vLLM's default `--max-loras`.
const DEFAULT_MAX_LORAS: u64 = 1;

/// A fixed origin for timestamps stored in atomics.
fn epoch() -> Instant {
    static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

pub(super) fn since_epoch_ms(t: Instant) -> u64 {
    t.saturating_duration_since(epoch()).as_millis() as u64
}

impl Live {
    pub(super) fn new() -> Live {
        Live {
            telemetry: Slot::default(),
            learned_rate: AtomicU64::new(0),
            learned_floor: AtomicU64::new(0),
            learner: Mutex::new(PrefillLearner::default()),
            decode_step: AtomicU64::new(0),
            decode_learner: Mutex::new(DecodeLearner::default()),
            learned_kv_capacity: AtomicU64::new(0),
            slots: AtomicU64::new(0),
            learned_spread: AtomicU64::new(1f64.to_bits()),
            ends: Mutex::new(Vec::new()),
            kv_unknown_said: std::sync::atomic::AtomicBool::new(false),
            inflight: AtomicU64::new(0),
            queued_prefill: AtomicU64::new(0),
            rank_prefill: (0..crate::config::MAX_DP_RANKS)
                .map(|_| AtomicU64::new(0))
                .collect(),
            decoding: AtomicU64::new(0),
            outlier: Mutex::new(Outlier::default()),
            ejected_until_ms: AtomicU64::new(0),
            discovered_models: ArcSwapOption::empty(),
            adapters: Arc::default(),
            adapter_loads: Mutex::default(),
            max_loras: AtomicU64::new(0),
            refuses_continuation: std::sync::atomic::AtomicBool::new(false),
        }
    }
}

/// One configured backend: its settings from the config in force plus its live state.
pub struct BackendState {
    pub addr: SocketAddr,
    /// `ip:port`, the `backend` label in metrics and logs.
    pub name: String,
    pub weight: u32,
    /// Configured prefill rate (`None`: [`DEFAULT_PREFILL_TOKENS_PER_S`] until learned).
    pub prefill_rate_configured: Option<f64>,
    /// Use the learned rate once there is one (`routing.learn_prefill_rate`).
    pub(super) learn: bool,
    pub engine: EngineKind,
    pub metrics_path: String,
    pub dcgm: Option<SocketAddr>,
    /// Configured KV capacity; `None` lets telemetry set it.
    pub kv_capacity_configured: Option<u64>,
    /// Data-parallel ranks behind it whose KV events are followed (1: one engine).
    pub dp_size: u32,
    /// Its slot in the prefix index (`None` past the index's 64 slots).
    pub(super) slot: Option<usize>,
    pub(super) live: Arc<Live>,
    pub(super) lb_backend: Backend,
    /// `backends[].tls`: reached over TLS.
    pub tls: Option<Arc<UpstreamTls>>,
    /// `Authorization` for the engine's own key (`backends[].api_key_file`).
    pub engine_auth: Option<Arc<str>>,
    /// `backends[].models` (`None` when the config lists none).
    pub configured_models: Option<Arc<Vec<ModelEntry>>>,
}

impl BackendState {
    /// Whether the engine refused to continue a stream (see `mark_refuses_continuation`).
    pub fn refuses_continuation(&self) -> bool {
        self.live.refuses_continuation.load(Ordering::Relaxed)
    }

    /// The engine answered a continuation with a refusal: migrations go elsewhere.
    pub fn mark_refuses_continuation(&self) -> bool {
        !self.live.refuses_continuation.swap(true, Ordering::Relaxed)
    }

    /// A Pingora peer for this backend (TLS when configured); callers set its timeouts.
    pub fn peer(&self) -> HttpPeer {
        http_peer(self.addr, self.tls.as_deref())
    }

    /// Prefill tokens queued on data-parallel rank `rank` by requests kvroute pinned there.
    pub fn rank_prefill(&self, rank: usize) -> u64 {
        self.live
            .rank_prefill
            .get(rank)
            .map_or(0, |q| q.load(Ordering::Relaxed))
    }

    pub fn inflight(&self) -> u64 {
        self.live.inflight.load(Ordering::Relaxed)
    }

    pub fn queued_prefill(&self) -> u64 {
        self.live.queued_prefill.load(Ordering::Relaxed)
    }

    pub fn decoding(&self) -> u64 {
        self.live.decoding.load(Ordering::Relaxed)
    }

    /// The models this backend is known to serve: configured, else discovered. A configured
    /// list names models without their base: the engine's own list says which are adapters.
    pub fn models(&self) -> Option<Arc<Vec<ModelEntry>>> {
        let discovered = self.live.discovered_models.load_full();
        let Some(configured) = &self.configured_models else {
            return discovered;
        };
        let parent_of = |id: &str| {
            discovered
                .as_deref()?
                .iter()
                .find(|d| d.id == id)
                .and_then(|d| d.parent.clone())
        };
        if !configured
            .iter()
            .any(|m| m.parent.is_none() && parent_of(&m.id).is_some())
        {
            return Some(configured.clone());
        }
        let merged = configured
            .iter()
            .map(|m| ModelEntry {
                id: m.id.clone(),
                parent: m.parent.clone().or_else(|| parent_of(&m.id)),
            })
            .collect();
        Some(Arc::new(merged))
    }

    /// Whether a request for `model` may be placed here.
    pub fn serves(&self, model: &str) -> bool {
        // Nothing known yet: every model, as before models were tracked.
        self.models().is_none_or(|l| lists(&l, model))
    }

    /// A request for LoRA adapter `model` is sent here: the engine loads it (evicting its
    /// least recently used idle adapter when full), and it holds a slot until the hold drops.
    pub fn hold_adapter(&self, model: &str) -> AdapterHold {
        AdapterHold::new(self.live.adapters.clone(), model, self.max_loras() as usize)
    }

    /// Where a request for adapter `model` would stand here, given the adapters the engine
    /// last reported running.
    pub(super) fn adapter_slot(&self, model: &str, reported: Option<Reported>) -> AdapterSlot {
        let cap = self.max_loras() as usize;
        match self.live.adapters.lock() {
            Ok(b) => b.slot(model, cap, reported),
            Err(_) => AdapterSlot::Free,
        }
    }

    /// A request that loaded its adapter here took `seconds` longer than predicted without.
    pub fn observe_adapter_load(&self, seconds: f64) {
        if let Ok(mut t) = self.live.adapter_loads.lock() {
            t.observe(seconds);
        }
    }

    /// How long an adapter load takes here, as recent loads showed (`None` until enough).
    pub fn learned_adapter_load_s(&self) -> Option<f64> {
        self.live.adapter_loads.lock().ok()?.estimate()
    }

    /// The adapters kvroute believes loaded here, least recently used first.
    pub fn loaded_adapters(&self) -> Vec<String> {
        self.live
            .adapters
            .lock()
            .map(|b| b.loaded())
            .unwrap_or_default()
    }

    /// Adapters the engine holds at once: as reported, else vLLM's default.
    pub fn max_loras(&self) -> u64 {
        match self.live.max_loras.load(Ordering::Relaxed) {
            0 => DEFAULT_MAX_LORAS,
            m => m,
        }
    }

    pub(super) fn set_max_loras(&self, m: usize) {
        self.live.max_loras.store(m as u64, Ordering::Relaxed);
    }

    /// Record what the engine's `/v1/models` listed; whether it changed.
    pub(super) fn discover_models(&self, list: Vec<ModelEntry>) -> bool {
        let same = self
            .live
            .discovered_models
            .load()
            .as_deref()
            .is_some_and(|old| *old == list);
        if !same {
            self.live.discovered_models.store(Some(Arc::new(list)));
        }
        !same
    }

    pub fn telemetry(&self) -> &Slot {
        &self.live.telemetry
    }

    /// Taken out of placement by passive outlier detection.
    pub fn ejected(&self, now: Instant) -> bool {
        since_epoch_ms(now) < self.live.ejected_until_ms.load(Ordering::Relaxed)
    }

    /// How long the current ejection has left (`None`: not ejected).
    pub fn ejection_left(&self, now: Instant) -> Option<std::time::Duration> {
        let until = self.live.ejected_until_ms.load(Ordering::Relaxed);
        let now = since_epoch_ms(now);
        (now < until).then(|| std::time::Duration::from_millis(until - now))
    }

    /// LoRA adapters the engine last reported running (fresh or not).
    pub fn lora_running(&self) -> Option<Vec<String>> {
        self.live.telemetry.lora_running()
    }

    /// The prefill rate placement uses. Without learning: the configured rate, else the
    /// default. Learning, before its engine's counters say anything: the configured rate (at
    /// least `explore`, the fleet's median learned rate, or one configured far too slow would
    /// get no request to learn from), else `explore` itself: a backend nothing is known of is
    /// priced like the fleet it joins, not at a default that may be 200x off (a CPU engine at
    /// 118 tokens/s priced at 25,000 was sent three cold prefills at once while the backend
    /// that had learned idled). Only while nothing in the fleet has learned does the default
    /// stand. Once learned, a configured rate stands while the evidence allows it (at least the
    /// proven floor, at most `CONFIGURED_RATE_TOLERANCE` times the estimate): on a fleet
    /// configured right, learning changes nothing, while a rate configured 100x wrong is
    /// replaced after the first prefills. An unconfigured backend uses the estimate.
    pub fn effective_prefill_rate(&self, explore: f64) -> f64 {
        let prior = self
            .prefill_rate_configured
            .unwrap_or(DEFAULT_PREFILL_TOKENS_PER_S);
        if !self.learn {
            return prior;
        }
        match (self.learned_prefill(), self.prefill_rate_configured) {
            (None, Some(c)) => c.max(explore),
            (None, None) if explore > 0.0 => explore,
            (None, None) => prior,
            (Some(e), Some(c)) if c >= e.floor && c <= e.rate * CONFIGURED_RATE_TOLERANCE => c,
            (Some(e), _) => e.rate,
        }
    }

    /// How far the rate placement uses may be off, as a factor (see
    /// [`crate::placement::BackendLoad::prefill_spread`]): 1 for a rate the operator set or
    /// learning is off; for a learned one what its learner says (1 for a proven lower bound,
    /// more for a fit); [`UNMEASURED_RATE_SPREAD`] while nothing is measured here but other
    /// backends of the fleet have been (`fleet_measured`). With nothing measured anywhere,
    /// every backend is as uncertain as the next: 1, or a queue would look dearer than the
    /// same prefill on another backend known as little.
    pub fn prefill_spread(&self, fleet_measured: bool) -> f64 {
        if !self.learn {
            return 1.0;
        }
        match (self.learned_prefill(), self.prefill_rate_configured) {
            (Some(e), Some(c)) if c >= e.floor && c <= e.rate * CONFIGURED_RATE_TOLERANCE => 1.0,
            (Some(_), _) => f64::from_bits(self.live.learned_spread.load(Ordering::Relaxed)),
            (None, Some(_)) => 1.0,
            (None, None) if fleet_measured => UNMEASURED_RATE_SPREAD,
            (None, None) => 1.0,
        }
    }

    /// What the engine's counters say, whether or not placement uses it.
    pub fn learned_prefill(&self) -> Option<PrefillEstimate> {
        let rate = f64::from_bits(self.live.learned_rate.load(Ordering::Relaxed));
        let floor = f64::from_bits(self.live.learned_floor.load(Ordering::Relaxed));
        (rate > 0.0).then_some(PrefillEstimate {
            rate,
            floor: floor.min(rate),
        })
    }

    /// The engine's cumulative prefill counters from one scrape.
    pub(super) fn observe_prefill(&self, counters: PrefillCounters) {
        let Ok(mut learner) = self.live.learner.lock() else {
            return;
        };
        let estimate = learner.observe(counters);
        self.live
            .learned_spread
            .store(learner.spread().to_bits(), Ordering::Relaxed);
        if let Some(e) = estimate {
            self.live
                .learned_floor
                .store(e.floor.to_bits(), Ordering::Relaxed);
            let old = self
                .live
                .learned_rate
                .swap(e.rate.to_bits(), Ordering::Relaxed);
            let old = f64::from_bits(old);
            let r = e.rate;
            // Say when what placement believes changes materially, not on every scrape.
            if !(old > 0.0 && (r / old - 1.0).abs() < 0.2) {
                log::info!(
                    "backend {}: prefill rate learned from its engine: {r:.0} tokens/s, at least {:.0} (configured {}{})",
                    self.name,
                    e.floor,
                    self.prefill_rate_configured
                        .map_or_else(|| "none".to_owned(), |c| format!("{c:.0}")),
                    if old > 0.0 { format!(", was {old:.0}") } else { String::new() }
                );
            }
        }
    }

    /// Seconds one engine step takes now, as the engine's decode gaps show it.
    pub fn decode_step_seconds(&self) -> Option<f64> {
        let s = f64::from_bits(self.live.decode_step.load(Ordering::Relaxed));
        (s > 0.0).then_some(s)
    }

    /// The engine's cumulative decode counters from one scrape.
    pub(super) fn observe_decode(&self, counters: DecodeCounters) {
        let Ok(mut learner) = self.live.decode_learner.lock() else {
            return;
        };
        if let Some(step) = learner.observe(counters) {
            self.live
                .decode_step
                .store(step.to_bits(), Ordering::Relaxed);
        }
    }

    /// KV capacity the engine reported or showed, if any.
    pub fn learned_kv_capacity(&self) -> Option<u64> {
        let t = self.live.learned_kv_capacity.load(Ordering::Relaxed);
        (t > 0).then_some(t)
    }

    pub(super) fn set_learned_kv_capacity(&self, tokens: u64) {
        let old = self
            .live
            .learned_kv_capacity
            .swap(tokens, Ordering::Relaxed);
        // Sizes derived from usage (tokens in use over the ratio) wobble with rounding on
        // every scrape: say only a material change.
        if old == 0 || tokens.abs_diff(old) * 10 > old {
            log::info!(
                "backend {}: KV capacity from its engine: {tokens} tokens{}",
                self.name,
                self.kv_capacity_configured
                    .map_or_else(String::new, |c| format!(" (configured {c} stands)"))
            );
        }
    }

    /// Says once, on a scrape that showed no KV size, that the index is sized to a default.
    pub(super) fn kv_capacity_unknown(&self) {
        if self.kv_capacity_configured.is_some() || self.learned_kv_capacity().is_some() {
            return;
        }
        if !self.live.kv_unknown_said.swap(true, Ordering::Relaxed) {
            log::warn!(
                "backend {}: its {} engine reports no KV cache size; the prefix index assumes \
                 {DEFAULT_KV_CAPACITY_TOKENS} tokens (set kv_capacity_tokens to say)",
                self.name,
                self.engine.as_str()
            );
        }
    }

    /// Requests the engine runs at once, where it says (llama.cpp's slots).
    pub fn slots(&self) -> Option<u32> {
        let n = self.live.slots.load(Ordering::Relaxed);
        (n > 0).then(|| u32::try_from(n).unwrap_or(u32::MAX))
    }

    /// Seconds until the engine has a slot for one more request, with `busy` requests there
    /// (kvroute's and, from telemetry, other routers'): 0 while fewer than its slots are
    /// busy or its slots are unknown. Otherwise the (busy - slots + 1)-th earliest expected
    /// end of kvroute's requests here; requests it cannot see the end of (another router's)
    /// count as ending with the last it can, and at least a step is waited.
    pub fn slot_wait_s(&self, now: Instant, busy: u64) -> f64 {
        let Some(slots) = self.slots() else {
            return 0.0;
        };
        if busy < u64::from(slots) {
            return 0.0;
        }
        let floor = self.decode_step_seconds().unwrap_or(0.001).max(0.001);
        let Ok(ends) = self.live.ends.lock() else {
            return floor;
        };
        let now = since_epoch_ms(now);
        let mut left: Vec<u64> = ends.iter().map(|&(_, e)| e.saturating_sub(now)).collect();
        drop(ends);
        let k = (busy - u64::from(slots)) as usize;
        let wait_ms = match left.len() {
            0 => 0,
            len => *left.select_nth_unstable(k.min(len - 1)).1,
        };
        (wait_ms as f64 / 1000.0).max(floor)
    }

    pub(super) fn set_slots(&self, slots: u32) {
        self.live.slots.store(u64::from(slots), Ordering::Relaxed);
    }

    /// The KV capacity the prefix index is sized to: configured, else learned, else the
    /// default.
    pub fn kv_capacity(&self) -> u64 {
        self.kv_capacity_configured
            .or(self.learned_kv_capacity())
            .unwrap_or(DEFAULT_KV_CAPACITY_TOKENS)
    }
}

/// The median of the backends' learned prefill rates; 0 while none has one.
pub(super) fn median_learned_rate(backends: &[Arc<BackendState>]) -> f64 {
    let mut rates: Vec<f64> = backends
        .iter()
        .filter_map(|b| b.learned_prefill().map(|e| e.rate))
        .collect();
    rates.sort_by(f64::total_cmp);
    rates.get(rates.len() / 2).copied().unwrap_or(0.0)
}
