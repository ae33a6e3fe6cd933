//! HTTP/2 client connections (TLS with ALPN `h2`, or h2c with prior knowledge): the accept loop
//! of Pingora's `HttpServerApp`, each stream served by the same proxy as HTTP/1.1, plus the
//! edge's defences:
//!
//! - a deadline for the connection preface and first stream's headers, and after an idle spell
//!   (no stream open) for the next stream's: the h2 codec surfaces a stream only once its
//!   headers are complete, so a trickled HEADERS/CONTINUATION sequence is cut like a slowloris
//!   HTTP/1 header;
//! - a cap on concurrent streams (SETTINGS_MAX_CONCURRENT_STREAMS);
//! - rapid reset (CVE-2023-44487). The h2 crate already bounds streams reset before they are
//!   accepted (`max_pending_accept_reset_streams`, 20) and caps header lists at 64 KiB (Pingora's
//!   default options). A stream reset *after* it is accepted is the costly case for a proxy: it
//!   may already have started backend work. The proxy reports every stream the client abandons
//!   ([`super::ConnSignals::stream_abandoned`]); more than `limits.h2_max_client_resets` within
//!   `limits.h2_reset_window_ms` and the connection gets GOAWAY(ENHANCE_YOUR_CALM) and is closed.

use pingora::apps::HttpServerApp;
use pingora::protocols::http::v2::server::{default_h2_options, handshake, H2Accept, HttpSession};
use pingora::protocols::http::ServerSession;
use pingora::protocols::{Digest, Stream};
use pingora::proxy::{HttpProxy, ProxyHttp};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;

use super::conn::Conn;

/// How long a closed connection's GOAWAY may take to flush.
const GOAWAY_FLUSH: Duration = Duration::from_millis(500);
/// How long the socket stays open once the GOAWAY is out. Closing it while the client is still
/// sending (a resetting client is) makes the kernel answer with RST, and a client that sees
/// the RST before it reads the GOAWAY never learns why it was closed.
const GOAWAY_LINGER: Duration = Duration::from_millis(250);

/// Abandoned streams within the current window.
struct ResetWindow {
    started: Instant,
    at_start: u64,
}

impl ResetWindow {
    /// Whether `total` abandoned streams so far exceed `max` within `window`.
    fn exceeded(&mut self, total: u64, max: u32, window: Duration) -> bool {
        let now = Instant::now();
        if now.duration_since(self.started) > window {
            self.started = now;
            self.at_start = total;
        }
        total - self.at_start > u64::from(max)
    }
}

/// Resolves once no stream has been open for `limit`.
async fn idle_for(active: &mut watch::Receiver<usize>, limit: Duration) {
    loop {
        if active.wait_for(|n| *n == 0).await.is_err() {
            return std::future::pending().await;
        }
        tokio::select! {
            _ = tokio::time::sleep(limit) => return,
            _ = active.wait_for(|n| *n > 0) => {}
        }
    }
}

pub(super) async fn serve<P>(proxy: &Arc<HttpProxy<P>>, stream: Stream, conn: Conn<'_>)
where
    P: ProxyHttp + Send + Sync + 'static,
    P::CTX: Send + Sync,
{
    let Conn {
        edge,
        shutdown,
        limits,
        signal,
        peer,
    } = conn;
    let m = &edge.metrics;
    let digest = Arc::new(Digest {
        ssl_digest: stream.get_ssl_digest(),
        timing_digest: stream.get_timing_digest(),
        proxy_digest: stream.get_proxy_digest(),
        socket_digest: stream.get_socket_digest(),
    });
    let mut options = default_h2_options();
    options.max_concurrent_streams(limits.h2_max_concurrent_streams);
    let mut conn = match tokio::time::timeout(limits.header, handshake(stream, Some(options))).await
    {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => {
            log::debug!("h2 handshake with {peer} failed: {e}");
            return;
        }
        Err(_) => {
            m.client_timeouts.with_label_values(&["header"]).inc();
            log::info!(
                "closing client connection {peer}: no HTTP/2 preface within {} ms",
                limits.header.as_millis()
            );
            return;
        }
    };
    let (active_tx, mut active) = watch::channel(0usize);
    let active_tx = Arc::new(active_tx);
    let mut abandoned = signal.map(|s| s.abandoned);
    let mut resets = ResetWindow {
        started: Instant::now(),
        at_start: 0,
    };
    let mut limit = limits.header;
    let mut shutdown_rx = shutdown.clone();
    let mut draining = *shutdown.borrow();
    if draining {
        conn.graceful_shutdown();
    }
    loop {
        let accepted = tokio::select! {
            biased;
            _ = shutdown_rx.changed(), if !draining => {
                conn.graceful_shutdown();
                draining = true;
                continue;
            }
            changed = async {
                match abandoned.as_mut() {
                    Some(rx) => rx.changed().await.map(|_| *rx.borrow_and_update()),
                    None => std::future::pending().await,
                }
            } => {
                let Ok(total) = changed else {
                    abandoned = None;
                    continue;
                };
                let window = Duration::from_millis(limits.h2_reset_window_ms);
                if resets.exceeded(total, limits.h2_max_client_resets, window) {
                    m.h2_reset_closes.inc();
                    log::warn!(
                        "closing HTTP/2 connection {peer}: the client abandoned more than {} \
                         streams within {} ms (limits.h2_max_client_resets)",
                        limits.h2_max_client_resets,
                        limits.h2_reset_window_ms
                    );
                    conn.abrupt_shutdown(h2::Reason::ENHANCE_YOUR_CALM);
                    let flush = async { while let Some(Ok(_)) = conn.accept().await {} };
                    let _ = tokio::time::timeout(GOAWAY_FLUSH, flush).await;
                    tokio::time::sleep(GOAWAY_LINGER).await;
                    return;
                }
                continue;
            }
            s = HttpSession::from_h2_conn(&mut conn, digest.clone()) => s,
            _ = idle_for(&mut active, limit), if !draining => {
                m.client_timeouts.with_label_values(&["header"]).inc();
                log::info!(
                    "closing HTTP/2 client connection {peer}: no stream within {} ms",
                    limit.as_millis()
                );
                return;
            }
        };
        match accepted {
            Err(e) => {
                // Clients often drop TCP without closing HTTP/2 cleanly.
                log::debug!("HTTP/2 connection {peer} ended: {e}");
                return;
            }
            Ok(None) => return,
            Ok(Some(H2Accept::Rejected)) => continue,
            Ok(Some(H2Accept::Session(session))) => {
                limit = limits.idle + limits.header;
                active_tx.send_modify(|n| *n += 1);
                let proxy = proxy.clone();
                let shutdown = shutdown.clone();
                let active_tx = active_tx.clone();
                tokio::spawn(async move {
                    proxy
                        .process_new_http(ServerSession::new_http2(session), &shutdown)
                        .await;
                    active_tx.send_modify(|n| *n -= 1);
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reset_window_counts_within_the_window_only() {
        let mut w = ResetWindow {
            started: Instant::now(),
            at_start: 0,
        };
        let window = Duration::from_secs(60);
        assert!(!w.exceeded(3, 3, window));
        assert!(w.exceeded(4, 3, window));
        // A new window starts from the total it opens with.
        w.started = Instant::now() - Duration::from_secs(61);
        assert!(!w.exceeded(7, 3, window));
        assert!(!w.exceeded(10, 3, window));
        assert!(w.exceeded(11, 3, window));
    }
}
