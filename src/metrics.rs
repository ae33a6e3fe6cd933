//! kvroute's Prometheus metrics, on a registry of their own (rendered by the admin listener).

use prometheus::{
    exponential_buckets, Encoder, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

use crate::fleet::Fleet;

pub struct Metrics {
    registry: Registry,
    pub requests: IntCounterVec,
    pub duration: HistogramVec,
    pub ttft: HistogramVec,
    pub inflight: IntGaugeVec,
    pub healthy: IntGaugeVec,
    pub decisions: IntCounterVec,
    pub upstream_failures: IntCounterVec,
    pub predicted_cached: IntCounter,
    pub index_blocks: IntGauge,
    pub index_bytes: IntGauge,
    pub queued_prefill: IntGaugeVec,
    pub decoding: IntGaugeVec,
}

fn counter(
    reg: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> prometheus::Result<IntCounterVec> {
    let c = IntCounterVec::new(Opts::new(name, help), labels)?;
    reg.register(Box::new(c.clone()))?;
    Ok(c)
}

fn gauge(
    reg: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> prometheus::Result<IntGaugeVec> {
    let g = IntGaugeVec::new(Opts::new(name, help), labels)?;
    reg.register(Box::new(g.clone()))?;
    Ok(g)
}

fn histogram(
    reg: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> prometheus::Result<HistogramVec> {
    // 1 ms .. ~524 s: covers a cache-hit first token and a long generation.
    let buckets = exponential_buckets(0.001, 2.0, 20)?;
    let h = HistogramVec::new(HistogramOpts::new(name, help).buckets(buckets), labels)?;
    reg.register(Box::new(h.clone()))?;
    Ok(h)
}

impl Metrics {
    pub fn new() -> prometheus::Result<Metrics> {
        let r = Registry::new();
        Ok(Metrics {
            requests: counter(
                &r,
                "kvroute_requests_total",
                "Requests answered, by backend (\"none\" if never dispatched) and HTTP status code.",
                &["backend", "code"],
            )?,
            duration: histogram(
                &r,
                "kvroute_request_duration_seconds",
                "Time from request start to the last response byte.",
                &["backend"],
            )?,
            ttft: histogram(
                &r,
                "kvroute_time_to_first_token_seconds",
                "Time from request start to the first response body byte of a streamed response.",
                &["backend"],
            )?,
            inflight: gauge(
                &r,
                "kvroute_backend_inflight_requests",
                "Requests dispatched to the backend and not yet finished.",
                &["backend"],
            )?,
            healthy: gauge(
                &r,
                "kvroute_backend_healthy",
                "1 if the backend passes active health checks, else 0.",
                &["backend"],
            )?,
            decisions: counter(
                &r,
                "kvroute_routing_decisions_total",
                "Placement decisions by policy and reason (affinity, spill, failover, ...).",
                &["policy", "reason"],
            )?,
            upstream_failures: counter(
                &r,
                "kvroute_upstream_failures_total",
                "Failed upstream attempts before any response byte, by backend and kind (connect, io).",
                &["backend", "kind"],
            )?,
            predicted_cached: {
                let c = IntCounter::new(
                    "kvroute_predicted_cached_prompt_tokens_total",
                    "Prompt tokens the prefix index predicted the chosen backend holds (kv_aware).",
                )?;
                r.register(Box::new(c.clone()))?;
                c
            },
            index_blocks: {
                let g = IntGauge::new(
                    "kvroute_index_blocks",
                    "(backend, block) pairs tracked by the prefix index.",
                )?;
                r.register(Box::new(g.clone()))?;
                g
            },
            index_bytes: {
                let g = IntGauge::new("kvroute_index_bytes", "Heap bytes held by the prefix index.")?;
                r.register(Box::new(g.clone()))?;
                g
            },
            queued_prefill: gauge(
                &r,
                "kvroute_backend_queued_prefill_tokens",
                "Estimated prompt tokens dispatched to the backend and not yet answered.",
                &["backend"],
            )?,
            decoding: gauge(
                &r,
                "kvroute_backend_decoding_requests",
                "Requests streaming output from the backend.",
                &["backend"],
            )?,
            registry: r,
        })
    }

    /// Prometheus text exposition, with per-backend gauges refreshed from the fleet.
    pub fn render(&self, fleet: &Fleet) -> Vec<u8> {
        for (i, b) in fleet.backends().iter().enumerate() {
            self.inflight
                .with_label_values(&[&b.name])
                .set(b.inflight() as i64);
            self.healthy
                .with_label_values(&[&b.name])
                .set(fleet.healthy(i) as i64);
            self.queued_prefill
                .with_label_values(&[&b.name])
                .set(b.queued_prefill() as i64);
            self.decoding
                .with_label_values(&[&b.name])
                .set(b.decoding() as i64);
        }
        let (blocks, bytes) = fleet.index_size();
        self.index_blocks.set(blocks as i64);
        self.index_bytes.set(bytes as i64);
        let mut out = Vec::new();
        if let Err(e) = TextEncoder::new().encode(&self.registry.gather(), &mut out) {
            log::error!("metrics encoding failed: {e}");
        }
        out
    }
}
