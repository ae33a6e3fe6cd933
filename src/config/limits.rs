//! `kvroute.limits` and `kvroute.timeouts`: what one client, request or backend may hold.

use serde::Deserialize;

use super::error::{err, ConfigError};

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct LimitsConfig {
    /// Largest request body accepted (413 above it).
    pub max_body_bytes: usize,
    /// Request bodies being received or parsed at once, in bytes of memory (a body's parse
    /// counts as what it may allocate): past it a body is refused with 503. At least
    /// `max_body_bytes`.
    pub body_memory_bytes: usize,
    /// Response bytes read ahead of the client on one plaintext engine connection, so that an
    /// engine's finished response frees its backend's place however slowly the client reads
    /// (0: off; Pingora then reads the engine only as fast as the client takes it).
    pub upstream_read_ahead_bytes: usize,
    /// Response bytes read ahead on all engine connections together.
    pub read_ahead_memory_bytes: usize,
    /// Read ahead for HTTP/1.1 clients too, not only HTTP/2 ones.
    pub read_ahead_http1: bool,
    /// Upstream attempts per request (first try included); only failures before the first
    /// response byte are retried, each on a backend not tried yet.
    pub max_attempts: u32,
    /// Times one stream may be continued on another backend after its backend failed
    /// mid-response (0: never; the stream then ends with an error event).
    pub max_migrations: u32,
    /// Seconds suggested in `Retry-After` when no backend can take a request.
    pub retry_after_seconds: u32,
    /// Hard cap of requests in flight per backend (per unit of weight); when every backend is
    /// at it, requests wait in the router queue.
    pub backend_max_inflight: u64,
    /// Requests that may wait in the router queue; more are shed with 503.
    pub queue_size: usize,
    /// Longest wait in the router queue before a request is shed with 503.
    pub queue_timeout_ms: u64,
    /// Requests retrying at once may be at most this share of the requests in flight ...
    pub retry_budget_ratio: f64,
    /// ... or this many, whichever is more.
    pub retry_budget_min: u64,
    /// Client connections open at once; more are closed on accept.
    pub max_connections: usize,
    /// HTTP/2 streams one client connection may have open at once (advertised in SETTINGS).
    pub h2_max_concurrent_streams: u32,
    /// An HTTP/2 connection whose client abandons (resets) more than this many streams within
    /// `h2_reset_window_ms` is closed: the rapid-reset attack (CVE-2023-44487) makes the proxy
    /// start backend work for streams the client cancels at once.
    pub h2_max_client_resets: u32,
    /// See `h2_max_client_resets`.
    pub h2_reset_window_ms: u64,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        LimitsConfig {
            max_body_bytes: 32 * 1024 * 1024,
            body_memory_bytes: 64 * 1024 * 1024,
            upstream_read_ahead_bytes: 256 * 1024,
            read_ahead_memory_bytes: 64 * 1024 * 1024,
            read_ahead_http1: false,
            max_attempts: 3,
            max_migrations: 2,
            retry_after_seconds: 1,
            backend_max_inflight: 256,
            queue_size: 1024,
            queue_timeout_ms: 10_000,
            retry_budget_ratio: 0.2,
            retry_budget_min: 3,
            max_connections: 10_000,
            h2_max_concurrent_streams: 128,
            h2_max_client_resets: 100,
            h2_reset_window_ms: 10_000,
        }
    }
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct TimeoutsConfig {
    /// TCP connect to a backend.
    pub connect_ms: u64,
    /// Longest silence while reading from a backend. Long prefills produce no bytes until the
    /// first token, so this must exceed the worst TTFT you expect.
    pub upstream_read_ms: u64,
    /// Longest wait for each read of the client's request body.
    pub client_body_read_ms: u64,
    /// The whole request body must arrive within this (408 after), however it trickles.
    pub client_body_ms: u64,
    /// A new connection's first request header must be complete within this; slower
    /// (slowloris) connections are closed. On HTTP/2, the connection preface and a first
    /// stream's headers, and after an idle spell the next stream's.
    pub client_header_ms: u64,
    /// A TLS handshake must complete within this; slower connections are closed.
    pub tls_handshake_ms: u64,
    /// A keep-alive connection may sit idle this long before its next request; that request's
    /// header must then be complete within `client_header_ms` more.
    pub client_idle_ms: u64,
    /// Longest wait for each write of a response to the client: a client that stops reading
    /// (an HTTP/2 stream held at a zero window, a full socket) is cut after it, and the
    /// request's place on its backend freed.
    pub client_write_ms: u64,
    /// A streamed request whose backend sends nothing for max(this, `first_byte_factor` x the
    /// predicted time to first token) is treated as hung: retried elsewhere (no byte has
    /// reached the client) and counted toward outlier ejection. Also bounds each later read of
    /// the stream. Capped by `upstream_read_ms`.
    pub first_byte_floor_ms: u64,
    /// See `first_byte_floor_ms`.
    pub first_byte_factor: f64,
}

impl Default for TimeoutsConfig {
    fn default() -> Self {
        TimeoutsConfig {
            connect_ms: 2000,
            upstream_read_ms: 300_000,
            client_body_read_ms: 30_000,
            client_body_ms: 60_000,
            client_header_ms: 10_000,
            tls_handshake_ms: 10_000,
            client_idle_ms: 60_000,
            client_write_ms: 30_000,
            first_byte_floor_ms: 30_000,
            first_byte_factor: 10.0,
        }
    }
}

impl LimitsConfig {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if self.max_body_bytes == 0 {
            return Err(err("kvroute.limits.max_body_bytes", "must be positive"));
        }
        if self.body_memory_bytes < self.max_body_bytes {
            return Err(err(
                "kvroute.limits.body_memory_bytes",
                format!(
                    "must be at least limits.max_body_bytes ({}): a body that size could \
                     never be read",
                    self.max_body_bytes
                ),
            ));
        }
        if self.max_attempts == 0 || self.max_attempts > 16 {
            return Err(err(
                "kvroute.limits.max_attempts",
                "must be between 1 and 16",
            ));
        }
        if self.max_migrations > 16 {
            return Err(err(
                "kvroute.limits.max_migrations",
                "must be between 0 and 16",
            ));
        }
        if self.backend_max_inflight == 0 {
            return Err(err(
                "kvroute.limits.backend_max_inflight",
                "must be positive",
            ));
        }
        if self.queue_timeout_ms == 0 {
            return Err(err("kvroute.limits.queue_timeout_ms", "must be positive"));
        }
        if !(0.0..=10.0).contains(&self.retry_budget_ratio) {
            return Err(err(
                "kvroute.limits.retry_budget_ratio",
                "must be between 0 and 10",
            ));
        }
        if self.max_connections == 0 {
            return Err(err("kvroute.limits.max_connections", "must be positive"));
        }
        for (key, v) in [
            (
                "kvroute.limits.h2_max_concurrent_streams",
                u64::from(self.h2_max_concurrent_streams),
            ),
            (
                "kvroute.limits.h2_max_client_resets",
                u64::from(self.h2_max_client_resets),
            ),
            ("kvroute.limits.h2_reset_window_ms", self.h2_reset_window_ms),
        ] {
            if v == 0 {
                return Err(err(key, "must be positive"));
            }
        }
        Ok(())
    }
}

impl TimeoutsConfig {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        for (key, v) in [
            ("kvroute.timeouts.connect_ms", self.connect_ms),
            ("kvroute.timeouts.upstream_read_ms", self.upstream_read_ms),
            (
                "kvroute.timeouts.client_body_read_ms",
                self.client_body_read_ms,
            ),
            ("kvroute.timeouts.client_body_ms", self.client_body_ms),
            ("kvroute.timeouts.client_header_ms", self.client_header_ms),
            ("kvroute.timeouts.tls_handshake_ms", self.tls_handshake_ms),
            ("kvroute.timeouts.client_idle_ms", self.client_idle_ms),
            ("kvroute.timeouts.client_write_ms", self.client_write_ms),
            (
                "kvroute.timeouts.first_byte_floor_ms",
                self.first_byte_floor_ms,
            ),
        ] {
            if v == 0 {
                return Err(err(key, "must be positive"));
            }
        }
        if !(self.first_byte_factor.is_finite() && self.first_byte_factor >= 1.0) {
            return Err(err(
                "kvroute.timeouts.first_byte_factor",
                "must be at least 1",
            ));
        }
        Ok(())
    }
}
