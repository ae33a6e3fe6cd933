//! Why a fleet could not be built or its health checker updated.

use std::fmt;

#[derive(Debug, Clone, PartialEq)]
pub enum FleetError {
    /// A backend address that is not `ip:port`.
    BackendAddress(String),
    /// A DCGM exporter address that is not `ip:port`.
    DcgmAddress(String),
    /// The health check request could not be built.
    HealthCheck(String),
    /// Pingora's load balancer refused the backend set.
    Membership(String),
    /// A thread panicked while holding the prefix index.
    IndexPoisoned,
    /// A backend's TLS settings cannot be used (its CA bundle).
    BackendTls { backend: String, reason: String },
    /// A backend's API key file cannot be used.
    BackendApiKey { backend: String, reason: String },
}

impl fmt::Display for FleetError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FleetError::BackendAddress(a) => write!(f, "invalid backend address {a}"),
            FleetError::DcgmAddress(a) => write!(f, "invalid dcgm_addr {a}"),
            FleetError::HealthCheck(e) => write!(f, "health check: {e}"),
            FleetError::Membership(e) => write!(f, "backends: {e}"),
            FleetError::IndexPoisoned => f.write_str("prefix index lock poisoned"),
            FleetError::BackendTls { backend, reason } => {
                write!(f, "backend {backend}: tls: {reason}")
            }
            FleetError::BackendApiKey { backend, reason } => {
                write!(f, "backend {backend}: api_key_file: {reason}")
            }
        }
    }
}

impl std::error::Error for FleetError {}
