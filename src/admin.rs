//! The admin listener: `GET /metrics`, `/healthz` (process alive), `/readyz` (can serve traffic).
//! It is a separate Pingora service on its own address, never the client port.

use async_trait::async_trait;
use http::{Response, StatusCode};
use pingora::apps::http_app::ServeHttp;
use pingora::protocols::http::ServerSession;
use std::sync::Arc;

use crate::state::State;

pub struct AdminApp {
    pub state: Arc<State>,
}

fn reply(status: StatusCode, content_type: &str, body: Vec<u8>) -> Response<Vec<u8>> {
    Response::builder()
        .status(status)
        .header("content-type", content_type)
        .header("content-length", body.len())
        .body(body)
        .unwrap_or_else(|_| Response::new(Vec::new()))
}

#[async_trait]
impl ServeHttp for AdminApp {
    async fn response(&self, session: &mut ServerSession) -> Response<Vec<u8>> {
        let path = session.req_header().uri.path().to_owned();
        let fleet = self.state.fleet();
        match path.as_str() {
            "/metrics" => reply(
                StatusCode::OK,
                "text/plain; version=0.0.4",
                self.state
                    .metrics
                    .render(&fleet, self.state.admission.depth()),
            ),
            "/healthz" => reply(StatusCode::OK, "text/plain", b"ok\n".to_vec()),
            "/readyz" if self.state.draining() => reply(
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
