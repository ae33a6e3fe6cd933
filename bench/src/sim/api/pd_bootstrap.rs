//! The HTTP side of SGLang's bootstrap protocol (`crate::sim::pd::bootstrap`): which leg a
//! request is, P's long-poll endpoint, D's wait and read before it is served, P's answer held
//! back until its room's outcome, and the errors SGLang gives.
//!
//! P's answer follows SGLang's prefill server (`python/sglang/srt/disaggregation/prefill.py`
//! @ 000c2b942308ea5502978be73542016c230dba02): the request runs with `max_new_tokens = 1`
//! (`_process_req`), its one token is kept (`req.output_ids.append(next_token_id)`), and it
//! is answered only from the inflight queue once the transfer succeeded, `finish_reason`
//! length; a failed bootstrap or transfer aborts it with 500 ("Prefill bootstrap failed for
//! request ...", "Prefill transfer failed for request ..."). So the router's P leg gets an
//! ordinary answer with one token and `usage.prompt_tokens_details.cached_tokens` (what P
//! found cached), the body a router reads only for logprobs. D's failure is SGLang's
//! `decode.py` abort ("Decode transfer failed for request ...", 500): a whole answer is that
//! error; a streamed one, whose headers SGLang has sent already, is one `data: {"error":
//! ...}` event and `data: [DONE]`, as SGLang's OpenAI layer and sgl-router stream errors.

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{Path, RawQuery, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use tokio::time::{Duration, Instant};

use super::admission::Admitted;
use super::pd::pull;
use super::sse::sse_response;
use super::state::ServerState;
use crate::sim::error::ApiError;
use crate::sim::pd::bootstrap::{self, room_key, Bootstrap, MAX_POLL, NO_ROOM};
use crate::sim::pd::{block_id, NotifyGuard, Outcome, Remote, Role, RoomWaiter};
use crate::sim::text::openai::Endpoint;

/// The bootstrap fields of a body, as values (read with the body's other early fields).
#[derive(Default, serde::Deserialize)]
pub struct Fields {
    pub bootstrap_host: Option<Value>,
    pub bootstrap_port: Option<Value>,
    pub bootstrap_room: Option<Value>,
}

/// The side a request plays under SGLang's protocol.
pub enum Leg {
    Prefill(Bootstrap),
    Decode(Bootstrap),
}

impl Leg {
    pub fn room(&self) -> u64 {
        match self {
            Leg::Prefill(b) | Leg::Decode(b) => b.room,
        }
    }
}

/// Which leg a chat or completions request is on a P or D server speaking SGLang's protocol
/// (None: served plain, as a `both` server or vLLM's protocol serves everything). Err is the
/// 400: no room (SGLang refuses it), a batch, fields that are not what SGLang's routers send.
/// `fields` is None when the body is not JSON: admission says why.
pub fn classify(
    s: &ServerState,
    endpoint: Endpoint,
    fields: Option<&Fields>,
) -> Result<Option<Leg>, ApiError> {
    let Some(role) = s.pd.config.sglang_role() else {
        return Ok(None);
    };
    let (true, Some(f)) = (
        matches!(endpoint, Endpoint::Chat | Endpoint::Completions),
        fields,
    ) else {
        return Ok(None);
    };
    let parsed = bootstrap::parse(
        f.bootstrap_host.as_ref(),
        f.bootstrap_port.as_ref(),
        f.bootstrap_room.as_ref(),
    );
    match parsed.map_err(ApiError::bad_request)? {
        None => Err(ApiError::bad_request(NO_ROOM)),
        Some(b) if role == Role::Decode => {
            bootstrap::prefill_addr(&b).map_err(ApiError::bad_request)?;
            Ok(Some(Leg::Decode(b)))
        }
        Some(b) => Ok(Some(Leg::Prefill(b))),
    }
}

/// SGLang's data-parallel controller sends a room to rank `room % dp_size`
/// (`follow_bootstrap_room_scheduler`) unless the request names its rank.
pub fn rank_of(s: &ServerState, leg: &Leg) -> Option<usize> {
    let ranks = s.config.dp_size as u64;
    (ranks > 1).then(|| (leg.room() % ranks) as usize)
}

/// P's leg, before it is served: one token, held under its room; returns the wait for the
/// room's outcome, registered before the hold exists.
pub fn start_prefill(s: &ServerState, a: &mut Admitted, b: &Bootstrap) -> RoomWaiter {
    let key = room_key(b.room);
    a.req.max_tokens = 1;
    a.usage.completion_tokens = 1;
    a.kv_transfer.hold = Some(key.clone());
    s.pd.rooms.expect(&key)
}

/// P's answer, held back until D has read the room (as SGLang answers from its inflight
/// queue): the answer as served, or SGLang's 500 when nobody fetched it in time or D's leg
/// was aborted mid-read. A streamed answer is run to its end first (its token comes when
/// due). P's leg cut meanwhile drops this; the room stays held for D.
pub async fn finish_prefill(
    s: &ServerState,
    res: Response,
    mut waiter: RoomWaiter,
    b: &Bootstrap,
    rid: &str,
    stream: bool,
) -> Response {
    if !res.status().is_success() {
        return res;
    }
    let (parts, body) = res.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, usize::MAX).await else {
        let e = ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "kvbench-sim: the prefill answer broke off",
        );
        return failure(stream, e);
    };
    let key = room_key(b.room);
    let outcome = match waiter.try_outcome() {
        Some(o) => Some(o),
        // Never held (the engine dropped it): nothing to wait for. Held or taken just now:
        // the outcome comes.
        None if s.pd.held.peek(&key).is_none() => waiter.try_outcome(),
        None => waiter.outcome().await,
    };
    let room = b.room;
    let e500 = |what: &str, why: &str| {
        let msg = format!(
            "Prefill {what} failed for request rank=0 req.rid='{rid}' \
             req.bootstrap_room={room} with exception KVTransferError(bootstrap_room={room}): \
             {why}"
        );
        failure(
            stream,
            ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, msg),
        )
    };
    match outcome {
        Some(Outcome::Expired) => e500(
            "bootstrap",
            "no decode server fetched the KV within the bootstrap timeout",
        ),
        Some(Outcome::Aborted) => e500("transfer", "the decode request was aborted"),
        Some(Outcome::Read) | None => Response::from_parts(parts, Body::from(bytes)),
    }
}

/// D's leg, before it is served: waits for P to hold the room (`--pd-waiting-timeout-s`),
/// then reads what it lacks as vLLM's decode side does, P told. Err is SGLang's 500.
pub async fn decode(
    s: &Arc<ServerState>,
    a: &mut Admitted,
    b: &Bootstrap,
    rid: &str,
) -> Result<(), ApiError> {
    let addr = bootstrap::prefill_addr(b).map_err(ApiError::bad_request)?;
    let started = Instant::now();
    let kv = {
        let _waiting = s.stats.start_waiting();
        let _prealloc = s.pd.stats.waiting_decode();
        let deadline = started + s.pd.config.waiting_timeout;
        bootstrap::wait_for_kv(&s.pd.client, addr, b.room, deadline).await
    };
    let room = b.room;
    let Some(kv) = kv else {
        s.pd.stats.timed_out_wait();
        let waited = s.model_seconds_since(started);
        log::warn!(
            "pd: decode request {rid:?} gave up on bootstrap room {room} after {waited:.1}s"
        );
        let msg = format!(
            "Decode transfer failed for request rank=0 decode_req.req.rid='{rid}' \
             decode_req.req.bootstrap_room={room} with exception \
             KVTransferError(bootstrap_room={room}): Request {room} timed out after \
             {waited:.1}s in KVPoll.WaitingForInput"
        );
        return Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, msg));
    };
    let remote = Remote {
        engine_id: kv.engine_id,
        request_id: room_key(room),
        host: addr.ip().to_string(),
        port: addr.port(),
        block_ids: kv.block_ids,
    };
    let _reading = s.pd.stats.transferring_decode();
    pull(s, a, NotifyGuard::new(s.pd.client.clone(), remote)).await;
    Ok(())
}

/// An error as SGLang gives it: the error itself, or in a stream one error event and
/// `[DONE]`.
pub fn failure(stream: bool, e: ApiError) -> Response {
    if !stream {
        return e.into_response();
    }
    let event = Bytes::from(format!("data: {}\n\n", e.body()));
    let done = Bytes::from_static(b"data: [DONE]\n\n");
    sse_response(futures_util::stream::iter([Ok(event), Ok(done)]))
}

/// `GET /kvbench/bootstrap/{room}?wait_ms=N`: the room's blocks once this server holds them,
/// waiting up to N ms (at most `MAX_POLL`) for them; 404 if they are not held by then.
pub async fn bootstrap(
    State(s): State<Arc<ServerState>>,
    Path(room): Path<u64>,
    RawQuery(query): RawQuery,
) -> Response {
    let wait = query
        .as_deref()
        .and_then(|q| q.split('&').find_map(|kv| kv.strip_prefix("wait_ms=")))
        .and_then(|n| n.parse().ok())
        .map_or(MAX_POLL, Duration::from_millis)
        .min(MAX_POLL);
    let deadline = Instant::now() + wait;
    let key = room_key(room);
    // Subscribed before looking, so that a hold added in between is seen.
    let mut changes = s.pd.held.subscribe();
    loop {
        if let Some(hashes) = s.pd.held.peek(&key) {
            let ids: Vec<u64> = hashes.into_iter().map(block_id).collect();
            return Json(json!({
                "bootstrap_room": room,
                "engine_id": s.pd.engine_id,
                "block_ids": ids,
            }))
            .into_response();
        }
        if !matches!(
            tokio::time::timeout_at(deadline, changes.changed()).await,
            Ok(Ok(()))
        ) {
            let msg = format!(
                "kvbench-sim: engine {} holds no KV for bootstrap room {room}",
                s.pd.engine_id
            );
            return ApiError::not_found(msg).into_response();
        }
    }
}
