//! The fleet's gauges: per backend, what kvroute's accounting and the engine's telemetry say.
//! They are set from the fleet in force when the admin listener renders, not on the request
//! path.

use prometheus::{GaugeVec, IntGauge, IntGaugeVec, Registry};
use std::time::Instant;

use super::roster::Fleet;
use super::telemetry::EngineStats;
use crate::metrics::{gauge_vec, int_gauge, int_gauge_vec};

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

pub struct FleetMetrics {
    inflight: IntGaugeVec,
    healthy: IntGaugeVec,
    ejected: IntGaugeVec,
    queued_prefill: IntGaugeVec,
    decoding: IntGaugeVec,
    prefill_rate: GaugeVec,
    decode_step: GaugeVec,
    kv_capacity: IntGaugeVec,
    telemetry_age: GaugeVec,
    /// Engine telemetry, one gauge family per scraped quantity.
    engine: Vec<(GaugeVec, Pick)>,
    index_blocks: IntGauge,
    index_bytes: IntGauge,
    read_ahead: IntGauge,
}

impl FleetMetrics {
    pub fn register(r: &Registry) -> prometheus::Result<FleetMetrics> {
        Ok(FleetMetrics {
            inflight: int_gauge_vec(
                r,
                "kvroute_backend_inflight_requests",
                "Requests dispatched to the backend and not yet finished.",
                &["backend"],
            )?,
            healthy: int_gauge_vec(
                r,
                "kvroute_backend_healthy",
                "1 if the backend passes active health checks, else 0.",
                &["backend"],
            )?,
            ejected: int_gauge_vec(
                r,
                "kvroute_backend_ejected",
                "1 while passive outlier detection keeps the backend out of placement.",
                &["backend"],
            )?,
            queued_prefill: int_gauge_vec(
                r,
                "kvroute_backend_queued_prefill_tokens",
                "Estimated prompt tokens dispatched to the backend and not yet answered.",
                &["backend"],
            )?,
            decoding: int_gauge_vec(
                r,
                "kvroute_backend_decoding_requests",
                "Requests streaming output from the backend.",
                &["backend"],
            )?,
            prefill_rate: gauge_vec(
                r,
                "kvroute_backend_prefill_tokens_per_second",
                "Prefill rate kv_aware uses: learned from the engine's counters, else configured.",
                &["backend"],
            )?,
            decode_step: gauge_vec(
                r,
                "kvroute_backend_decode_step_seconds",
                "Seconds an engine step takes each decoding stream, from the engine's inter-token \
                 latency (vLLM, SGLang) or predicted-token seconds (llama.cpp); absent until known.",
                &["backend"],
            )?,
            kv_capacity: int_gauge_vec(
                r,
                "kvroute_backend_kv_capacity_tokens",
                "KV cache size the prefix index assumes: configured, else the engine's (reported or \
                 shown by tokens in use / usage), else the default.",
                &["backend"],
            )?,
            telemetry_age: gauge_vec(
                r,
                "kvroute_backend_telemetry_age_seconds",
                "Age of the backend's latest successful engine scrape.",
                &["backend"],
            )?,
            engine: ENGINE_GAUGES
                .iter()
                .map(|(name, help, pick)| Ok((gauge_vec(r, name, help, &["backend"])?, *pick)))
                .collect::<prometheus::Result<Vec<_>>>()?,
            index_blocks: int_gauge(
                r,
                "kvroute_index_blocks",
                "(backend, block) pairs tracked by the prefix index.",
            )?,
            index_bytes: int_gauge(
                r,
                "kvroute_index_bytes",
                "Heap bytes held by the prefix index.",
            )?,
            read_ahead: int_gauge(
                r,
                "kvroute_upstream_read_ahead_bytes",
                "Engine response bytes read ahead of their clients and not yet sent on \
                 (limits.read_ahead_memory_bytes bounds them).",
            )?,
        })
    }

    /// Drop the gauges of a backend a reload removed (counters elsewhere keep its history).
    pub fn forget_backend(&self, name: &str) {
        for g in [
            &self.inflight,
            &self.healthy,
            &self.queued_prefill,
            &self.decoding,
            &self.kv_capacity,
        ] {
            let _ = g.remove_label_values(&[name]);
        }
        let _ = self.prefill_rate.remove_label_values(&[name]);
        let _ = self.decode_step.remove_label_values(&[name]);
        let _ = self.telemetry_age.remove_label_values(&[name]);
        for (g, _) in &self.engine {
            let _ = g.remove_label_values(&[name]);
        }
    }

    /// Set every gauge from `fleet`, just before a scrape renders them.
    pub fn refresh(&self, fleet: &Fleet) {
        let now = Instant::now();
        for (i, b) in fleet.backends().iter().enumerate() {
            let name = [b.name.as_str()];
            self.ejected
                .with_label_values(&name)
                .set(b.ejected(now) as i64);
            self.inflight
                .with_label_values(&name)
                .set(b.inflight() as i64);
            self.healthy
                .with_label_values(&name)
                .set(fleet.healthy(i) as i64);
            self.queued_prefill
                .with_label_values(&name)
                .set(b.queued_prefill() as i64);
            self.decoding
                .with_label_values(&name)
                .set(b.decoding() as i64);
            self.prefill_rate
                .with_label_values(&name)
                .set(fleet.prefill_rate(i));
            if let Some(step) = b.decode_step_seconds() {
                self.decode_step.with_label_values(&name).set(step);
            }
            self.kv_capacity
                .with_label_values(&name)
                .set(b.kv_capacity() as i64);
            let fresh = b.telemetry().fresh(fleet.stale_after());
            for (g, pick) in &self.engine {
                match fresh.as_ref().and_then(pick) {
                    Some(v) => g.with_label_values(&name).set(v),
                    // Stale or not exported: no sample rather than a misleading one.
                    None => {
                        let _ = g.remove_label_values(&name);
                    }
                }
            }
            if let Some(age) = b.telemetry().age() {
                self.telemetry_age
                    .with_label_values(&name)
                    .set(age.as_secs_f64());
            }
        }
        let (blocks, bytes) = fleet.index_size();
        self.index_blocks.set(blocks as i64);
        self.index_bytes.set(bytes as i64);
        self.read_ahead.set(super::read_ahead::buffered() as i64);
    }
}
