//! kvroute: a KV-cache-aware edge proxy for OpenAI-compatible LLM inference fleets, built on
//! Cloudflare's Pingora.
//!
//! # Features
//! - Routes `POST /v1/chat/completions` and `/v1/completions` by a session key (explicit header
//!   or body field, else a hash of the conversation's opening), so every turn of a conversation
//!   lands on the GPU server that holds its KV cache.
//! - Consistent hashing with bounded loads: a hot session spills to its next ring positions
//!   instead of piling onto one server; `kv_aware` adds a prefix index and a TTFT cost model.
//! - Active health checks, passive outlier ejection, retries on another backend before the
//!   first response byte, a router queue, OpenAI-shaped errors, Prometheus metrics on a
//!   separate admin listener, SIGHUP reload and zero-downtime upgrades.
//!
//! # How to use
//! `kvroute -c conf/kvroute.yaml` (Pingora's `-t`, `-u`, `-d` work as in Pingora). See README.md
//! and docs/ (the layers below: docs/dev/architecture.md).
//!
//! # Layout
//! Each layer imports only the layers below it:
//!
//! ```text
//! server/     bootstrap, reload, drain, admin listener (metrics rendering)
//!   proxy/    the Pingora ProxyHttp phases: Ctx, Placer, FailurePolicy, end_request
//!     edge/   client listener, connection cap, access control, router queue, retry budget
//!       fleet/      backends, health, accounting, outlier ejection, telemetry, Generation
//!         placement/  pure: ring, snapshot/params/decision, one file per policy, prefix index
//!           request/  body reading, OpenAI parsing, canonical prompt, blocks, tokens, usage tap
//!             config/ the YAML schema, defaults written once, validation per section
//! error, metrics: leaves (the OpenAI error shape; Prometheus registration helpers)
//! ```
//!
//! One [`fleet::Generation`] (config + fleet) is published by a single atomic swap on reload and
//! pinned once per request. Each component registers its own `kvroute_*` families in the one
//! registry the admin listener renders.

pub mod config;
pub(crate) mod edge;
pub(crate) mod error;
pub(crate) mod fleet;
pub(crate) mod metrics;
pub mod placement;
pub(crate) mod proxy;
pub mod request;
pub mod server;

pub use edge::digest;
