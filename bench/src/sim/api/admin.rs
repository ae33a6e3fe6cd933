//! The non-inference endpoints: health, model list, metrics, llama.cpp's `/props` and
//! `/slots`, and test introspection.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use super::metrics;
use super::state::ServerState;
use crate::sim::config::Engine;
use crate::sim::error::ApiError;
use crate::sim::faults::FaultUpdate;

pub async fn health(State(s): State<Arc<ServerState>>) -> Response {
    if s.in_slow_start() || s.faults().unhealthy {
        (StatusCode::SERVICE_UNAVAILABLE, "unavailable").into_response()
    } else {
        (StatusCode::OK, "ok").into_response()
    }
}

pub async fn models(State(s): State<Arc<ServerState>>) -> Json<serde_json::Value> {
    let mut data = vec![json!({
        "id": s.config.model,
        "object": "model",
        "created": 0,
        "owned_by": "kvbench",
        "root": s.config.model,
        "parent": null,
        "max_model_len": 131072,
    })];
    // As vLLM lists LoRA adapters: each with its base model as `parent`.
    for a in &s.config.lora.adapters {
        data.push(json!({
            "id": a,
            "object": "model",
            "created": 0,
            "owned_by": "kvbench",
            "root": a,
            "parent": s.config.model,
            "max_model_len": 131072,
        }));
    }
    Json(json!({"object": "list", "data": data}))
}

pub async fn metrics(State(s): State<Arc<ServerState>>) -> Response {
    let cfg = &s.config;
    let blocks = cfg.num_gpu_blocks();
    // A scrape starts llama.cpp's next interval (its throughput gauges).
    let snapshot = s.stats.scrape(blocks);
    let mut text = metrics::render(cfg.engine, &cfg.model, &snapshot, blocks);
    // vLLM's NixlConnector metrics, SGLang's disaggregation gauges and counters; llama.cpp
    // has no P/D.
    match cfg.engine {
        Engine::Vllm => text.push_str(&metrics::render_pd(&cfg.model, &s.pd.stats.snapshot())),
        Engine::Sglang => {
            let held = s.pd.held.counts().0;
            let snapshot = s.pd.stats.snapshot();
            text.push_str(&metrics::render_sglang_pd(&cfg.model, held, &snapshot));
        }
        Engine::Llamacpp => {}
    }
    if !cfg.lora.adapters.is_empty() {
        if let Ok(lora) = s.lora.slots.lock() {
            text.push_str(&metrics::render_lora(&cfg.lora, &lora));
        }
    }
    if let Some(counters) = s
        .engine
        .as_ref()
        .map(|e| e.kv_event_counters())
        .filter(|c| !c.is_empty())
    {
        text.push_str(&metrics::render_kv_events(&counters));
    }
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

/// The slots of a llama.cpp server: `--parallel` per engine, and the context of each.
fn slots_and_ctx(s: &ServerState) -> (usize, u64) {
    let p = &s.config.profile;
    (p.max_num_seqs * s.config.dp_size.max(1), p.slot_ctx())
}

/// llama.cpp's `GET /props`, shaped as llama-server 0.6.0 answers it
/// (`tests/fixtures/scrapes/llamacpp-0.6.0.props.json`): what kvroute reads is `total_slots`
/// and `default_generation_settings.n_ctx`, one slot's context. Served only when the server
/// speaks llama.cpp (`server::router`).
pub async fn props(State(s): State<Arc<ServerState>>) -> Response {
    let (total_slots, n_ctx) = slots_and_ctx(&s);
    let model = &s.config.model;
    Json(json!({
        "default_generation_settings": {
            "params": {
                "n_predict": -1,
                "max_tokens": -1,
                "temperature": 0.800000011920929,
                "top_k": 40,
                "top_p": 0.949999988079071,
                "stream": false,
                "speculative.types": "none",
                "lora": [],
            },
            "n_ctx": n_ctx,
        },
        "total_slots": total_slots,
        "model_alias": model,
        "model_path": format!("{model}.gguf"),
        "modalities": {"vision": false, "video": false, "audio": false},
        "endpoint_slots": true,
        "endpoint_props": false,
        "endpoint_metrics": true,
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "build_info": "b0-kvbench-sim",
        "is_sleeping": false,
    }))
    .into_response()
}

/// llama.cpp's `GET /slots`: one entry per slot, the first `requests_processing` of them
/// busy (the simulator does not pin requests to slots).
pub async fn slots(State(s): State<Arc<ServerState>>) -> Response {
    let (total, n_ctx) = slots_and_ctx(&s);
    let busy = s.stats.snapshot(s.config.num_gpu_blocks()).running;
    let slots: Vec<serde_json::Value> = (0..total)
        .map(|id| {
            json!({
                "id": id,
                "n_ctx": n_ctx,
                "speculative": false,
                "is_processing": (id as u64) < busy,
            })
        })
        .collect();
    Json(slots).into_response()
}

pub async fn requests(State(s): State<Arc<ServerState>>) -> Response {
    let entries = s.log().entries();
    Json(entries).into_response()
}

pub async fn get_faults(State(s): State<Arc<ServerState>>) -> Response {
    Json(s.faults()).into_response()
}

/// Takes raw bytes so a malformed update gets the OpenAI error shape, not axum's text.
pub async fn set_faults(State(s): State<Arc<ServerState>>, body: Bytes) -> Response {
    let update: FaultUpdate = match serde_json::from_slice(&body) {
        Ok(u) => u,
        Err(e) => return ApiError::bad_request(format!("invalid faults: {e}")).into_response(),
    };
    if let Err(e) = update.validate() {
        return e.into_response();
    }
    s.faults.send_modify(|f| f.apply(&update));
    log::info!("server {}: faults now {:?}", s.index, s.faults());
    Json(s.faults()).into_response()
}

pub async fn state(State(s): State<Arc<ServerState>>) -> Response {
    let snapshot = s.stats.snapshot(s.config.num_gpu_blocks());
    let mut v = serde_json::to_value(snapshot).unwrap_or_else(|_| json!({}));
    if let Some(obj) = v.as_object_mut() {
        obj.insert("index".into(), json!(s.index));
        obj.insert("addr".into(), json!(s.addr.to_string()));
        obj.insert("model".into(), json!(s.config.model));
        // The truth behind this server's telemetry, for tests of what a router learns from it.
        let profile = &s.config.profile;
        obj.insert("profile".into(), json!(profile.name.as_str()));
        let rate = (!s.config.fixed_timing).then_some(profile.prefill_rate);
        obj.insert("prefill_tokens_per_s".into(), json!(rate));
        obj.insert("slow_start".into(), json!(s.in_slow_start()));
        obj.insert("faults".into(), json!(s.faults()));
        obj.insert("role".into(), json!(s.config.pd.role));
        obj.insert("pd".into(), s.pd.state());
        match &s.engine {
            Some(engine) => {
                let e = engine.state();
                obj.insert("cached_blocks".into(), json!(e.cached_blocks));
                obj.insert("engine".into(), json!(e));
            }
            None => {
                obj.insert("cached_blocks".into(), json!(s.kv().len()));
            }
        }
    }
    Json(v).into_response()
}
