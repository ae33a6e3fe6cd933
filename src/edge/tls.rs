//! TLS termination for the client listener: the certificate in force, its checks, and the
//! handshake under a deadline.
//!
//! kvroute runs the handshake itself, on a plain Pingora TCP listener, rather than through
//! Pingora's TLS listener: Pingora's handshake timeout is a fixed 60 s (a slowloris window), and
//! its acceptor is fixed at start. Here the acceptor sits behind an `ArcSwap`, so a reload that
//! installs a renewed certificate affects new handshakes only; established connections keep the
//! session they negotiated. OpenSSL (Debian's libssl) rather than rustls, which Pingora marks
//! experimental: it is the TLS stack Pingora itself is built and run on.

use arc_swap::ArcSwap;
use openssl::asn1::Asn1Time;
use openssl::pkey::{PKey, Private};
use openssl::ssl::{
    select_next_proto, AlpnError, SslAcceptor, SslMethod, SslOptions, SslVerifyMode, SslVersion,
};
use openssl::x509::store::X509StoreBuilder;
use openssl::x509::X509;
use pingora::protocols::l4::stream::Stream as L4Stream;
use pingora::protocols::tls::server::handshake;
use pingora::protocols::Stream;
use prometheus::{Gauge, IntCounterVec, Registry};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use crate::config::TlsConfig;
use crate::metrics::{counter_vec, gauge};

/// ALPN, in the server's order of preference (wire format).
const ALPN_H2_H1: &[u8] = b"\x02h2\x08http/1.1";

/// Key exchange groups: Mozilla's intermediate profile (OpenSSL's default list adds X448,
/// secp521r1 and the finite-field groups).
const GROUPS: &str = "X25519:P-256:P-384";

/// TLS 1.2 suites: Mozilla's intermediate profile without its two DHE suites, whose
/// finite-field exchange is slow and whose parameters a client cannot pick (the external probe
/// flagged them); every client that has them has ECDHE. TLS 1.3's suites are OpenSSL's.
const TLS12_CIPHERS: &str = "ECDHE-ECDSA-AES128-GCM-SHA256:ECDHE-RSA-AES128-GCM-SHA256:\
                             ECDHE-ECDSA-AES256-GCM-SHA384:ECDHE-RSA-AES256-GCM-SHA384:\
                             ECDHE-ECDSA-CHACHA20-POLY1305:ECDHE-RSA-CHACHA20-POLY1305";

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

/// A checked certificate and key, ready to serve.
pub struct TlsIdentity {
    acceptor: SslAcceptor,
    /// Unix time at which the leaf certificate expires.
    pub not_after: i64,
    /// The leaf's serial number, in hex.
    pub serial: String,
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

/// Read and check the files `cfg` names: the chain parses, the key parses and matches the leaf
/// certificate, the leaf has not expired, the client CA bundle (if any) parses. Builds the
/// acceptor: TLS 1.2 and 1.3 only (Mozilla's intermediate profile: its groups, its suites but
/// no DHE), ALPN h2 then http/1.1, no renegotiation, and client certificates required when
/// `client_ca` is set.
pub fn load(cfg: &TlsConfig) -> Result<TlsIdentity, TlsError> {
    let chain = certificates(&cfg.cert)?;
    let key: PKey<Private> = PKey::private_key_from_pem(&read(&cfg.key)?)
        .map_err(|e| tls_err(&cfg.key, format!("not a PEM private key: {e}")))?;
    let leaf = &chain[0];
    let matches = leaf
        .public_key()
        .map(|public| public.public_eq(&key))
        .unwrap_or(false);
    if !matches {
        return Err(tls_err(
            &cfg.key,
            format!(
                "does not match the certificate in {} (the first certificate of the chain)",
                cfg.cert.display()
            ),
        ));
    }
    let not_after = unix_time(leaf.not_after())
        .ok_or_else(|| tls_err(&cfg.cert, "unreadable notAfter date"))?;
    if not_after <= now_unix() {
        return Err(tls_err(
            &cfg.cert,
            format!("the certificate expired at {}", leaf.not_after()),
        ));
    }
    let serial = leaf
        .serial_number()
        .to_bn()
        .and_then(|n| n.to_hex_str().map(|s| s.to_string()))
        .unwrap_or_default();

    let openssl_err = |path: &Path, what: &str, e: openssl::error::ErrorStack| {
        tls_err(path, format!("{what}: {e}"))
    };
    let mut b = SslAcceptor::mozilla_intermediate_v5(SslMethod::tls_server())
        .map_err(|e| openssl_err(&cfg.cert, "cannot create a TLS context", e))?;
    b.set_min_proto_version(Some(SslVersion::TLS1_2))
        .map_err(|e| openssl_err(&cfg.cert, "cannot set TLS 1.2 as minimum", e))?;
    // The server's order: every suite offered is an AEAD one with forward secrecy, and
    // scanners (testssl.sh) rate leaving the choice to the client high.
    b.set_options(SslOptions::NO_RENEGOTIATION | SslOptions::CIPHER_SERVER_PREFERENCE);
    b.set_groups_list(GROUPS)
        .map_err(|e| openssl_err(&cfg.cert, "cannot set the key exchange groups", e))?;
    b.set_cipher_list(TLS12_CIPHERS)
        .map_err(|e| openssl_err(&cfg.cert, "cannot set the TLS 1.2 suites", e))?;
    b.set_certificate(leaf)
        .map_err(|e| openssl_err(&cfg.cert, "certificate rejected", e))?;
    for extra in &chain[1..] {
        b.add_extra_chain_cert(extra.clone())
            .map_err(|e| openssl_err(&cfg.cert, "chain certificate rejected", e))?;
    }
    b.set_private_key(&key)
        .map_err(|e| openssl_err(&cfg.key, "key rejected", e))?;
    b.check_private_key()
        .map_err(|e| openssl_err(&cfg.key, "does not match the certificate", e))?;
    b.set_alpn_select_callback(|_, client| {
        select_next_proto(ALPN_H2_H1, client).ok_or(AlpnError::NOACK)
    });
    if let Some(ca_path) = &cfg.client_ca {
        let cas = certificates(ca_path)?;
        let mut store =
            X509StoreBuilder::new().map_err(|e| openssl_err(ca_path, "cannot build a store", e))?;
        for ca in &cas {
            store
                .add_cert(ca.clone())
                .map_err(|e| openssl_err(ca_path, "CA certificate rejected", e))?;
            b.add_client_ca(ca)
                .map_err(|e| openssl_err(ca_path, "CA name rejected", e))?;
        }
        b.set_verify_cert_store(store.build())
            .map_err(|e| openssl_err(ca_path, "cannot use the CA bundle", e))?;
        b.set_verify(SslVerifyMode::PEER | SslVerifyMode::FAIL_IF_NO_PEER_CERT);
    }
    Ok(TlsIdentity {
        acceptor: b.build(),
        not_after,
        serial,
    })
}

/// Why a client connection did not complete its TLS handshake.
pub enum HandshakeFailure {
    TimedOut,
    Failed(String),
}

/// The TLS listener's certificate in force and its metric families.
pub struct TlsEdge {
    acceptor: ArcSwap<SslAcceptor>,
    expiry: Gauge,
    handshakes: IntCounterVec,
}

impl TlsEdge {
    pub fn register(r: &Registry, first: TlsIdentity) -> prometheus::Result<TlsEdge> {
        let expiry = gauge(
            r,
            "kvroute_tls_certificate_expiry_timestamp_seconds",
            "Unix time at which the TLS listener's certificate (kvroute.tls.cert) expires.",
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
        expiry.set(first.not_after as f64);
        Ok(TlsEdge {
            acceptor: ArcSwap::from_pointee(first.acceptor),
            expiry,
            handshakes,
        })
    }

    /// Serve `id` to new handshakes; connections already open keep theirs.
    pub fn install(&self, id: TlsIdentity) {
        self.expiry.set(id.not_after as f64);
        self.acceptor.store(Arc::new(id.acceptor));
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
        let acceptor = self.acceptor.load_full();
        let result = tokio::time::timeout(deadline, handshake(&acceptor, *l4)).await;
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
