//! kvroute: a KV-cache-aware edge proxy for OpenAI-compatible LLM inference fleets, built on
//! Cloudflare's Pingora.
//!
//! # Features
//! - Routes `POST /v1/chat/completions` and `/v1/completions` by a session key (explicit header
//!   or body field, else a hash of the conversation's opening), so every turn of a conversation
//!   lands on the GPU server that holds its KV cache.
//! - Consistent hashing with bounded loads: a hot session spills to its next ring positions
//!   instead of piling onto one server.
//! - Active health checks, retry on another backend before the first response byte, OpenAI-shaped
//!   errors, Prometheus metrics on a separate admin listener.
//!
//! # How to use
//! `kvroute -c conf/kvroute.yaml` (Pingora's `-t`, `-u`, `-d` work as in Pingora). See README.md.
//!
//! # Layout
//! - [`config`]: YAML schema, defaults, validation.
//! - [`request`]: OpenAI body parsing and the canonical prompt -> [`request::RequestProfile`].
//! - [`prefix`]: block hashing of the canonical prompt.
//! - [`ring`]: Ketama ring walk and the bounded-load capacity.
//! - [`policy`]: the placement decision (pure function of a snapshot and a profile).
//! - [`kv_aware`]: the kv_aware policy: work-bounded ring, prefix matches, TTFT cost model.
//! - [`fleet`]: backends, health, in-flight accounting, snapshot.
//! - [`index`]: prefix index (per-backend LRU of block hashes, reverse map for longest match).
//! - [`proxy`]: the Pingora `ProxyHttp` phases (placement glue, failure handling and the end
//!   of a request in its submodules).
//! - [`body`]: reading a routed request's body (limits, deadlines, Pingora's retry buffer).
//! - [`edge`]: client connections: connection cap, request header deadline (slowloris).
//! - [`outlier`]: passive outlier ejection of backends that fail requests in a row.
//! - [`retry_budget`]: caps retries in flight at a share of requests in flight.
//! - [`access`]: API keys (hashed, constant-time), tenants, allowed models, per-key rate limits.
//! - [`admin`]: `/metrics`, `/healthz`, `/readyz` listener.
//! - [`admission`]: the router queue (priority, deadline) and shedding.
//! - [`metrics`]: `kvroute_*` Prometheus families.
//! - [`telemetry`]: engine /metrics scraping (vLLM, SGLang, llama.cpp, DCGM).
//! - [`error`]: the client-facing error type (HTTP status + OpenAI error JSON).
//! - [`state`]: shared process state (config, fleet, metrics, draining flag).
//! - [`reload`]: SIGHUP hot reload of the config file.
//! - [`drain`]: notices a graceful upgrade or shutdown so `/readyz` turns not-ready.
//! - [`server`]: process wiring of the Pingora services.
//! - [`usage`]: engine-reported usage from responses (asked for on streams, then stripped).

pub mod access;
pub mod admin;
pub mod admission;
pub mod body;
pub mod config;
pub mod drain;
pub mod edge;
pub mod error;
pub mod fleet;
pub mod index;
pub mod kv_aware;
pub mod metrics;
pub mod outlier;
pub mod policy;
pub mod prefix;
pub mod proxy;
pub mod reload;
pub mod request;
pub mod retry_budget;
pub mod ring;
pub mod server;
pub mod state;
pub mod telemetry;
pub mod usage;
