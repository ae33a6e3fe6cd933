//! Active health checks: Pingora's load balancer checks the backends of the fleet in force.

use arc_swap::ArcSwap;
use async_trait::async_trait;
use pingora::http::RequestHeader;
use pingora_load_balancing::discovery::ServiceDiscovery;
use pingora_load_balancing::health_check::{HealthCheck, HttpHealthCheck};
use pingora_load_balancing::Backend;
use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::error::FleetError;
use super::upstream::{http_peer, UpstreamTls};
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

/// The backends reached over TLS, by address, replaced on reload with the membership.
#[derive(Clone, Default)]
pub(super) struct TlsTargets(pub(super) Arc<ArcSwap<HashMap<SocketAddr, Arc<UpstreamTls>>>>);

/// Pingora's HTTP check for `cfg`, through `tls` when given.
fn http_check(
    cfg: &HealthCheckConfig,
    tls: Option<&UpstreamTls>,
) -> Result<HttpHealthCheck, FleetError> {
    let host = tls.map_or("localhost", |t| t.sni.as_str());
    let mut hc = HttpHealthCheck::new(host, false);
    let mut req = RequestHeader::build("GET", cfg.path.as_bytes(), None)
        .map_err(|e| FleetError::HealthCheck(e.to_string()))?;
    req.append_header("Host", host)
        .map_err(|e| FleetError::HealthCheck(e.to_string()))?;
    hc.req = req;
    // The address is a placeholder: each check sets the backend's.
    hc.peer_template = http_peer(SocketAddr::from(([0, 0, 0, 0], 1)), tls);
    let timeout = Some(Duration::from_millis(cfg.timeout_ms));
    hc.peer_template.options.connection_timeout = timeout;
    hc.peer_template.options.read_timeout = timeout;
    hc.consecutive_success = cfg.consecutive_success;
    hc.consecutive_failure = cfg.consecutive_failure;
    Ok(hc)
}

/// A TLS backend's check and the settings it was built with.
type TlsCheck = (Arc<UpstreamTls>, Arc<HttpHealthCheck>);

/// Pingora's HTTP health check, per backend over plaintext or TLS: Pingora's own check has one
/// peer template for every backend.
pub(super) struct FleetHealthCheck {
    cfg: HealthCheckConfig,
    plain: HttpHealthCheck,
    targets: TlsTargets,
    /// One check per TLS backend, rebuilt when a reload gives it new settings.
    tls_checks: Mutex<HashMap<SocketAddr, TlsCheck>>,
}

impl FleetHealthCheck {
    fn tls_check(
        &self,
        addr: SocketAddr,
        tls: Arc<UpstreamTls>,
    ) -> pingora::Result<Arc<HttpHealthCheck>> {
        let mut checks = self
            .tls_checks
            .lock()
            .map_err(|_| pingora::Error::explain(pingora::ErrorType::InternalError, "poisoned"))?;
        if let Some((t, hc)) = checks.get(&addr) {
            if Arc::ptr_eq(t, &tls) {
                return Ok(hc.clone());
            }
        }
        let hc = Arc::new(http_check(&self.cfg, Some(&tls)).map_err(|e| {
            pingora::Error::explain(pingora::ErrorType::InternalError, e.to_string())
        })?);
        checks.insert(addr, (tls, hc.clone()));
        Ok(hc)
    }
}

#[async_trait]
impl HealthCheck for FleetHealthCheck {
    async fn check(&self, target: &Backend) -> pingora::Result<()> {
        let addr = target.addr.as_inet().copied();
        let tls = addr.and_then(|a| self.targets.0.load().get(&a).cloned().map(|t| (a, t)));
        match tls {
            None => self.plain.check(target).await,
            Some((a, t)) => self.tls_check(a, t)?.check(target).await,
        }
    }

    fn health_threshold(&self, success: bool) -> usize {
        self.plain.health_threshold(success)
    }
}

pub(super) fn health_check(
    cfg: &HealthCheckConfig,
    targets: TlsTargets,
) -> Result<Box<FleetHealthCheck>, FleetError> {
    Ok(Box::new(FleetHealthCheck {
        cfg: cfg.clone(),
        plain: http_check(cfg, None)?,
        targets,
        tls_checks: Mutex::new(HashMap::new()),
    }))
}
