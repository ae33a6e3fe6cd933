//! What one simulated server holds while it serves: configuration, prefix cache, counters,
//! engine, request log, fault knobs and stored Responses answers. Every handler module reads it, so it sits below
//! `server` (which builds the router from those handlers) rather than inside it.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use axum::http::HeaderValue;
use tokio::sync::watch;
use tokio::time::Instant;

use super::reqlog::{RequestLog, LOG_CAPACITY};
use super::response_store::{ResponseStore, STORE_CAPACITY};
use crate::sim::config::SimConfig;
use crate::sim::engine::kv_events::kvpublish::Publisher;
use crate::sim::engine::kvcache::KvCache;
use crate::sim::engine::lora::Lora;
use crate::sim::engine::stats::Stats;
use crate::sim::engine::task::{EngineHandle, HoldReport};
use crate::sim::faults::Faults;
use crate::sim::pd::Pd;

pub struct ServerState {
    pub index: usize,
    pub addr: SocketAddr,
    pub config: Arc<SimConfig>,
    pub started: Instant,
    pub kv: Mutex<KvCache>,
    pub stats: Arc<Stats>,
    /// Engine mode only; fixed-timing mode paces each request on its own.
    pub engine: Option<EngineHandle>,
    pub log: Mutex<RequestLog>,
    /// A watch channel so that requests held by the `hang` fault wake when it is cleared.
    pub faults: watch::Sender<Faults>,
    /// Rendered once, not per answer: `server` adds them to every response.
    pub index_header: HeaderValue,
    pub addr_header: HeaderValue,
    /// The LoRA adapters loaded now (`config.lora`).
    pub lora: Arc<Lora>,
    /// Finished Responses answers, for `previous_response_id` and `/v1/responses/{id}`.
    pub responses: Arc<ResponseStore>,
    /// P/D disaggregation: what this server holds for decode servers, what it read from
    /// prefill servers.
    pub pd: Arc<Pd>,
}

impl ServerState {
    /// Must run inside a tokio runtime: in engine mode it spawns the engine tasks (one per
    /// data-parallel rank), rank r publishing its KV events into `kv_events[r]` (fixed timing
    /// has no KV pool to publish).
    pub fn new(
        index: usize,
        addr: SocketAddr,
        config: Arc<SimConfig>,
        kv_events: Vec<Publisher>,
    ) -> Self {
        let (faults, _) = watch::channel(config.faults);
        let ranks = if config.fixed_timing {
            0
        } else {
            config.dp_size
        };
        let stats = Arc::new(Stats::with_ranks(ranks));
        let pd = Arc::new(Pd::new(
            config.pd,
            index,
            addr,
            config.profile.kv_bytes_per_token,
        ));
        let engine = (!config.fixed_timing).then(|| {
            let pd = pd.clone();
            let holds = Arc::new(move |h: HoldReport| pd.held.hold(h.key, h.rank, h.hashes, None));
            let (profile, scale) = (config.profile, config.time_scale);
            let cores = config.cores.clone();
            EngineHandle::spawn(profile, scale, stats.clone(), kv_events, holds, cores)
        });
        Self {
            index,
            addr,
            kv: Mutex::new(KvCache::new(config.num_gpu_blocks())),
            stats,
            engine,
            log: Mutex::new(RequestLog::new(LOG_CAPACITY)),
            faults,
            started: Instant::now(),
            index_header: HeaderValue::from(index),
            addr_header: header_value(&addr.to_string()),
            lora: Arc::default(),
            responses: Arc::new(ResponseStore::new(STORE_CAPACITY)),
            pd,
            config,
        }
    }

    pub fn in_slow_start(&self) -> bool {
        self.started.elapsed() < self.config.slow_start
    }

    pub fn faults(&self) -> Faults {
        *self.faults.borrow()
    }

    pub fn kv(&self) -> MutexGuard<'_, KvCache> {
        self.kv.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn log(&self) -> MutexGuard<'_, RequestLog> {
        self.log.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Model-time seconds elapsed since `since` (wall time times the time scale).
    pub fn model_seconds_since(&self, since: Instant) -> f64 {
        since.elapsed().as_secs_f64() * self.config.time_scale
    }
}

pub fn header_value(s: &str) -> HeaderValue {
    HeaderValue::from_str(s).unwrap_or_else(|_| HeaderValue::from_static("invalid"))
}
