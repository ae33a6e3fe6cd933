//! Active health checks: Pingora's load balancer checks the backends of the fleet in force.

use arc_swap::ArcSwap;
use async_trait::async_trait;
use pingora::http::RequestHeader;
use pingora_load_balancing::discovery::ServiceDiscovery;
use pingora_load_balancing::health_check::HealthCheck;
use pingora_load_balancing::Backend;
use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use super::error::FleetError;
use super::in_flight::InFlight;
use super::upstream::{http_peer, probe_session, UpstreamTls};
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

/// The HTTP check of every backend, plaintext or TLS, over kvroute's probe sessions
/// ([`probe_session`]): Pingora's `HttpHealthCheck` has one peer template for all backends,
/// so a check per TLS backend cost two TLS contexts per backend.
pub(super) struct FleetHealthCheck {
    cfg: HealthCheckConfig,
    targets: TlsTargets,
    in_flight: Arc<InFlight>,
    /// Backends found down: each further failed check cuts what has gone silent on them since
    /// (a request sent there just before the check found it down).
    down: std::sync::Mutex<std::collections::HashSet<SocketAddr>>,
}

impl FleetHealthCheck {
    fn cut_silent(&self, addr: SocketAddr) {
        let silent_for = Duration::from_millis(self.cfg.timeout_ms);
        let cut = self.in_flight.cut_silent(addr, silent_for);
        if cut > 0 {
            log::warn!(
                "backend {addr} is down: cut {cut} request(s) silent on it for {} ms or more; they go on elsewhere",
                self.cfg.timeout_ms
            );
        }
    }

    fn is_down(&self, addr: SocketAddr) -> bool {
        self.down.lock().is_ok_and(|d| d.contains(&addr))
    }
}

impl FleetHealthCheck {
    async fn probe(&self, addr: SocketAddr) -> pingora::Result<()> {
        let tls = self.targets.0.load().get(&addr).cloned();
        // The whole check, connect and answer, within two timeouts: an engine dripping its
        // answer a byte at a time is as down as a silent one, and Pingora waits for every
        // backend's check before it starts the next round.
        let bound = Duration::from_millis(self.cfg.timeout_ms.saturating_mul(2));
        let status = match tokio::time::timeout(bound, self.get(addr, tls.as_deref())).await {
            Ok(r) => r?,
            Err(_) => {
                return pingora::Error::e_explain(
                    pingora::ErrorType::ReadTimedout,
                    format!("no whole answer within {} ms", bound.as_millis()),
                )
            }
        };
        if (200..300).contains(&status) {
            Ok(())
        } else {
            pingora::Error::e_explain(
                pingora::ErrorType::CustomCode("non 2xx code", status),
                "during http healthcheck",
            )
        }
    }

    async fn get(&self, addr: SocketAddr, tls: Option<&UpstreamTls>) -> pingora::Result<u16> {
        let mut peer = http_peer(addr, tls);
        let timeout = Some(Duration::from_millis(self.cfg.timeout_ms));
        peer.options.connection_timeout = timeout;
        peer.options.read_timeout = timeout;
        peer.options.write_timeout = timeout;
        let host = tls.map_or("localhost", |t| t.sni.as_str());
        let mut req = RequestHeader::build("GET", self.cfg.path.as_bytes(), None)?;
        req.append_header("Host", host)?;
        let mut session = probe_session(&peer).await?;
        session.write_request_header(Box::new(req)).await?;
        session.finish_body().await?;
        session.read_response().await?;
        let status = session.resp_header().map_or(0, |h| h.status.as_u16());
        // Drained, so a slow or endless body fails the check by the read timeout.
        while session.read_body_ref().await?.is_some() {}
        Ok(status)
    }
}

#[async_trait]
impl HealthCheck for FleetHealthCheck {
    async fn check(&self, target: &Backend) -> pingora::Result<()> {
        let Some(addr) = target.addr.as_inet().copied() else {
            return Err(pingora::Error::explain(
                pingora::ErrorType::InternalError,
                "health check of a backend that is not an IP address",
            ));
        };
        let result = self.probe(addr).await;
        if result.is_err() && self.is_down(addr) {
            self.cut_silent(addr);
        }
        result
    }

    /// A backend found down: the requests silent on it for as long as the check waited are
    /// cut now, to go on elsewhere, rather than each at its own read deadline.
    async fn health_status_change(&self, target: &Backend, healthy: bool) {
        let Some(addr) = target.addr.as_inet().copied() else {
            return;
        };
        if let Ok(mut d) = self.down.lock() {
            if healthy {
                d.remove(&addr);
            } else {
                d.insert(addr);
            }
        }
        if !healthy {
            self.cut_silent(addr);
        }
    }

    fn health_threshold(&self, success: bool) -> usize {
        if success {
            self.cfg.consecutive_success
        } else {
            self.cfg.consecutive_failure
        }
    }
}

pub(super) fn health_check(
    cfg: &HealthCheckConfig,
    targets: TlsTargets,
    in_flight: Arc<InFlight>,
) -> Result<Box<FleetHealthCheck>, FleetError> {
    // The path must make a request line: checked here, at start and on reload.
    RequestHeader::build("GET", cfg.path.as_bytes(), None)
        .map_err(|e| FleetError::HealthCheck(e.to_string()))?;
    Ok(Box::new(FleetHealthCheck {
        cfg: cfg.clone(),
        targets,
        in_flight,
        down: Default::default(),
    }))
}
