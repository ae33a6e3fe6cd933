//! Each attempt's engine connection is registered with the fleet's in-flight requests
//! ([`crate::fleet::in_flight`]) while the request waits on it, so the health checker can cut
//! it when the backend is found down, and the failure that follows is read as that.

use pingora::protocols::Digest;
use std::os::unix::io::RawFd;
use std::sync::Arc;

use super::ctx::Ctx;
use crate::fleet::in_flight::Conn;
use crate::fleet::read_ahead::Link;

/// The attempt is connected to its backend over `fd` (`-1`: a read-ahead connection, cut
/// through `link`).
pub(super) fn watch(ctx: &mut Ctx, fd: RawFd, digest: Option<&Digest>, link: Option<Arc<Link>>) {
    ctx.attempts.watch = None;
    let Some(i) = ctx.attempts.backend else {
        return;
    };
    let conn = match link {
        Some(link) => Conn::ReadAhead(link),
        None => {
            let addrs = digest
                .and_then(|d| d.socket_digest.as_ref())
                .and_then(|s| Some((*s.local_addr()?.as_inet()?, *s.peer_addr()?.as_inet()?)));
            let Some((local, peer)) = addrs else {
                return;
            };
            Conn::Socket { fd, local, peer }
        }
    };
    let fleet = &ctx.generation.fleet;
    let Some(addr) = fleet.backends().get(i).map(|b| b.addr) else {
        return;
    };
    let watch = fleet.in_flight().watch(addr, conn);
    if let Some(leg) = &ctx.pd.leg {
        leg.arm(watch.cutter());
    }
    ctx.attempts.watch = Some(watch);
}

/// The engine sent part of its response; `end`: all of it.
pub(super) fn progress(ctx: &Ctx, end: bool) {
    if let Some(w) = &ctx.attempts.watch {
        if end {
            w.done();
        } else {
            w.progress();
        }
    }
}

/// The attempt failed because kvroute cut it: its backend was found down.
pub(super) fn was_cut(ctx: &Ctx) -> bool {
    ctx.attempts.watch.as_ref().is_some_and(|w| w.was_cut())
}
