//! kvroute's Prometheus metrics, on a registry of their own (rendered by the admin listener).

use prometheus::{
    exponential_buckets, Encoder, GaugeVec, HistogramOpts, HistogramVec, IntCounter, IntCounterVec,
    IntGauge, IntGaugeVec, Opts, Registry, TextEncoder,
};

use crate::fleet::Fleet;
use crate::telemetry::EngineStats;

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
    pub prompt_tokens: IntCounterVec,
    pub cached_prompt_tokens: IntCounterVec,
    pub index_blocks: IntGauge,
    pub index_bytes: IntGauge,
    pub queued_prefill: IntGaugeVec,
    pub prefill_rate: GaugeVec,
    pub decoding: IntGaugeVec,
    /// Engine telemetry, one gauge family per scraped quantity.
    engine: Vec<(GaugeVec, Pick)>,
    pub queue_depth: IntGauge,
    pub decision_time: prometheus::Histogram,
    pub queue_wait: HistogramVec,
    pub shed: IntCounterVec,
    telemetry_age: GaugeVec,
    pub config_reloads: IntCounterVec,
    pub config_last_reload: prometheus::Gauge,
    pub config_pending_upgrade: IntGauge,
    pub draining: IntGauge,
    pub ejected: IntGaugeVec,
    pub ejections: IntCounterVec,
    pub retries: IntCounterVec,
    pub client_timeouts: IntCounterVec,
    pub connections: IntGauge,
    pub connections_refused: IntCounter,
    pub cut_streams: IntCounterVec,
    pub rate_limited: IntCounterVec,
}

type Pick = fn(&EngineStats) -> Option<f64>;

const ENGINE_GAUGES: &[(&str, &str, Pick)] = &[
    (
        "kvroute_backend_engine_waiting_requests",
        "Requests waiting in the engine's queue (scraped).",
        |e| e.waiting,
    ),
    (
        "kvroute_backend_engine_running_requests",
        "Requests the engine is running (scraped).",
        |e| e.running,
    ),
    (
        "kvroute_backend_kv_cache_usage_ratio",
        "Fraction of the engine's KV cache in use (scraped).",
        |e| e.kv_usage,
    ),
    (
        "kvroute_backend_engine_prefix_cache_hit_ratio",
        "Engine prefix cache hits / queries since it started (scraped, vLLM).",
        |e| match (e.prefix_hits, e.prefix_queries) {
            (Some(h), Some(q)) if q > 0.0 => Some(h / q),
            _ => None,
        },
    ),
    (
        "kvroute_backend_kv_capacity_tokens",
        "KV cache size the engine reports (vLLM cache_config_info).",
        |e| e.kv_capacity_tokens.map(|t| t as f64),
    ),
    (
        "kvroute_backend_gpu_utilization_ratio",
        "GPU utilisation from the backend's DCGM exporter.",
        |e| e.gpu_utilization,
    ),
    (
        "kvroute_backend_gpu_memory_used_bytes",
        "GPU framebuffer in use from the backend's DCGM exporter.",
        |e| e.gpu_memory_used_bytes,
    ),
];

/// Register a collector and hand it back.
fn registered<C>(reg: &Registry, c: C) -> prometheus::Result<C>
where
    C: prometheus::core::Collector + Clone + 'static,
{
    reg.register(Box::new(c.clone()))?;
    Ok(c)
}

fn counter(
    reg: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> prometheus::Result<IntCounterVec> {
    registered(reg, IntCounterVec::new(Opts::new(name, help), labels)?)
}

fn gauge(
    reg: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> prometheus::Result<IntGaugeVec> {
    registered(reg, IntGaugeVec::new(Opts::new(name, help), labels)?)
}

fn histogram(
    reg: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> prometheus::Result<HistogramVec> {
    // 1 ms .. ~524 s: covers a cache-hit first token and a long generation.
    let buckets = exponential_buckets(0.001, 2.0, 20)?;
    registered(
        reg,
        HistogramVec::new(HistogramOpts::new(name, help).buckets(buckets), labels)?,
    )
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
            predicted_cached: registered(
                &r,
                IntCounter::new(
                    "kvroute_predicted_cached_prompt_tokens_total",
                    "Prompt tokens the prefix index predicted the chosen backend holds (kv_aware).",
                )?,
            )?,
            prompt_tokens: counter(
                &r,
                "kvroute_prompt_tokens_total",
                "Prompt tokens of answered requests, as the engine reported them in usage.",
                &["backend"],
            )?,
            cached_prompt_tokens: counter(
                &r,
                "kvroute_cached_prompt_tokens_total",
                "Prompt tokens the engine reported as served from its prefix cache.",
                &["backend"],
            )?,
            index_blocks: registered(
                &r,
                IntGauge::new(
                    "kvroute_index_blocks",
                    "(backend, block) pairs tracked by the prefix index.",
                )?,
            )?,
            index_bytes: registered(
                &r,
                IntGauge::new("kvroute_index_bytes", "Heap bytes held by the prefix index.")?,
            )?,
            queued_prefill: gauge(
                &r,
                "kvroute_backend_queued_prefill_tokens",
                "Estimated prompt tokens dispatched to the backend and not yet answered.",
                &["backend"],
            )?,
            prefill_rate: registered(
                &r,
                GaugeVec::new(
                    Opts::new(
                        "kvroute_backend_prefill_rate_tokens_per_second",
                        "Prefill rate kv_aware assumes: configured, corrected online from observed TTFTs.",
                    ),
                    &["backend"],
                )?,
            )?,
            decoding: gauge(
                &r,
                "kvroute_backend_decoding_requests",
                "Requests streaming output from the backend.",
                &["backend"],
            )?,
            engine: ENGINE_GAUGES
                .iter()
                .map(|(name, help, pick)| {
                    let g = GaugeVec::new(Opts::new(*name, *help), &["backend"])?;
                    Ok((registered(&r, g)?, *pick))
                })
                .collect::<prometheus::Result<Vec<_>>>()?,
            // 1 us .. ~0.5 s.
            decision_time: registered(
                &r,
                prometheus::Histogram::with_opts(
                    HistogramOpts::new(
                        "kvroute_routing_decision_seconds",
                        "Time to place a routed request: index lookup, snapshot, policy.",
                    )
                    .buckets(exponential_buckets(1e-6, 2.0, 20)?),
                )?,
            )?,
            queue_depth: registered(
                &r,
                IntGauge::new("kvroute_queue_depth", "Requests waiting in the router queue.")?,
            )?,
            queue_wait: histogram(
                &r,
                "kvroute_queue_wait_seconds",
                "Time requests spent in the router queue, by outcome (admitted, shed).",
                &["outcome"],
            )?,
            shed: counter(
                &r,
                "kvroute_shed_requests_total",
                "Requests answered 503 because the fleet was saturated, by reason (queue_full, queue_timeout).",
                &["reason"],
            )?,
            telemetry_age: registered(
                &r,
                GaugeVec::new(
                    Opts::new(
                        "kvroute_backend_telemetry_age_seconds",
                        "Age of the backend's latest successful engine scrape.",
                    ),
                    &["backend"],
                )?,
            )?,
            config_reloads: counter(
                &r,
                "kvroute_config_reloads_total",
                "Config reloads (SIGHUP), by result (success, failure).",
                &["result"],
            )?,
            config_last_reload: registered(
                &r,
                prometheus::Gauge::new(
                    "kvroute_config_last_reload_success_timestamp_seconds",
                    "Unix time of the last config load that took effect (start or reload).",
                )?,
            )?,
            config_pending_upgrade: registered(
                &r,
                IntGauge::new(
                    "kvroute_config_pending_upgrade",
                    "1 if the config file changes settings that only a binary upgrade applies \
                     (listeners, health checks, Pingora server keys).",
                )?,
            )?,
            draining: registered(
                &r,
                IntGauge::new(
                    "kvroute_draining",
                    "1 once a graceful upgrade or shutdown has begun: finishing in-flight work.",
                )?,
            )?,
            ejected: gauge(
                &r,
                "kvroute_backend_ejected",
                "1 while passive outlier detection keeps the backend out of placement.",
                &["backend"],
            )?,
            ejections: counter(
                &r,
                "kvroute_outlier_ejections_total",
                "Times a backend was ejected for failing requests in a row.",
                &["backend"],
            )?,
            retries: counter(
                &r,
                "kvroute_retries_total",
                "Retry decisions after a failed attempt (retried, budget_exhausted, attempts_exhausted).",
                &["outcome"],
            )?,
            client_timeouts: counter(
                &r,
                "kvroute_client_timeouts_total",
                "Client connections or requests cut for being too slow, by phase (header, body).",
                &["phase"],
            )?,
            connections: registered(
                &r,
                IntGauge::new("kvroute_client_connections", "Client connections open.")?,
            )?,
            connections_refused: registered(
                &r,
                IntCounter::new(
                    "kvroute_client_connections_refused_total",
                    "Client connections closed on accept because limits.max_connections were open.",
                )?,
            )?,
            cut_streams: counter(
                &r,
                "kvroute_cut_streams_total",
                "Responses cut after they started (the backend failed mid-stream), by backend.",
                &["backend"],
            )?,
            rate_limited: counter(
                &r,
                "kvroute_rate_limited_requests_total",
                "Requests answered 429 because their API key was over its rate limit, by tenant.",
                &["tenant"],
            )?,
            registry: r,
        })
    }

    /// Drop the per-backend gauges of a backend a reload removed (counters keep its history).
    pub fn forget_backend(&self, name: &str) {
        for g in [
            &self.inflight,
            &self.healthy,
            &self.queued_prefill,
            &self.decoding,
        ] {
            let _ = g.remove_label_values(&[name]);
        }
        let _ = self.prefill_rate.remove_label_values(&[name]);
        let _ = self.telemetry_age.remove_label_values(&[name]);
        for (g, _) in &self.engine {
            let _ = g.remove_label_values(&[name]);
        }
    }

    /// Prometheus text exposition, with per-backend gauges refreshed from the fleet.
    pub fn render(&self, fleet: &Fleet, queue_depth: usize) -> Vec<u8> {
        self.queue_depth.set(queue_depth as i64);
        let now = std::time::Instant::now();
        for (i, b) in fleet.backends().iter().enumerate() {
            self.ejected
                .with_label_values(&[&b.name])
                .set(b.ejected(now) as i64);
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
            self.prefill_rate
                .with_label_values(&[&b.name])
                .set(b.effective_prefill_rate());
        }
        for b in fleet.backends() {
            let fresh = b.telemetry().fresh(fleet.stale_after());
            for (g, pick) in &self.engine {
                match fresh.as_ref().and_then(pick) {
                    Some(v) => g.with_label_values(&[&b.name]).set(v),
                    // Stale or not exported: no sample rather than a misleading one.
                    None => {
                        let _ = g.remove_label_values(&[&b.name]);
                    }
                }
            }
            if let Some(age) = b.telemetry().age() {
                self.telemetry_age
                    .with_label_values(&[&b.name])
                    .set(age.as_secs_f64());
            }
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
