//! Certificates for the TLS tests, made on the fly: a CA, server certificates for 127.0.0.1
//! with chosen serials and validity, and client certificates for mTLS.

use openssl::asn1::{Asn1Integer, Asn1Time};
use openssl::bn::BigNum;
use openssl::ec::{EcGroup, EcKey};
use openssl::hash::MessageDigest;
use openssl::nid::Nid;
use openssl::pkey::{PKey, Private};
use openssl::x509::extension::{
    BasicConstraints, ExtendedKeyUsage, KeyUsage, SubjectAlternativeName,
};
use openssl::x509::{X509Name, X509};
use std::path::{Path, PathBuf};

fn key() -> PKey<Private> {
    let group = EcGroup::from_curve_name(Nid::X9_62_PRIME256V1).expect("P-256");
    PKey::from_ec_key(EcKey::generate(&group).expect("ec key")).expect("pkey")
}

fn name(cn: &str) -> X509Name {
    let mut n = X509Name::builder().expect("name");
    n.append_entry_by_text("CN", cn).expect("CN");
    n.build()
}

fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs() as i64
}

pub struct Ca {
    pub cert: X509,
    key: PKey<Private>,
}

/// What a certificate is for.
#[derive(Clone, Copy)]
pub enum Role {
    Server,
    Client,
}

impl Ca {
    pub fn new(cn: &str) -> Ca {
        let key = key();
        let mut b = X509::builder().expect("builder");
        b.set_version(2).expect("v3");
        let serial = Asn1Integer::from_bn(&BigNum::from_u32(1).expect("bn")).expect("serial");
        b.set_serial_number(&serial).expect("serial");
        b.set_subject_name(&name(cn)).expect("subject");
        b.set_issuer_name(&name(cn)).expect("issuer");
        b.set_pubkey(&key).expect("pubkey");
        b.set_not_before(&Asn1Time::from_unix(now() - 3600).expect("t"))
            .expect("nb");
        b.set_not_after(&Asn1Time::from_unix(now() + 86_400).expect("t"))
            .expect("na");
        b.append_extension(BasicConstraints::new().critical().ca().build().expect("bc"))
            .expect("ext");
        b.append_extension(
            KeyUsage::new()
                .critical()
                .key_cert_sign()
                .crl_sign()
                .build()
                .expect("ku"),
        )
        .expect("ext");
        b.sign(&key, MessageDigest::sha256()).expect("sign");
        Ca {
            cert: b.build(),
            key,
        }
    }

    /// A certificate signed by this CA, valid from `from` to `until` seconds relative to now.
    pub fn issue(&self, role: Role, serial: u32, from: i64, until: i64) -> (X509, PKey<Private>) {
        self.issue_for(key(), role, serial, from, until)
    }

    /// [`Ca::issue`] for a key of the caller's (an RSA one, say).
    pub fn issue_for(
        &self,
        key: PKey<Private>,
        role: Role,
        serial: u32,
        from: i64,
        until: i64,
    ) -> (X509, PKey<Private>) {
        let mut b = X509::builder().expect("builder");
        b.set_version(2).expect("v3");
        let sn = Asn1Integer::from_bn(&BigNum::from_u32(serial).expect("bn")).expect("serial");
        b.set_serial_number(&sn).expect("serial");
        b.set_subject_name(&name(match role {
            Role::Server => "localhost",
            Role::Client => "test-client",
        }))
        .expect("subject");
        b.set_issuer_name(self.cert.subject_name()).expect("issuer");
        b.set_pubkey(&key).expect("pubkey");
        b.set_not_before(&Asn1Time::from_unix(now() + from).expect("t"))
            .expect("nb");
        b.set_not_after(&Asn1Time::from_unix(now() + until).expect("t"))
            .expect("na");
        let ctx = b.x509v3_context(Some(&self.cert), None);
        let san = SubjectAlternativeName::new()
            .dns("localhost")
            .ip("127.0.0.1")
            .build(&ctx)
            .expect("san");
        b.append_extension(san).expect("ext");
        let eku = match role {
            Role::Server => ExtendedKeyUsage::new().server_auth().build(),
            Role::Client => ExtendedKeyUsage::new().client_auth().build(),
        };
        b.append_extension(eku.expect("eku")).expect("ext");
        b.sign(&self.key, MessageDigest::sha256()).expect("sign");
        (b.build(), key)
    }

    pub fn pem(&self) -> Vec<u8> {
        self.cert.to_pem().expect("pem")
    }

    /// An OCSP response signed by this CA about `leaf`, saying good or revoked and valid for
    /// `minutes`, written to `dir/<name>` (DER), as `openssl ocsp` makes them: the operator's
    /// tool, and the binding cannot build responses.
    pub fn write_ocsp_response(
        &self,
        dir: &Path,
        name: &str,
        leaf: &X509,
        revoked: bool,
        minutes: u32,
    ) -> PathBuf {
        let ca_pem = dir.join("ocsp-ca.pem");
        let ca_key = dir.join("ocsp-ca.key");
        let leaf_pem = dir.join("ocsp-leaf.pem");
        let index = dir.join("ocsp-index.txt");
        let request = dir.join("ocsp-request.der");
        std::fs::write(&ca_pem, self.pem()).expect("write");
        std::fs::write(&ca_key, self.key.private_key_to_pem_pkcs8().expect("key")).expect("w");
        std::fs::write(&leaf_pem, leaf.to_pem().expect("pem")).expect("write");
        let serial = leaf
            .serial_number()
            .to_bn()
            .expect("bn")
            .to_hex_str()
            .expect("hex")
            .to_string();
        let serial = if serial.len() % 2 == 1 {
            format!("0{serial}")
        } else {
            serial
        };
        // The CA database `openssl ca` keeps: status, expiry, revocation time, serial, file,
        // subject.
        let line = match revoked {
            false => format!("V\t301231235959Z\t\t{serial}\tunknown\t/CN=127.0.0.1\n"),
            true => format!("R\t301231235959Z\t240101000000Z\t{serial}\tunknown\t/CN=127.0.0.1\n"),
        };
        std::fs::write(&index, line).expect("write index");
        let run = |args: &[&str]| {
            let out = std::process::Command::new("openssl")
                .arg("ocsp")
                .args(args)
                .output()
                .expect("run openssl ocsp (the openssl package)");
            assert!(
                out.status.success(),
                "openssl ocsp {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        let p = |p: &Path| p.display().to_string();
        run(&[
            "-no_nonce",
            "-issuer",
            &p(&ca_pem),
            "-cert",
            &p(&leaf_pem),
            "-reqout",
            &p(&request),
        ]);
        let response = dir.join(name);
        run(&[
            "-index",
            &p(&index),
            "-rsigner",
            &p(&ca_pem),
            "-rkey",
            &p(&ca_key),
            "-CA",
            &p(&ca_pem),
            "-reqin",
            &p(&request),
            "-respout",
            &p(&response),
            "-nmin",
            &minutes.to_string(),
        ]);
        response
    }

    /// Write a server certificate (the chain: leaf, then this CA) and its key into `dir` as
    /// `cert.pem` and `key.pem`, replacing what is there; returns their paths.
    pub fn write_server(
        &self,
        dir: &Path,
        serial: u32,
        from: i64,
        until: i64,
    ) -> (PathBuf, PathBuf) {
        let (cert, key) = self.issue(Role::Server, serial, from, until);
        let mut chain = cert.to_pem().expect("pem");
        chain.extend(self.pem());
        write_pair(dir, &chain, &key)
    }

    /// [`Ca::write_server`] with an RSA key: the key type TLS 1.2's DHE suites need.
    pub fn write_rsa_server(&self, dir: &Path, serial: u32) -> (PathBuf, PathBuf) {
        let rsa = openssl::rsa::Rsa::generate(2048).expect("rsa key");
        let key = PKey::from_rsa(rsa).expect("pkey");
        let (cert, key) = self.issue_for(key, Role::Server, serial, -60, 86_000);
        let mut chain = cert.to_pem().expect("pem");
        chain.extend(self.pem());
        write_pair(dir, &chain, &key)
    }
}

/// Write `chain` and `key` as `cert.pem` and `key.pem` in `dir` (each by rename, as certbot
/// replaces files, so a reader never sees half a file).
pub fn write_pair(dir: &Path, chain: &[u8], key: &PKey<Private>) -> (PathBuf, PathBuf) {
    let cert_path = dir.join("cert.pem");
    let key_path = dir.join("key.pem");
    let key_pem = key.private_key_to_pem_pkcs8().expect("key pem");
    for (path, bytes) in [(&cert_path, chain), (&key_path, &key_pem[..])] {
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, bytes).expect("write pem");
        std::fs::rename(&tmp, path).expect("rename pem");
    }
    (cert_path, key_path)
}

/// A client identity for reqwest (PEM certificate followed by PKCS#8 key).
pub fn client_identity(ca: &Ca) -> reqwest::Identity {
    let (cert, key) = ca.issue(Role::Client, 77, -60, 3600);
    reqwest::Identity::from_pkcs8_pem(
        &cert.to_pem().expect("pem"),
        &key.private_key_to_pem_pkcs8().expect("key"),
    )
    .expect("identity")
}

/// The serial of the certificate a TLS peer showed, from its DER.
pub fn serial_of(der: &[u8]) -> u32 {
    let cert = X509::from_der(der).expect("peer certificate");
    let bn = cert.serial_number().to_bn().expect("serial");
    bn.to_dec_str().expect("dec").parse().expect("u32 serial")
}
