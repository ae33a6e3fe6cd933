//! What the proxy tells the listener about each client connection: a complete request header
//! was parsed (the header deadline), or an HTTP/2 stream ended because the client abandoned it
//! (the rapid-reset defence). Keyed by the client's socket address, which is unique per open
//! connection; the listener registers a connection when it opens and drops it when it closes.
//!
//! A parsed header comes with every request, on every worker thread: it is a counter and the
//! connection task's own waker (one or two atomic operations), not a channel whose waiters sit
//! behind a mutex. The map is read on every request and written only when a connection opens or
//! closes, hence a read-write lock.

use futures_util::task::AtomicWaker;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::task::Poll;
use tokio::sync::watch;

/// Complete request headers parsed on a connection, and the task waiting for the next one.
#[derive(Default)]
struct Headers {
    count: AtomicU64,
    waiter: AtomicWaker,
}

struct Senders {
    headers: Arc<Headers>,
    abandoned: watch::Sender<u64>,
}

/// The listener's end for one connection: counters that only go up.
pub(super) struct ConnSignal {
    headers: Arc<Headers>,
    pub abandoned: watch::Receiver<u64>,
}

/// Which registration a connection holds: a client port reused by a new connection before the
/// old one's cleanup has run must not lose the new one's entry.
pub(super) struct ConnToken(Arc<Headers>);

impl ConnSignal {
    pub fn token(&self) -> ConnToken {
        ConnToken(self.headers.clone())
    }

    /// Complete request headers parsed on this connection so far.
    pub fn headers(&self) -> u64 {
        self.headers.count.load(Ordering::Acquire)
    }

    /// Resolves once more than `seen` request headers have been parsed. One task waits at a
    /// time: the connection's own.
    pub async fn header_after(&self, seen: u64) {
        std::future::poll_fn(|cx| {
            if self.headers() > seen {
                return Poll::Ready(());
            }
            self.headers.waiter.register(cx.waker());
            // A header counted between the check and the registration woke nobody.
            if self.headers() > seen {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        })
        .await
    }
}

#[derive(Default)]
pub struct ConnSignals(RwLock<HashMap<SocketAddr, Senders>>);

impl ConnSignals {
    pub(super) fn register(&self, peer: SocketAddr) -> ConnSignal {
        let headers = Arc::new(Headers::default());
        let (abandoned, abandoned_rx) = watch::channel(0);
        if let Ok(mut m) = self.0.write() {
            m.insert(
                peer,
                Senders {
                    headers: headers.clone(),
                    abandoned,
                },
            );
        }
        ConnSignal {
            headers,
            abandoned: abandoned_rx,
        }
    }

    /// Drop `peer`'s entry if it is still the one `token` registered.
    pub(super) fn unregister(&self, peer: SocketAddr, token: &ConnToken) {
        if let Ok(mut m) = self.0.write() {
            if m.get(&peer)
                .is_some_and(|s| Arc::ptr_eq(&s.headers, &token.0))
            {
                m.remove(&peer);
            }
        }
    }

    /// The connection from `peer` delivered a complete request header.
    pub fn header_seen(&self, peer: SocketAddr) {
        if let Ok(m) = self.0.read() {
            if let Some(s) = m.get(&peer) {
                s.headers.count.fetch_add(1, Ordering::Release);
                s.headers.waiter.wake();
            }
        }
    }

    /// A stream of the HTTP/2 connection from `peer` ended because the client reset or left it
    /// before its response was complete.
    pub fn stream_abandoned(&self, peer: SocketAddr) {
        if let Ok(m) = self.0.read() {
            if let Some(s) = m.get(&peer) {
                s.abandoned.send_modify(|n| *n += 1);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A client port reused by a new connection before the old one is cleaned up: the old
    /// one's cleanup leaves the new registration, whose headers are still counted.
    #[test]
    fn an_old_connections_cleanup_keeps_a_reused_ports_new_registration() {
        let signals = ConnSignals::default();
        let peer: SocketAddr = "127.0.0.1:40000".parse().expect("addr");
        let old = signals.register(peer);
        signals.header_seen(peer);
        assert_eq!(old.headers(), 1);
        let new = signals.register(peer);
        signals.unregister(peer, &old.token());
        signals.header_seen(peer);
        assert_eq!(new.headers(), 1, "the new connection's header was lost");
        assert_eq!(old.headers(), 1);
        signals.unregister(peer, &new.token());
        signals.header_seen(peer);
        assert_eq!(new.headers(), 1, "unregistered, nothing counts");
    }

    /// The connection task waiting for its next header is woken by it.
    #[tokio::test]
    async fn a_header_wakes_the_task_waiting_for_it() {
        let signals = Arc::new(ConnSignals::default());
        let peer: SocketAddr = "127.0.0.1:40001".parse().expect("addr");
        let signal = signals.register(peer);
        let seen = signal.headers();
        let s2 = signals.clone();
        let later = tokio::spawn(async move {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            s2.header_seen(peer);
        });
        tokio::time::timeout(std::time::Duration::from_secs(5), signal.header_after(seen))
            .await
            .expect("woken by the header");
        later.await.expect("task");
    }
}
