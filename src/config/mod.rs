//! kvroute's configuration: the `kvroute:` section of the YAML file. Each section's schema,
//! defaults (written once, here) and validation live together in one file; nothing in this
//! layer does I/O except reading the file in [`Config::load`].

mod access;
mod backend;
mod disagg;
mod error;
mod file;
mod headers;
mod health;
mod kv_events;
mod limits;
mod log;
mod passthrough;
mod routing;
mod tenants;
mod tls;

pub use access::{parse_digest, AccessConfig, ApiKeyConfig, KeyDigest};
pub use backend::{
    BackendConfig, BackendTlsConfig, EngineKind, EnginePriority, DEFAULT_KV_CAPACITY_TOKENS,
    DEFAULT_PREFILL_TOKENS_PER_S,
};
pub use disagg::{DisaggregationConfig, PdDecision, PdProtocol, Role};
pub use error::ConfigError;
pub use file::{Config, MAX_INDEXED_BACKENDS};
pub use headers::ResponseHeadersConfig;
pub use health::{HealthCheckConfig, OutlierConfig, TelemetryConfig};
pub use kv_events::{
    BackendKvEvents, KvEventsConfig, ModelTokenizer, TokenizerFiles, MAX_DP_RANKS,
};
pub use limits::{LimitsConfig, TimeoutsConfig};
pub use log::{LogConfig, LogFormat};
pub use passthrough::{path_matches, AllowRule, PassthroughConfig};
pub use routing::{
    BodyKey, KeySource, PolicyKind, RoutingConfig, BLOCK_BYTES, DEFAULT_SESSION_KEYS,
};
pub use tenants::{
    metric_label, valid_tenant, BandConfig, FairShareConfig, TenantsConfig, DEFAULT_TENANT,
};
pub use tls::TlsConfig;
