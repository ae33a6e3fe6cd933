//! How kvroute reaches a backend: plaintext HTTP/1.1, or TLS with the backend's own SNI and CA
//! (`backends[].tls`). Requests, health checks and metrics scrapes all connect through
//! [`http_peer`], so they reach the engine the same way.

use openssl::x509::X509;
use pingora::connectors::http::v1;
use pingora::prelude::HttpPeer;
use pingora::protocols::http::v1::client::HttpSession;
use pingora::protocols::l4::stream::Stream;
use pingora::protocols::ALPN;
use pingora::upstreams::peer::Peer;
use pingora::ErrorType;
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use super::error::FleetError;
use crate::config::BackendTlsConfig;

/// The HTTP/1.1 connector of kvroute's own requests to TLS engines (health checks, metrics and
/// model-list scrapes), one per process, built when the first TLS backend is loaded: each
/// Pingora connector builds a TLS context that parses the system's CA bundle (about 0.9 MiB of
/// heap on Debian 12, measured), which a plaintext fleet never uses. Pingora's `HttpHealthCheck`
/// and HTTP connector would each build two (HTTP/1 and HTTP/2), per TLS backend for the check.
fn tls_probe_connector() -> &'static v1::Connector {
    static CONNECTOR: OnceLock<v1::Connector> = OnceLock::new();
    CONNECTOR.get_or_init(|| v1::Connector::new(None))
}

/// An HTTP/1.1 session to `peer` for one of kvroute's own requests, within the peer's
/// connection timeout. Plaintext engines are reached over a TCP connection of their own, so
/// the TLS context above is only built when a TLS backend is probed.
pub(super) async fn probe_session(peer: &HttpPeer) -> pingora::Result<HttpSession> {
    if peer.is_tls() {
        let (session, _) = tls_probe_connector().get_http_session(peer).await?;
        return Ok(session);
    }
    let Some(addr) = peer.address().as_inet().copied() else {
        return pingora::Error::e_explain(
            ErrorType::InternalError,
            "kvroute probes backends at IP addresses only",
        );
    };
    let connect = tokio::net::TcpStream::connect(addr);
    let connected = match peer.options.connection_timeout {
        Some(t) => tokio::time::timeout(t, connect).await.map_err(|e| {
            pingora::Error::because(
                ErrorType::ConnectTimedout,
                format!("timeout {t:?} connecting to {addr}"),
                e,
            )
        })?,
        None => connect.await,
    };
    let tcp = connected.map_err(|e| {
        pingora::Error::because(ErrorType::ConnectError, format!("connecting to {addr}"), e)
    })?;
    // As Pingora's connector sets it on its own connections; a probe that cannot is no worse.
    let _ = tcp.set_nodelay(true);
    let mut session = HttpSession::new_with_options(Box::new(Stream::from(tcp)), peer);
    // Pingora's connector sets these on the sessions it makes; `new_with_options` does not, and
    // without them a check of a hung engine (its socket open, nothing read) never ends.
    session.read_timeout = peer.options.read_timeout;
    session.write_timeout = peer.options.write_timeout;
    Ok(session)
}

/// Hand a finished session back for reuse: TLS sessions go to the connector's idle pool (a
/// handshake per scrape would cost the engine more than the scrape); plaintext ones close.
pub(super) async fn release_probe_session(session: HttpSession, peer: &HttpPeer, idle: Duration) {
    if peer.is_tls() {
        tls_probe_connector()
            .release_http_session(session, peer, Some(idle))
            .await;
    }
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
        // Built here, on the thread that loads the config, rather than by the first probe on a
        // proxy thread: the parse lands in the main heap, and no check waits for it.
        tls_probe_connector();
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

#[cfg(test)]
mod tests {
    use super::*;
    use pingora::http::RequestHeader;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn peer(addr: SocketAddr) -> HttpPeer {
        let mut peer = http_peer(addr, None);
        peer.options.connection_timeout = Some(Duration::from_secs(2));
        peer.options.read_timeout = Some(Duration::from_secs(2));
        peer
    }

    #[tokio::test]
    async fn a_plaintext_probe_gets_the_engines_answer() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let engine = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut req = vec![0; 1024];
            let n = s.read(&mut req).await.unwrap();
            s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nready")
                .await
                .unwrap();
            String::from_utf8_lossy(&req[..n]).into_owned()
        });
        let mut session = probe_session(&peer(addr)).await.unwrap();
        let mut req = RequestHeader::build("GET", b"/health", None).unwrap();
        req.append_header("Host", "localhost").unwrap();
        session.write_request_header(Box::new(req)).await.unwrap();
        session.finish_body().await.unwrap();
        session.read_response().await.unwrap();
        assert_eq!(session.resp_header().unwrap().status.as_u16(), 200);
        let body = session.read_body_bytes().await.unwrap().unwrap();
        assert_eq!(&body[..], b"ready");
        assert!(engine
            .await
            .unwrap()
            .starts_with("GET /health HTTP/1.1\r\n"));
    }

    #[tokio::test]
    async fn a_plaintext_probe_to_a_closed_port_is_a_connect_error() {
        let addr = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let e = probe_session(&peer(addr)).await.err().unwrap();
        assert_eq!(e.etype(), &ErrorType::ConnectError, "{e}");
    }
}
