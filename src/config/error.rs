//! A config error names the offending key.

use std::net::SocketAddr;

#[derive(Debug, Clone, PartialEq)]
pub struct ConfigError {
    /// Dotted path of the offending key, e.g. `kvroute.routing.epsilon`.
    pub key: String,
    pub reason: String,
}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.key, self.reason)
    }
}

impl std::error::Error for ConfigError {}

pub(super) fn err(key: impl Into<String>, reason: impl Into<String>) -> ConfigError {
    ConfigError {
        key: key.into(),
        reason: reason.into(),
    }
}

pub(super) fn parse_addr(key: &str, s: &str) -> Result<SocketAddr, ConfigError> {
    s.parse()
        .map_err(|_| err(key, format!("`{s}` is not an ip:port socket address")))
}
