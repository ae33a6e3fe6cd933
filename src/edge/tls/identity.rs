//! The listener's identity: the certificate chain, key, client CA bundle and OCSP response read
//! and checked once, and the OpenSSL acceptor built from them, as often as the ticket keys are
//! replaced.

use openssl::pkey::{PKey, Private};
use openssl::ssl::{
    select_next_proto, AlpnError, SslAcceptor, SslMethod, SslOptions, SslVerifyMode, SslVersion,
};
use openssl::x509::store::X509StoreBuilder;
use openssl::x509::X509;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use super::ocsp::{self, Staple};
use super::{certificates, now_unix, read, tls_err, unix_time, TlsError};
use crate::config::TlsConfig;

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

/// What the files hold, checked; kept so that acceptors with fresh ticket keys can be built
/// without reading the files again (they may have changed since, unchecked, before a reload).
pub(super) struct Material {
    chain: Vec<X509>,
    key: PKey<Private>,
    cert_path: PathBuf,
    key_path: PathBuf,
    client_ca: Option<(PathBuf, Vec<X509>)>,
    staple: Option<Arc<Staple>>,
    pub ticket_key_rotation: Duration,
}

/// A checked certificate and key, with an acceptor ready to serve.
pub struct TlsIdentity {
    pub(super) material: Arc<Material>,
    pub(super) acceptor: SslAcceptor,
    /// Unix time at which the leaf certificate expires.
    pub not_after: i64,
    /// The leaf's serial number, in hex.
    pub serial: String,
    /// Unix time after which the stapled OCSP response is stale, if one is stapled and it
    /// says.
    pub ocsp_next_update: Option<i64>,
}

/// Read and check the files `cfg` names: the chain parses, the key parses and matches the leaf
/// certificate, the leaf has not expired, the client CA bundle (if any) parses, the OCSP
/// response (if any) is a current "good" one for the leaf. Builds the first acceptor.
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
    let client_ca = match &cfg.client_ca {
        Some(path) => Some((path.clone(), certificates(path)?)),
        None => None,
    };
    let staple = match &cfg.ocsp_response {
        Some(path) => Some(Arc::new(ocsp::load(
            path,
            &cfg.cert,
            leaf,
            chain.get(1).map(|c| &**c),
        )?)),
        None => None,
    };
    let ocsp_next_update = staple.as_ref().and_then(|s| s.next_update);
    let material = Arc::new(Material {
        chain,
        key,
        cert_path: cfg.cert.clone(),
        key_path: cfg.key.clone(),
        client_ca,
        staple,
        ticket_key_rotation: Duration::from_secs(cfg.ticket_key_rotation_seconds),
    });
    Ok(TlsIdentity {
        acceptor: material.acceptor()?,
        material,
        not_after,
        serial,
        ocsp_next_update,
    })
}

impl Material {
    /// A new acceptor: TLS 1.2 and 1.3 only (Mozilla's intermediate profile: its groups, its
    /// suites but no DHE), ALPN h2 then http/1.1, no renegotiation, client certificates
    /// required when a client CA bundle is set, the OCSP response stapled for clients that ask.
    /// OpenSSL draws each context's session ticket keys at random, so every acceptor built here
    /// has its own.
    pub(super) fn acceptor(&self) -> Result<SslAcceptor, TlsError> {
        let cert = &self.cert_path;
        let openssl_err = |path: &Path, what: &str, e: openssl::error::ErrorStack| {
            tls_err(path, format!("{what}: {e}"))
        };
        let mut b = SslAcceptor::mozilla_intermediate_v5(SslMethod::tls_server())
            .map_err(|e| openssl_err(cert, "cannot create a TLS context", e))?;
        b.set_min_proto_version(Some(SslVersion::TLS1_2))
            .map_err(|e| openssl_err(cert, "cannot set TLS 1.2 as minimum", e))?;
        // The server's order: every suite offered is an AEAD one with forward secrecy, and
        // scanners (testssl.sh) rate leaving the choice to the client high.
        b.set_options(SslOptions::NO_RENEGOTIATION | SslOptions::CIPHER_SERVER_PREFERENCE);
        b.set_groups_list(GROUPS)
            .map_err(|e| openssl_err(cert, "cannot set the key exchange groups", e))?;
        b.set_cipher_list(TLS12_CIPHERS)
            .map_err(|e| openssl_err(cert, "cannot set the TLS 1.2 suites", e))?;
        b.set_certificate(&self.chain[0])
            .map_err(|e| openssl_err(cert, "certificate rejected", e))?;
        for extra in &self.chain[1..] {
            b.add_extra_chain_cert(extra.clone())
                .map_err(|e| openssl_err(cert, "chain certificate rejected", e))?;
        }
        b.set_private_key(&self.key)
            .map_err(|e| openssl_err(&self.key_path, "key rejected", e))?;
        b.check_private_key()
            .map_err(|e| openssl_err(&self.key_path, "does not match the certificate", e))?;
        b.set_alpn_select_callback(|_, client| {
            select_next_proto(ALPN_H2_H1, client).ok_or(AlpnError::NOACK)
        });
        if let Some(staple) = &self.staple {
            let staple = Arc::clone(staple);
            b.set_status_callback(move |ssl| {
                if !staple.current(now_unix()) {
                    return Ok(false);
                }
                ssl.set_ocsp_status(&staple.der)?;
                Ok(true)
            })
            .map_err(|e| openssl_err(cert, "cannot staple the OCSP response", e))?;
        }
        if let Some((ca_path, cas)) = &self.client_ca {
            let mut store = X509StoreBuilder::new()
                .map_err(|e| openssl_err(ca_path, "cannot build a store", e))?;
            for ca in cas {
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
        Ok(b.build())
    }
}
