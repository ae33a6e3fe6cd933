//! The client connection layer in front of Pingora's HTTP handling: a cap on open connections,
//! TLS termination, the choice of HTTP/1.1 or HTTP/2 (ALPN on TLS, the h2c preface on
//! plaintext), and the per-protocol loops with their deadlines (`h1`, `h2`).
//!
//! The listener is generic over the `ProxyHttp` it serves, so the edge does not depend on the
//! proxy layer above it. One instance serves each client listener; they share the proxy and
//! the connection count.

use async_trait::async_trait;
use pingora::apps::{HttpServerApp, ServerApp};
use pingora::protocols::{Stream, ALPN};
use pingora::proxy::{HttpProxy, ProxyHttp};
use pingora::server::ShutdownWatch;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::conn::{Conn, ConnLimits};
use super::signals::ConnToken;
use super::state::EdgeState;
use super::tls::{HandshakeFailure, TlsEdge};
use super::{h1, h2};
use crate::fleet::Current;

/// The HTTP/2 connection preface (RFC 9113 section 3.4), as Pingora's own h2c check reads it.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// What a client listener speaks below HTTP.
pub enum Transport {
    /// Plaintext: HTTP/1.1, and HTTP/2 with prior knowledge when `kvroute.h2c` is on.
    Plain,
    /// TLS, with the protocol chosen by ALPN.
    Tls(Arc<TlsEdge>),
}

pub struct Listener<P> {
    proxy: Arc<HttpProxy<P>>,
    current: Arc<Current>,
    edge: Arc<EdgeState>,
    transport: Transport,
}

/// One open client connection, counted until dropped, and its registration for the proxy's
/// signals (from when it is served).
struct Open<'a> {
    edge: &'a EdgeState,
    signals: Option<(SocketAddr, ConnToken)>,
}

impl Drop for Open<'_> {
    fn drop(&mut self) {
        self.edge.open_connections.fetch_sub(1, Ordering::Relaxed);
        // inc/dec, not set: two tasks' sets can land out of order and leave the gauge stale.
        self.edge.metrics.connections.dec();
        if let Some((p, token)) = &self.signals {
            self.edge.conns.unregister(*p, token);
        }
    }
}

impl<P> Listener<P> {
    pub fn new(
        proxy: Arc<HttpProxy<P>>,
        current: Arc<Current>,
        edge: Arc<EdgeState>,
        transport: Transport,
    ) -> Listener<P> {
        Listener {
            proxy,
            current,
            edge,
            transport,
        }
    }
}

/// Whether a plaintext connection opens with the HTTP/2 preface, read within `deadline`.
async fn has_h2_preface(stream: &mut Stream, deadline: Duration) -> Option<bool> {
    let mut buf = [0u8; H2_PREFACE.len()];
    match tokio::time::timeout(deadline, stream.try_peek(&mut buf)).await {
        // Not every stream can peek: then it is HTTP/1.
        Ok(Ok(peeked)) => Some(peeked && buf == H2_PREFACE),
        // Fewer bytes than the preface and then EOF: nothing to serve.
        Ok(Err(_)) => None,
        // A request shorter than the preface sent whole is served as HTTP/1 (its header deadline
        // then applies); a silent connection is closed when that deadline passes.
        Err(_) => Some(false),
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
        mut stream: Stream,
        shutdown: &ShutdownWatch,
    ) -> Option<Stream> {
        let limits = ConnLimits::of(&self.current.load().config);
        let edge = self.edge.as_ref();
        let m = &edge.metrics;
        let n = edge.open_connections.fetch_add(1, Ordering::Relaxed) + 1;
        let peer = stream
            .get_socket_digest()
            .and_then(|d| d.peer_addr().and_then(|a| a.as_inet().copied()));
        let mut open = Open {
            edge,
            signals: None,
        };
        m.connections.inc();
        if n > limits.max_connections {
            m.connections_refused.inc();
            log::warn!(
                "closing a new client connection: {} open (limits.max_connections)",
                n - 1
            );
            return None;
        }
        let peer_name = peer.map_or_else(|| "-".to_string(), |p| p.to_string());
        let (transport, h2) = match &self.transport {
            Transport::Tls(tls) => {
                stream = match tls.accept(stream, limits.handshake).await {
                    Ok(s) => s,
                    Err(HandshakeFailure::TimedOut) => {
                        m.client_timeouts
                            .with_label_values(&["tls_handshake"])
                            .inc();
                        log::info!(
                            "closing client connection {peer_name}: no TLS handshake within {} ms",
                            limits.handshake.as_millis()
                        );
                        return None;
                    }
                    Err(HandshakeFailure::Failed(e)) => {
                        // Scanners and plaintext clients: not worth more than debug.
                        log::debug!("TLS handshake with {peer_name} failed: {e}");
                        return None;
                    }
                };
                (
                    "https",
                    matches!(stream.selected_alpn_proto(), Some(ALPN::H2)),
                )
            }
            Transport::Plain if limits.h2c => {
                ("http", has_h2_preface(&mut stream, limits.header).await?)
            }
            Transport::Plain => ("http", false),
        };
        m.accepted
            .with_label_values(&[transport, if h2 { "h2" } else { "http1" }])
            .inc();
        let signal = peer.map(|p| {
            let s = edge.conns.register(p);
            open.signals = Some((p, s.token()));
            s
        });
        let conn = Conn {
            edge,
            shutdown,
            limits: &limits,
            signal,
            peer: &peer_name,
        };
        if h2 {
            h2::serve(&self.proxy, stream, conn).await;
        } else {
            h1::serve(&self.proxy, stream, conn).await;
        }
        None
    }

    async fn cleanup(&self) {
        self.proxy.http_cleanup().await;
    }
}
