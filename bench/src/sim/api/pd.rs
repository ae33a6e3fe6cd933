//! The HTTP side of prefill/decode disaggregation (`crate::sim::pd`): what a request's
//! `kv_transfer_params` make of it, the decode side's read before it is served, the prefill
//! side's hold (fixed timing; the engine holds its own) and its release, on D's notice
//! (`POST /kvbench/nixl/notify`) or at the deadline (`spawn_expiry`).
//!
//! Engine mode and fixed timing differ only in where the blocks are: the engine's pool, asked
//! through its task (a lookup, a release, an import with the request), or fixed timing's
//! prefix cache, here under its lock.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use tokio::time::{sleep_until, Instant};

use super::admission::Admitted;
use super::state::ServerState;
use crate::sim::engine::kvcache::BLOCK_TOKENS;
use crate::sim::error::ApiError;
use crate::sim::pd::{self, Held, NotifyGuard, Outcome};
use crate::sim::text::openai::Endpoint;

const REQUEST_ID_HEADER: &str = "x-request-id";

/// What P/D asks of one request, read before admission: a decode request's guard is armed
/// from here on, so that a request refused or abandoned at any later point still frees P's
/// blocks.
#[derive(Default)]
pub struct Incoming {
    pub hold: Option<String>,
    pub pull: Option<NotifyGuard>,
}

/// Reads `kv_transfer_params` (the body's, already parsed) of a chat or completions request,
/// the two endpoints vLLM's P/D proxies speak; others are served plain.
pub fn classify(
    s: &ServerState,
    endpoint: Endpoint,
    params: Option<&Value>,
    headers: &HeaderMap,
) -> Incoming {
    if !matches!(endpoint, Endpoint::Chat | Endpoint::Completions) {
        return Incoming::default();
    }
    let request_id = headers.get(REQUEST_ID_HEADER).and_then(|v| v.to_str().ok());
    let asked = pd::parse(params, request_id);
    Incoming {
        hold: asked.hold,
        pull: asked
            .pull
            .map(|remote| NotifyGuard::new(s.pd.client.clone(), remote)),
    }
}

/// The decode side's read: the prompt's blocks P holds that this server lacks take
/// `base + tokens x bytes / bandwidth` of model time (the request counts as waiting), then P
/// is told and the blocks are this server's, cached for the request (engine mode: imported
/// with it, on the rank that looked them up). If P does not take the notice, the read is
/// counted failed and the prompt recomputed.
pub async fn pull(s: &Arc<ServerState>, a: &mut Admitted, mut guard: NotifyGuard) {
    let remote = guard.remote();
    let m = remote.matching_blocks(&a.blocks);
    if m < remote.block_ids.len().min(a.blocks.len()) {
        log::warn!(
            "pd: request {:?}: only {m} of P's {} blocks are this prompt's",
            remote.request_id,
            remote.block_ids.len()
        );
    }
    let (rank, local) = match &s.engine {
        Some(engine) => {
            let rank = engine.pick_rank(a.dp_rank);
            let local = match m {
                0 => 0,
                _ => engine.lookup(rank, a.blocks[..m].to_vec()).await,
            };
            (Some(rank), local)
        }
        // Admission matched fixed timing's cache already.
        None => (None, (a.usage.cached_tokens / BLOCK_TOKENS) as usize),
    };
    a.dp_rank = rank.or(a.dp_rank);
    let missing = m.saturating_sub(local);
    if missing == 0 {
        // Nothing to read: vLLM sends the notice alone.
        if let Err(e) = guard.notify_read(0).await {
            s.pd.stats.failed_notification();
            log::warn!("pd: notice not taken, P frees its blocks at its timeout: {e}");
        }
        return;
    }
    let tokens = missing as u64 * BLOCK_TOKENS;
    let seconds = s.pd.transfer_seconds(tokens);
    {
        let _waiting = s.stats.start_waiting();
        let wall = Duration::try_from_secs_f64(seconds / s.config.time_scale);
        tokio::time::sleep(wall.unwrap_or(Duration::MAX)).await;
    }
    if let Err(e) = guard.notify_read(missing).await {
        s.pd.stats.failed_transfer();
        log::warn!("pd: KV transfer failed, the prompt is recomputed: {e}");
        return;
    }
    let bytes = tokens.saturating_mul(s.pd.kv_bytes_per_token);
    s.pd.stats
        .transferred(tokens, bytes, s.pd.wire_seconds(tokens));
    if s.engine.is_some() {
        a.kv_transfer.import_blocks = m;
        a.kv_transfer.transferred_blocks = missing;
    } else {
        s.kv().insert(&a.blocks[..m]);
        a.usage.cached_tokens = a.usage.cached_tokens.max(m as u64 * BLOCK_TOKENS);
        let cached = a.usage.cached_tokens;
        s.log().update(a.seq, |e| e.cached_tokens = Some(cached));
    }
}

/// Fixed timing's hold: pins the prompt's leading cached blocks, counts them as in use and
/// holds them under `id`; returns them (the engine holds its own when the request finishes).
pub fn hold_fixed(s: &ServerState, id: String, prompt_blocks: &[u64]) -> Vec<u64> {
    let pinned = s.kv().pin(prompt_blocks);
    let usage = s.stats.start_holding(pinned.len() as u64);
    s.pd.held.hold(id, 0, pinned.clone(), Some(usage));
    pinned
}

/// A held request's blocks go back to the cache, evictable like any released prefix.
fn release(s: &ServerState, held: Held) {
    match &s.engine {
        Some(engine) => engine.release(held.rank, held.hashes),
        None => s.kv().unpin(&held.hashes),
    }
}

/// Frees held blocks nobody read once their deadline passes (vLLM's "Releasing expired KV
/// blocks"). Sleeps until the nearest deadline or a new hold; ends with the server.
pub fn spawn_expiry(s: &Arc<ServerState>) {
    let weak = Arc::downgrade(s);
    tokio::spawn(async move {
        loop {
            let Some(s) = weak.upgrade() else {
                return;
            };
            for (id, held) in s.pd.held.take_expired(Instant::now()) {
                log::info!(
                    "pd: releasing expired KV blocks of request {id:?} ({} blocks), not read \
                     within the abort timeout",
                    held.hashes.len()
                );
                s.pd.stats.expired();
                release(&s, held);
                s.pd.rooms.resolve(&id, Outcome::Expired);
            }
            let (pd, next) = (s.pd.clone(), s.pd.held.next_deadline());
            drop(s);
            match next {
                Some(at) => {
                    tokio::select! {
                        _ = sleep_until(at) => {}
                        _ = pd.held.added() => {}
                    }
                }
                None => pd.held.added().await,
            }
        }
    });
}

/// D's notice (`pd::notify`).
#[derive(serde::Deserialize)]
struct Notice {
    request_id: String,
    engine_id: Option<String>,
    /// Sent for a decode request that ended before its read.
    #[serde(default)]
    aborted: bool,
}

/// `POST /kvbench/nixl/notify`: frees what is held under the notice's request id; 404 when
/// nothing is (or the notice is for another engine).
pub async fn notify(State(s): State<Arc<ServerState>>, body: Bytes) -> Response {
    let notice: Notice = match serde_json::from_slice(&body) {
        Ok(n) => n,
        Err(e) => return ApiError::bad_request(format!("invalid notice: {e}")).into_response(),
    };
    let ours = notice
        .engine_id
        .as_deref()
        .is_none_or(|e| e == s.pd.engine_id);
    let holds = if ours {
        s.pd.held.take(&notice.request_id)
    } else {
        Vec::new()
    };
    if holds.is_empty() {
        let msg = format!(
            "kvbench-sim: engine {} holds no KV blocks for request {:?}",
            s.pd.engine_id, notice.request_id
        );
        return ApiError::new(StatusCode::NOT_FOUND, msg).into_response();
    }
    let blocks: usize = holds.iter().map(|h| h.hashes.len()).sum();
    s.pd.stats.released(holds.len());
    let requests = holds.len();
    for held in holds {
        release(&s, held);
    }
    let outcome = match notice.aborted {
        true => Outcome::Aborted,
        false => Outcome::Read,
    };
    s.pd.rooms.resolve(&notice.request_id, outcome);
    Json(json!({"released_requests": requests, "released_blocks": blocks})).into_response()
}
