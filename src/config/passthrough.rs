//! `kvroute.passthrough`: the few routes besides the OpenAI inference API that kvroute forwards
//! to a backend. Everything else gets 404 at the edge, so an engine's admin endpoints (vLLM's
//! `/sleep`, SGLang's `/flush_cache`, ...) are never reachable through it.

use serde::Deserialize;

use super::error::{err, ConfigError};

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PassthroughConfig {
    /// Extra routes forwarded unchanged to any healthy backend.
    #[serde(default)]
    pub allow: Vec<AllowRule>,
}

/// One forwarded route: an exact path, or every path under a prefix (`/v1/files/*`).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct AllowRule {
    pub path: String,
    /// Upper-case HTTP methods; default `GET` and `HEAD` (read-only).
    #[serde(default = "read_only")]
    pub methods: Vec<String>,
    /// Forward `Upgrade` (a WebSocket, say) on this route: the backend may switch protocols,
    /// and the connection then becomes a tunnel kvroute no longer inspects. Off: the header
    /// is removed, and a backend that switches anyway is refused.
    #[serde(default)]
    pub upgrade: bool,
}

fn read_only() -> Vec<String> {
    vec!["GET".into(), "HEAD".into()]
}

const METHODS: [&str; 7] = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"];

/// Whether `path` is `rule`, or under it when `rule` ends in `*`.
pub fn path_matches(rule: &str, path: &str) -> bool {
    match rule.strip_suffix('*') {
        Some(prefix) => path.starts_with(prefix),
        None => path == rule,
    }
}

impl AllowRule {
    /// Whether `method path` falls under this rule (`path` already checked to be plain).
    pub fn matches(&self, method: &str, path: &str) -> bool {
        path_matches(&self.path, path) && self.methods.iter().any(|m| m == method)
    }
}

impl PassthroughConfig {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        for (i, rule) in self.allow.iter().enumerate() {
            let key = |k: &str| format!("kvroute.passthrough.allow[{i}].{k}");
            let p = &rule.path;
            let body = p.strip_suffix('*').unwrap_or(p);
            let plain = body
                .chars()
                .all(|c| c.is_ascii_graphic() && !"*?#%\\".contains(c));
            if !p.starts_with('/') || !plain || body.contains("//") || body.contains("/.") {
                return Err(err(
                    key("path"),
                    format!(
                        "{p:?} must be an absolute path of plain characters, optionally ending \
                         in * for a prefix (no '//', dot segments, '%', '?' or '#')"
                    ),
                ));
            }
            if rule.methods.is_empty() {
                return Err(err(key("methods"), "must list at least one method"));
            }
            if let Some(m) = rule.methods.iter().find(|m| !METHODS.contains(&m.as_str())) {
                return Err(err(
                    key("methods"),
                    format!("{m:?} is not one of {}", METHODS.join(", ")),
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(path: &str, methods: &[&str]) -> AllowRule {
        AllowRule {
            path: path.into(),
            methods: methods.iter().map(|m| m.to_string()).collect(),
            upgrade: false,
        }
    }

    #[test]
    fn exact_paths_and_prefixes_per_method() {
        let exact = rule("/health", &["GET"]);
        assert!(exact.matches("GET", "/health"));
        assert!(!exact.matches("POST", "/health"));
        assert!(!exact.matches("GET", "/health/x"));
        let prefix = rule("/v1/files/*", &["GET", "HEAD"]);
        assert!(prefix.matches("HEAD", "/v1/files/abc"));
        assert!(!prefix.matches("GET", "/v1/files"));
    }

    #[test]
    fn rules_are_checked() {
        let bad = |r: AllowRule| {
            PassthroughConfig { allow: vec![r] }
                .validate()
                .unwrap_err()
                .to_string()
        };
        for p in ["health", "/a/../sleep", "/a//b", "/a%2e", "/a*b", "/x?y"] {
            assert!(bad(rule(p, &["GET"])).contains("allow[0].path"), "{p}");
        }
        assert!(bad(rule("/a", &[])).contains("allow[0].methods"));
        assert!(bad(rule("/a", &["get"])).contains("\"get\""));
        assert!(PassthroughConfig {
            allow: vec![rule("/health", &["GET"]), rule("/v1/files/*", &["GET"])]
        }
        .validate()
        .is_ok());
    }
}
