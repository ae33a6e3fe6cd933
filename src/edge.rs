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

use async_trait::async_trait;
use pingora::apps::{HttpServerApp, ServerApp};
use pingora::protocols::http::ServerSession;
use pingora::protocols::Stream;
use pingora::proxy::HttpProxy;
use pingora::server::ShutdownWatch;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;

use crate::proxy::Router;
use crate::state::State;

/// Per connection, a counter of request headers parsed so far.
#[derive(Default)]
pub struct HeaderWatches(Mutex<HashMap<SocketAddr, watch::Sender<u64>>>);

impl HeaderWatches {
    fn register(&self, peer: SocketAddr) -> watch::Receiver<u64> {
        let (tx, rx) = watch::channel(0);
        if let Ok(mut m) = self.0.lock() {
            m.insert(peer, tx);
        }
        rx
    }

    fn unregister(&self, peer: SocketAddr) {
        if let Ok(mut m) = self.0.lock() {
            m.remove(&peer);
        }
    }

    /// The connection from `peer` delivered a complete request header.
    pub fn header_seen(&self, peer: SocketAddr) {
        if let Ok(m) = self.0.lock() {
            if let Some(tx) = m.get(&peer) {
                tx.send_modify(|n| *n += 1);
            }
        }
    }
}

pub struct Edge {
    pub proxy: Arc<HttpProxy<Router>>,
    pub state: Arc<State>,
    open: AtomicUsize,
}

/// One open client connection, counted until dropped.
struct Open<'a> {
    edge: &'a Edge,
    peer: Option<SocketAddr>,
}

impl Drop for Open<'_> {
    fn drop(&mut self) {
        let n = self.edge.open.fetch_sub(1, Ordering::Relaxed) - 1;
        self.edge.state.metrics.connections.set(n as i64);
        if let Some(p) = self.peer {
            self.edge.state.headers.unregister(p);
        }
    }
}

impl Edge {
    pub fn new(proxy: HttpProxy<Router>, state: Arc<State>) -> Edge {
        Edge {
            proxy: Arc::new(proxy),
            state,
            open: AtomicUsize::new(0),
        }
    }
}

#[async_trait]
impl ServerApp for Edge {
    async fn process_new(
        self: &Arc<Self>,
        stream: Stream,
        shutdown: &ShutdownWatch,
    ) -> Option<Stream> {
        let cfg = self.state.config();
        let m = &self.state.metrics;
        let n = self.open.fetch_add(1, Ordering::Relaxed) + 1;
        let peer = stream
            .get_socket_digest()
            .and_then(|d| d.peer_addr().and_then(|a| a.as_inet().copied()));
        let _open = Open { edge: self, peer };
        m.connections.set(n as i64);
        if n > cfg.limits.max_connections {
            m.connections_refused.inc();
            log::warn!(
                "closing a new client connection: {} open (limits.max_connections)",
                n - 1
            );
            return None;
        }
        let mut headers = peer.map(|p| self.state.headers.register(p));

        let header = Duration::from_millis(cfg.timeouts.client_header_ms);
        let idle = Duration::from_millis(cfg.timeouts.client_idle_ms);
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
