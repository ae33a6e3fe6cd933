//! `kvroute.access`: API keys (as SHA-256 digests), tenants, allowed models and rate limits.

use serde::Deserialize;

use super::error::{err, ConfigError};

/// The SHA-256 of an API key.
pub type KeyDigest = [u8; 32];

/// Access control: every request needs one of these keys.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct AccessConfig {
    pub keys: Vec<ApiKeyConfig>,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ApiKeyConfig {
    /// Hex SHA-256 of the key (`printf %s KEY | sha256sum`); the key itself is never stored.
    pub sha256: String,
    pub tenant: String,
    /// Models this key may use; empty: all.
    #[serde(default)]
    pub models: Vec<String>,
    pub requests_per_minute: Option<u64>,
    /// Prompt plus completion tokens per minute (estimated up front, settled from `usage`).
    pub tokens_per_minute: Option<u64>,
    /// Prompt plus completion tokens per rolling day, charged and settled the same way.
    pub tokens_per_day: Option<u64>,
    /// The highest `x-priority` this key's requests get in the router queue; a higher one
    /// is lowered to it (default 0: the header can only lower a request's priority).
    #[serde(default)]
    pub max_priority: i32,
    /// Requests this key may have in flight at once (routed and passed through); more get
    /// 429. Unset: no cap.
    pub max_concurrent: Option<u64>,
    /// Whether a tenant header (`tenants.headers`) may name the tenant of this key's
    /// requests, for a gateway that serves several tenants with one key.
    #[serde(default)]
    pub tenant_from_header: bool,
}

/// Parse a `sha256:` hex digest from the config.
pub fn parse_digest(hex: &str) -> Option<KeyDigest> {
    let hex = hex.trim();
    if hex.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

impl AccessConfig {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if self.keys.is_empty() {
            return Err(err(
                "kvroute.access.keys",
                "at least one key is required (remove `access` to turn access control off)",
            ));
        }
        let mut seen = std::collections::HashSet::new();
        for (i, k) in self.keys.iter().enumerate() {
            let Some(d) = parse_digest(&k.sha256) else {
                return Err(err(
                    format!("kvroute.access.keys[{i}].sha256"),
                    "must be 64 hex digits (the SHA-256 of the key)",
                ));
            };
            if !seen.insert(d) {
                return Err(err(
                    format!("kvroute.access.keys[{i}].sha256"),
                    "duplicate key",
                ));
            }
            if k.tenant.is_empty() {
                return Err(err(format!("kvroute.access.keys[{i}].tenant"), "required"));
            }
            if k.requests_per_minute == Some(0)
                || k.tokens_per_minute == Some(0)
                || k.tokens_per_day == Some(0)
                || k.max_concurrent == Some(0)
            {
                return Err(err(
                    format!("kvroute.access.keys[{i}]"),
                    "rate limits must be positive (leave one out for no limit)",
                ));
            }
        }
        Ok(())
    }
}
