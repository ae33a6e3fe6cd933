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
    let split_s = ctx
        .pd
        .leg
        .as_ref()
        .and(ctx.pd.choice)
        .and_then(|c| c.split_ttft_s);
    let predicted_s = first_byte_s(ctx.charge.est_ttft_s, split_s);
    let predicted = Duration::from_secs_f64((predicted_s * t.first_byte_factor).clamp(0.0, 1e6));
    read.min(Duration::from_millis(t.first_byte_floor_ms).max(predicted))
}

/// When the decode server's first byte is due, predicted: its own TTFT, or, for a decode leg
/// sent beside its prefill leg (SGLang's protocol), the split's (`split_s`: the prefill
/// server's queue and prefill, the transfer, then the decode server), which it waits through
/// before it sends anything. Without it an overloaded prefill server's queue reads as a hung
/// decode server, and each retry adds another prefill leg to that queue.
fn first_byte_s(est_ttft_s: f64, split_s: Option<f64>) -> f64 {
    split_s.map_or(est_ttft_s, |s| est_ttft_s.max(s))
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

#[cfg(test)]
mod tests {
    use super::first_byte_s;

    #[test]
    fn a_decode_leg_beside_its_prefill_leg_is_due_after_the_split() {
        assert_eq!(first_byte_s(0.2, None), 0.2);
        // The prefill server's queue makes the split later than the decode server alone.
        assert_eq!(first_byte_s(0.2, Some(3.5)), 3.5);
        assert_eq!(first_byte_s(0.2, Some(0.1)), 0.2);
    }
}
