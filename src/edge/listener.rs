//! The client connection layer in front of Pingora's HTTP/1 handling: a cap on open connections
//! and a deadline for every request header. Pingora only times out single reads (60 s each), so
//! a client trickling its header a byte at a time (slowloris) would otherwise hold a connection
//! and its memory for as long as it likes.
//!
//! This mirrors Pingora's own HTTP/1 keep-alive loop (`ServerApp for HttpServerApp`) and adds the
//! deadline: the proxy reports each parsed header (`early_request_filter` ->
//! [`HeaderWatches::header_seen`], keyed by the client's socket address) and a connection whose
//! header has not arrived in time is closed. Only HTTP/1 is served (kvroute enables neither TLS
//! nor h2c).
//!
//! The listener is generic over the `ProxyHttp` it serves, so the edge does not depend on the
//! proxy layer above it.

use async_trait::async_trait;
use pingora::apps::{HttpServerApp, ServerApp};
use pingora::protocols::http::ServerSession;
use pingora::protocols::Stream;
use pingora::proxy::{HttpProxy, ProxyHttp};
use pingora::server::ShutdownWatch;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::state::EdgeState;
use crate::fleet::Current;

pub struct Listener<P> {
    proxy: Arc<HttpProxy<P>>,
    current: Arc<Current>,
    edge: Arc<EdgeState>,
    open: AtomicUsize,
}

/// One open client connection, counted until dropped.
struct Open<'a, P> {
    listener: &'a Listener<P>,
    peer: Option<SocketAddr>,
}

impl<P> Drop for Open<'_, P> {
    fn drop(&mut self) {
        let n = self.listener.open.fetch_sub(1, Ordering::Relaxed) - 1;
        let edge = &self.listener.edge;
        edge.metrics.connections.set(n as i64);
        if let Some(p) = self.peer {
            edge.headers.unregister(p);
        }
    }
}

impl<P> Listener<P> {
    pub fn new(proxy: HttpProxy<P>, current: Arc<Current>, edge: Arc<EdgeState>) -> Listener<P> {
        Listener {
            proxy: Arc::new(proxy),
            current,
            edge,
            open: AtomicUsize::new(0),
        }
    }
}

#[async_trait]
impl<P> ServerApp for Listener<P>
where
    P: ProxyHttp + Send + Sync + 'static,
    P::CTX: Send + Sync,
{
    async fn process_new(
        self: &Arc<Self>,
        stream: Stream,
        shutdown: &ShutdownWatch,
    ) -> Option<Stream> {
        // The connection's limits come from the config in force when it opened; the generation
        // itself is not held, so a long keep-alive connection pins no old fleet.
        let (max_connections, header, idle) = {
            let generation = self.current.load();
            let c = &generation.config;
            (
                c.limits.max_connections,
                Duration::from_millis(c.timeouts.client_header_ms),
                Duration::from_millis(c.timeouts.client_idle_ms),
            )
        };
        let m = &self.edge.metrics;
        let n = self.open.fetch_add(1, Ordering::Relaxed) + 1;
        let peer = stream
            .get_socket_digest()
            .and_then(|d| d.peer_addr().and_then(|a| a.as_inet().copied()));
        let _open = Open {
            listener: self.as_ref(),
            peer,
        };
        m.connections.set(n as i64);
        if n > max_connections {
            m.connections_refused.inc();
            log::warn!(
                "closing a new client connection: {} open (limits.max_connections)",
                n - 1
            );
            return None;
        }
        let mut headers = peer.map(|p| self.edge.headers.register(p));

        let mut session = ServerSession::new_http1(stream);
        if *shutdown.borrow() {
            session.set_keepalive(None);
        } else {
            session.set_keepalive(Some(idle.as_secs().max(1)));
        }
        let mut limit = header;
        loop {
            let seen = headers.as_mut().map_or(0, |rx| *rx.borrow_and_update());
            let work = self.proxy.process_new_http(session, shutdown);
            let reused = match headers.as_mut() {
                None => work.await,
                Some(rx) => {
                    tokio::pin!(work);
                    tokio::select! {
                        biased;
                        done = &mut work => done,
                        // (The watch's guard must not live across the await below.)
                        _ = async { rx.wait_for(|n| *n > seen).await.is_ok() } => work.await,
                        _ = tokio::time::sleep(limit) => {
                            m.client_timeouts.with_label_values(&["header"]).inc();
                            log::info!(
                                "closing client connection {}: no complete request header within {} ms",
                                peer.map_or_else(|| "-".to_string(), |p| p.to_string()),
                                limit.as_millis()
                            );
                            return None;
                        }
                    }
                }
            };
            let (stream, settings) = reused?.consume();
            session = ServerSession::new_http1(stream);
            if let Some(s) = settings {
                s.apply_to_session(&mut session);
            }
            limit = idle + header;
        }
    }

    async fn cleanup(&self) {
        self.proxy.http_cleanup().await;
    }
}
