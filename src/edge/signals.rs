//! What the proxy tells the listener about each client connection: a complete request header
//! was parsed (the header deadline), or an HTTP/2 stream ended because the client abandoned it
//! (the rapid-reset defence). Keyed by the client's socket address, which is unique per open
//! connection; the listener registers a connection when it opens and drops it when it closes.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Mutex;
use tokio::sync::watch;

struct Senders {
    headers: watch::Sender<u64>,
    abandoned: watch::Sender<u64>,
}

/// The listener's end for one connection: counters that only go up.
pub(super) struct ConnSignal {
    pub headers: watch::Receiver<u64>,
    pub abandoned: watch::Receiver<u64>,
}

#[derive(Default)]
pub struct ConnSignals(Mutex<HashMap<SocketAddr, Senders>>);

impl ConnSignals {
    pub(super) fn register(&self, peer: SocketAddr) -> ConnSignal {
        let (headers, headers_rx) = watch::channel(0);
        let (abandoned, abandoned_rx) = watch::channel(0);
        if let Ok(mut m) = self.0.lock() {
            m.insert(peer, Senders { headers, abandoned });
        }
        ConnSignal {
            headers: headers_rx,
            abandoned: abandoned_rx,
        }
    }

    pub(super) fn unregister(&self, peer: SocketAddr) {
        if let Ok(mut m) = self.0.lock() {
            m.remove(&peer);
        }
    }

    fn bump(&self, peer: SocketAddr, which: impl Fn(&Senders) -> &watch::Sender<u64>) {
        if let Ok(m) = self.0.lock() {
            if let Some(s) = m.get(&peer) {
                which(s).send_modify(|n| *n += 1);
            }
        }
    }

    /// The connection from `peer` delivered a complete request header.
    pub fn header_seen(&self, peer: SocketAddr) {
        self.bump(peer, |s| &s.headers);
    }

    /// A stream of the HTTP/2 connection from `peer` ended because the client reset or left it
    /// before its response was complete.
    pub fn stream_abandoned(&self, peer: SocketAddr) {
        self.bump(peer, |s| &s.abandoned);
    }
}
