//! Anthropic's Messages API routes. `POST /v1/messages` is served as chat (`inference`, with
//! the body converted by `text::anthropic`); `count_tokens` counts the same prompt without
//! generating. Both answer errors in Anthropic's shape: the shared path's OpenAI errors are
//! rewritten on the way out, mapping an overloaded or starting server to Anthropic's 529.

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::admission::tokenize;
use super::inference::{self, body_hash_hex, BODY_HASH_HEADER, BODY_LEN_HEADER};
use super::reqlog::Entry;
use super::state::{header_value, ServerState};
use crate::sim::error::ApiError;
use crate::sim::text::anthropic;
use crate::sim::text::openai::Endpoint;
use crate::sim::text::prompt::count_tokens as tokens_of;

pub const COUNT_TOKENS_PATH: &str = "/v1/messages/count_tokens";

/// Error bodies are small; anything larger is not one of the sim's errors.
const ERROR_BODY_LIMIT: usize = 1 << 20;

pub async fn create(
    State(s): State<Arc<ServerState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    anthropic_errors(inference::handle(s, Endpoint::Messages, &headers, body).await).await
}

/// `{"input_tokens": N}`: the prompt tokens of the body's conversation, counted as a
/// generation request would count them. Logged like a generation request, but no fault but
/// slow start applies and no KV is used.
pub async fn count_tokens(
    State(s): State<Arc<ServerState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let hash = body_hash_hex(&body);
    let session = headers
        .get("x-session-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let entry = Entry::arrival(COUNT_TOKENS_PATH, session, body.len(), hash.clone());
    let seq = s.log().push(entry);
    let res = match count(&s, seq, &body).await {
        Ok(n) => Json(json!({"input_tokens": n})).into_response(),
        Err(e) => anthropic_errors(e.into_response()).await,
    };
    let status = res.status().as_u16();
    s.log().update(seq, |e| e.status = Some(status));
    let mut res = res;
    let headers = res.headers_mut();
    headers.insert(BODY_HASH_HEADER, header_value(&hash));
    headers.insert(BODY_LEN_HEADER, HeaderValue::from(body.len()));
    res
}

async fn count(s: &Arc<ServerState>, seq: u64, body: &[u8]) -> Result<u64, ApiError> {
    if s.in_slow_start() {
        return Err(ApiError::unavailable("kvbench-sim: server is starting"));
    }
    let mut req = anthropic::parse(body, false)?;
    if !s.config.tokenizer.is_stand_in() {
        req.prompt = tokenize(&s.config.tokenizer, std::mem::take(&mut req.prompt)).await?;
    }
    let n = tokens_of(req.prompt.len());
    s.log().update(seq, |e| {
        e.model = Some(req.model.clone());
        e.prompt_tokens = Some(n);
    });
    Ok(n)
}

/// Anthropic's error type and status for the sim's error status.
fn anthropic_error(status: StatusCode) -> (StatusCode, &'static str) {
    match status.as_u16() {
        400 => (status, "invalid_request_error"),
        401 => (status, "authentication_error"),
        403 => (status, "permission_error"),
        404 => (status, "not_found_error"),
        413 => (status, "request_too_large"),
        // A starting, stopped or overloaded server: Anthropic's "overloaded".
        429 | 503 => (overloaded(), "overloaded_error"),
        _ => (status, "api_error"),
    }
}

fn overloaded() -> StatusCode {
    StatusCode::from_u16(529).unwrap_or(StatusCode::SERVICE_UNAVAILABLE)
}

/// Rewrites an error answer (OpenAI's shape) into Anthropic's, keeping its headers; any other
/// answer passes untouched (a stream is never read here).
pub async fn anthropic_errors(res: Response) -> Response {
    if !res.status().is_client_error() && !res.status().is_server_error() {
        return res;
    }
    let (mut parts, body) = res.into_parts();
    let bytes = axum::body::to_bytes(body, ERROR_BODY_LIMIT)
        .await
        .unwrap_or_default();
    let message = serde_json::from_slice::<Value>(&bytes)
        .ok()
        .and_then(|v| v["error"]["message"].as_str().map(str::to_owned))
        .unwrap_or_else(|| String::from_utf8_lossy(&bytes).into_owned());
    let (status, kind) = anthropic_error(parts.status);
    let body = json!({"type": "error", "error": {"type": kind, "message": message}});
    parts.status = status;
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    Response::from_parts(parts, Body::from(body.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn rewritten(e: ApiError) -> (u16, Value) {
        let res = anthropic_errors(e.into_response()).await;
        let status = res.status().as_u16();
        let bytes = axum::body::to_bytes(res.into_body(), 1 << 16)
            .await
            .unwrap();
        (status, serde_json::from_slice(&bytes).unwrap())
    }

    #[tokio::test]
    async fn errors_take_anthropics_shape_and_status() {
        let (status, v) = rewritten(ApiError::bad_request("max_tokens: Field required")).await;
        assert_eq!(status, 400);
        assert_eq!(
            v,
            json!({"type": "error", "error": {"type": "invalid_request_error",
                                              "message": "max_tokens: Field required"}})
        );
        let (status, v) = rewritten(ApiError::unavailable("starting")).await;
        assert_eq!(
            (status, v["error"]["type"].as_str()),
            (529, Some("overloaded_error"))
        );
        let failed = ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "injected");
        let (status, v) = rewritten(failed).await;
        assert_eq!(
            (status, v["error"]["type"].as_str()),
            (500, Some("api_error"))
        );
        let (status, _) = rewritten(ApiError::not_found("x")).await;
        assert_eq!(status, 404);
    }
}
