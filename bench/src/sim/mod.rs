//! `kvbench sim`: N simulated OpenAI-compatible inference servers in one process.
//!
//! # Features
//! - `/v1/chat/completions` and `/v1/completions`, streaming (SSE) and not, with deterministic
//!   filler output of exactly `max_tokens` tokens.
//! - OpenAI's Responses API (`/v1/responses`, with `previous_response_id` and the stored
//!   answers' `GET`, `DELETE`, `cancel` and `input_items`) and Anthropic's Messages API
//!   (`/v1/messages`, `/v1/messages/count_tokens`), served as the chat request each body
//!   converts to, as vLLM, SGLang and llama-server render them: one prompt, one prefix cache,
//!   the same faults and timing, answered in each API's own shapes and stream events.
//! - Engine mode (the default): per server, a vLLM-like engine with continuous batching,
//!   chunked prefill, a KV block pool with prefix reuse, LRU eviction and preemption, and a
//!   step-time model from a GPU profile (`--profile`, `--kv-tokens`); `--profiles
//!   h100-llama8b:4,l40s-llama8b:4` mixes profiles in one fleet (server i gets the i-th).
//! - `--profile cpu-smollm2`: a real llama.cpp `llama-server` (SmolLM2-135M on one CPU thread,
//!   two slots, `--cache-ram 256`) as measured on this machine: two requests run at once and
//!   the rest wait, `n_batch` 2,048, a 4,096-token context per slot (a prompt that fills it
//!   is refused, and output stops where it is full), a pool of the slots plus the RAM prompt
//!   cache. It speaks llama.cpp unless `--engine` says otherwise.
//! - Fixed-timing mode (when `--ttft-ms` or `--itl-ms` is given): every request gets its first
//!   token after the TTFT and the rest one per inter-token interval, independent of load; a
//!   per-server LRU prefix cache still reports `cached_tokens`. kvroute's integration tests
//!   use this mode.
//! - Both report `usage.prompt_tokens_details.cached_tokens` the way vLLM does, and a server
//!   speaking llama.cpp adds its `timings` (prompt and decode, in model milliseconds).
//! - Engine telemetry on `/metrics` in vLLM, SGLang or llama.cpp names and meanings,
//!   including each request's prefill time, measured in model time by the engine's step loop;
//!   for llama.cpp exactly the families of a real llama-server 0.6.0, plus its `/props`
//!   (slots and per-slot context, which kvroute reads) and `/slots`.
//! - Fault knobs (failure rate, hangs, unhealthy, slow start) and request introspection under
//!   `/debug/*`, so kvroute's integration tests can see what each backend received.
//! - `--kv-events PORT`: each engine publishes its KV pool's changes as vLLM's KV cache
//!   events, on vLLM's ZMQ PUB and replay sockets (`kvevents`, `kvpublish`).
//! - Prefill/decode disaggregation after vLLM's NixlConnector (`pd`): a prefill request holds
//!   its prompt's blocks for a decode server, which reads them in model time and finds its
//!   prefix cached; `--role`, `--kv-transfer-gbps` and the others set it up.
//!
//! # How to use
//! `kvbench sim --servers 2 --base-port 0` prints one `kvbench-sim listening ADDR index I` line
//! per server, then `kvbench-sim ready`, on stdout. With `--kv-events`, a
//! `kvbench-sim kv-events index I pub ENDPOINT replay ENDPOINT` line per server comes before
//! `ready`.
//!
//! # Layout
//! - `cli`: arguments and their validation into a `SimConfig`.
//! - `config`: the validated, time-scaled settings shared by every server; `faults`: fault
//!   knobs; `error`: the one error type, rendered in OpenAI's error shape.
//! - `api/`, the HTTP face:
//!   - `server`: the axum router and the listener task; `state`: what each server holds.
//!   - `inference`: the POST endpoints and fixed-timing answers; `admission`: slow start,
//!     parsing, hang and failure faults, prefix lookup.
//!   - `engine_answer`: engine-mode answers (waiting on the engine, SSE coalescing).
//!   - `admin`: health, models, metrics, llama.cpp's `/props` and `/slots`, and the `/debug`
//!     endpoints.
//!   - `response` / `sse`: answer bodies; `metrics`: the counters' Prometheus text; `reqlog`:
//!     request log.
//!   - `responses` / `messages`: the Responses and Messages routes beside the shared POST
//!     path (stored answers; Anthropic's error shape, `count_tokens`); `responses_answer` /
//!     `messages_answer`: their bodies and stream events; `response_store`: the bounded store
//!     of finished Responses answers.
//! - `engine/`, the engine model:
//!   - `task`: the per-server engine task; `scheduler`: its step logic (pure, time injected);
//!     `kvpool`: its KV block pool; `profile`: GPU profiles (and the measured llama.cpp CPU
//!     server, `cpu-smollm2`), the step-time model and the scheduler's limits.
//!   - `kvcache`: chained block hashes and fixed mode's bounded prefix cache.
//!   - `lora`: LoRA adapter slots; `stats`: the counters (the server's and its engine's).
//!   - `kv_events/`: `kvevents`: the pool's changes as vLLM's KV events and their msgpack;
//!     `kvpublish`: their ZMQ sockets (PUB, and ROUTER for replay).
//! - `text/`, what the model reads and writes:
//!   - `openai`: request body parsing; `responses` / `anthropic`: Responses and Messages
//!     bodies converted to chat; `ids`: random answer and item ids; `prompt`: canonical prompt
//!     and stand-in tokenizer; `tokenizer`: a real Hugging Face tokenizer instead
//!     (`--tokenizer`).
//!   - `generate`: filler text, token timing and the reply's block hashes.
//!
//! - `pd/`, prefill/decode disaggregation: `params` (`kv_transfer_params`), `held` (the
//!   prefill side's held blocks), `transfer` (the decode side's notice to the prefill
//!   server), `stats`; the HTTP glue is `api::pd`, the pool's part `engine::scheduler`.
//!
//! Imports between these modules go one way only, from the endpoints (`api`) down through
//! `pd` and `text` to `engine`, which imports none of them, so that any module can be read
//! and tested knowing only the ones below it.

mod api;
mod cli;
mod config;
mod engine;
mod error;
mod faults;
mod pd;
mod text;

#[cfg(test)]
mod e2e_tests;
#[cfg(test)]
mod pd_bootstrap_e2e_tests;
#[cfg(test)]
mod pd_e2e_tests;

use std::io::Write;
use std::net::SocketAddr;
use std::sync::Arc;

use api::server;
use engine::kv_events::kvpublish;

pub use cli::SimArgs;
pub use engine::profile::{fleet_profiles, Profile, ProfileName};
pub use error::SimError;
pub use text::tokenizer::PromptTokenizer;

/// Binds every server, announces them on stdout, then serves until SIGTERM or SIGINT.
pub async fn run(args: SimArgs) -> Result<(), SimError> {
    let plan = args.validate()?;
    let mut bound = Vec::with_capacity(plan.listen.len());
    let mut kv_bound = Vec::new();
    let mut profiles: Vec<&str> = Vec::with_capacity(plan.configs.len());
    for (index, (addr, config)) in plan.listen.iter().zip(plan.configs).enumerate() {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| SimError::new(format!("cannot bind {addr}: {e}")))?;
        if index == 0 {
            log::info!(
                "kvbench-sim: {} server(s), model {}, engine {:?}, time scale {}",
                plan.listen.len(),
                config.model,
                config.engine,
                config.time_scale
            );
            log::info!(
                "kvbench-sim: prompt tokens counted by {:?}",
                config.tokenizer
            );
            let pd = &config.pd;
            log::info!(
                "kvbench-sim: role {:?}, P/D protocol {:?}, KV transfers {} GB/s + {} ms, \
                 {} bytes a token, held blocks expire after {:?} (wall)",
                pd.role,
                pd.protocol,
                pd.transfer_gbps,
                pd.transfer_base_s * 1e3,
                pd.kv_bytes_per_token
                    .unwrap_or(config.profile.kv_bytes_per_token),
                pd.abort_timeout
            );
        }
        profiles.push(config.profile.name.as_str());
        let kv_events = match &plan.kv_events {
            Some(kv) => {
                let ranks = kv.addrs.get(index).map_or(&[][..], Vec::as_slice);
                let publishers = bind_ranks(ranks, &kv.options).await?;
                if let Some(first) = publishers.first() {
                    kv_bound.push(first.bound().clone());
                }
                publishers
            }
            None => Vec::new(),
        };
        let local = server::spawn(listener, index, Arc::new(config), kv_events)
            .map_err(|e| SimError::new(format!("cannot serve on {addr}: {e}")))?;
        bound.push(local);
    }
    announce(&bound, &kv_bound)
        .map_err(|e| SimError::new(format!("cannot write to stdout: {e}")))?;
    log::info!("kvbench-sim: profiles {}", profiles.join(","));
    wait_for_shutdown().await;
    log::info!("kvbench-sim: shutting down");
    Ok(())
}

/// One server's publishers, rank by rank. Ephemeral ports (0) are still consecutive, rank r
/// at rank 0's ports + r, as a router following vLLM's layout expects: rank 0 takes what the
/// kernel gives, the others the ports after it, tried again with fresh ones if taken.
async fn bind_ranks(
    ranks: &[(SocketAddr, SocketAddr)],
    options: &kvpublish::KvEventsOptions,
) -> Result<Vec<kvpublish::Publisher>, SimError> {
    let ephemeral = ranks.iter().all(|(p, r)| p.port() == 0 && r.port() == 0);
    if !ephemeral || ranks.len() < 2 {
        let mut out = Vec::with_capacity(ranks.len());
        for &(publish, replay) in ranks {
            out.push(
                kvpublish::Publisher::bind(publish, replay, options)
                    .await
                    .map_err(SimError::new)?,
            );
        }
        return Ok(out);
    }
    let port = |endpoint: &str| {
        endpoint
            .rsplit(':')
            .next()
            .and_then(|p| p.parse::<u16>().ok())
    };
    let mut last = String::new();
    for _ in 0..20 {
        let (publish, replay) = ranks[0];
        let first = kvpublish::Publisher::bind(publish, replay, options)
            .await
            .map_err(SimError::new)?;
        let (Some(p0), Some(r0)) = (port(&first.bound().publish), port(&first.bound().replay))
        else {
            return Err(SimError::new("kv events: a bound endpoint without a port"));
        };
        let mut out = vec![first];
        for r in 1..ranks.len() as u16 {
            let (Some(p), Some(q)) = (p0.checked_add(r), r0.checked_add(r)) else {
                break;
            };
            let at = |port| SocketAddr::new(publish.ip(), port);
            match kvpublish::Publisher::bind(at(p), at(q), options).await {
                Ok(x) => out.push(x),
                Err(e) => {
                    last = e;
                    break;
                }
            }
        }
        if out.len() == ranks.len() {
            return Ok(out);
        }
    }
    Err(SimError::new(format!(
        "--kv-events 0 --dp-size {}: no run of free ports found ({last})",
        ranks.len()
    )))
}

/// Tests learn ports and readiness from these lines, so they are printed only once every
/// listener is bound (connections queue in the kernel backlog until accepted) and flushed.
fn announce(bound: &[SocketAddr], kv_events: &[kvpublish::Bound]) -> std::io::Result<()> {
    let mut out = std::io::stdout().lock();
    for (index, addr) in bound.iter().enumerate() {
        writeln!(out, "kvbench-sim listening {addr} index {index}")?;
    }
    for (index, kv) in kv_events.iter().enumerate() {
        let (publish, replay) = (&kv.publish, &kv.replay);
        writeln!(
            out,
            "kvbench-sim kv-events index {index} pub {publish} replay {replay}"
        )?;
    }
    writeln!(out, "kvbench-sim ready")?;
    out.flush()
}

async fn wait_for_shutdown() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
                return;
            }
            Err(e) => log::warn!("cannot install SIGTERM handler: {e}"),
        }
    }
    if let Err(e) = tokio::signal::ctrl_c().await {
        log::warn!("cannot wait for ctrl-c: {e}");
        std::future::pending::<()>().await;
    }
}
