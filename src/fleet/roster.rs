//! The roster of one generation: its backends, their ring, and the health checker and prefix
//! index that outlive generations. A reload builds a new `Fleet` from the old one: backends
//! that stay keep their accounting, telemetry, learned rate, health and prefix-index slot.

use futures_util::FutureExt;
use pingora_load_balancing::selection::RoundRobin;
use pingora_load_balancing::{Backend, Backends, LoadBalancer};
use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::adapters::{AdapterSlot, Reported};
use super::backend::{median_learned_rate, since_epoch_ms, BackendState, Live};
use super::error::FleetError;
use super::health::{health_check, Membership, TlsTargets};
use super::in_flight::InFlight;
use super::models::{ModelEntry, PoolCache, ANY_MODEL};
use super::outlier::{self, Outcome};
use super::read_ahead::{self, ReadAhead};
use super::telemetry::{EngineStats, LoraInfo};
use super::turns::TurnMix;
use super::upstream::UpstreamTls;
use crate::config::{BackendConfig, Config, OutlierConfig, DEFAULT_KV_CAPACITY_TOKENS};
use crate::placement::index::MAX_BACKENDS;
use crate::placement::{ExactIndex, Pool, PrefixIndex, Ring, SyncState};

/// The prefix index and which backend owns each of its slots. Owners are checked on every
/// write, so a request placed by an older fleet cannot teach a reassigned slot.
pub(super) struct Beliefs {
    pub(super) index: PrefixIndex,
    /// What the engines' KV events say they cache: one index per data-parallel rank (rank r
    /// of the backend in slot s is slot s of `exact[r]`), at least rank 0's.
    pub(super) exact: Vec<ExactIndex>,
    pub(super) owner: Vec<Option<SocketAddr>>,
}

/// What outlives a fleet generation: health checking and the prefix index.
pub(super) struct Shared {
    lb: Arc<LoadBalancer<RoundRobin>>,
    membership: Membership,
    /// Which backends the health checker reaches over TLS.
    tls_targets: TlsTargets,
    /// Bumped whenever an engine lists other models: model pools are rebuilt.
    models_version: AtomicU64,
    pub(super) beliefs: Mutex<Beliefs>,
    /// Requests waiting on each backend, cut when its health check finds it down.
    in_flight: Arc<InFlight>,
    /// Later turns per conversation on recent traffic: the worth of a first turn's affinity.
    pub(super) turns: TurnMix,
}

pub struct Fleet {
    pub(super) backends: Vec<Arc<BackendState>>,
    ring: Ring,
    pub(super) shared: Arc<Shared>,
    tickets: AtomicU64,
    pub(super) block_tokens: u64,
    pub(super) stale_after: Duration,
    /// The median learned prefill rate (f64 bits; 0 while none is): a backend whose engine
    /// has not yet said is assumed at least this fast, so that it gets the traffic it needs to
    /// say. Without it, a backend configured far too slow would never be sent a request.
    pub(super) explore_rate: AtomicU64,
    /// Completion tokens a request of this fleet produces, as a moving average (f64 bits; 0
    /// until one finished): `max_tokens` is a ceiling, and a chat's reply most often ends
    /// far below it, so a slot is expected to free up sooner than `max_tokens` says.
    pub(super) typical_output: AtomicU64,
    /// How much later than predicted the first tokens of whole and of split requests came, in
    /// a disaggregated fleet, seconds (f64 bits; see `placement::disagg::Bias`).
    pub(super) pd_bias: [AtomicU64; 2],
    /// The KV transfer rate the engines' own reports show (a disaggregated fleet).
    pub(super) transfer: super::transfer::TransferLearner,
    pools: PoolCache,
    read_ahead: Option<Arc<ReadAhead>>,
}

/// A backend as parsed before anything is changed: address, DCGM exporter, Pingora's
/// `Backend`, TLS settings.
type Parsed = (
    SocketAddr,
    Option<SocketAddr>,
    Backend,
    Option<Arc<UpstreamTls>>,
    Option<Arc<str>>,
);

/// The `Authorization` value for an engine's own key, read from `path` (on every build of the
/// fleet, so a reload picks up a rotated key).
fn engine_auth(backend: &str, path: &std::path::Path) -> Result<Arc<str>, FleetError> {
    let bad = |reason: String| FleetError::BackendApiKey {
        backend: backend.to_string(),
        reason: format!("{}: {reason}", path.display()),
    };
    let text = std::fs::read_to_string(path).map_err(|e| bad(format!("cannot read: {e}")))?;
    let key = text.trim();
    if key.is_empty() || key.contains(char::is_whitespace) {
        return Err(bad("must hold one key, on one line".into()));
    }
    let value = format!("Bearer {key}");
    if http::HeaderValue::from_str(&value).is_err() {
        return Err(bad("the key is not a valid header value".into()));
    }
    Ok(value.into())
}

/// A backend's address, optional DCGM exporter and TLS settings (its CA bundle read), parsed
/// before anything is changed.
fn parse_backend(b: &BackendConfig) -> Result<Parsed, FleetError> {
    let addr: SocketAddr = b
        .addr
        .parse()
        .map_err(|_| FleetError::BackendAddress(b.addr.clone()))?;
    let lb_backend =
        Backend::new(&b.addr).map_err(|_| FleetError::BackendAddress(b.addr.clone()))?;
    let dcgm = match &b.dcgm_addr {
        Some(d) => Some(d.parse().map_err(|_| FleetError::DcgmAddress(d.clone()))?),
        None => None,
    };
    let tls = match &b.tls {
        Some(t) => Some(Arc::new(UpstreamTls::load(&b.addr, t)?)),
        None => None,
    };
    let auth = match &b.api_key_file {
        Some(path) => Some(engine_auth(&b.addr, path)?),
        None => None,
    };
    Ok((addr, dcgm, lb_backend, tls, auth))
}

/// Index blocks for a backend: its configured KV size, else what its engine showed, else the
/// default.
fn capacity_blocks(b: &BackendConfig, learned: Option<u64>, block_tokens: u64) -> usize {
    let tokens = b
        .kv_capacity_tokens
        .or(learned)
        .unwrap_or(DEFAULT_KV_CAPACITY_TOKENS);
    (tokens / block_tokens).max(1) as usize
}

impl Fleet {
    /// Build the first fleet. The returned load balancer must run as a Pingora background
    /// service for health checks to happen.
    pub fn new(cfg: &Config) -> Result<Fleet, FleetError> {
        let membership = Membership::default();
        let tls_targets = TlsTargets::default();
        let in_flight = Arc::new(InFlight::default());
        let mut lb =
            LoadBalancer::<RoundRobin>::from_backends(Backends::new(Box::new(membership.clone())));
        lb.set_health_check(health_check(
            &cfg.health_check,
            tls_targets.clone(),
            Arc::clone(&in_flight),
        )?);
        lb.health_check_frequency = Some(Duration::from_millis(cfg.health_check.interval_ms));
        lb.parallel_health_check = true;
        let shared = Arc::new(Shared {
            lb: Arc::new(lb),
            membership,
            tls_targets,
            models_version: AtomicU64::new(0),
            in_flight,
            turns: TurnMix::default(),
            beliefs: Mutex::new(Beliefs {
                index: PrefixIndex::new(&[]),
                exact: vec![ExactIndex::default()],
                owner: Vec::new(),
            }),
        });
        let fleet = Fleet::build(cfg, shared, &[])?;
        // Membership is in memory: the update completes at once.
        if let Some(Err(e)) = fleet.shared.lb.update().now_or_never() {
            return Err(FleetError::Membership(e.to_string()));
        }
        Ok(fleet)
    }

    /// The fleet `cfg` describes, carrying over everything known about backends that stay.
    /// Nothing is changed if `cfg` is rejected. Call [`Fleet::sync_health`] before publishing
    /// the result so added backends are health-checked.
    pub fn reload(&self, cfg: &Config) -> Result<Fleet, FleetError> {
        Fleet::build(cfg, self.shared.clone(), &self.backends)
    }

    /// Hand the current backend set to Pingora's health checker; backends that stay keep their
    /// health, added ones start healthy until a check fails.
    pub async fn sync_health(&self) -> Result<(), FleetError> {
        self.shared
            .lb
            .update()
            .await
            .map_err(|e| FleetError::Membership(e.to_string()))
    }

    fn build(
        cfg: &Config,
        shared: Arc<Shared>,
        previous: &[Arc<BackendState>],
    ) -> Result<Fleet, FleetError> {
        let parsed = cfg
            .backends
            .iter()
            .map(parse_backend)
            .collect::<Result<Vec<_>, _>>()?;
        let block_tokens = cfg.routing.block_tokens();
        let old: HashMap<SocketAddr, &Arc<BackendState>> =
            previous.iter().map(|b| (b.addr, b)).collect();
        let kept: BTreeSet<SocketAddr> = parsed
            .iter()
            .map(|p| p.0)
            .filter(|a| old.contains_key(a))
            .collect();
        let mut backends = Vec::with_capacity(cfg.backends.len());
        {
            let mut beliefs = shared
                .beliefs
                .lock()
                .map_err(|_| FleetError::IndexPoisoned)?;
            let Beliefs {
                index,
                exact,
                owner,
            } = &mut *beliefs;
            let ranks = cfg
                .backends
                .iter()
                .filter_map(|b| b.kv_events.as_ref())
                .map(|k| k.data_parallel_size as usize)
                .max()
                .unwrap_or(1);
            while exact.len() < ranks {
                exact.push(ExactIndex::default());
            }
            // Free the slots of removed backends first so added ones can reuse them.
            for b in previous.iter().filter(|b| !kept.contains(&b.addr)) {
                if let Some(s) = b.slot {
                    index.purge(s);
                    exact.iter_mut().for_each(|x| x.reset(s, SyncState::Off));
                    owner[s] = None;
                }
            }
            for (b, (addr, dcgm, lb_backend, tls, engine_auth)) in cfg.backends.iter().zip(parsed) {
                let (slot, live) = match old.get(&addr) {
                    Some(prev) => {
                        if let Some(s) = prev.slot {
                            if b.kv_capacity_tokens != prev.kv_capacity_configured {
                                index.set_capacity(
                                    s,
                                    capacity_blocks(b, prev.learned_kv_capacity(), block_tokens),
                                );
                            }
                        }
                        (prev.slot, prev.live.clone())
                    }
                    None => {
                        let slot = match owner.iter().position(Option::is_none) {
                            Some(s) => Some(s),
                            None if owner.len() < MAX_BACKENDS => {
                                owner.push(None);
                                Some(owner.len() - 1)
                            }
                            None => None,
                        };
                        if let Some(s) = slot {
                            owner[s] = Some(addr);
                            index.open_slot(s, capacity_blocks(b, None, block_tokens));
                            exact.iter_mut().for_each(|x| x.reset(s, SyncState::Off));
                        }
                        (slot, Arc::new(Live::new()))
                    }
                };
                backends.push(Arc::new(BackendState {
                    addr,
                    name: b.addr.clone(),
                    weight: b.weight,
                    prefill_rate_configured: b.prefill_tokens_per_s,
                    learn: cfg.routing.learn_prefill_rate,
                    engine: b.engine,
                    metrics_path: b.metrics_path.clone(),
                    dcgm,
                    kv_capacity_configured: b.kv_capacity_tokens,
                    dp_size: b.kv_events.as_ref().map_or(1, |k| k.data_parallel_size),
                    slot,
                    live,
                    lb_backend,
                    tls,
                    engine_auth,
                    configured_models: (!b.models.is_empty()).then(|| {
                        Arc::new(
                            b.models
                                .iter()
                                .map(|m| ModelEntry {
                                    id: m.clone(),
                                    parent: None,
                                })
                                .collect(),
                        )
                    }),
                }));
            }
        }
        shared.tls_targets.0.store(Arc::new(
            backends
                .iter()
                .filter_map(|b| b.tls.clone().map(|t| (b.addr, t)))
                .collect(),
        ));
        shared.membership.0.store(Arc::new(
            backends.iter().map(|b| b.lb_backend.clone()).collect(),
        ));
        let ring = Ring::new(
            &backends
                .iter()
                .map(|b| (b.addr, b.weight))
                .collect::<Vec<_>>(),
        );
        let explore_rate = AtomicU64::new(median_learned_rate(&backends).to_bits());
        Ok(Fleet {
            backends,
            ring,
            shared,
            tickets: AtomicU64::new(0),
            // Backends kept across a reload keep what they learned: a backend added by the
            // reload is assumed as fast as they are from its first request, not only after
            // the next scrape (until then it would lose every placement to them).
            explore_rate,
            typical_output: AtomicU64::new(0),
            pd_bias: [AtomicU64::new(0), AtomicU64::new(0)],
            transfer: Default::default(),
            pools: PoolCache::default(),
            block_tokens,
            stale_after: Duration::from_millis(cfg.telemetry.stale_after_ms),
            read_ahead: read_ahead::connector(read_ahead::Limits {
                per_connection: cfg.limits.upstream_read_ahead_bytes,
                total: cfg.limits.read_ahead_memory_bytes,
                connect_timeout: Duration::from_millis(cfg.timeouts.connect_ms),
            }),
        })
    }

    /// The requests waiting on each backend's engine connections.
    pub fn in_flight(&self) -> &Arc<InFlight> {
        &self.shared.in_flight
    }

    /// The connector for this fleet's plaintext engines (`None`: read-ahead is off).
    pub fn read_ahead(&self) -> Option<Arc<ReadAhead>> {
        self.read_ahead.clone()
    }

    pub fn load_balancer(&self) -> Arc<LoadBalancer<RoundRobin>> {
        self.shared.lb.clone()
    }

    pub fn backends(&self) -> &[Arc<BackendState>] {
        &self.backends
    }

    pub fn ring(&self) -> &Ring {
        &self.ring
    }

    /// The backends requests for `model` are placed among (empty: no backend serves it).
    pub fn pool(&self, model: &str) -> Arc<Pool> {
        let version = self.shared.models_version.load(Ordering::Acquire);
        self.pools.get(model, version, || {
            let members: Vec<usize> = (0..self.backends.len())
                .filter(|&i| self.backends[i].serves(model))
                .collect();
            let ring = (members.len() != self.backends.len()).then(|| {
                Ring::new(
                    &members
                        .iter()
                        .map(|&i| (self.backends[i].addr, self.backends[i].weight))
                        .collect::<Vec<_>>(),
                )
            });
            let entries: Vec<ModelEntry> = self
                .backends
                .iter()
                .filter_map(|b| b.models())
                .flat_map(|l| {
                    l.iter()
                        .filter(|m| m.id == model)
                        .cloned()
                        .collect::<Vec<_>>()
                })
                .collect();
            Pool {
                members,
                ring,
                listed: !entries.is_empty(),
                adapter: entries.iter().any(|m| m.parent.is_some()),
            }
        })
    }

    /// Where a request for LoRA adapter `model` stands on backend `i`, and what that adds to
    /// its time to first token there: one load takes what recent loads there showed, else
    /// `configured_s`.
    pub fn adapter_cost(&self, i: usize, model: &str, configured_s: f64) -> (AdapterSlot, f64) {
        let Some(b) = self.backends.get(i) else {
            return (AdapterSlot::Free, configured_s);
        };
        let sample = b.telemetry().adapters_running(self.stale_after);
        let reported = sample
            .as_ref()
            .map(|(running, at)| Reported { running, at: *at });
        let slot = b.adapter_slot(model, reported);
        let load_s = b.learned_adapter_load_s().unwrap_or(configured_s);
        (slot, slot.cost_s(load_s))
    }

    /// Backend `i`'s engine listed `models`: a change rebuilds the pools of every generation.
    pub fn discover_models(&self, i: usize, models: Vec<ModelEntry>) {
        if let Some(b) = self.backends.get(i) {
            let ids: Vec<String> = models.iter().map(|m| m.id.clone()).collect();
            if b.discover_models(models) {
                let pinned = if b.configured_models.is_some() {
                    " (its configured list is what routing uses)"
                } else {
                    ""
                };
                log::info!("backend {}: engine lists {ids:?}{pinned}", b.name);
                self.shared.models_version.fetch_add(1, Ordering::AcqRel);
            }
        }
    }

    /// The models healthy backends are known to serve (configured or discovered), and whether
    /// some healthy backend's models are not known yet.
    pub fn served_models(&self) -> (Vec<ModelEntry>, bool) {
        let mut out = Vec::new();
        let mut unknown = false;
        for (i, b) in self.backends.iter().enumerate() {
            if !self.healthy(i) {
                continue;
            }
            match b.models() {
                Some(l) => out.extend(l.iter().filter(|m| m.id != ANY_MODEL).cloned()),
                None => unknown = true,
            }
        }
        out.sort();
        out.dedup_by(|a, b| a.id == b.id);
        (out, unknown)
    }

    pub fn healthy(&self, i: usize) -> bool {
        self.shared
            .lb
            .backends()
            .ready(&self.backends[i].lb_backend)
    }

    /// Backend `i` is healthy and not ejected: placement may use it.
    pub fn available(&self, i: usize, now: Instant) -> bool {
        self.healthy(i) && self.backends.get(i).is_some_and(|b| !b.ejected(now))
    }

    /// A request is being placed, a later turn of its conversation if `has_history`.
    pub fn record_turn(&self, has_history: bool) {
        self.shared.turns.record(has_history);
    }

    /// Later turns per conversation on recent traffic (see [`TurnMix`]).
    pub fn later_turns(&self) -> f64 {
        self.shared.turns.later_turns()
    }

    /// A fresh round-robin ticket.
    pub fn ticket(&self) -> u64 {
        self.tickets.fetch_add(1, Ordering::Relaxed)
    }

    /// Believe that backend `i` now caches `blocks` (it is being sent them).
    /// `token_blocks`: the same prompt as the engines' KV events name it (empty when not
    /// tokenized), counted there until the engine's events say (see `placement::exact`), on
    /// data-parallel rank `rank` (a backend of several ranks: only the one it was pinned to).
    pub fn record(&self, i: usize, blocks: &[u64], token_blocks: &[u64], rank: Option<u32>) {
        let b = &self.backends[i];
        let Some(slot) = b.slot else { return };
        let rank = match rank {
            Some(r) => Some(r as usize),
            None => (b.dp_size <= 1).then_some(0),
        };
        if let Ok(mut beliefs) = self.shared.beliefs.lock() {
            if beliefs.owner.get(slot) == Some(&Some(b.addr)) {
                beliefs.index.insert(slot, blocks);
                if let (false, Some(x)) = (
                    token_blocks.is_empty(),
                    rank.and_then(|r| beliefs.exact.get_mut(r)),
                ) {
                    x.pending(slot, token_blocks, Instant::now());
                }
            }
        }
    }

    #[cfg(test)]
    fn observe(&self, i: usize, stats: EngineStats) {
        self.observe_scrape(i, stats, None);
    }

    /// A telemetry scrape of backend `i`: its prefill counters teach its rate, and a reported
    /// KV size bounds its index unless one is configured.
    /// `lora`: what its engine says of its LoRA adapters.
    pub fn observe_scrape(&self, i: usize, stats: EngineStats, lora: Option<LoraInfo>) {
        let Some(b) = self.backends.get(i) else {
            return;
        };
        if let Some(counters) = stats.prefill {
            b.observe_prefill(counters);
            self.explore_rate.store(
                median_learned_rate(&self.backends).to_bits(),
                Ordering::Relaxed,
            );
        }
        if let Some(counters) = stats.decode {
            b.observe_decode(counters);
        }
        if let Some(t) = stats.transfer {
            self.transfer.observe(i, t);
        }
        if let Some(gb_s) = stats.transfer_speed_gb_s {
            self.transfer.observe_speed(gb_s * 1e9);
        }
        if let Some(speeds) = stats.transfer_speeds {
            self.transfer.observe_speeds(i, speeds);
        }
        match stats.kv_capacity_tokens {
            Some(tokens) => b.set_learned_kv_capacity(tokens),
            None => b.kv_capacity_unknown(),
        }
        if let Some(slots) = stats.slots {
            b.set_slots(slots);
        }
        if let (None, Some(tokens), Some(slot)) =
            (b.kv_capacity_configured, stats.kv_capacity_tokens, b.slot)
        {
            if let Ok(mut beliefs) = self.shared.beliefs.lock() {
                if beliefs.owner.get(slot) == Some(&Some(b.addr)) {
                    let blocks = (tokens / self.block_tokens).max(1) as usize;
                    beliefs.index.set_capacity(slot, blocks);
                }
            }
        }
        if let Some(m) = lora.as_ref().and_then(|l| l.max_loras) {
            b.set_max_loras(m);
        }
        b.telemetry().store(stats, lora, b.inflight());
    }

    pub fn stale_after(&self) -> Duration {
        self.stale_after
    }

    /// Prefix-index blocks believed held by backend `i` (0 past the index's slots).
    pub fn index_blocks_of(&self, i: usize) -> usize {
        let Some(slot) = self.backends.get(i).and_then(|b| b.slot) else {
            return 0;
        };
        self.shared
            .beliefs
            .lock()
            .map(|b| b.index.blocks_of(slot))
            .unwrap_or(0)
    }

    /// Tracked (backend, block) pairs and the index's heap bytes.
    pub fn index_size(&self) -> (usize, usize) {
        self.shared
            .beliefs
            .lock()
            .map(|b| (b.index.blocks(), b.index.bytes()))
            .unwrap_or((0, 0))
    }

    /// What an upstream attempt on backend `i` said about it; returns the ejection this
    /// caused, if any.
    pub fn report(&self, i: usize, outcome: Outcome, cfg: &OutlierConfig) -> Option<Duration> {
        let now = Instant::now();
        let ejected = self.backends.iter().filter(|b| b.ejected(now)).count();
        let may = outlier::may_eject(ejected, self.backends.len(), cfg.max_ejected_percent);
        let b = self.backends.get(i)?;
        let mut o = b.live.outlier.lock().ok()?;
        let ejection = o.observe(outcome, now, cfg, may)?;
        b.live
            .ejected_until_ms
            .store(since_epoch_ms(now + ejection), Ordering::Relaxed);
        Some(ejection)
    }

    /// A healthy, not ejected backend not in `excluded`, for requests passed through unrouted.
    pub fn pick_passthrough(&self, excluded: &[usize]) -> Option<usize> {
        let n = self.backends.len();
        let now = Instant::now();
        let found = self.shared.lb.select_with(b"", 4 * n, |b, healthy| {
            healthy
                && self
                    .index_of(b)
                    .is_some_and(|i| !excluded.contains(&i) && !self.backends[i].ejected(now))
        })?;
        self.index_of(&found)
    }

    fn index_of(&self, b: &Backend) -> Option<usize> {
        self.backends
            .iter()
            .position(|s| s.lb_backend.addr == b.addr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::BLOCK_BYTES;
    use crate::fleet::charge::Expected;
    use crate::fleet::learn::PrefillCounters;

    fn fleet() -> Fleet {
        let cfg = Config::from_yaml(
            "kvroute:\n  listen: \"127.0.0.1:1\"\n  backends:\n    - addr: \"127.0.0.1:2\"\n      prefill_tokens_per_s: 20000\n",
        )
        .unwrap();
        Fleet::new(&cfg).unwrap()
    }

    /// A scrape of paired cumulative prefill counters, request counts unknown.
    fn paired_scrape(tokens: f64, seconds: f64) -> EngineStats {
        EngineStats {
            prefill: Some(PrefillCounters {
                tokens,
                seconds,
                requests: None,
                paired: true,
            }),
            ..EngineStats::default()
        }
    }

    #[test]
    fn prefill_rate_and_kv_capacity_are_learned_from_engine_counters() {
        let f = fleet();
        let b = &f.backends()[0];
        assert_eq!(f.prefill_rate(0), 20_000.0, "the configured prior");
        let scrape = |tokens: f64, seconds: f64| EngineStats {
            kv_capacity_tokens: Some(150_000),
            ..paired_scrape(tokens, seconds)
        };
        f.observe(0, scrape(0.0, 0.0));
        f.observe(0, scrape(90_000.0, 10.0));
        assert_eq!(b.learned_prefill().map(|e| e.rate), Some(9_000.0));
        assert_eq!(f.prefill_rate(0), 9_000.0);
        assert_eq!(b.kv_capacity(), 150_000);
        assert_eq!(f.loads()[0].prefill_rate, 9_000.0);
    }

    #[test]
    fn a_configured_rate_stands_while_the_evidence_allows_it() {
        let yaml = |rate: &str| {
            format!("kvroute:\n  listen: \"127.0.0.1:1\"\n  backends:\n    - addr: \"127.0.0.1:2\"\n{rate}")
        };
        // Small prompts with a fixed per-request cost: the plain ratio (the floor) reads ~6,200
        // tokens/s for an engine the fit puts at 9,000.
        let feed = |f: &Fleet| {
            let mut c = PrefillCounters {
                tokens: 0.0,
                seconds: 0.0,
                requests: Some(0.0),
                paired: false,
            };
            f.observe(
                0,
                EngineStats {
                    prefill: Some(c),
                    ..EngineStats::default()
                },
            );
            for k in 0..30 {
                let (small, docs) = (20.0 + (k % 5) as f64, (k % 3 == 0) as u8 as f64);
                c.tokens += small * 100.0 + docs * 20_000.0;
                c.seconds += (small + docs) * 0.02 + (small * 100.0 + docs * 20_000.0) / 9_000.0;
                c.requests = c.requests.map(|r| r + small + docs);
                f.observe(
                    0,
                    EngineStats {
                        prefill: Some(c),
                        ..EngineStats::default()
                    },
                );
            }
        };
        let run = |rate: &str| {
            let cfg = Config::from_yaml(&yaml(rate)).unwrap();
            let f = Fleet::new(&cfg).unwrap();
            feed(&f);
            let b = &f.backends()[0];
            let e = b.learned_prefill().unwrap();
            assert!((e.rate / 9_000.0 - 1.0).abs() < 0.05, "{e:?}");
            assert!(
                e.floor < 0.8 * e.rate,
                "the test needs a floor well below: {e:?}"
            );
            f.prefill_rate(0)
        };
        // Right, or within what the evidence cannot rule out: kept as configured.
        assert_eq!(run("      prefill_tokens_per_s: 9500\n"), 9_500.0);
        assert_eq!(run("      prefill_tokens_per_s: 7000\n"), 7_000.0);
        assert_eq!(run("      prefill_tokens_per_s: 13000\n"), 13_000.0);
        // Below the proven floor (~6,200), or far above the estimate: the estimate.
        let est = run("");
        assert!((est / 9_000.0 - 1.0).abs() < 0.05, "unconfigured: {est}");
        assert_eq!(run("      prefill_tokens_per_s: 5000\n"), est);
        assert_eq!(run("      prefill_tokens_per_s: 90\n"), est);
        assert_eq!(run("      prefill_tokens_per_s: 900000\n"), est);
    }

    #[test]
    fn a_backend_not_yet_heard_from_is_assumed_as_fast_as_the_median() {
        let cfg = Config::from_yaml(
            "kvroute:\n  listen: \"127.0.0.1:1\"\n  backends:\n    - addr: \"127.0.0.1:2\"\n    - addr: \"127.0.0.1:3\"\n      prefill_tokens_per_s: 250\n",
        )
        .unwrap();
        let f = Fleet::new(&cfg).unwrap();
        assert_eq!((f.prefill_rate(0), f.prefill_rate(1)), (25_000.0, 250.0));
        let scrape = paired_scrape;
        f.observe(0, scrape(0.0, 0.0));
        f.observe(0, scrape(80_000.0, 4.0));
        // Told it is 80x slower, backend 1 would never be sent a request to learn from.
        assert_eq!((f.prefill_rate(0), f.prefill_rate(1)), (20_000.0, 20_000.0));
        f.observe(1, scrape(0.0, 0.0));
        f.observe(1, scrape(50_000.0, 2.0));
        assert_eq!(
            f.prefill_rate(1),
            25_000.0,
            "its own evidence rules out 250"
        );
    }

    #[test]
    fn charges_are_released_however_requests_end() {
        let f = fleet();
        let g = f.charge(0, 1000, None, Expected::default());
        assert_eq!(
            (f.backends()[0].inflight(), f.backends()[0].queued_prefill()),
            (1, 1000)
        );
        g.first_byte();
        assert_eq!(
            (f.backends()[0].queued_prefill(), f.backends()[0].decoding()),
            (0, 1)
        );
        // Pinned to a data-parallel rank: queued there too, until answered or dropped.
        let before_answer = f
            .try_charge(0, 500, Some(3), (2, None), Expected::default())
            .unwrap();
        assert_eq!(
            (
                f.backends()[0].rank_prefill(3),
                f.backends()[0].rank_prefill(0)
            ),
            (500, 0)
        );
        assert!(
            f.try_charge(0, 1, None, (2, None), Expected::default())
                .is_none(),
            "cap of 2 reached"
        );
        // A placement's bound below the cap holds as the cap does.
        assert!(f
            .try_charge(0, 1, None, (8, Some(2)), Expected::default())
            .is_none());
        drop(g);
        drop(before_answer);
        let b = &f.backends()[0];
        assert_eq!((b.inflight(), b.queued_prefill(), b.decoding()), (0, 0, 0));
        assert_eq!(b.rank_prefill(3), 0);
        let answered = f.charge(0, 200, Some(1), Expected::default());
        answered.first_byte();
        assert_eq!(f.backends()[0].rank_prefill(1), 0);
    }

    fn cfg(addrs: &[&str]) -> Config {
        let mut y = "kvroute:\n  listen: \"127.0.0.1:1\"\n  backends:\n".to_string();
        for a in addrs {
            y.push_str(&format!("    - addr: \"{a}\"\n"));
        }
        Config::from_yaml(&y).unwrap()
    }

    #[test]
    fn a_backend_added_by_reload_is_assumed_as_fast_as_the_learned_fleet_at_once() {
        let (a, b) = ("127.0.0.1:2", "127.0.0.1:3");
        let f1 = Fleet::new(&cfg(&[a])).unwrap();
        f1.observe(0, paired_scrape(0.0, 0.0));
        f1.observe(0, paired_scrape(400_000.0, 1.0));
        assert_eq!(f1.prefill_rate(0), 400_000.0);
        // No scrape has happened since the reload: b would be priced at the 25,000 default,
        // 16x slower than a, and lose every placement until one did.
        let f2 = f1.reload(&cfg(&[a, b])).unwrap();
        assert_eq!(
            (f2.prefill_rate(0), f2.prefill_rate(1)),
            (400_000.0, 400_000.0)
        );
    }

    #[test]
    fn a_backend_not_learned_yet_is_priced_at_the_fleets_median_even_when_it_is_slow() {
        // Two CPU engines: the first prefill shows 118 tokens/s, 200x under the default.
        let f = Fleet::new(&cfg(&["127.0.0.1:2", "127.0.0.1:3"])).unwrap();
        assert_eq!(
            f.prefill_rate(1),
            crate::config::DEFAULT_PREFILL_TOKENS_PER_S,
            "nothing known yet"
        );
        f.observe(0, paired_scrape(0.0, 0.0));
        f.observe(0, paired_scrape(826.0, 7.0));
        assert_eq!(f.prefill_rate(0), 118.0);
        assert_eq!(
            f.prefill_rate(1),
            118.0,
            "a cold prefill there costs what it costs on its peer, not 34 ms"
        );
        // Its own first prefill then takes over.
        f.observe(1, paired_scrape(0.0, 0.0));
        f.observe(1, paired_scrape(900.0, 6.0));
        assert_eq!(f.prefill_rate(1), 150.0);
    }

    #[test]
    fn reload_keeps_what_staying_backends_know_and_forgets_removed_ones() {
        let (a, b, c) = ("127.0.0.1:2", "127.0.0.1:3", "127.0.0.1:4");
        let f1 = Fleet::new(&cfg(&[a, b])).unwrap();
        let blocks = [11, 12, 13];
        f1.record(0, &blocks, &[], None);
        f1.record(1, &blocks[..1], &[], None);
        let held = f1.charge(0, 700, None, Expected::default());

        // Drop b, add c: c takes b's freed slot and must not inherit its beliefs.
        let f2 = f1.reload(&cfg(&[c, a])).unwrap();
        assert_eq!(f2.backends()[1].name, a);
        let bt = BLOCK_BYTES as u64 / 4;
        assert_eq!(
            f2.matches(&blocks, None, 0, 1.0).tokens,
            vec![0, 3 * bt],
            "a keeps its prefix, c starts empty"
        );
        assert_eq!(
            (
                f2.backends()[1].inflight(),
                f2.backends()[1].queued_prefill()
            ),
            (1, 700),
            "a request in flight across the reload stays counted"
        );
        drop(held);
        assert_eq!(
            f2.backends()[1].inflight(),
            0,
            "and is released on the new fleet"
        );

        // A request placed by the old fleet on b cannot teach c's slot.
        f1.record(1, &blocks, &[], None);
        assert_eq!(f2.matches(&blocks, None, 0, 1.0).tokens[0], 0);
        f2.record(0, &blocks, &[], None);
        assert_eq!(
            f2.matches(&blocks, None, 0, 1.0).tokens,
            vec![3 * bt, 3 * bt]
        );
        assert_eq!(f2.index_size().0, 6);
    }
}
