//! HTTP/1.1 client connections: Pingora's keep-alive loop (`ServerApp for HttpServerApp`) with a
//! deadline for every request header. Pingora only times out single reads (60 s each), so a
//! client trickling its header a byte at a time (slowloris) would otherwise hold a connection
//! and its memory for as long as it likes. The proxy reports each parsed header
//! (`early_request_filter` -> [`super::ConnSignals::header_seen`]).

use pingora::apps::HttpServerApp;
use pingora::protocols::http::ServerSession;
use pingora::protocols::Stream;
use pingora::proxy::{HttpProxy, ProxyHttp};
use pingora::time::fast_timeout::fast_sleep;
use std::sync::Arc;

use super::conn::Conn;

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
    let mut session = ServerSession::new_http1(stream);
    if *shutdown.borrow() {
        session.set_keepalive(None);
    } else {
        session.set_keepalive(Some(limits.idle.as_secs().max(1)));
    }
    let mut limit = limits.header;
    loop {
        let seen = signal.as_ref().map_or(0, |s| s.headers());
        let work = proxy.process_new_http(session, shutdown);
        let reused = match signal.as_ref() {
            None => work.await,
            Some(s) => {
                tokio::pin!(work);
                tokio::select! {
                    biased;
                    done = &mut work => done,
                    // Once the header is in, the rest of the request has no deadline here (and
                    // the timer below is no longer polled at each of the request's wake-ups).
                    _ = s.header_after(seen) => work.await,
                    // Pingora's timer thread, not tokio's: a tokio sleep made afresh for every
                    // request wakes the runtime's driver through an eventfd when registered (a
                    // syscall a request, found with perf), where this shares a 10 ms tick.
                    _ = fast_sleep(limit) => {
                        edge.metrics.client_timeouts.with_label_values(&["header"]).inc();
                        log::info!(
                            "closing client connection {peer}: no complete request header \
                             within {} ms",
                            limit.as_millis()
                        );
                        return;
                    }
                }
            }
        };
        let Some(reused) = reused else { return };
        let (stream, settings) = reused.consume();
        session = ServerSession::new_http1(stream);
        if let Some(s) = settings {
            s.apply_to_session(&mut session);
        }
        limit = limits.idle + limits.header;
    }
}
