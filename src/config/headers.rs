//! `kvroute.response_headers`: what of an engine's response head never reaches clients.

use serde::Deserialize;

use super::error::{err, ConfigError};

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ResponseHeadersConfig {
    /// Header names removed from every proxied response, case-insensitive; a name ending in
    /// `*` removes every header it prefixes.
    pub strip: Vec<String>,
}

impl Default for ResponseHeadersConfig {
    fn default() -> Self {
        // What names the engine's server software and version (uvicorn, llama.cpp, ...): it
        // tells a client which exploits to try and nothing it needs.
        ResponseHeadersConfig {
            strip: vec!["server".into(), "x-powered-by".into()],
        }
    }
}

impl ResponseHeadersConfig {
    /// Whether a response header named `name` (lower-case, as `http` keeps them) is removed.
    pub fn strips(&self, name: &str) -> bool {
        self.strip.iter().any(|s| match s.strip_suffix('*') {
            Some(prefix) => name.starts_with(prefix),
            None => name == s,
        })
    }

    /// Names are kept lower-case, so matching is a plain comparison.
    pub(super) fn normalize(&mut self) {
        for s in &mut self.strip {
            s.make_ascii_lowercase();
        }
    }

    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        for (i, s) in self.strip.iter().enumerate() {
            let name = s.strip_suffix('*').unwrap_or(s);
            if name.is_empty() || http::HeaderName::from_bytes(name.as_bytes()).is_err() {
                return Err(err(
                    format!("kvroute.response_headers.strip[{i}]"),
                    format!("{s:?} is not a header name (optionally ending in * for a prefix)"),
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_prefixes_match_case_insensitively() {
        let mut c = ResponseHeadersConfig {
            strip: vec!["Server".into(), "X-Kvbench-*".into()],
        };
        c.normalize();
        assert!(c.validate().is_ok());
        assert!(c.strips("server"));
        assert!(c.strips("x-kvbench-addr"));
        assert!(!c.strips("server-timing"));
        assert!(!c.strips("content-type"));
    }

    #[test]
    fn what_is_not_a_header_name_is_refused() {
        for bad in ["", "*", "bad header", "x:y"] {
            let c = ResponseHeadersConfig {
                strip: vec![bad.into()],
            };
            assert!(c.validate().is_err(), "{bad:?}");
        }
    }
}
