//! One simulated server: its state, its routes and the task that serves its listener.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderName, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use tokio::sync::watch;
use tokio::time::Instant;

use super::admin;
use super::config::SimConfig;
use super::engine::EngineHandle;
use super::error::ApiError;
use super::faults::Faults;
use super::inference;
use super::kvcache::KvCache;
use super::metrics::Stats;
use super::reqlog::{RequestLog, LOG_CAPACITY};

/// Tests send 5 MB bodies; long-context prompts run to megabytes.
const BODY_LIMIT: usize = 64 << 20;

pub const SERVER_HEADER: HeaderName = HeaderName::from_static("x-kvbench-server");
pub const ADDR_HEADER: HeaderName = HeaderName::from_static("x-kvbench-addr");

pub struct ServerState {
    pub index: usize,
    pub addr: SocketAddr,
    pub config: Arc<SimConfig>,
    pub started: Instant,
    pub kv: Mutex<KvCache>,
    pub stats: Arc<Stats>,
    /// Engine mode only; fixed-timing mode paces each request on its own.
    pub engine: Option<EngineHandle>,
    pub log: Mutex<RequestLog>,
    /// A watch channel so that requests held by the `hang` fault wake when it is cleared.
    pub faults: watch::Sender<Faults>,
    index_header: HeaderValue,
    addr_header: HeaderValue,
}

impl ServerState {
    /// Must run inside a tokio runtime: in engine mode it spawns the engine task.
    pub fn new(index: usize, addr: SocketAddr, config: Arc<SimConfig>) -> Self {
        let (faults, _) = watch::channel(config.faults);
        let stats = Arc::new(Stats::default());
        let engine = config
            .profile
            .map(|p| EngineHandle::spawn(p, config.time_scale, stats.clone()));
        Self {
            index,
            addr,
            kv: Mutex::new(KvCache::new(config.num_gpu_blocks)),
            stats,
            engine,
            log: Mutex::new(RequestLog::new(LOG_CAPACITY)),
            faults,
            started: Instant::now(),
            index_header: HeaderValue::from(index),
            addr_header: header_value(&addr.to_string()),
            config,
        }
    }

    pub fn in_slow_start(&self) -> bool {
        self.started.elapsed() < self.config.slow_start
    }

    pub fn faults(&self) -> Faults {
        *self.faults.borrow()
    }

    pub fn kv(&self) -> MutexGuard<'_, KvCache> {
        self.kv.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn log(&self) -> MutexGuard<'_, RequestLog> {
        self.log.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Model-time seconds elapsed since `since` (wall time times the time scale).
    pub fn model_seconds_since(&self, since: Instant) -> f64 {
        since.elapsed().as_secs_f64() * self.config.time_scale
    }
}

pub fn header_value(s: &str) -> HeaderValue {
    HeaderValue::from_str(s).unwrap_or_else(|_| HeaderValue::from_static("invalid"))
}

pub fn router(state: Arc<ServerState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(inference::chat))
        .route("/v1/completions", post(inference::completions))
        .route("/v1/embeddings", post(inference::embeddings))
        .route("/v1/models", get(admin::models))
        .route("/health", get(admin::health))
        .route("/metrics", get(admin::metrics))
        .route("/debug/requests", get(admin::requests))
        .route(
            "/debug/faults",
            post(admin::set_faults).get(admin::get_faults),
        )
        .route("/debug/state", get(admin::state))
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
pub fn spawn(
    listener: tokio::net::TcpListener,
    index: usize,
    config: Arc<SimConfig>,
) -> std::io::Result<SocketAddr> {
    use axum::serve::ListenerExt;

    let addr = listener.local_addr()?;
    let app = router(Arc::new(ServerState::new(index, addr, config)));
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
