//! `kvroute.tenants`: who a request is for (the API key's tenant, else a header), how urgent it
//! is (priority names), and how the router queue shares a saturated fleet among tenants.

use serde::Deserialize;
use std::collections::BTreeMap;

use super::access::AccessConfig;
use super::error::{err, ConfigError};

/// The tenant of a request with neither a key's tenant nor a tenant header.
pub const DEFAULT_TENANT: &str = "default";

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct TenantsConfig {
    /// Request headers naming the tenant, first present wins. Read when access control is off,
    /// and for keys with `tenant_from_header: true`; otherwise a key's tenant stands.
    pub headers: Vec<String>,
    /// Tenants named in metrics besides the keys' own; any other is counted as `other`, so a
    /// client cannot grow the metrics without bound.
    pub names: Vec<String>,
    /// Priorities by name, for `x-kvroute-priority: interactive` and the values of
    /// `x-llm-d-inference-objective`.
    pub priority_names: BTreeMap<String, i32>,
    pub fair_share: FairShareConfig,
    /// Limits of one priority band of the router queue, over `limits.queue_size` and
    /// `limits.queue_timeout_ms`; a band not listed has only those.
    pub bands: Vec<BandConfig>,
}

/// One priority band's share of the router queue: so a flood of bulk requests cannot fill
/// the queue that interactive ones need, nor wait as long as they may.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct BandConfig {
    pub priority: i32,
    /// Requests of this band waiting at once.
    #[serde(default)]
    pub max_requests: Option<usize>,
    /// Request bodies of this band held while waiting, in bytes.
    #[serde(default)]
    pub max_bytes: Option<u64>,
    /// How long a request of this band may wait, from its start (its TTL).
    #[serde(default)]
    pub queue_timeout_ms: Option<u64>,
}

impl Default for TenantsConfig {
    fn default() -> Self {
        TenantsConfig {
            // kvroute's own, then the names llm-d, the Gateway API inference extension and
            // SGLang's model gateway send.
            headers: vec![
                "x-tenant-id".into(),
                "x-llm-d-inference-fairness-id".into(),
                "x-gateway-inference-fairness-id".into(),
                "x-smg-tenant-id".into(),
            ],
            names: Vec::new(),
            // SGLang model gateway's classes, in its order.
            priority_names: BTreeMap::from([
                ("bulk".into(), -1),
                ("default".into(), 0),
                ("interactive".into(), 1),
                ("system".into(), 2),
            ]),
            fair_share: FairShareConfig::default(),
            bands: Vec::new(),
        }
    }
}

/// What a tenant has been served, for fairness inside a priority band: prompt tokens times
/// `prompt_weight` plus completion tokens times `completion_weight`, halved every
/// `half_life_ms`.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct FairShareConfig {
    pub prompt_weight: f64,
    pub completion_weight: f64,
    pub half_life_ms: u64,
}

impl Default for FairShareConfig {
    fn default() -> Self {
        // A completion token costs a decode step of its own; a prompt token shares a prefill
        // pass with thousands of others.
        FairShareConfig {
            prompt_weight: 1.0,
            completion_weight: 2.0,
            half_life_ms: 60_000,
        }
    }
}

impl TenantsConfig {
    /// Header names are kept lower-case, as `http` keeps them.
    pub(super) fn normalize(&mut self) {
        for h in &mut self.headers {
            h.make_ascii_lowercase();
        }
    }

    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        for (i, h) in self.headers.iter().enumerate() {
            if http::HeaderName::from_bytes(h.as_bytes()).is_err() {
                return Err(err(
                    format!("kvroute.tenants.headers[{i}]"),
                    format!("{h:?} is not a header name"),
                ));
            }
        }
        for (i, n) in self.names.iter().enumerate() {
            if !valid_tenant(n) {
                return Err(err(
                    format!("kvroute.tenants.names[{i}]"),
                    format!("{n:?}: 1-64 visible ASCII characters"),
                ));
            }
        }
        for name in self.priority_names.keys() {
            if name.is_empty() || name.parse::<i32>().is_ok() {
                return Err(err(
                    "kvroute.tenants.priority_names",
                    format!("{name:?}: a name must be non-empty and not a number"),
                ));
            }
        }
        let f = &self.fair_share;
        let weight_ok = |w: f64| w.is_finite() && w >= 0.0;
        if !weight_ok(f.prompt_weight) || !weight_ok(f.completion_weight) {
            return Err(err(
                "kvroute.tenants.fair_share",
                "prompt_weight and completion_weight must be finite and not negative",
            ));
        }
        if f.half_life_ms == 0 {
            return Err(err(
                "kvroute.tenants.fair_share.half_life_ms",
                "must be positive",
            ));
        }
        for (i, b) in self.bands.iter().enumerate() {
            let at = |k: &str| format!("kvroute.tenants.bands[{i}].{k}");
            if self.bands[..i].iter().any(|o| o.priority == b.priority) {
                return Err(err(
                    at("priority"),
                    format!("band {} is listed twice", b.priority),
                ));
            }
            if b.max_requests == Some(0) {
                return Err(err(at("max_requests"), "must be positive"));
            }
            if b.max_bytes == Some(0) {
                return Err(err(at("max_bytes"), "must be positive"));
            }
            if b.queue_timeout_ms == Some(0) {
                return Err(err(at("queue_timeout_ms"), "must be positive"));
            }
        }
        Ok(())
    }

    /// The limits of band `priority`, if configured.
    pub fn band(&self, priority: i32) -> Option<&BandConfig> {
        self.bands.iter().find(|b| b.priority == priority)
    }

    /// The priority a name or integer stands for.
    pub fn priority_of(&self, value: &str) -> Option<i32> {
        let v = value.trim();
        v.parse()
            .ok()
            .or_else(|| self.priority_names.get(v).copied())
    }
}

/// The tenant as metrics name it: itself where the config names it (a key's tenant,
/// `tenants.names`, or `default`), else `other`, so clients cannot grow the metrics.
pub fn metric_label<'a>(
    tenants: &TenantsConfig,
    access: Option<&AccessConfig>,
    tenant: &'a str,
) -> &'a str {
    let named = tenant == DEFAULT_TENANT
        || tenants.names.iter().any(|n| n == tenant)
        || access.is_some_and(|a| a.keys.iter().any(|k| k.tenant == tenant));
    if named {
        tenant
    } else {
        "other"
    }
}

/// A tenant id as kvroute accepts it from a header: what fits a metric label and a log line.
pub fn valid_tenant(s: &str) -> bool {
    (1..=64).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_graphic())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn priorities_are_integers_or_configured_names() {
        let t = TenantsConfig::default();
        assert_eq!(t.priority_of(" 7 "), Some(7));
        assert_eq!(t.priority_of("-3"), Some(-3));
        assert_eq!(t.priority_of("interactive"), Some(1));
        assert_eq!(t.priority_of("bulk"), Some(-1));
        assert_eq!(t.priority_of("urgent"), None);
    }

    #[test]
    fn bad_settings_are_named() {
        let mut t = TenantsConfig::default();
        t.headers.push("bad header".into());
        assert!(t
            .validate()
            .unwrap_err()
            .to_string()
            .contains("tenants.headers[4]"));
        let mut t = TenantsConfig::default();
        t.priority_names.insert("12".into(), 3);
        assert!(t.validate().is_err());
        let mut t = TenantsConfig::default();
        t.fair_share.half_life_ms = 0;
        assert!(t.validate().is_err());
        let mut t = TenantsConfig::default();
        t.names.push("a b".into());
        assert!(t.validate().is_err());
        let band = |priority| BandConfig {
            priority,
            max_requests: Some(4),
            max_bytes: None,
            queue_timeout_ms: Some(500),
        };
        let mut t = TenantsConfig {
            bands: vec![band(1), band(0), band(1)],
            ..TenantsConfig::default()
        };
        let e = t.validate().unwrap_err().to_string();
        assert!(e.contains("bands[2].priority"), "{e}");
        t.bands = vec![band(1), band(0)];
        assert!(t.validate().is_ok());
        assert_eq!(t.band(0).and_then(|b| b.queue_timeout_ms), Some(500));
        assert!(t.band(2).is_none());
        t.bands[1].max_requests = Some(0);
        assert!(t.validate().is_err());
        assert!(TenantsConfig::default().validate().is_ok());
    }
}
