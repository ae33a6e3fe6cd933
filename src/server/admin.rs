//! The admin listener: `GET /metrics`, `/healthz` (process alive), `/readyz` (can serve traffic).
//! It is a separate Pingora service on its own address, never the client port.

use async_trait::async_trait;
use http::{Response, StatusCode};
use pingora::apps::http_app::ServeHttp;
use pingora::protocols::http::ServerSession;
use std::sync::Arc;

use prometheus::{Encoder, TextEncoder};

use crate::config::Config;
use crate::edge::EdgeState;
use crate::fleet::Fleet;
use crate::fleet::{Current, FleetMetrics};

pub(super) struct AdminApp {
    /// Every `kvroute_*` family, registered by the component that updates it.
    pub registry: prometheus::Registry,
    pub current: Arc<Current>,
    pub edge: Arc<EdgeState>,
    pub fleet_metrics: Arc<FleetMetrics>,
}

fn reply(status: StatusCode, content_type: &str, body: Vec<u8>) -> Response<Vec<u8>> {
    Response::builder()
        .status(status)
        .header("content-type", content_type)
        .header("content-length", body.len())
        .body(body)
        .unwrap_or_else(|_| Response::new(Vec::new()))
}

impl AdminApp {
    /// Prometheus text exposition, with the gauges that are read from the fleet and the queue
    /// set first.
    fn render(&self, fleet: &Fleet, cfg: &Config) -> Vec<u8> {
        self.fleet_metrics.refresh(fleet);
        self.edge.queue.publish_depth();
        self.edge.publish_budgets(cfg.access.as_ref());
        self.edge
            .publish_attained(&cfg.tenants, cfg.access.as_ref());
        let mut out = Vec::new();
        if let Err(e) = TextEncoder::new().encode(&self.registry.gather(), &mut out) {
            log::error!("metrics encoding failed: {e}");
        }
        out
    }
}

/// What kvroute believes of each backend, for an operator: health, load, and the cost model's
/// inputs with where each came from.
fn backends_view(fleet: &Fleet, cfg: &Config) -> Vec<serde_json::Value> {
    let now = std::time::Instant::now();
    let stale = fleet.stale_after();
    let list: Vec<serde_json::Value> = fleet
        .backends()
        .iter()
        .enumerate()
        .map(|(i, b)| {
            let engine = b.telemetry().fresh(stale);
            serde_json::json!({
                "backend": b.name,
                "healthy": fleet.healthy(i),
                "ejected": b.ejected(now),
                "ejection_left_seconds": b.ejection_left(now).map(|d| d.as_secs_f64()),
                "weight": b.weight,
                "role": cfg.backends.get(i).map_or("both", |c| c.role.as_str()),
                "inflight_requests": b.inflight(),
                "queued_prefill_tokens": b.queued_prefill(),
                "decoding_requests": b.decoding(),
                "prefill_tokens_per_second": {
                    "in_use": fleet.prefill_rate(i),
                    "configured": b.prefill_rate_configured,
                    "learned": b.learned_prefill().map(|e| e.rate),
                    "learned_floor": b.learned_prefill().map(|e| e.floor),
                    "learning": cfg.routing.learn_prefill_rate,
                    "spread": fleet.prefill_spread(i),
                },
                "decode_step_seconds": b.decode_step_seconds(),
                "slots": b.slots(),
                "slot_wait_seconds": b.slot_wait_s(now, b.inflight()),
                "kv_capacity_tokens": {
                    "in_use": b.kv_capacity(),
                    "configured": b.kv_capacity_configured,
                    "learned": b.learned_kv_capacity(),
                },
                "engine": engine.map(|e| serde_json::json!({
                    "running_requests": e.running,
                    "waiting_requests": e.waiting,
                    "kv_cache_usage_ratio": e.kv_usage,
                })),
                "telemetry_age_seconds": b.telemetry().age().map(|a| a.as_secs_f64()),
                "prefix_index_blocks": fleet.index_blocks_of(i),
                "kv_events": cfg.backends.get(i).and_then(|c| c.kv_events.as_ref()).map(|k| {
                    let ranks = fleet.exact_state(i);
                    // Several data-parallel ranks: the state of the one known least, their
                    // blocks together, and each rank's own.
                    let state = ranks.iter().map(|r| r.0).min_by_key(|s| *s as u8);
                    let mut v = serde_json::json!({
                        "endpoint": k.endpoint,
                        "state": state.unwrap_or(crate::placement::SyncState::Off).as_str(),
                        "blocks": ranks.iter().map(|r| r.1).sum::<usize>(),
                    });
                    if ranks.len() > 1 {
                        v["ranks"] = ranks
                            .iter()
                            .enumerate()
                            .map(|(r, (s, blocks))| {
                                serde_json::json!({"rank": r, "state": s.as_str(), "blocks": blocks})
                            })
                            .collect();
                    }
                    v
                }),
                "models": b.models().map(|l| l.iter().map(|m| match &m.parent {
                    Some(p) => serde_json::json!({"id": m.id, "parent": p}),
                    None => serde_json::json!({"id": m.id}),
                }).collect::<Vec<_>>()),
                "models_source": if b.configured_models.is_some() { "config" } else if b.models().is_some() { "engine" } else { "unknown: every model" },
                "lora_adapters_running": b.lora_running(),
                "lora_max_adapters": b.max_loras(),
                "lora_adapters_believed_loaded": b.loaded_adapters(),
                "lora_load_seconds_learned": b.learned_adapter_load_s(),
            })
        })
        .collect();
    list
}

/// `GET /backends`: the per-backend list. `GET /debug/backends`: the same with the prefix
/// index's totals.
fn backends_json(fleet: &Fleet, cfg: &Config, debug: bool) -> Vec<u8> {
    let list = backends_view(fleet, cfg);
    let view = if debug {
        let (blocks, bytes) = fleet.index_size();
        let mut v = serde_json::json!({
            "prefix_index": {"blocks": blocks, "bytes": bytes},
            "exact_index": {"bytes": fleet.exact_bytes()},
            // What a first turn's affinity credit is worth now (kv_aware).
            "later_turns_per_conversation": fleet.later_turns(),
            "backends": list,
        });
        if let Some(d) = &cfg.disaggregation {
            // What the split decision prices beside each backend's own figures.
            let bias = fleet.pd_bias();
            let learned = fleet.transfer_bytes_per_s().map(|r| r / 1e9);
            v["disaggregation"] = serde_json::json!({
                "protocol": d.protocol.as_str(),
                "decision": d.decision.as_str(),
                "transfer_gbytes_per_s": learned.unwrap_or(d.transfer_gbytes_per_s),
                "transfer_learned": learned.is_some(),
                "transfer_base_ms": d.transfer_base_ms,
                "decode_stall_weight": d.decode_stall_weight,
                "bias_whole_ms": bias.whole_s * 1000.0,
                "bias_split_ms": bias.split_s * 1000.0,
            });
        }
        v
    } else {
        serde_json::Value::Array(list)
    };
    let mut body = serde_json::to_vec_pretty(&view).unwrap_or_default();
    body.push(b'\n');
    body
}

/// `GET /debug/queue`: the router queue's waiters by priority band and tenant, and every
/// tenant's attained service (weighted tokens, decayed), which orders tenants inside a band.
fn queue_json(edge: &EdgeState) -> Vec<u8> {
    let mut bands: std::collections::BTreeMap<i32, std::collections::BTreeMap<String, usize>> =
        Default::default();
    let waiting = edge.queue.waiting();
    for (priority, tenant, _) in &waiting {
        *bands
            .entry(*priority)
            .or_default()
            .entry(tenant.clone())
            .or_default() += 1;
    }
    let bands: Vec<_> = bands
        .into_iter()
        .rev()
        .map(|(priority, tenants)| serde_json::json!({"priority": priority, "waiting": tenants}))
        .collect();
    let served: serde_json::Map<String, serde_json::Value> = edge
        .queue
        .fair
        .snapshot(std::time::Instant::now())
        .into_iter()
        .map(|(t, v)| (t, serde_json::json!((v * 10.0).round() / 10.0)))
        .collect();
    let view = serde_json::json!({
        "depth": waiting.len(),
        "bands": bands,
        "attained_service": served,
    });
    let mut body = serde_json::to_vec_pretty(&view).unwrap_or_default();
    body.push(b'\n');
    body
}

#[async_trait]
impl ServeHttp for AdminApp {
    async fn response(&self, session: &mut ServerSession) -> Response<Vec<u8>> {
        let path = session.req_header().uri.path().to_owned();
        let generation = self.current.load();
        let fleet = &generation.fleet;
        match path.as_str() {
            "/metrics" => reply(
                StatusCode::OK,
                "text/plain; version=0.0.4",
                self.render(fleet, &generation.config),
            ),
            "/backends" | "/debug/backends" => reply(
                StatusCode::OK,
                "application/json",
                backends_json(fleet, &generation.config, path == "/debug/backends"),
            ),
            "/debug/queue" => reply(StatusCode::OK, "application/json", queue_json(&self.edge)),
            "/healthz" => reply(StatusCode::OK, "text/plain", b"ok\n".to_vec()),
            "/readyz" if self.edge.draining.is_on() => reply(
                StatusCode::SERVICE_UNAVAILABLE,
                "text/plain",
                b"not ready: draining for upgrade or shutdown\n".to_vec(),
            ),
            "/readyz" => {
                let healthy = (0..fleet.backends().len())
                    .filter(|&i| fleet.healthy(i))
                    .count();
                if healthy > 0 {
                    let body = format!(
                        "ready: {healthy}/{} backends healthy\n",
                        fleet.backends().len()
                    );
                    reply(StatusCode::OK, "text/plain", body.into_bytes())
                } else {
                    reply(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "text/plain",
                        b"not ready: no healthy backend\n".to_vec(),
                    )
                }
            }
            _ => reply(StatusCode::NOT_FOUND, "text/plain", b"not found\n".to_vec()),
        }
    }
}
