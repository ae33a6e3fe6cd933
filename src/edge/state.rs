//! The edge's process-wide state: what outlives config generations (quotas, queue, budget,
//! draining) and the edge's metric families.

use prometheus::{GaugeVec, IntCounter, IntCounterVec, IntGauge, Registry};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use super::access::Limiter;
use super::body_budget::BodyBudget;
use super::queue::Admission;
use super::retry_budget::RetryBudget;
use super::signals::ConnSignals;
use crate::config::{metric_label, AccessConfig, TenantsConfig};
use crate::metrics::{counter, counter_vec, gauge_vec, int_gauge};

/// The edge's own families (the router queue registers its own).
pub struct EdgeMetrics {
    pub connections: IntGauge,
    pub connections_refused: IntCounter,
    /// By phase: `header` (the listener), `body` (reading a routed request's body).
    pub client_timeouts: IntCounterVec,
    pub rate_limited: IntCounterVec,
    /// Connections served, by transport (`http`, `https`) and protocol (`http1`, `h2`).
    pub accepted: IntCounterVec,
    /// HTTP/2 connections closed for abandoning streams faster than the limit (rapid reset).
    pub h2_reset_closes: IntCounter,
    /// Tokens left of each tenant's daily budget, set at each scrape.
    pub budget_left: GaugeVec,
    /// Each tenant's attained service (the fair share's), set at each scrape.
    pub attained: GaugeVec,
}

impl EdgeMetrics {
    fn register(r: &Registry) -> prometheus::Result<EdgeMetrics> {
        let m = EdgeMetrics {
            connections: int_gauge(r, "kvroute_client_connections", "Client connections open.")?,
            connections_refused: counter(
                r,
                "kvroute_client_connections_refused_total",
                "Client connections closed on accept because limits.max_connections were open.",
            )?,
            client_timeouts: counter_vec(
                r,
                "kvroute_client_timeouts_total",
                "Client connections or requests cut for being too slow, by phase \
                 (tls_handshake, header, body).",
                &["phase"],
            )?,
            rate_limited: counter_vec(
                r,
                "kvroute_rate_limited_requests_total",
                "Requests answered 429 because their API key was over its rate limit, by tenant.",
                &["tenant"],
            )?,
            accepted: counter_vec(
                r,
                "kvroute_client_connections_accepted_total",
                "Client connections served, by transport (http, https) and protocol (http1, h2).",
                &["transport", "protocol"],
            )?,
            attained: gauge_vec(
                r,
                "kvroute_tenant_attained_service_tokens",
                "Each tenant's attained service: weighted tokens served, decayed \
                 (tenants.fair_share), by tenant (configured tenants, else other).",
                &["tenant"],
            )?,
            budget_left: gauge_vec(
                r,
                "kvroute_tenant_token_budget_remaining",
                "Tokens left of each key's daily budget (access.keys[].tokens_per_day), by tenant.",
                &["tenant"],
            )?,
            h2_reset_closes: counter(
                r,
                "kvroute_h2_rapid_reset_closes_total",
                "HTTP/2 client connections closed for abandoning more than \
                 limits.h2_max_client_resets streams within limits.h2_reset_window_ms.",
            )?,
        };
        // Exported from start at zero, so an alert on their increase sees the first event.
        for phase in ["tls_handshake", "header", "body"] {
            m.client_timeouts.with_label_values(&[phase]);
        }
        for transport in ["http", "https"] {
            for protocol in ["http1", "h2"] {
                m.accepted.with_label_values(&[transport, protocol]);
            }
        }
        Ok(m)
    }
}

/// A graceful upgrade or shutdown has begun: this process finishes what it has, and `/readyz`
/// says not ready.
pub struct Draining {
    flag: AtomicBool,
    /// The drain is being cut short: streams end at their next chunk, with the SSE error event.
    cut: AtomicBool,
    gauge: IntGauge,
}

impl Draining {
    fn register(r: &Registry) -> prometheus::Result<Draining> {
        Ok(Draining {
            flag: AtomicBool::new(false),
            cut: AtomicBool::new(false),
            gauge: int_gauge(
                r,
                "kvroute_draining",
                "1 once a graceful upgrade or shutdown has begun: finishing in-flight work.",
            )?,
        })
    }

    pub fn start(&self) {
        self.flag.store(true, Ordering::Relaxed);
        self.gauge.set(1);
    }

    pub fn is_on(&self) -> bool {
        self.flag.load(Ordering::Relaxed)
    }

    /// End the streams still running (a second SIGTERM or a SIGINT during the drain).
    pub fn cut(&self) {
        self.cut.store(true, Ordering::Relaxed);
    }

    pub fn is_cut(&self) -> bool {
        self.cut.load(Ordering::Relaxed)
    }
}

/// Process-wide client-side state, shared by the listener, the proxy phases and the admin
/// listener. It outlives config generations: quotas, queue and budget survive a reload.
pub struct EdgeState {
    pub queue: Admission,
    pub retry_budget: Arc<RetryBudget>,
    /// Per client connection: request headers parsed (the listener's header deadline) and
    /// HTTP/2 streams abandoned (its rapid-reset defence).
    pub conns: ConnSignals,
    /// Client connections open on all client listeners (`limits.max_connections`).
    pub open_connections: AtomicUsize,
    /// Per-key rate limits (kept across reloads).
    pub limiter: Limiter,
    /// Request bodies being received or parsed (`limits.body_memory_bytes`).
    pub bodies: Arc<BodyBudget>,
    pub draining: Draining,
    pub metrics: EdgeMetrics,
}

impl EdgeState {
    /// Set the tenants' attained-service gauges, just before a scrape renders them; tenants
    /// the config does not name add up under `other`.
    pub fn publish_attained(&self, tenants: &TenantsConfig, access: Option<&AccessConfig>) {
        self.metrics.attained.reset();
        for (tenant, v) in self.queue.fair.snapshot(std::time::Instant::now()) {
            let label = metric_label(tenants, access, &tenant);
            self.metrics.attained.with_label_values(&[label]).add(v);
        }
    }

    /// Set the budget gauges, just before a scrape renders them. Keys of one tenant add up.
    pub fn publish_budgets(&self, access: Option<&AccessConfig>) {
        self.metrics.budget_left.reset();
        let Some(access) = access else {
            return;
        };
        for (tenant, left) in self.limiter.budgets_left(access, std::time::Instant::now()) {
            self.metrics
                .budget_left
                .with_label_values(&[&tenant])
                .add(left);
        }
    }

    pub fn register(r: &Registry) -> prometheus::Result<EdgeState> {
        Ok(EdgeState {
            queue: Admission::register(r)?,
            retry_budget: Arc::default(),
            conns: ConnSignals::default(),
            open_connections: AtomicUsize::new(0),
            limiter: Limiter::default(),
            bodies: Arc::new(BodyBudget::register(r)?),
            draining: Draining::register(r)?,
            metrics: EdgeMetrics::register(r)?,
        })
    }
}
