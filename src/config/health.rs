//! How kvroute watches its backends: active health checks, passive outlier ejection and engine
//! telemetry scraping.

use serde::Deserialize;

use super::error::{err, ConfigError};

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct HealthCheckConfig {
    /// Path requested with `GET`; any 2xx is healthy.
    pub path: String,
    pub interval_ms: u64,
    pub timeout_ms: u64,
    /// Consecutive results needed to flip a backend's state.
    pub consecutive_success: usize,
    pub consecutive_failure: usize,
}

impl Default for HealthCheckConfig {
    fn default() -> Self {
        HealthCheckConfig {
            path: "/health".into(),
            interval_ms: 1000,
            timeout_ms: 1000,
            consecutive_success: 1,
            consecutive_failure: 1,
        }
    }
}

impl HealthCheckConfig {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if !self.path.starts_with('/') {
            return Err(err("kvroute.health_check.path", "must start with '/'"));
        }
        if self.interval_ms < 50 {
            return Err(err(
                "kvroute.health_check.interval_ms",
                "must be at least 50",
            ));
        }
        if self.timeout_ms == 0 {
            return Err(err("kvroute.health_check.timeout_ms", "must be positive"));
        }
        if self.consecutive_success == 0 || self.consecutive_failure == 0 {
            return Err(err(
                "kvroute.health_check.consecutive_success",
                "consecutive_success and consecutive_failure must be at least 1",
            ));
        }
        Ok(())
    }
}

/// Passive outlier ejection (see `fleet/outlier.rs`).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct OutlierConfig {
    pub enabled: bool,
    /// Failures in a row (connect errors, resets and timeouts before a response, 5xx but 503)
    /// that eject a backend.
    pub consecutive_failures: u32,
    /// First ejection; each further one without a success in between doubles it.
    pub base_ejection_ms: u64,
    pub max_ejection_ms: u64,
    /// Never eject more than this share of the fleet.
    pub max_ejected_percent: u32,
}

impl Default for OutlierConfig {
    fn default() -> Self {
        OutlierConfig {
            enabled: true,
            consecutive_failures: 5,
            base_ejection_ms: 10_000,
            max_ejection_ms: 300_000,
            max_ejected_percent: 50,
        }
    }
}

impl OutlierConfig {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if self.consecutive_failures == 0 {
            return Err(err(
                "kvroute.outlier.consecutive_failures",
                "must be at least 1",
            ));
        }
        if self.base_ejection_ms == 0 || self.max_ejection_ms < self.base_ejection_ms {
            return Err(err(
                "kvroute.outlier.max_ejection_ms",
                "base_ejection_ms must be positive and at most max_ejection_ms",
            ));
        }
        if self.max_ejected_percent > 100 {
            return Err(err(
                "kvroute.outlier.max_ejected_percent",
                "must be between 0 and 100",
            ));
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct TelemetryConfig {
    /// Scrape each backend's engine metrics.
    pub enabled: bool,
    pub interval_ms: u64,
    /// One scrape's deadline.
    pub timeout_ms: u64,
    /// Older samples are ignored; placement then uses kvroute's own accounting alone.
    pub stale_after_ms: u64,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        TelemetryConfig {
            enabled: true,
            interval_ms: 1000,
            timeout_ms: 500,
            stale_after_ms: 3000,
        }
    }
}

impl TelemetryConfig {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if self.interval_ms < 100 || self.timeout_ms == 0 || self.stale_after_ms == 0 {
            return Err(err(
                "kvroute.telemetry",
                "interval_ms must be at least 100, timeout_ms and stale_after_ms positive",
            ));
        }
        Ok(())
    }
}
