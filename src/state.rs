//! Process-wide state shared by the proxy, the admin listener and background services.

use arc_swap::ArcSwap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::access::Limiter;
use crate::admission::Admission;
use crate::config::Config;
use crate::edge::HeaderWatches;
use crate::fleet::Fleet;
use crate::metrics::Metrics;
use crate::retry_budget::RetryBudget;

pub struct State {
    config: ArcSwap<Config>,
    fleet: ArcSwap<Fleet>,
    pub metrics: Metrics,
    pub admission: Admission,
    pub retry_budget: Arc<RetryBudget>,
    /// Request headers parsed per client connection (the edge's header deadline).
    pub headers: HeaderWatches,
    /// Per-key rate limits (kept across reloads).
    pub limiter: Limiter,
    draining: AtomicBool,
}

impl State {
    pub fn new(config: Config, fleet: Fleet, metrics: Metrics) -> State {
        State {
            config: ArcSwap::from_pointee(config),
            fleet: ArcSwap::from_pointee(fleet),
            metrics,
            admission: Admission::default(),
            retry_budget: Arc::default(),
            headers: HeaderWatches::default(),
            limiter: Limiter::default(),
            draining: AtomicBool::new(false),
        }
    }

    /// The config in force; a request keeps the one it started with.
    pub fn config(&self) -> Arc<Config> {
        self.config.load_full()
    }

    /// The fleet in force; a request keeps the one it was placed with, so backend indices in
    /// its context stay valid.
    pub fn fleet(&self) -> Arc<Fleet> {
        self.fleet.load_full()
    }

    /// Publish a reloaded config and the fleet built from it. Requests already placed keep
    /// the generation they started with.
    pub fn publish(&self, config: Config, fleet: Fleet) {
        self.fleet.store(Arc::new(fleet));
        self.config.store(Arc::new(config));
    }

    /// A graceful upgrade or shutdown has begun: this process finishes what it has.
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::Relaxed);
        self.metrics.draining.set(1);
    }

    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }
}
