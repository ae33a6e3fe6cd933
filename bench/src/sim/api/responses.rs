//! OpenAI's Responses API routes. `POST /v1/responses` is served as chat (`inference`, with
//! the body converted by `text::responses`); the others read the server's store of finished
//! answers (`response_store`). Only finished answers are stored, so the sim never has a
//! response in progress to cancel: `cancel` answers 400 for a stored response and 404 for any
//! other id, a streamed answer still running included.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, Uri};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::inference;
use super::state::ServerState;
use crate::sim::error::ApiError;
use crate::sim::text::openai::Endpoint;
use crate::sim::text::responses::not_found;

pub async fn create(
    State(s): State<Arc<ServerState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    inference::handle(s, Endpoint::Responses, &headers, body).await
}

pub async fn get(State(s): State<Arc<ServerState>>, Path(id): Path<String>) -> Response {
    match s.responses.get(&id) {
        Some(stored) => Json(stored.response).into_response(),
        None => not_found(&id).into_response(),
    }
}

pub async fn delete(State(s): State<Arc<ServerState>>, Path(id): Path<String>) -> Response {
    if s.responses.remove(&id) {
        Json(json!({"id": id, "object": "response", "deleted": true})).into_response()
    } else {
        not_found(&id).into_response()
    }
}

pub async fn cancel(State(s): State<Arc<ServerState>>, Path(id): Path<String>) -> Response {
    match s.responses.get(&id) {
        Some(stored) => {
            let status = stored.response["status"].as_str().unwrap_or("completed");
            ApiError::bad_request(format!(
                "Cannot cancel a response that is not in progress (response '{id}' is {status})."
            ))
            .into_response()
        }
        None => not_found(&id).into_response(),
    }
}

/// The conversation's input items up to this response, oldest first (`?order=desc` for newest
/// first), all on one page.
pub async fn input_items(
    State(s): State<Arc<ServerState>>,
    Path(id): Path<String>,
    uri: Uri,
) -> Response {
    let Some(stored) = s.responses.get(&id) else {
        return not_found(&id).into_response();
    };
    let mut data: Vec<Value> = stored.thread.input_items().into_iter().cloned().collect();
    let desc = uri
        .query()
        .is_some_and(|q| q.split('&').any(|kv| kv == "order=desc"));
    if desc {
        data.reverse();
    }
    let first_id = data.first().map(|i| i["id"].clone());
    let last_id = data.last().map(|i| i["id"].clone());
    Json(json!({
        "object": "list",
        "data": data,
        "first_id": first_id,
        "last_id": last_id,
        "has_more": false,
    }))
    .into_response()
}
