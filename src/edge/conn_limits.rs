//! The limits a client connection lives by, read from the config in force when it opened.

use std::time::Duration;

use crate::config::Config;

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
