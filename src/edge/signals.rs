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

impl ConnSignal {
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

    pub(super) fn unregister(&self, peer: SocketAddr) {
        if let Ok(mut m) = self.0.write() {
            m.remove(&peer);
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
