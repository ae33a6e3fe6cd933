//! The connection an attempt takes to its backend: its deadlines, and whether its response is
//! read ahead of the client.

use pingora::prelude::HttpPeer;
use pingora::proxy::Session;
use std::time::Duration;

use super::ctx::Ctx;
use crate::config::{Config, TimeoutsConfig};
use crate::fleet::Fleet;

/// How long a read from the backend may take. A streamed request's backend owes a first byte
/// by max(floor, factor x predicted TTFT): a hung engine is caught in seconds, not after
/// `upstream_read_ms`. A non-streamed answer's first byte comes only after the whole
/// generation, which kvroute does not predict, so it keeps `upstream_read_ms`.
fn read_timeout(ctx: &Ctx, t: &TimeoutsConfig) -> Duration {
    let read = Duration::from_millis(t.upstream_read_ms);
    if !ctx.route.profile.as_ref().is_some_and(|p| p.stream) {
        return read;
    }
    let predicted =
        Duration::from_secs_f64((ctx.charge.est_ttft_s * t.first_byte_factor).clamp(0.0, 1e6));
    read.min(Duration::from_millis(t.first_byte_floor_ms).max(predicted))
}

/// The peer for `ctx`'s attempt on backend `idx` of `fleet`.
pub(super) fn for_attempt(
    fleet: &Fleet,
    idx: usize,
    cfg: &Config,
    session: &Session,
    ctx: &Ctx,
) -> HttpPeer {
    let mut peer = fleet.backends()[idx].peer();
    let t = &cfg.timeouts;
    peer.options.connection_timeout = Some(Duration::from_millis(t.connect_ms));
    peer.options.read_timeout = Some(read_timeout(ctx, t));
    peer.options.write_timeout = Some(Duration::from_millis(t.upstream_read_ms));
    peer.options.idle_timeout = Some(Duration::from_secs(60));
    // HTTP/2 clients stall a stream at no cost to themselves (a zero window); an HTTP/1.1
    // client only by leaving its whole socket buffer unread, and read-ahead costs every
    // request a pooled virtual connection (see `limits.read_ahead_http1`).
    let h2 = session.as_downstream().is_http2();
    if let (false, true, Some(ra)) = (
        peer.is_tls(),
        h2 || cfg.limits.read_ahead_http1,
        fleet.read_ahead(),
    ) {
        peer.options.custom_l4 = Some(ra);
    }
    peer
}
