//! TLS termination for the client listener: the certificate in force, its session ticket keys
//! and their rotation, and the handshake under a deadline. Reading and checking the files is
//! `identity`'s; the OCSP response's checks are `ocsp`'s.
//!
//! kvroute runs the handshake itself, on a plain Pingora TCP listener, rather than through
//! Pingora's TLS listener: Pingora's handshake timeout is a fixed 60 s (a slowloris window), and
//! its acceptor is fixed at start. Here the acceptor sits behind an `ArcSwap`, so a reload that
//! installs a renewed certificate affects new handshakes only; established connections keep the
//! session they negotiated. OpenSSL (Debian's libssl) rather than rustls, which Pingora marks
//! experimental: it is the TLS stack Pingora itself is built and run on.

use arc_swap::ArcSwap;
use openssl::asn1::Asn1Time;
use openssl::ssl::SslAcceptor;
use openssl::x509::X509;
use pingora::protocols::l4::stream::Stream as L4Stream;
use pingora::protocols::tls::server::handshake;
use pingora::protocols::Stream;
use prometheus::{Gauge, IntCounter, IntCounterVec, Registry};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::metrics::{counter, counter_vec, gauge};

mod identity;
mod ocsp;

use identity::Material;
pub use identity::{load, TlsIdentity};

/// Why a certificate, key or CA file cannot be served; names the file.
#[derive(Debug, Clone, PartialEq)]
pub struct TlsError {
    pub path: PathBuf,
    pub reason: String,
}

impl fmt::Display for TlsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path.display(), self.reason)
    }
}

impl std::error::Error for TlsError {}

fn tls_err(path: &Path, reason: impl Into<String>) -> TlsError {
    TlsError {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|e| tls_err(path, format!("cannot read: {e}")))
}

fn certificates(path: &Path) -> Result<Vec<X509>, TlsError> {
    let chain = X509::stack_from_pem(&read(path)?)
        .map_err(|e| tls_err(path, format!("not a PEM certificate file: {e}")))?;
    if chain.is_empty() {
        return Err(tls_err(path, "holds no PEM certificate"));
    }
    Ok(chain)
}

fn unix_time(t: &openssl::asn1::Asn1TimeRef) -> Option<i64> {
    let d = Asn1Time::from_unix(0).ok()?.diff(t).ok()?;
    Some(i64::from(d.days) * 86_400 + i64::from(d.secs))
}

fn now_unix() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

/// Why a client connection did not complete its TLS handshake.
pub enum HandshakeFailure {
    TimedOut,
    Failed(String),
}

/// The acceptor new handshakes use, and since when: its ticket keys are replaced when it is
/// older than the rotation period.
struct Serving {
    acceptor: SslAcceptor,
    material: Arc<Material>,
    since: Instant,
}

/// The TLS listener's certificate in force and its metric families.
pub struct TlsEdge {
    serving: ArcSwap<Serving>,
    /// Held while a fresh acceptor is built, so that handshakes arriving together rotate once.
    rotating: Mutex<()>,
    expiry: Gauge,
    ocsp_next_update: Gauge,
    rotations: IntCounter,
    handshakes: IntCounterVec,
}

impl TlsEdge {
    pub fn register(r: &Registry, first: TlsIdentity) -> prometheus::Result<TlsEdge> {
        let expiry = gauge(
            r,
            "kvroute_tls_certificate_expiry_timestamp_seconds",
            "Unix time at which the TLS listener's certificate (kvroute.tls.cert) expires.",
        )?;
        let ocsp_next_update = gauge(
            r,
            "kvroute_tls_ocsp_next_update_timestamp_seconds",
            "Unix time after which the stapled OCSP response (kvroute.tls.ocsp_response) is \
             stale and no longer sent; 0 when none is stapled or it has no nextUpdate.",
        )?;
        let rotations = counter(
            r,
            "kvroute_tls_ticket_key_rotations_total",
            "Times the session ticket keys were replaced on their timer \
             (kvroute.tls.ticket_key_rotation_seconds); reloads replace them too, uncounted.",
        )?;
        let handshakes = counter_vec(
            r,
            "kvroute_tls_handshakes_total",
            "TLS handshakes with clients, by result (ok, failed, timeout).",
            &["result"],
        )?;
        for result in ["ok", "failed", "timeout"] {
            handshakes.with_label_values(&[result]);
        }
        let edge = TlsEdge {
            serving: ArcSwap::from_pointee(Serving {
                acceptor: first.acceptor,
                material: Arc::clone(&first.material),
                since: Instant::now(),
            }),
            rotating: Mutex::new(()),
            expiry,
            ocsp_next_update,
            rotations,
            handshakes,
        };
        edge.set_gauges(first.not_after, first.ocsp_next_update);
        Ok(edge)
    }

    fn set_gauges(&self, not_after: i64, ocsp_next_update: Option<i64>) {
        self.expiry.set(not_after as f64);
        self.ocsp_next_update
            .set(ocsp_next_update.map_or(0.0, |t| t as f64));
    }

    /// Serve `id` to new handshakes; connections already open keep theirs.
    pub fn install(&self, id: TlsIdentity) {
        self.set_gauges(id.not_after, id.ocsp_next_update);
        self.serving.store(Arc::new(Serving {
            acceptor: id.acceptor,
            material: id.material,
            since: Instant::now(),
        }));
    }

    /// The acceptor for a new handshake, with fresh ticket keys if the current ones are due.
    /// Rotating on the accept path rather than on a timer task: keys are never used past their
    /// period, and an idle listener does no work.
    fn acceptor(&self) -> Arc<Serving> {
        let serving = self.serving.load_full();
        if serving.since.elapsed() < serving.material.ticket_key_rotation {
            return serving;
        }
        let Ok(_rotating) = self.rotating.try_lock() else {
            // Another handshake is building the next one; this one uses the current keys.
            return serving;
        };
        let current = self.serving.load_full();
        if !Arc::ptr_eq(&current, &serving) {
            return current;
        }
        match serving.material.acceptor() {
            Ok(acceptor) => {
                let next = Arc::new(Serving {
                    acceptor,
                    material: Arc::clone(&serving.material),
                    since: Instant::now(),
                });
                self.serving.store(Arc::clone(&next));
                self.rotations.inc();
                next
            }
            Err(e) => {
                // Built from the same checked material as the one serving: not expected. The
                // old keys stay rather than no TLS at all.
                log::error!("TLS session ticket keys not rotated: {e}");
                serving
            }
        }
    }

    /// Run the server side of the handshake on a freshly accepted connection, within `deadline`.
    pub(super) async fn accept(
        &self,
        stream: Stream,
        deadline: Duration,
    ) -> Result<Stream, HandshakeFailure> {
        let l4 = stream
            .into_any()
            .downcast::<L4Stream>()
            .map_err(|_| HandshakeFailure::Failed("not a TCP connection".into()))?;
        let serving = self.acceptor();
        let result = tokio::time::timeout(deadline, handshake(&serving.acceptor, *l4)).await;
        let outcome = match result {
            Err(_) => Err(HandshakeFailure::TimedOut),
            Ok(Err(e)) => Err(HandshakeFailure::Failed(e.to_string())),
            Ok(Ok(tls)) => Ok(Box::new(tls) as Stream),
        };
        let label = match &outcome {
            Ok(_) => "ok",
            Err(HandshakeFailure::TimedOut) => "timeout",
            Err(HandshakeFailure::Failed(_)) => "failed",
        };
        self.handshakes.with_label_values(&[label]).inc();
        outcome
    }
}
