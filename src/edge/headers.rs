//! Which client connections have delivered a complete request header: the proxy reports each
//! parsed header, the listener waits on it for its header deadline.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Mutex;
use tokio::sync::watch;

/// Per connection, a counter of request headers parsed so far.
#[derive(Default)]
pub struct HeaderWatches(Mutex<HashMap<SocketAddr, watch::Sender<u64>>>);

impl HeaderWatches {
    pub(super) fn register(&self, peer: SocketAddr) -> watch::Receiver<u64> {
        let (tx, rx) = watch::channel(0);
        if let Ok(mut m) = self.0.lock() {
            m.insert(peer, tx);
        }
        rx
    }

    pub(super) fn unregister(&self, peer: SocketAddr) {
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
