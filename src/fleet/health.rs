//! Active health checks: Pingora's load balancer checks the backends of the fleet in force.

use arc_swap::ArcSwap;
use async_trait::async_trait;
use pingora::http::RequestHeader;
use pingora_load_balancing::discovery::ServiceDiscovery;
use pingora_load_balancing::health_check::HttpHealthCheck;
use pingora_load_balancing::Backend;
use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use super::error::FleetError;
use crate::config::HealthCheckConfig;

/// The backend set Pingora's load balancer health-checks, replaced on reload. Pingora's own
/// `Static` discovery cannot be changed from outside its crate.
#[derive(Clone, Default)]
pub(super) struct Membership(pub(super) Arc<ArcSwap<BTreeSet<Backend>>>);

#[async_trait]
impl ServiceDiscovery for Membership {
    async fn discover(&self) -> pingora::Result<(BTreeSet<Backend>, HashMap<u64, bool>)> {
        Ok((BTreeSet::clone(&self.0.load()), HashMap::new()))
    }
}

pub(super) fn health_check(cfg: &HealthCheckConfig) -> Result<Box<HttpHealthCheck>, FleetError> {
    let mut hc = HttpHealthCheck::new("localhost", false);
    let mut req = RequestHeader::build("GET", cfg.path.as_bytes(), None)
        .map_err(|e| FleetError::HealthCheck(e.to_string()))?;
    req.append_header("Host", "localhost")
        .map_err(|e| FleetError::HealthCheck(e.to_string()))?;
    hc.req = req;
    let timeout = Some(Duration::from_millis(cfg.timeout_ms));
    hc.peer_template.options.connection_timeout = timeout;
    hc.peer_template.options.read_timeout = timeout;
    hc.consecutive_success = cfg.consecutive_success;
    hc.consecutive_failure = cfg.consecutive_failure;
    Ok(Box::new(hc))
}
