//! One backend's identity and live state, and the charge a request holds on it.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use pingora_load_balancing::Backend;

use super::outlier::Outlier;
use super::telemetry::Slot;
use crate::config::EngineKind;

/// What a backend accumulates while it runs. Shared by `Arc` between fleet generations and the
/// guards of requests in flight, so a reload neither loses nor double-counts load.
pub(super) struct Live {
    pub(super) telemetry: Slot,
    /// Online correction of `prefill_rate` (f64 bits), learned from observed TTFTs.
    pub(super) rate_scale: AtomicU64,
    pub(super) inflight: AtomicU64,
    pub(super) queued_prefill: AtomicU64,
    pub(super) decoding: AtomicU64,
    pub(super) outlier: Mutex<Outlier>,
    /// End of the current ejection in ms since [`epoch`]: read on every placement without the
    /// outlier lock, which only responses take.
    pub(super) ejected_until_ms: AtomicU64,
}

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
            rate_scale: AtomicU64::new(1.0f64.to_bits()),
            inflight: AtomicU64::new(0),
            queued_prefill: AtomicU64::new(0),
            decoding: AtomicU64::new(0),
            outlier: Mutex::new(Outlier::default()),
            ejected_until_ms: AtomicU64::new(0),
        }
    }
}

/// One configured backend: its settings from the config in force plus its live state.
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
    pub(super) kv_capacity_configured: Option<u64>,
    /// Its slot in the prefix index (`None` past the index's 64 slots).
    pub(super) slot: Option<usize>,
    pub(super) live: Arc<Live>,
    pub(super) lb_backend: Backend,
}

impl BackendState {
    pub fn inflight(&self) -> u64 {
        self.live.inflight.load(Ordering::Relaxed)
    }

    pub fn queued_prefill(&self) -> u64 {
        self.live.queued_prefill.load(Ordering::Relaxed)
    }

    pub fn decoding(&self) -> u64 {
        self.live.decoding.load(Ordering::Relaxed)
    }

    pub fn telemetry(&self) -> &Slot {
        &self.live.telemetry
    }

    /// Taken out of placement by passive outlier detection.
    pub fn ejected(&self, now: Instant) -> bool {
        since_epoch_ms(now) < self.live.ejected_until_ms.load(Ordering::Relaxed)
    }

    /// The prefill rate placement uses: configured, times what observed TTFTs taught.
    pub fn effective_prefill_rate(&self) -> f64 {
        self.prefill_rate * f64::from_bits(self.live.rate_scale.load(Ordering::Relaxed))
    }

    /// A request estimated to wait `est_s` for its first byte waited `observed_s`: move the rate
    /// a tenth of the way (in log space) toward what would have predicted it.
    pub fn observe_ttft(&self, est_s: f64, observed_s: f64) {
        if !(est_s > 0.0 && observed_s > 0.0) {
            return;
        }
        let step = (est_s / observed_s).clamp(0.25, 4.0).powf(0.1);
        let _ = self
            .live
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
    live: Arc<Live>,
    prefill: u64,
    decoding: bool,
}

impl InflightGuard {
    pub(super) fn new(live: Arc<Live>, prefill: u64) -> InflightGuard {
        live.queued_prefill.fetch_add(prefill, Ordering::Relaxed);
        InflightGuard {
            live,
            prefill,
            decoding: false,
        }
    }

    /// The backend answered: its prefill is done and the request is decoding.
    pub fn first_byte(&mut self) {
        if !self.decoding {
            self.decoding = true;
            self.live
                .queued_prefill
                .fetch_sub(self.prefill, Ordering::Relaxed);
            self.live.decoding.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        let l = &self.live;
        l.inflight.fetch_sub(1, Ordering::Relaxed);
        if self.decoding {
            l.decoding.fetch_sub(1, Ordering::Relaxed);
        } else {
            l.queued_prefill.fetch_sub(self.prefill, Ordering::Relaxed);
        }
    }
}
