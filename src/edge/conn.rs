//! One client connection as the protocol loops (`h1`, `h2`) see it: the limits it lives by,
//! read from the config in force when it opened, and what it shares with the listener.

use pingora::server::ShutdownWatch;
use std::time::Duration;

use super::signals::ConnSignal;
use super::state::EdgeState;
use crate::config::Config;

/// What a protocol loop serves a connection with.
pub(super) struct Conn<'a> {
    pub edge: &'a EdgeState,
    pub shutdown: &'a ShutdownWatch,
    pub limits: &'a ConnLimits,
    /// The proxy's reports about this connection (`None` without a peer address).
    pub signal: Option<ConnSignal>,
    /// The client's address, for logs.
    pub peer: &'a str,
}

/// A connection's limits, from the config in force when it opened. The generation itself is not
/// held, so a long keep-alive connection pins no old fleet.
pub(super) struct ConnLimits {
    pub header: Duration,
    pub idle: Duration,
    pub handshake: Duration,
    pub max_connections: usize,
    pub h2c: bool,
    pub h2_max_concurrent_streams: u32,
    pub h2_max_client_resets: u32,
    pub h2_reset_window_ms: u64,
}

impl ConnLimits {
    pub fn of(c: &Config) -> ConnLimits {
        ConnLimits {
            header: Duration::from_millis(c.timeouts.client_header_ms),
            idle: Duration::from_millis(c.timeouts.client_idle_ms),
            handshake: Duration::from_millis(c.timeouts.tls_handshake_ms),
            max_connections: c.limits.max_connections,
            h2c: c.h2c,
            h2_max_concurrent_streams: c.limits.h2_max_concurrent_streams,
            h2_max_client_resets: c.limits.h2_max_client_resets,
            h2_reset_window_ms: c.limits.h2_reset_window_ms,
        }
    }
}
