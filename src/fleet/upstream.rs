//! How kvroute reaches a backend: plaintext HTTP/1.1, or TLS with the backend's own SNI and CA
//! (`backends[].tls`). Requests, health checks and metrics scrapes all connect through
//! [`http_peer`], so they reach the engine the same way.

use openssl::x509::X509;
use pingora::connectors::http::v1;
use pingora::prelude::HttpPeer;
use pingora::protocols::ALPN;
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};

use super::error::FleetError;
use crate::config::BackendTlsConfig;

/// The HTTP/1.1 connector of kvroute's own requests to the engines (health checks, metrics and
/// model-list scrapes), one per process: each Pingora connector builds a TLS context that parses
/// the system's CA bundle (about 0.9 MiB apiece), and Pingora's `HttpHealthCheck` and HTTP
/// connector would each build two (HTTP/1 and HTTP/2), per TLS backend for the check. Sessions
/// are never returned to its pool, so one connector serves every runtime that uses it.
pub(super) fn probe_connector() -> Arc<v1::Connector> {
    static CONNECTOR: OnceLock<Arc<v1::Connector>> = OnceLock::new();
    CONNECTOR
        .get_or_init(|| Arc::new(v1::Connector::new(None)))
        .clone()
}

/// A backend's TLS settings, its CA bundle read and parsed.
#[derive(Debug)]
pub struct UpstreamTls {
    pub sni: String,
    ca: Option<Arc<Box<[X509]>>>,
    verify: bool,
}

impl UpstreamTls {
    /// Read the CA bundle `cfg` names (on every build of the fleet, so a reload picks up a
    /// changed bundle).
    pub fn load(backend: &str, cfg: &BackendTlsConfig) -> Result<UpstreamTls, FleetError> {
        let bad = |reason: String| FleetError::BackendTls {
            backend: backend.to_string(),
            reason,
        };
        let ca = match &cfg.ca {
            None => None,
            Some(path) => {
                let pem = std::fs::read(path)
                    .map_err(|e| bad(format!("{}: cannot read: {e}", path.display())))?;
                let certs = X509::stack_from_pem(&pem)
                    .map_err(|e| bad(format!("{}: not a PEM bundle: {e}", path.display())))?;
                if certs.is_empty() {
                    return Err(bad(format!("{}: holds no certificate", path.display())));
                }
                Some(Arc::new(certs.into_boxed_slice()))
            }
        };
        Ok(UpstreamTls {
            sni: cfg.sni.clone(),
            ca,
            verify: cfg.verify,
        })
    }
}

/// A Pingora peer for `addr`: TLS (HTTP/1.1 by ALPN, as the engines serve) when `tls` is set.
pub fn http_peer(addr: SocketAddr, tls: Option<&UpstreamTls>) -> HttpPeer {
    match tls {
        None => HttpPeer::new(addr, false, String::new()),
        Some(t) => {
            let mut peer = HttpPeer::new(addr, true, t.sni.clone());
            peer.options.alpn = ALPN::H1;
            peer.options.verify_cert = t.verify;
            peer.options.verify_hostname = t.verify;
            peer.options.ca = t.ca.clone();
            peer
        }
    }
}
