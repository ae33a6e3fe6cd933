//! A request's charge on its backend ends when the engine's response is complete, not when its
//! client has read it: the read-ahead connection ([`crate::fleet::read_ahead`]) says when.

use pingora::prelude::HttpPeer;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use super::ctx::Ctx;
use super::metrics::ProxyMetrics;
use crate::edge::EdgeState;
use crate::fleet::read_ahead::{self, Link};

/// Arm the response to the request about to be written to `peer`: once complete, its charge
/// is released and the router queue's best waiter may go. Nothing for a connection that does
/// not read ahead (TLS engines, read-ahead off). The link to the connection it will be
/// written to, if armed.
pub(super) fn arm(edge: &Arc<EdgeState>, peer: &HttpPeer, ctx: &mut Ctx) -> Option<Arc<Link>> {
    let guard = ctx.charge.guard.as_ref()?;
    peer.options.custom_l4.as_ref()?;
    let release = guard.releaser();
    let edge = Arc::clone(edge);
    let done = Arc::new(OnceLock::new());
    ctx.charge.engine_done = Some(Arc::clone(&done));
    let link = Arc::new(Link::default());
    read_ahead::arm(
        Box::new(move || {
            let _ = done.set(Instant::now());
            if release() {
                edge.queue.wake_one();
            }
        }),
        Arc::clone(&link),
    );
    Some(link)
}

/// At the request's end: forget an arming no connection took, and say how long the client
/// took past the engine's end.
pub(super) fn settle(m: &ProxyMetrics, ctx: &mut Ctx) {
    // Only a request that was armed has anything to forget: the others skip the lock.
    let Some(done) = ctx.charge.engine_done.take() else {
        return;
    };
    read_ahead::disarm();
    if let Some(at) = done.get().copied() {
        m.client_drain
            .with_label_values::<&str>(&[])
            .observe(at.elapsed().as_secs_f64());
    }
}
