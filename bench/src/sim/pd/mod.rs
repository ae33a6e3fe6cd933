//! Prefill/decode disaggregation, as vLLM's NixlConnector does it (`--pd-protocol vllm_nixl`),
//! so that a router's P/D placement can be measured against the simulated fleet.
//!
//! # The protocol (sequential legs)
//! A router first sends the prefill server (P) the request with `max_tokens: 1`,
//! `stream: false` and `kv_transfer_params: {do_remote_decode: true, ...}`. P serves it as any
//! other; when it finishes, P keeps its prompt's full blocks referenced under the request's id
//! (`X-Request-Id`, else a generated one) and answers with a top-level `kv_transfer_params`
//! naming them (`params::prefill_answer`). The router then sends the decode server (D) the
//! original request plus those params. D looks up its own prefix, reads the blocks it lacks
//! (`base + tokens x bytes_per_token / bandwidth` of model time), notifies P, which frees its
//! copy, and schedules the request, whose prefix is now cached.
//!
//! # What stands in for NIXL
//! The READ is a wait; its completion notice is `POST http://remote_host:remote_port
//! /kvbench/nixl/notify` with the request id, to P's own HTTP port (loopback only). P answers
//! 404 for a request it does not hold (expired, restarted, never held); D then recomputes the
//! prompt and counts a failed transfer. A held request nobody reads is freed after
//! `--pd-abort-timeout-s` (vLLM's `VLLM_NIXL_ABORT_REQUEST_TIMEOUT`) and counted as expired.
//! A decode request abandoned before its read completes still notifies P (with no blocks), as
//! vLLM does for an aborted request, so the blocks do not wait for the timeout.
//!
//! # SGLang's bootstrap protocol (`--pd-protocol sglang_bootstrap`)
//! Concurrent legs with one body: see `bootstrap` for the wire and what stands in for
//! SGLang's bootstrap server and transfer engine. The two protocols share the holds (`held`,
//! keyed by the room there), the read (its time, the notice that frees P's copy, the import
//! into D's cache) and the counters.
//!
//! # Layout
//! - `params`: `kv_transfer_params` in requests and in P's answer.
//! - `bootstrap`: SGLang's `bootstrap_*` fields, and D's wait for P's KV.
//! - `held`: P's held requests, their deadlines and counts.
//! - `rooms`: P's legs waiting for their room's outcome (SGLang answers P's leg only then).
//! - `transfer`: D's side: which blocks to read, how long that takes, the notification.
//! - `stats`: the counters and histograms behind `/metrics` and `/debug/state`.
//!
//! The engine's part (pinning at finish, importing before queueing) is in
//! `engine::scheduler` (`KvTransfer`); the HTTP glue that ties both to a server is `api::pd`
//! (and `api::pd_bootstrap` for SGLang's legs).

pub mod bootstrap;
mod held;
mod params;
mod rooms;
mod stats;
mod transfer;

use std::net::SocketAddr;
use std::time::Duration;

pub use held::{Held, HeldRequests};
pub use params::{block_id, parse, prefill_answer, Remote};
pub use rooms::{Outcome, RoomWaiter, Rooms};
pub use stats::{PdSnapshot, PdStats};
pub use transfer::{NotifyGuard, NOTIFY_PATH};

/// What a server is for in a disaggregated fleet. With `vllm_nixl` informational
/// (`/debug/state`, logs): as with vLLM's `kv_both`, any server serves any request, plain,
/// prefill or decode. With `sglang_bootstrap` it is SGLang's `--disaggregation-mode`: the
/// legs carry the same body, so the role alone says which side a server plays.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    #[default]
    Both,
    Prefill,
    Decode,
}

/// The wire protocol between router, P and D.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, serde::Serialize)]
pub enum PdProtocol {
    /// vLLM's NixlConnector: sequential legs, `kv_transfer_params`.
    #[default]
    #[value(name = "vllm_nixl")]
    #[serde(rename = "vllm_nixl")]
    VllmNixl,
    /// SGLang's bootstrap protocol: concurrent legs, `bootstrap_host/port/room`.
    #[value(name = "sglang_bootstrap")]
    #[serde(rename = "sglang_bootstrap")]
    SglangBootstrap,
}

/// P/D settings of a server (`--role`, `--pd-protocol`, `--kv-transfer-*`,
/// `--pd-abort-timeout-s`, `--pd-bootstrap-timeout-s`, `--pd-waiting-timeout-s`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PdConfig {
    pub role: Role,
    pub protocol: PdProtocol,
    /// Bandwidth of one transfer, GB/s (10^9 bytes a second), model time.
    pub transfer_gbps: f64,
    /// Bytes of KV a token; None: the profile's.
    pub kv_bytes_per_token: Option<u64>,
    /// Fixed cost of one transfer, model seconds.
    pub transfer_base_s: f64,
    /// How long P holds blocks nobody reads, vLLM (already time-scaled, wall clock).
    pub abort_timeout: Duration,
    /// SGLang: how long P holds a room's blocks nobody fetches (wall clock).
    pub bootstrap_timeout: Duration,
    /// SGLang: how long D waits for a room's KV before failing the request (wall clock).
    pub waiting_timeout: Duration,
}

impl PdConfig {
    /// How long P holds blocks unread, under this server's protocol.
    fn hold_timeout(&self) -> Duration {
        match self.protocol {
            PdProtocol::VllmNixl => self.abort_timeout,
            PdProtocol::SglangBootstrap => self.bootstrap_timeout,
        }
    }

    /// SGLang's side this server plays, if it speaks SGLang's protocol as P or D.
    pub fn sglang_role(&self) -> Option<Role> {
        (self.protocol == PdProtocol::SglangBootstrap && self.role != Role::Both)
            .then_some(self.role)
    }
}

impl Default for PdConfig {
    /// The CLI's defaults at time scale 1.
    fn default() -> Self {
        Self {
            role: Role::Both,
            protocol: PdProtocol::VllmNixl,
            transfer_gbps: 25.0,
            kv_bytes_per_token: None,
            transfer_base_s: 0.002,
            abort_timeout: Duration::from_secs(480),
            bootstrap_timeout: Duration::from_secs(300),
            waiting_timeout: Duration::from_secs(300),
        }
    }
}

/// One server's P/D state: its identity as a KV source, what it holds, what it counted, and
/// the client its notifications go out on.
pub struct Pd {
    pub config: PdConfig,
    /// vLLM's `engine_id`: stable for the server's life, distinct between servers.
    pub engine_id: String,
    /// Where D reaches this server (`remote_host`, `remote_port`): its HTTP listener.
    pub addr: SocketAddr,
    /// Bytes of KV a token, resolved against the server's profile.
    pub kv_bytes_per_token: u64,
    pub held: HeldRequests,
    /// SGLang: P's legs waiting to learn what became of their room.
    pub rooms: Rooms,
    pub stats: PdStats,
    pub client: reqwest::Client,
}

impl Pd {
    pub fn new(config: PdConfig, index: usize, addr: SocketAddr, profile_kv_bytes: u64) -> Self {
        // Loopback only, never through a proxy an environment variable names; a notice that
        // takes seconds is as good as lost (P's timeout frees the blocks).
        let client = reqwest::Client::builder()
            .no_proxy()
            .timeout(Duration::from_secs(5))
            .build()
            .unwrap_or_default();
        Self {
            engine_id: format!("kvbench-sim-{index}-{}", addr.port()),
            addr,
            kv_bytes_per_token: config.kv_bytes_per_token.unwrap_or(profile_kv_bytes),
            held: HeldRequests::new(config.hold_timeout()),
            rooms: Rooms::default(),
            stats: PdStats::default(),
            client,
            config,
        }
    }

    /// Model seconds to read `tokens` tokens of KV: `base + tokens x bytes / bandwidth`.
    pub fn transfer_seconds(&self, tokens: u64) -> f64 {
        self.config.transfer_base_s + self.wire_seconds(tokens)
    }

    /// The part of a read of `tokens` tokens that moves bytes: what NIXL's telemetry times
    /// (`xferDuration`, posted to done), without the request for the blocks and the notice.
    pub fn wire_seconds(&self, tokens: u64) -> f64 {
        let bytes = tokens as f64 * self.kv_bytes_per_token as f64;
        bytes / (self.config.transfer_gbps * 1e9)
    }

    /// `/debug/state`'s `pd` object: what is held now and what moved so far.
    pub fn state(&self) -> serde_json::Value {
        let (requests, blocks) = self.held.counts();
        let s = self.stats.snapshot();
        serde_json::json!({
            "protocol": self.config.protocol,
            "engine_id": self.engine_id,
            "held_requests": requests,
            "held_blocks": blocks,
            "released_total": s.released_total,
            "expired_total": s.expired_total,
            "transfers_total": s.transfers_total,
            "transfer_tokens_total": s.transfer_tokens_total,
            "failed_transfers_total": s.failed_transfers_total,
            "failed_notifications_total": s.failed_notifications_total,
            // SGLang's bootstrap protocol: P's legs waiting for their room's outcome, D's
            // legs waiting for P's KV (before their read) and reading it, and D's waits that
            // ran out. Held rooms are `held_requests`, expired ones `expired_total`.
            "waiting_prefill_legs": self.rooms.waiting(),
            "waiting_decodes": s.waiting_decodes,
            "transferring_decodes": s.transferring_decodes,
            "timed_out_waits_total": s.timed_out_waits_total,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transfer_time_is_base_plus_bytes_over_bandwidth() {
        let addr: SocketAddr = "127.0.0.1:8100".parse().unwrap();
        let pd = Pd::new(PdConfig::default(), 2, addr, 131_072);
        assert_eq!(pd.engine_id, "kvbench-sim-2-8100");
        // 10,000 tokens of Llama-3-8B's 128 KiB at 25 GB/s: 52.4 ms, plus 2 ms.
        let t = pd.transfer_seconds(10_000);
        assert!((t - (0.002 + 1_310_720_000.0 / 25e9)).abs() < 1e-12, "{t}");
        let custom = PdConfig {
            kv_bytes_per_token: Some(1_000),
            transfer_gbps: 1.0,
            transfer_base_s: 0.0,
            ..PdConfig::default()
        };
        let pd = Pd::new(custom, 0, addr, 131_072);
        assert_eq!(pd.transfer_seconds(1_000_000), 1.0);
    }
}
