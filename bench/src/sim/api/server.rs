//! One simulated server: its routes and the task that serves its listener.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, State};
use axum::http::HeaderName;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;

use super::admin;
use super::inference;
use super::pd;
use super::pd_bootstrap;
use super::state::ServerState;
use super::{messages, responses};
use crate::sim::config::{Engine, SimConfig};
use crate::sim::engine::kv_events::kvpublish::Publisher;
use crate::sim::error::ApiError;

/// Tests send 5 MB bodies; long-context prompts run to megabytes.
const BODY_LIMIT: usize = 64 << 20;

pub const SERVER_HEADER: HeaderName = HeaderName::from_static("x-kvbench-server");
pub const ADDR_HEADER: HeaderName = HeaderName::from_static("x-kvbench-addr");

pub fn router(state: Arc<ServerState>) -> Router {
    let mut routes = Router::new();
    // llama.cpp's own endpoints, where kvroute learns its slots and their context; other
    // engines have none (404).
    if state.config.engine == Engine::Llamacpp {
        routes = routes
            .route("/props", get(admin::props))
            .route("/slots", get(admin::slots));
    }
    routes
        .route("/v1/chat/completions", post(inference::chat))
        .route("/v1/completions", post(inference::completions))
        .route("/v1/embeddings", post(inference::embeddings))
        .route("/v1/responses", post(responses::create))
        .route(
            "/v1/responses/{id}",
            get(responses::get).delete(responses::delete),
        )
        .route("/v1/responses/{id}/cancel", post(responses::cancel))
        .route(
            "/v1/responses/{id}/input_items",
            get(responses::input_items),
        )
        .route("/v1/messages", post(messages::create))
        .route(messages::COUNT_TOKENS_PATH, post(messages::count_tokens))
        .route("/v1/models", get(admin::models))
        .route("/health", get(admin::health))
        .route("/metrics", get(admin::metrics))
        .route("/debug/requests", get(admin::requests))
        .route(
            "/debug/faults",
            post(admin::set_faults).get(admin::get_faults),
        )
        .route("/debug/state", get(admin::state))
        // The stand-in for NIXL's read notification, from decode servers (`pd`).
        .route(crate::sim::pd::NOTIFY_PATH, post(pd::notify))
        // The stand-in for SGLang's bootstrap server: decode servers ask for a room's KV.
        .route(
            crate::sim::pd::bootstrap::BOOTSTRAP_PATH,
            get(pd_bootstrap::bootstrap),
        )
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .layer(axum::middleware::map_response_with_state(
            state.clone(),
            identify,
        ))
        .with_state(state)
}

/// Every answer names the server that gave it, so tests can see where the proxy routed.
async fn identify(State(s): State<Arc<ServerState>>, mut res: Response) -> Response {
    let headers = res.headers_mut();
    headers.insert(SERVER_HEADER, s.index_header.clone());
    headers.insert(ADDR_HEADER, s.addr_header.clone());
    res
}

async fn not_found() -> Response {
    ApiError::new(axum::http::StatusCode::NOT_FOUND, "no such route").into_response()
}

/// Serves `listener` on the current runtime until the process exits; returns its address.
/// Engine rank r publishes its KV events into `kv_events[r]`, if there is one.
pub fn spawn(
    listener: tokio::net::TcpListener,
    index: usize,
    config: Arc<SimConfig>,
    kv_events: Vec<Publisher>,
) -> std::io::Result<SocketAddr> {
    use axum::serve::ListenerExt;

    let addr = listener.local_addr()?;
    let state = Arc::new(ServerState::new(index, addr, config, kv_events));
    pd::spawn_expiry(&state);
    let app = router(state);
    // Nagle plus delayed ACK would hold back small SSE events by tens of milliseconds.
    let listener = listener.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            log::debug!("set_nodelay: {e}");
        }
    });
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            log::error!("server {index} on {addr} stopped: {e}");
        }
    });
    Ok(addr)
}
