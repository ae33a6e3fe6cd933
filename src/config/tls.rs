//! `kvroute.tls`: the TLS listener's address and the files it serves. The files themselves are
//! read and checked by the edge (`edge::tls`), at start, at `-t` and on every reload, so a
//! renewed certificate is picked up by `systemctl reload`.

use serde::Deserialize;
use std::path::{Path, PathBuf};

use super::error::{err, parse_addr, ConfigError};

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// Address of the TLS listener (HTTP/1.1 and HTTP/2 by ALPN).
    pub listen: String,
    /// PEM certificate chain: the server certificate first, then intermediates.
    pub cert: PathBuf,
    /// PEM private key of the certificate.
    pub key: PathBuf,
    /// PEM bundle of CAs that client certificates must chain to. Set: every client must show a
    /// certificate (mTLS).
    #[serde(default)]
    pub client_ca: Option<PathBuf>,
    /// DER OCSP response for the leaf certificate, stapled to handshakes of clients that ask.
    /// Fetched by the operator (`openssl ocsp`, a timer unit) and re-read on every reload.
    #[serde(default)]
    pub ocsp_response: Option<PathBuf>,
    /// Session ticket keys (and the TLS 1.2 session cache) are replaced this often, so a key
    /// taken from memory later cannot decrypt older sessions (forward secrecy).
    #[serde(default = "default_ticket_key_rotation")]
    pub ticket_key_rotation_seconds: u64,
}

fn default_ticket_key_rotation() -> u64 {
    3600
}

impl TlsConfig {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        parse_addr("kvroute.tls.listen", &self.listen)?;
        let files = [
            ("kvroute.tls.cert", Some(&self.cert)),
            ("kvroute.tls.key", Some(&self.key)),
            ("kvroute.tls.client_ca", self.client_ca.as_ref()),
            ("kvroute.tls.ocsp_response", self.ocsp_response.as_ref()),
        ];
        for (key, path) in files {
            if let Some(p) = path {
                // `-d` changes the working directory: a relative path would name another file
                // after the fork than the one `-t` checked.
                if !Path::new(p).is_absolute() {
                    return Err(err(
                        key,
                        format!("`{}` must be an absolute path", p.display()),
                    ));
                }
            }
        }
        if self.ticket_key_rotation_seconds == 0 {
            return Err(err(
                "kvroute.tls.ticket_key_rotation_seconds",
                "must be at least 1",
            ));
        }
        Ok(())
    }
}
