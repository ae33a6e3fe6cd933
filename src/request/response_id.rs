//! Stored responses live in the memory of the engine that made them, so every later call that
//! names one (`previous_response_id`, `GET`/`DELETE /v1/responses/{id}`, `cancel`,
//! `input_items`) must reach that engine. kvroute stamps the backend into the id it returns:
//! `resp_kvr1` + the backend's tag + a MAC + `_` + the engine's own id. The tag is a hash of the
//! backend's configured name (stable across reloads, upgrades and replicas with one config);
//! the MAC, keyed by `routing.response_id_key_file`, keeps a client from naming a backend of
//! its choice.

use openssl::hash::MessageDigest;
use openssl::pkey::PKey;
use openssl::sign::Signer;
use std::sync::OnceLock;

use crate::config::{ConfigError, RoutingConfig};

/// Bytes a key file must hold at least.
const MIN_KEY_BYTES: usize = 32;

const PREFIX: &str = "resp_kvr1";
/// Hex digits of the tag and of the MAC.
const HEX: usize = 16;

/// Stamps and opens response ids under one key.
#[derive(Clone)]
pub struct ResponseIds {
    key: Vec<u8>,
}

impl std::fmt::Debug for ResponseIds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ResponseIds(..)")
    }
}

/// What an id a client sent says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Opened<'a> {
    /// Not stamped by kvroute (an engine's own id): no backend is named.
    Plain,
    /// Stamped, but not under this key: forged, altered or from another deployment.
    Forged,
    /// Stamped by kvroute: the backend's tag and the engine's own id.
    Stamped { tag: u64, id: &'a str },
}

/// The tag of a backend, by its configured name.
pub fn tag(backend: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(backend.as_bytes(), 0x6b76_7231)
}

/// This process's own key, when none is configured: one for the process's whole life, so
/// reloads keep it.
fn process_key() -> &'static [u8] {
    static KEY: OnceLock<Vec<u8>> = OnceLock::new();
    KEY.get_or_init(|| {
        let mut k = vec![0u8; MIN_KEY_BYTES];
        if let Err(e) = openssl::rand::rand_bytes(&mut k) {
            log::error!("no random bytes for the response-id key ({e}); ids are unsigned");
        }
        k
    })
}

impl ResponseIds {
    /// The ids of `routing.response_id_key_file`'s key, else of this process's own.
    pub fn from_config(r: &RoutingConfig) -> Result<ResponseIds, ConfigError> {
        let Some(path) = &r.response_id_key_file else {
            return Ok(ResponseIds::new(process_key()));
        };
        let error = |reason: String| ConfigError {
            key: "kvroute.routing.response_id_key_file".into(),
            reason,
        };
        let key = std::fs::read(path).map_err(|e| error(format!("cannot read {path}: {e}")))?;
        if key.trim_ascii().len() < MIN_KEY_BYTES {
            return Err(error(format!(
                "{path} holds fewer than {MIN_KEY_BYTES} bytes; make one with \
                 `openssl rand -hex 32 > {path}`"
            )));
        }
        Ok(ResponseIds::new(key.trim_ascii()))
    }

    pub fn new(key: &[u8]) -> ResponseIds {
        ResponseIds { key: key.to_vec() }
    }

    fn mac(&self, tag: u64, id: &str) -> u64 {
        let Ok(pkey) = PKey::hmac(&self.key) else {
            return 0;
        };
        let mut out = [0u8; 8];
        let signed = Signer::new(MessageDigest::sha256(), &pkey).and_then(|mut s| {
            s.update(&tag.to_be_bytes())?;
            s.update(id.as_bytes())?;
            s.sign_to_vec()
        });
        if let Ok(sig) = signed {
            out.copy_from_slice(&sig[..8]);
        }
        u64::from_be_bytes(out)
    }

    /// The id to give the client for the engine's `id` from `backend`.
    pub fn stamp(&self, backend: &str, id: &str) -> String {
        let t = tag(backend);
        format!("{PREFIX}{t:016x}{:016x}_{id}", self.mac(t, id))
    }

    pub fn open<'a>(&self, stamped: &'a str) -> Opened<'a> {
        let Some(rest) = stamped.strip_prefix(PREFIX) else {
            return Opened::Plain;
        };
        let parsed = (|| {
            let (tag, mac) = (rest.get(..HEX)?, rest.get(HEX..2 * HEX)?);
            let id = rest.get(2 * HEX..)?.strip_prefix('_')?;
            let tag = u64::from_str_radix(tag, 16).ok()?;
            let mac = u64::from_str_radix(mac, 16).ok()?;
            Some((tag, mac, id))
        })();
        match parsed {
            Some((tag, mac, id)) if !id.is_empty() && self.mac(tag, id) == mac => {
                Opened::Stamped { tag, id }
            }
            _ => Opened::Forged,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stamped_id_names_its_backend_and_nothing_else_opens() {
        let ids = ResponseIds::new(b"0123456789abcdef0123456789abcdef");
        let s = ids.stamp("b1", "resp_abc");
        assert!(
            s.starts_with("resp_kvr1") && s.ends_with("_resp_abc"),
            "{s}"
        );
        assert_eq!(
            ids.open(&s),
            Opened::Stamped {
                tag: tag("b1"),
                id: "resp_abc"
            }
        );
        // The same key (another replica, a reload, an upgrade) opens it; another does not.
        let again = ResponseIds::new(b"0123456789abcdef0123456789abcdef");
        assert_eq!(again.open(&s), ids.open(&s));
        assert_eq!(
            ResponseIds::new(b"another key, another deployment!").open(&s),
            Opened::Forged
        );
        // Steering to another backend, or another id, breaks the MAC.
        let steered = s.replacen(
            &format!("{:016x}", tag("b1")),
            &format!("{:016x}", tag("b2")),
            1,
        );
        assert_eq!(ids.open(&steered), Opened::Forged);
        assert_eq!(
            ids.open(&s.replace("_resp_abc", "_resp_abd")),
            Opened::Forged
        );
        for bad in [
            "resp_kvr1",
            "resp_kvr1zz",
            &s[..s.len() - 9],
            &format!("{}_", &s[..41]),
        ] {
            assert_eq!(ids.open(bad), Opened::Forged, "{bad}");
        }
        assert_eq!(ids.open("resp_abc"), Opened::Plain);
        assert_ne!(tag("b1"), tag("b2"));
    }
}
