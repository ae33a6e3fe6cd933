//! `kvroute.backends[]`: one OpenAI-compatible engine each.

use serde::Deserialize;
use std::path::PathBuf;

use super::disagg::Role;
use super::error::{err, parse_addr, ConfigError};
use super::kv_events::BackendKvEvents;

/// Which engine's metric names a backend's `/metrics` uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum EngineKind {
    #[default]
    Vllm,
    Sglang,
    Llamacpp,
}

impl EngineKind {
    /// The name the config uses.
    pub fn as_str(self) -> &'static str {
        match self {
            EngineKind::Vllm => "vllm",
            EngineKind::Sglang => "sglang",
            EngineKind::Llamacpp => "llamacpp",
        }
    }
}

/// Whether the engine schedules by a request's `priority` field, and which way: kvroute then
/// sends each request's priority band there (and owns the field: a client's is replaced).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum EnginePriority {
    /// The field is left as the client sent it.
    #[default]
    None,
    /// Larger values first: SGLang with `--enable-priority-scheduling`.
    HigherFirst,
    /// Smaller values first: vLLM with `--scheduling-policy priority`, SGLang with
    /// `--schedule-low-priority-values-first`.
    LowerFirst,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct BackendConfig {
    /// `ip:port` of an OpenAI-compatible engine (vLLM, SGLang, llama.cpp server, ...).
    pub addr: String,
    #[serde(default = "one")]
    pub weight: u32,
    /// Prefill throughput of this backend's engine (kv_aware's cost model). Unset: learned
    /// from the engine's counters, `DEFAULT_PREFILL_TOKENS_PER_S` until then.
    #[serde(default)]
    pub prefill_tokens_per_s: Option<f64>,
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
    /// Models this backend serves (base models and LoRA adapters, by the name requests use;
    /// `"*"`: any name). Empty: what its engine's `GET /v1/models` lists, or every model until
    /// that is known.
    #[serde(default)]
    pub models: Vec<String>,
    /// Reach this engine over TLS (requests, health checks and metrics scrapes); absent:
    /// plaintext HTTP/1.1.
    #[serde(default)]
    pub tls: Option<BackendTlsConfig>,
    /// Follow this engine's KV-cache events (with `kvroute.kv_events` set): placement then
    /// knows exactly which prefixes it caches.
    #[serde(default)]
    pub kv_events: Option<BackendKvEvents>,
    /// Absolute path of a file holding the engine's own API key (its `--api-key`), sent as
    /// `Authorization: Bearer` on every request and scrape. The key stays out of the config.
    #[serde(default)]
    pub api_key_file: Option<PathBuf>,
    /// Send the router's priority as the engine's `priority` field ([`EnginePriority`]).
    #[serde(default)]
    pub engine_priority: EnginePriority,
    /// What the backend does in a disaggregated fleet ([`Role`]).
    #[serde(default)]
    pub role: Role,
    /// The port of this SGLang server's bootstrap server (its `--disaggregation-bootstrap-port`),
    /// which decode servers fetch its KV through: `sglang_bootstrap` prefill legs name it.
    #[serde(default = "default_bootstrap_port")]
    pub bootstrap_port: u16,
}

/// SGLang's `--disaggregation-bootstrap-port` default (`server_args.py`).
fn default_bootstrap_port() -> u16 {
    8998
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct BackendTlsConfig {
    /// Server name sent in SNI and that the engine's certificate must be valid for.
    pub sni: String,
    /// Absolute path of a PEM CA bundle the engine's certificate must chain to; unset: the
    /// system's trust store.
    #[serde(default)]
    pub ca: Option<PathBuf>,
    /// Verify the engine's certificate and name. Only for a test fleet: `false` lets anyone on
    /// the path between kvroute and the engine read and change its traffic.
    #[serde(default = "yes")]
    pub verify: bool,
}

fn yes() -> bool {
    true
}

/// KV cache assumed when neither configured nor reported: an 8B model on one H100.
pub const DEFAULT_KV_CAPACITY_TOKENS: u64 = 500_000;

/// Prefill rate assumed when none is configured: an 8B model on one H100.
pub const DEFAULT_PREFILL_TOKENS_PER_S: f64 = 25_000.0;

fn default_metrics_path() -> String {
    "/metrics".into()
}

fn one() -> u32 {
    1
}

/// Every backend is a valid, distinct address with sane settings.
pub(super) fn validate(backends: &[BackendConfig]) -> Result<(), ConfigError> {
    if backends.is_empty() {
        return Err(err("kvroute.backends", "at least one backend is required"));
    }
    let mut seen = std::collections::HashSet::new();
    for (i, b) in backends.iter().enumerate() {
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
        if b.prefill_tokens_per_s
            .is_some_and(|r| !(r.is_finite() && r >= 1.0))
        {
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
        if b.bootstrap_port == 0 {
            return Err(err(
                format!("kvroute.backends[{i}].bootstrap_port"),
                "must be a port (1-65535)",
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
        if b.models.iter().any(|m| m.trim().is_empty()) {
            return Err(err(
                format!("kvroute.backends[{i}].models"),
                "model names must not be empty",
            ));
        }
        if let Some(k) = &b.kv_events {
            k.validate(&format!("kvroute.backends[{i}].kv_events"))?;
        }
        if b.api_key_file.as_ref().is_some_and(|p| !p.is_absolute()) {
            return Err(err(
                format!("kvroute.backends[{i}].api_key_file"),
                "must be an absolute path",
            ));
        }
        if let Some(t) = &b.tls {
            if t.sni.trim().is_empty() {
                return Err(err(
                    format!("kvroute.backends[{i}].tls.sni"),
                    "must name the engine's certificate (a DNS name)",
                ));
            }
            if t.ca.as_ref().is_some_and(|p| !p.is_absolute()) {
                return Err(err(
                    format!("kvroute.backends[{i}].tls.ca"),
                    "must be an absolute path",
                ));
            }
        }
    }
    Ok(())
}
