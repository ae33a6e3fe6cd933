//! The `kvroute:` section of the YAML file: schema, defaults and validation.
//!
//! Pingora's own server keys (threads, pid_file, upgrade_sock, grace_period_seconds, ...) live at
//! the top level of the same file and are read by Pingora. Unknown keys under `kvroute:` are
//! errors, so a typo never silently falls back to a default.

use serde::Deserialize;
use std::net::SocketAddr;
use std::path::Path;

use crate::policy::PolicyKind;
use crate::telemetry::EngineKind;

#[derive(Debug, Clone, PartialEq)]
pub struct ConfigError {
    /// Dotted path of the offending key, e.g. `kvroute.routing.epsilon`.
    pub key: String,
    pub reason: String,
}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.key, self.reason)
    }
}

impl std::error::Error for ConfigError {}

fn err(key: impl Into<String>, reason: impl Into<String>) -> ConfigError {
    ConfigError {
        key: key.into(),
        reason: reason.into(),
    }
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Client traffic listener.
    pub listen: String,
    /// Metrics and health listener; must differ from `listen`.
    #[serde(default = "default_admin_listen")]
    pub admin_listen: String,
    pub backends: Vec<BackendConfig>,
    #[serde(default)]
    pub routing: RoutingConfig,
    #[serde(default)]
    pub health_check: HealthCheckConfig,
    #[serde(default)]
    pub limits: LimitsConfig,
    #[serde(default)]
    pub timeouts: TimeoutsConfig,
    #[serde(default)]
    pub telemetry: TelemetryConfig,
    #[serde(default)]
    pub outlier: OutlierConfig,
    /// Models the fleet serves; a request for another gets 404. Empty: not checked.
    #[serde(default)]
    pub models: Vec<String>,
    /// API keys and per-key limits; absent: no access control.
    #[serde(default)]
    pub access: Option<AccessConfig>,
}

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
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct TelemetryConfig {
    /// Scrape each backend's engine metrics.
    pub enabled: bool,
    pub interval_ms: u64,
    /// One scrape's deadline.
    pub timeout_ms: u64,
    /// Older samples are ignored; placement then uses kvroute's own accounting alone.
    pub stale_after_ms: u64,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        TelemetryConfig {
            enabled: true,
            interval_ms: 1000,
            timeout_ms: 500,
            stale_after_ms: 3000,
        }
    }
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct BackendConfig {
    /// `ip:port` of an OpenAI-compatible engine (vLLM, SGLang, llama.cpp server, ...).
    pub addr: String,
    #[serde(default = "one")]
    pub weight: u32,
    /// Prefill throughput of this backend's engine (kv_aware's cost model).
    #[serde(default = "default_prefill_rate")]
    pub prefill_tokens_per_s: f64,
    /// KV cache size of this backend's engine, which bounds its prefix index. Unset: learned
    /// from `vllm:cache_config_info`, else `DEFAULT_KV_CAPACITY_TOKENS`.
    #[serde(default)]
    pub kv_capacity_tokens: Option<u64>,
    /// Which engine's metric names its `/metrics` uses.
    #[serde(default)]
    pub engine: EngineKind,
    #[serde(default = "default_metrics_path")]
    pub metrics_path: String,
    /// Optional DCGM exporter (`ip:port`, `GET /metrics`) for this backend's GPU.
    #[serde(default)]
    pub dcgm_addr: Option<String>,
}

/// KV cache assumed when neither configured nor reported: an 8B model on one H100.
pub const DEFAULT_KV_CAPACITY_TOKENS: u64 = 500_000;

fn default_prefill_rate() -> f64 {
    25_000.0
}

fn default_metrics_path() -> String {
    "/metrics".into()
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct RoutingConfig {
    pub policy: PolicyKind,
    /// Load bound headroom: a backend takes a request while
    /// `load + 1 <= ceil((1 + epsilon) * mean_load * weight_share) + slack`.
    pub epsilon: f64,
    /// Extra requests allowed over the bound, so low concurrency does not spill.
    pub slack: u32,
    /// kv_aware: prompt tokens that weigh as one more request in the load bound.
    pub work_unit_tokens: u64,
    /// kv_aware: ring positions considered besides backends holding a long prefix match.
    pub candidates: usize,
    /// kv_aware: requests with more uncached prompt tokens than this are placed by cost over
    /// the whole fleet.
    pub heavy_prefill_tokens: u64,
    /// kv_aware: cost, per decoding stream on a backend, of each second of prefill there.
    pub decode_stall_weight: f64,
    /// kv_aware: a backend whose engine reports more KV cache in use than this takes new
    /// requests only when no other can.
    pub kv_usage_ceiling: f64,
    /// kv_aware: leave the session key's owner for a backend holding a longer cached prefix
    /// only when it saves at least this many prompt tokens.
    pub min_prefix_saving_tokens: u64,
    /// kv_aware: correct each backend's prefill rate online from observed TTFTs. Off by
    /// default: in the N=8 comparison it skewed the fleet's prefill (see bench/README.md).
    pub learn_prefill_rate: bool,
}

impl RoutingConfig {
    /// Estimated tokens per prefix block (blocks are 256 bytes, about 4 bytes a token).
    pub fn block_tokens(&self) -> u64 {
        (crate::prefix::DEFAULT_BLOCK_BYTES / 4) as u64
    }

    pub fn params(&self) -> crate::policy::Params {
        crate::policy::Params {
            policy: self.policy,
            epsilon: self.epsilon,
            slack: self.slack,
            block_tokens: self.block_tokens(),
            work_unit_tokens: self.work_unit_tokens,
            candidates: self.candidates,
            heavy_prefill_tokens: self.heavy_prefill_tokens,
            decode_stall_weight: self.decode_stall_weight,
            kv_usage_ceiling: self.kv_usage_ceiling,
            backend_max_inflight: u64::MAX,
            min_prefix_saving_tokens: self.min_prefix_saving_tokens,
        }
    }
}

impl Default for RoutingConfig {
    fn default() -> Self {
        RoutingConfig {
            policy: PolicyKind::KvAware,
            epsilon: 0.5,
            slack: 1,
            work_unit_tokens: 4096,
            candidates: 3,
            heavy_prefill_tokens: 8192,
            decode_stall_weight: 0.02,
            kv_usage_ceiling: 0.9,
            min_prefix_saving_tokens: 1024,
            learn_prefill_rate: false,
        }
    }
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct HealthCheckConfig {
    /// Path requested with `GET`; any 2xx is healthy.
    pub path: String,
    pub interval_ms: u64,
    pub timeout_ms: u64,
    /// Consecutive results needed to flip a backend's state.
    pub consecutive_success: usize,
    pub consecutive_failure: usize,
}

impl Default for HealthCheckConfig {
    fn default() -> Self {
        HealthCheckConfig {
            path: "/health".into(),
            interval_ms: 1000,
            timeout_ms: 1000,
            consecutive_success: 1,
            consecutive_failure: 1,
        }
    }
}

/// Passive outlier ejection (see `outlier.rs`).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct OutlierConfig {
    pub enabled: bool,
    /// Failures in a row (connect errors, resets and timeouts before a response, 5xx but 503)
    /// that eject a backend.
    pub consecutive_failures: u32,
    /// First ejection; each further one without a success in between doubles it.
    pub base_ejection_ms: u64,
    pub max_ejection_ms: u64,
    /// Never eject more than this share of the fleet.
    pub max_ejected_percent: u32,
}

impl Default for OutlierConfig {
    fn default() -> Self {
        OutlierConfig {
            enabled: true,
            consecutive_failures: 5,
            base_ejection_ms: 10_000,
            max_ejection_ms: 300_000,
            max_ejected_percent: 50,
        }
    }
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct LimitsConfig {
    /// Largest request body accepted (413 above it).
    pub max_body_bytes: usize,
    /// Upstream attempts per request (first try included); only failures before the first
    /// response byte are retried, each on a backend not tried yet.
    pub max_attempts: u32,
    /// Seconds suggested in `Retry-After` when no backend can take a request.
    pub retry_after_seconds: u32,
    /// Hard cap of requests in flight per backend (per unit of weight); when every backend is
    /// at it, requests wait in the router queue.
    pub backend_max_inflight: u64,
    /// Requests that may wait in the router queue; more are shed with 503.
    pub queue_size: usize,
    /// Longest wait in the router queue before a request is shed with 503.
    pub queue_timeout_ms: u64,
    /// Requests retrying at once may be at most this share of the requests in flight ...
    pub retry_budget_ratio: f64,
    /// ... or this many, whichever is more.
    pub retry_budget_min: u64,
    /// Client connections open at once; more are closed on accept.
    pub max_connections: usize,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        LimitsConfig {
            max_body_bytes: 32 * 1024 * 1024,
            max_attempts: 3,
            retry_after_seconds: 1,
            backend_max_inflight: 256,
            queue_size: 1024,
            queue_timeout_ms: 10_000,
            retry_budget_ratio: 0.2,
            retry_budget_min: 3,
            max_connections: 10_000,
        }
    }
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct TimeoutsConfig {
    /// TCP connect to a backend.
    pub connect_ms: u64,
    /// Longest silence while reading from a backend. Long prefills produce no bytes until the
    /// first token, so this must exceed the worst TTFT you expect.
    pub upstream_read_ms: u64,
    /// Longest wait for each read of the client's request body.
    pub client_body_read_ms: u64,
    /// The whole request body must arrive within this (408 after), however it trickles.
    pub client_body_ms: u64,
    /// A new connection's first request header must be complete within this; slower
    /// (slowloris) connections are closed.
    pub client_header_ms: u64,
    /// A keep-alive connection may sit idle this long before its next request; that request's
    /// header must then be complete within `client_header_ms` more.
    pub client_idle_ms: u64,
}

impl Default for TimeoutsConfig {
    fn default() -> Self {
        TimeoutsConfig {
            connect_ms: 2000,
            upstream_read_ms: 300_000,
            client_body_read_ms: 30_000,
            client_body_ms: 60_000,
            client_header_ms: 10_000,
            client_idle_ms: 60_000,
        }
    }
}

fn default_admin_listen() -> String {
    "127.0.0.1:9090".into()
}

fn one() -> u32 {
    1
}

#[derive(Deserialize)]
struct FileRoot {
    kvroute: Option<serde_yaml::Value>,
}

impl Config {
    /// Read and validate the `kvroute:` section of a config file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| err(path.display().to_string(), format!("cannot read: {e}")))?;
        Self::from_yaml(&text)
    }

    pub fn from_yaml(text: &str) -> Result<Config, ConfigError> {
        let root: FileRoot =
            serde_yaml::from_str(text).map_err(|e| err("(file)", format!("invalid YAML: {e}")))?;
        let section = root
            .kvroute
            .ok_or_else(|| err("kvroute", "missing section"))?;
        // The path names the offending key (`kvroute.routing.policy`), not just the section.
        let cfg: Config = serde_path_to_error::deserialize(section).map_err(|e| {
            let path = e.path().to_string();
            let key = if path == "." {
                "kvroute".to_string()
            } else {
                format!("kvroute.{path}")
            };
            err(key, e.into_inner().to_string())
        })?;
        cfg.validate()?;
        Ok(cfg)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let listen = parse_addr("kvroute.listen", &self.listen)?;
        let admin = parse_addr("kvroute.admin_listen", &self.admin_listen)?;
        if listen == admin {
            return Err(err(
                "kvroute.admin_listen",
                "must differ from kvroute.listen (metrics never share the client port)",
            ));
        }
        if self.backends.is_empty() {
            return Err(err("kvroute.backends", "at least one backend is required"));
        }
        let mut seen = std::collections::HashSet::new();
        for (i, b) in self.backends.iter().enumerate() {
            let key = format!("kvroute.backends[{i}].addr");
            let addr = parse_addr(&key, &b.addr)?;
            if !seen.insert(addr) {
                return Err(err(key, format!("duplicate backend {addr}")));
            }
            if b.weight == 0 || b.weight > 1000 {
                return Err(err(
                    format!("kvroute.backends[{i}].weight"),
                    "must be between 1 and 1000",
                ));
            }
            if !(b.prefill_tokens_per_s.is_finite() && b.prefill_tokens_per_s >= 1.0) {
                return Err(err(
                    format!("kvroute.backends[{i}].prefill_tokens_per_s"),
                    "must be at least 1",
                ));
            }
            if b.kv_capacity_tokens.is_some_and(|t| t < 1024) {
                return Err(err(
                    format!("kvroute.backends[{i}].kv_capacity_tokens"),
                    "must be at least 1024",
                ));
            }
            if !b.metrics_path.starts_with('/') {
                return Err(err(
                    format!("kvroute.backends[{i}].metrics_path"),
                    "must start with '/'",
                ));
            }
            if let Some(d) = &b.dcgm_addr {
                parse_addr(&format!("kvroute.backends[{i}].dcgm_addr"), d)?;
            }
        }
        let r = &self.routing;
        if !(r.epsilon.is_finite() && r.epsilon >= 0.0 && r.epsilon <= 100.0) {
            return Err(err("kvroute.routing.epsilon", "must be between 0 and 100"));
        }
        if r.policy == PolicyKind::KvAware && self.backends.len() > crate::index::MAX_BACKENDS {
            return Err(err(
                "kvroute.backends",
                format!(
                    "kv_aware tracks at most {} backends",
                    crate::index::MAX_BACKENDS
                ),
            ));
        }
        if r.work_unit_tokens == 0 {
            return Err(err("kvroute.routing.work_unit_tokens", "must be positive"));
        }
        if r.candidates == 0 {
            return Err(err("kvroute.routing.candidates", "must be at least 1"));
        }
        if !(r.decode_stall_weight.is_finite() && r.decode_stall_weight >= 0.0) {
            return Err(err("kvroute.routing.decode_stall_weight", "must be >= 0"));
        }
        if !(r.kv_usage_ceiling > 0.0 && r.kv_usage_ceiling <= 1.0) {
            return Err(err("kvroute.routing.kv_usage_ceiling", "must be in (0, 1]"));
        }
        let tm = &self.telemetry;
        if tm.interval_ms < 100 || tm.timeout_ms == 0 || tm.stale_after_ms == 0 {
            return Err(err(
                "kvroute.telemetry",
                "interval_ms must be at least 100, timeout_ms and stale_after_ms positive",
            ));
        }
        let h = &self.health_check;
        if !h.path.starts_with('/') {
            return Err(err("kvroute.health_check.path", "must start with '/'"));
        }
        if h.interval_ms < 50 {
            return Err(err(
                "kvroute.health_check.interval_ms",
                "must be at least 50",
            ));
        }
        if h.timeout_ms == 0 {
            return Err(err("kvroute.health_check.timeout_ms", "must be positive"));
        }
        if h.consecutive_success == 0 || h.consecutive_failure == 0 {
            return Err(err(
                "kvroute.health_check.consecutive_success",
                "consecutive_success and consecutive_failure must be at least 1",
            ));
        }
        let l = &self.limits;
        if l.max_body_bytes == 0 {
            return Err(err("kvroute.limits.max_body_bytes", "must be positive"));
        }
        if l.max_attempts == 0 || l.max_attempts > 16 {
            return Err(err(
                "kvroute.limits.max_attempts",
                "must be between 1 and 16",
            ));
        }
        if l.backend_max_inflight == 0 {
            return Err(err(
                "kvroute.limits.backend_max_inflight",
                "must be positive",
            ));
        }
        if l.queue_timeout_ms == 0 {
            return Err(err("kvroute.limits.queue_timeout_ms", "must be positive"));
        }
        if !(0.0..=10.0).contains(&l.retry_budget_ratio) {
            return Err(err(
                "kvroute.limits.retry_budget_ratio",
                "must be between 0 and 10",
            ));
        }
        if l.max_connections == 0 {
            return Err(err("kvroute.limits.max_connections", "must be positive"));
        }
        if let Some(a) = &self.access {
            if a.keys.is_empty() {
                return Err(err(
                    "kvroute.access.keys",
                    "at least one key is required (remove `access` to turn access control off)",
                ));
            }
            let mut seen = std::collections::HashSet::new();
            for (i, k) in a.keys.iter().enumerate() {
                let Some(d) = crate::access::parse_digest(&k.sha256) else {
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
                if k.requests_per_minute == Some(0) || k.tokens_per_minute == Some(0) {
                    return Err(err(
                        format!("kvroute.access.keys[{i}]"),
                        "rate limits must be positive (leave one out for no limit)",
                    ));
                }
            }
        }
        let o = &self.outlier;
        if o.consecutive_failures == 0 {
            return Err(err(
                "kvroute.outlier.consecutive_failures",
                "must be at least 1",
            ));
        }
        if o.base_ejection_ms == 0 || o.max_ejection_ms < o.base_ejection_ms {
            return Err(err(
                "kvroute.outlier.max_ejection_ms",
                "base_ejection_ms must be positive and at most max_ejection_ms",
            ));
        }
        if o.max_ejected_percent > 100 {
            return Err(err(
                "kvroute.outlier.max_ejected_percent",
                "must be between 0 and 100",
            ));
        }
        let t = &self.timeouts;
        for (key, v) in [
            ("kvroute.timeouts.connect_ms", t.connect_ms),
            ("kvroute.timeouts.upstream_read_ms", t.upstream_read_ms),
            (
                "kvroute.timeouts.client_body_read_ms",
                t.client_body_read_ms,
            ),
            ("kvroute.timeouts.client_body_ms", t.client_body_ms),
            ("kvroute.timeouts.client_header_ms", t.client_header_ms),
            ("kvroute.timeouts.client_idle_ms", t.client_idle_ms),
        ] {
            if v == 0 {
                return Err(err(key, "must be positive"));
            }
        }
        Ok(())
    }
}

fn parse_addr(key: &str, s: &str) -> Result<SocketAddr, ConfigError> {
    s.parse()
        .map_err(|_| err(key, format!("`{s}` is not an ip:port socket address")))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = r#"
version: 1
threads: 2
kvroute:
  listen: "127.0.0.1:8080"
  backends:
    - addr: "127.0.0.1:8001"
    - addr: "127.0.0.1:8002"
      weight: 2
"#;

    #[test]
    fn minimal_file_gets_defaults() {
        let c = Config::from_yaml(MINIMAL).unwrap();
        assert_eq!(c.admin_listen, "127.0.0.1:9090");
        assert_eq!(c.backends[0].weight, 1);
        assert_eq!(c.backends[1].weight, 2);
        assert_eq!(c.routing.policy, PolicyKind::KvAware);
        assert_eq!(c.routing.slack, 1);
        assert_eq!(c.health_check.path, "/health");
    }

    #[test]
    fn unknown_key_is_named() {
        let text = MINIMAL.replace("  listen:", "  lisen: x\n  listen:");
        let e = Config::from_yaml(&text).unwrap_err();
        assert!(e.reason.contains("lisen"), "{e}");
    }

    #[test]
    fn bad_values_name_their_key() {
        let cases = [
            (
                "listen: \"127.0.0.1:8080\"",
                "listen: \"nope\"",
                "kvroute.listen",
            ),
            ("weight: 2", "weight: 0", "kvroute.backends[1].weight"),
            (
                "- addr: \"127.0.0.1:8002\"",
                "- addr: \"127.0.0.1:8001\"",
                "kvroute.backends[1].addr",
            ),
        ];
        for (from, to, key) in cases {
            let e = Config::from_yaml(&MINIMAL.replace(from, to)).unwrap_err();
            assert_eq!(e.key, key, "{e}");
        }
        let e = Config::from_yaml(&format!("{MINIMAL}  routing:\n    epsilon: -1\n")).unwrap_err();
        assert_eq!(e.key, "kvroute.routing.epsilon");
        let e =
            Config::from_yaml(&format!("{MINIMAL}  routing:\n    policy: magic\n")).unwrap_err();
        assert!(e.reason.contains("magic"), "{e}");
        let e = Config::from_yaml(&format!("{MINIMAL}  admin_listen: \"127.0.0.1:8080\"\n"))
            .unwrap_err();
        assert_eq!(e.key, "kvroute.admin_listen");
    }

    #[test]
    fn missing_section_and_empty_backends() {
        assert_eq!(
            Config::from_yaml("version: 1\n").unwrap_err().key,
            "kvroute"
        );
        let e =
            Config::from_yaml("kvroute:\n  listen: \"127.0.0.1:1\"\n  backends: []\n").unwrap_err();
        assert_eq!(e.key, "kvroute.backends");
    }

    #[test]
    fn example_config_is_valid() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("conf/kvroute.yaml");
        Config::load(&path).unwrap();
    }
}
