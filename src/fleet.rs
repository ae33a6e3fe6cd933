//! The backends: their identity, health (Pingora's active HTTP checks), in-flight accounting and
//! the snapshot placement decides from.

use pingora::http::RequestHeader;
use pingora_load_balancing::health_check::HttpHealthCheck;
use pingora_load_balancing::selection::RoundRobin;
use pingora_load_balancing::{Backend, LoadBalancer};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::config::{Config, HealthCheckConfig, DEFAULT_KV_CAPACITY_TOKENS};
use crate::index::PrefixIndex;
use crate::policy::BackendLoad;
use crate::ring::Ring;
use crate::telemetry::{EngineKind, EngineStats, Slot};

/// One configured backend. Shared by `Arc` so accounting outlives any fleet rebuild.
pub struct BackendState {
    pub addr: SocketAddr,
    /// `ip:port`, the `backend` label in metrics and logs.
    pub name: String,
    pub weight: u32,
    pub prefill_rate: f64,
    pub engine: EngineKind,
    pub metrics_path: String,
    pub dcgm: Option<SocketAddr>,
    /// Configured KV capacity; `None` lets telemetry set it.
    kv_capacity_configured: Option<u64>,
    pub telemetry: Slot,
    /// Online correction of `prefill_rate` (f64 bits), learned from observed TTFTs.
    rate_scale: AtomicU64,
    inflight: AtomicU64,
    queued_prefill: AtomicU64,
    decoding: AtomicU64,
    lb_backend: Backend,
}

impl BackendState {
    pub fn inflight(&self) -> u64 {
        self.inflight.load(Ordering::Relaxed)
    }

    pub fn queued_prefill(&self) -> u64 {
        self.queued_prefill.load(Ordering::Relaxed)
    }

    pub fn decoding(&self) -> u64 {
        self.decoding.load(Ordering::Relaxed)
    }

    /// The prefill rate placement uses: configured, times what observed TTFTs taught.
    pub fn effective_prefill_rate(&self) -> f64 {
        self.prefill_rate * f64::from_bits(self.rate_scale.load(Ordering::Relaxed))
    }

    /// A request estimated to wait `est_s` for its first byte waited `observed_s`: move the rate
    /// a tenth of the way (in log space) toward what would have predicted it.
    pub fn observe_ttft(&self, est_s: f64, observed_s: f64) {
        if !(est_s > 0.0 && observed_s > 0.0) {
            return;
        }
        let step = (est_s / observed_s).clamp(0.25, 4.0).powf(0.1);
        let _ = self
            .rate_scale
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                Some((f64::from_bits(bits) * step).clamp(0.1, 10.0).to_bits())
            });
    }
}

/// One request's charge on a backend: in flight until dropped; its estimated prefill counts as
/// queued until the first response byte, then it counts as a decoding stream. Dropping releases
/// whatever is still charged, however the request ends.
pub struct InflightGuard {
    backend: Arc<BackendState>,
    prefill: u64,
    decoding: bool,
}

impl InflightGuard {
    /// The backend answered: its prefill is done and the request is decoding.
    pub fn first_byte(&mut self) {
        if !self.decoding {
            self.decoding = true;
            self.backend
                .queued_prefill
                .fetch_sub(self.prefill, Ordering::Relaxed);
            self.backend.decoding.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        let b = &self.backend;
        b.inflight.fetch_sub(1, Ordering::Relaxed);
        if self.decoding {
            b.decoding.fetch_sub(1, Ordering::Relaxed);
        } else {
            b.queued_prefill.fetch_sub(self.prefill, Ordering::Relaxed);
        }
    }
}

pub struct Fleet {
    backends: Vec<Arc<BackendState>>,
    ring: Ring,
    /// Owns the health state; also picks backends for pass-through requests.
    lb: Arc<LoadBalancer<RoundRobin>>,
    tickets: AtomicU64,
    /// What each backend is believed to cache (slot = backend index).
    index: Mutex<PrefixIndex>,
    block_tokens: u64,
    stale_after: Duration,
}

impl Fleet {
    /// Build the fleet. The returned load balancer must run as a Pingora background service for
    /// health checks to happen.
    pub fn new(cfg: &Config) -> Result<Fleet, String> {
        let mut backends = Vec::with_capacity(cfg.backends.len());
        for b in &cfg.backends {
            let addr: SocketAddr = b
                .addr
                .parse()
                .map_err(|_| format!("invalid backend address {}", b.addr))?;
            let lb_backend = Backend::new(&b.addr).map_err(|e| e.to_string())?;
            let dcgm = match &b.dcgm_addr {
                Some(d) => Some(d.parse().map_err(|_| format!("invalid dcgm_addr {d}"))?),
                None => None,
            };
            backends.push(Arc::new(BackendState {
                addr,
                name: b.addr.clone(),
                weight: b.weight,
                prefill_rate: b.prefill_tokens_per_s,
                engine: b.engine,
                metrics_path: b.metrics_path.clone(),
                dcgm,
                kv_capacity_configured: b.kv_capacity_tokens,
                telemetry: Slot::default(),
                rate_scale: AtomicU64::new(1.0f64.to_bits()),
                inflight: AtomicU64::new(0),
                queued_prefill: AtomicU64::new(0),
                decoding: AtomicU64::new(0),
                lb_backend,
            }));
        }
        let ring = Ring::new(
            &backends
                .iter()
                .map(|b| (b.addr, b.weight))
                .collect::<Vec<_>>(),
        );
        let mut lb =
            LoadBalancer::<RoundRobin>::try_from_iter(cfg.backends.iter().map(|b| b.addr.as_str()))
                .map_err(|e| format!("backends: {e}"))?;
        lb.set_health_check(health_check(&cfg.health_check)?);
        lb.health_check_frequency = Some(Duration::from_millis(cfg.health_check.interval_ms));
        lb.parallel_health_check = true;
        let capacities: Vec<usize> = cfg
            .backends
            .iter()
            .map(|b| {
                let tokens = b.kv_capacity_tokens.unwrap_or(DEFAULT_KV_CAPACITY_TOKENS);
                (tokens / cfg.routing.block_tokens()).max(1) as usize
            })
            .collect();
        Ok(Fleet {
            backends,
            ring,
            lb: Arc::new(lb),
            tickets: AtomicU64::new(0),
            index: Mutex::new(PrefixIndex::new(&capacities)),
            block_tokens: cfg.routing.block_tokens(),
            stale_after: Duration::from_millis(cfg.telemetry.stale_after_ms),
        })
    }

    pub fn load_balancer(&self) -> Arc<LoadBalancer<RoundRobin>> {
        self.lb.clone()
    }

    pub fn backends(&self) -> &[Arc<BackendState>] {
        &self.backends
    }

    pub fn ring(&self) -> &Ring {
        &self.ring
    }

    pub fn healthy(&self, i: usize) -> bool {
        self.lb.backends().ready(&self.backends[i].lb_backend)
    }

    /// Current health and load of every backend, in ring-index order.
    pub fn loads(&self) -> Vec<BackendLoad> {
        self.backends
            .iter()
            .enumerate()
            .map(|(i, b)| {
                let engine = b.telemetry.fresh(self.stale_after);
                BackendLoad {
                    healthy: self.healthy(i),
                    weight: b.weight,
                    inflight: b.inflight(),
                    queued_prefill: b.queued_prefill(),
                    decoding: b.decoding(),
                    prefill_rate: b.effective_prefill_rate(),
                    engine_load: engine.and_then(|e| match (e.running, e.waiting) {
                        (None, None) => None,
                        (r, w) => Some((r.unwrap_or(0.0) + w.unwrap_or(0.0)).max(0.0) as u64),
                    }),
                    kv_usage: engine.and_then(|e| e.kv_usage),
                }
            })
            .collect()
    }

    /// A fresh round-robin ticket.
    pub fn ticket(&self) -> u64 {
        self.tickets.fetch_add(1, Ordering::Relaxed)
    }

    /// Count a request with `prefill` estimated uncached tokens against backend `i` until the
    /// guard drops.
    pub fn charge(&self, i: usize, prefill: u64) -> InflightGuard {
        let backend = self.backends[i].clone();
        backend.inflight.fetch_add(1, Ordering::Relaxed);
        backend.queued_prefill.fetch_add(prefill, Ordering::Relaxed);
        InflightGuard {
            backend,
            prefill,
            decoding: false,
        }
    }

    /// Like [`Fleet::charge`], but only while backend `i` has fewer than `cap` (per unit of
    /// weight) requests in flight; the check and the charge are one atomic step.
    pub fn try_charge(&self, i: usize, prefill: u64, cap: u64) -> Option<InflightGuard> {
        let backend = self.backends[i].clone();
        let limit = cap.saturating_mul(backend.weight as u64);
        backend
            .inflight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
                (v < limit).then_some(v + 1)
            })
            .ok()?;
        backend.queued_prefill.fetch_add(prefill, Ordering::Relaxed);
        Some(InflightGuard {
            backend,
            prefill,
            decoding: false,
        })
    }

    /// Per backend, how many of `blocks` (a request's prefix) its index holds.
    pub fn matches(&self, blocks: &[u64]) -> Vec<u32> {
        let mut out = vec![0; self.backends.len()];
        if let Ok(idx) = self.index.lock() {
            idx.longest_matches(blocks, &mut out);
        }
        out
    }

    /// Believe that backend `i` now caches `blocks` (it is being sent them).
    pub fn record(&self, i: usize, blocks: &[u64]) {
        if let Ok(mut idx) = self.index.lock() {
            idx.insert(i, blocks);
        }
    }

    /// A telemetry scrape of backend `i`; a reported KV size bounds its index unless one is
    /// configured.
    pub fn observe(&self, i: usize, stats: EngineStats) {
        let Some(b) = self.backends.get(i) else {
            return;
        };
        if let (None, Some(tokens)) = (b.kv_capacity_configured, stats.kv_capacity_tokens) {
            if let Ok(mut idx) = self.index.lock() {
                idx.set_capacity(i, (tokens / self.block_tokens).max(1) as usize);
            }
        }
        b.telemetry.store(stats);
    }

    pub fn stale_after(&self) -> Duration {
        self.stale_after
    }

    /// Tracked (backend, block) pairs and the index's heap bytes.
    pub fn index_size(&self) -> (usize, usize) {
        self.index
            .lock()
            .map(|idx| (idx.blocks(), idx.bytes()))
            .unwrap_or((0, 0))
    }

    /// A healthy backend not in `excluded`, for requests that are passed through unrouted.
    pub fn pick_passthrough(&self, excluded: &[usize]) -> Option<usize> {
        let n = self.backends.len();
        let found = self.lb.select_with(b"", 4 * n, |b, healthy| {
            healthy && self.index_of(b).is_some_and(|i| !excluded.contains(&i))
        })?;
        self.index_of(&found)
    }

    fn index_of(&self, b: &Backend) -> Option<usize> {
        self.backends
            .iter()
            .position(|s| s.lb_backend.addr == b.addr)
    }
}

fn health_check(cfg: &HealthCheckConfig) -> Result<Box<HttpHealthCheck>, String> {
    let mut hc = HttpHealthCheck::new("localhost", false);
    let mut req =
        RequestHeader::build("GET", cfg.path.as_bytes(), None).map_err(|e| e.to_string())?;
    req.append_header("Host", "localhost")
        .map_err(|e| e.to_string())?;
    hc.req = req;
    let timeout = Some(Duration::from_millis(cfg.timeout_ms));
    hc.peer_template.options.connection_timeout = timeout;
    hc.peer_template.options.read_timeout = timeout;
    hc.consecutive_success = cfg.consecutive_success;
    hc.consecutive_failure = cfg.consecutive_failure;
    Ok(Box::new(hc))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fleet() -> Fleet {
        let cfg = Config::from_yaml(
            "kvroute:\n  listen: \"127.0.0.1:1\"\n  backends:\n    - addr: \"127.0.0.1:2\"\n      prefill_tokens_per_s: 20000\n",
        )
        .unwrap();
        Fleet::new(&cfg).unwrap()
    }

    #[test]
    fn prefill_rate_learns_from_observed_ttft() {
        let f = fleet();
        let b = &f.backends()[0];
        // The engine is twice as slow as configured: TTFTs come in at twice the estimate.
        for _ in 0..200 {
            let est = 0.2 * 20_000.0 / b.effective_prefill_rate();
            b.observe_ttft(est, 0.4);
        }
        let rate = b.effective_prefill_rate();
        assert!((rate - 10_000.0).abs() < 500.0, "{rate}");
        // Nonsense observations change nothing.
        b.observe_ttft(0.0, 1.0);
        b.observe_ttft(1.0, f64::NAN);
        assert_eq!(b.effective_prefill_rate(), rate);
    }

    #[test]
    fn charges_are_released_however_requests_end() {
        let f = fleet();
        let mut g = f.charge(0, 1000);
        assert_eq!(
            (f.backends()[0].inflight(), f.backends()[0].queued_prefill()),
            (1, 1000)
        );
        g.first_byte();
        assert_eq!(
            (f.backends()[0].queued_prefill(), f.backends()[0].decoding()),
            (0, 1)
        );
        let before_answer = f.try_charge(0, 500, 2).unwrap();
        assert!(f.try_charge(0, 1, 2).is_none(), "cap of 2 reached");
        drop(g);
        drop(before_answer);
        let b = &f.backends()[0];
        assert_eq!((b.inflight(), b.queued_prefill(), b.decoding()), (0, 0, 0));
    }
}
