//! What one request carries across the Pingora phases, in named parts.

use bytes::Bytes;
use std::sync::Arc;
use std::time::Instant;

use crate::edge::access::Holding;
use crate::edge::retry_budget::{Active, Retrying};
use crate::edge::Caller;
use crate::error::{ApiError, Dialect};
use crate::fleet::adapters::AdapterHold;
use crate::fleet::in_flight::Watch;
use crate::fleet::kv_events::ExactBlocks;
use crate::fleet::{Generation, InflightGuard};
use crate::placement::disagg::PdChoice;
use crate::placement::Pool;
use crate::placement::Reason;
use crate::request::id_stamp::IdStamp;
use crate::request::resume::{Splice, Transcript};
use crate::request::usage::UsageTap;
use crate::request::{RequestProfile, TokenEstimate};

pub struct Ctx {
    pub(super) start: Instant,
    /// When a refused request's answer was sent, before its unread body was drained: the
    /// request's duration ends there.
    pub(super) answered: Option<Instant>,
    /// The config and fleet this request runs under, pinned when it starts: backend indices
    /// below refer to this fleet, and a reload mid-request changes nothing for it.
    pub(super) generation: Arc<Generation>,
    pub(super) route: Route,
    pub(super) attempts: Attempts,
    pub(super) charge: Charge,
    pub(super) tap: ResponseTap,
    pub(super) quota: Quota,
    pub(super) resume: Resume,
    pub(super) pd: Disagg,
    /// A specific error to render instead of the generic one for the Pingora error.
    pub(super) error: Option<ApiError>,
    /// The shape errors are answered in: the API the request's path speaks.
    pub(super) dialect: Dialect,
    /// Counts toward the retry budget's base while the request runs.
    pub(super) _active: Active,
}

/// What is being routed: the parsed request and the body to forward.
#[derive(Default)]
pub(super) struct Route {
    pub profile: Option<RequestProfile>,
    /// The whole request body, read before placement.
    pub body: Option<Bytes>,
    /// `x-kvroute-priority`: higher leaves the router queue first; below 0 is sheddable.
    pub priority: i32,
    /// Whose request it is (`tenants`).
    pub tenant: String,
    /// Its TTFT deadline (`x-slo-ttft-ms`) and what kvroute predicted against it.
    pub slo: Option<Slo>,
    /// This attempt's body where it differs from `body` (the engine's `priority` field).
    pub attempt_body: Option<Bytes>,
    /// kvroute added `stream_options.include_usage`: remove the usage chunk from the stream.
    pub strip_usage: bool,
    /// How the prompt's tokens were estimated, settled by the engine's `usage`.
    pub tokens: Option<TokenEstimate>,
    /// The `model` label of this request's metrics: its model if configured or listed by an
    /// engine, else `other`.
    pub model_label: Option<String>,
    /// The backends of the request's model, looked up once at admission.
    pub pool: Option<Arc<Pool>>,
    /// The prompt's token blocks as the engines name them, when it was tokenized in time.
    pub exact: Option<ExactBlocks>,
    /// Which index kv_aware's prediction for the chosen backend came from.
    pub index: Option<IndexMode>,
    /// The chosen backend's data-parallel rank this request is pinned to (a backend of
    /// several ranks whose events kvroute follows).
    pub dp_rank: Option<u32>,
    /// The backend that stored the response this request names: it goes there or nowhere.
    pub pinned: Option<usize>,
    /// The path (and query) to send instead of the client's: a stored response's call, with
    /// the engine's own id.
    pub upstream_path: Option<String>,
    /// The answer carries response ids to stamp; the engine id the request named, if any.
    pub stamp_ids: Option<Option<String>>,
    /// A pass-through route whose rule lets the backend switch protocols (`upgrade: true`).
    pub allow_upgrade: bool,
}

/// Prefill/decode disaggregation of the current attempt (`kvroute.disaggregation`).
#[derive(Default)]
pub(super) struct Disagg {
    /// Whole or split, and the figures behind it (kv_aware only).
    pub choice: Option<PdChoice>,
    /// The prefill leg's `kv_transfer_params`, for the decode leg's body.
    pub params: Option<serde_json::Value>,
    /// The id both legs carry (`X-Request-Id`).
    pub request_id: Option<String>,
    /// The prompt tokens the prefill server found cached.
    pub prefill_cached: Option<u64>,
    /// Prefill servers that failed this request.
    pub failed: Vec<usize>,
    /// When the prefill leg was sent: a split request's first token is timed from it.
    pub leg_started: Option<Instant>,
    /// SGLang: where the decode leg fetches the KV (both legs' bodies name it).
    pub bootstrap: Option<crate::request::bootstrap::Bootstrap>,
    /// SGLang: the prefill leg running beside the decode leg.
    pub leg: Option<super::prefill_leg::PrefillLeg>,
}

impl Disagg {
    /// The request went to its decode server split: its prefill leg was sent (vLLM: and
    /// returned what the decode leg needs).
    pub fn split_sent(&self) -> bool {
        self.params.is_some() || self.leg.is_some()
    }

    /// The prompt tokens the prefill server found cached, as far as known.
    pub fn prefill_cached(&self) -> Option<u64> {
        self.leg
            .as_ref()
            .map_or(self.prefill_cached, |l| l.cached())
    }
}

/// A request's TTFT deadline, judged once before it first queues or is placed.
#[derive(Debug, Clone, Copy)]
pub(super) struct Slo {
    pub ttft_ms: u64,
    /// The predicted TTFT (router queue wait included), once judged.
    pub predicted_ms: Option<u64>,
    /// The latest it can leave the router queue and still meet the deadline.
    pub latest_start: Option<Instant>,
}

impl Slo {
    /// Predicted past its deadline: ordered by slack, answered `x-kvroute-slo: at_risk`.
    pub fn at_risk(&self) -> bool {
        self.predicted_ms.is_some_and(|p| p > self.ttft_ms)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum IndexMode {
    /// The engine's KV events.
    Exact,
    /// What kvroute sent the backend.
    Approximate,
}

impl IndexMode {
    pub fn as_str(self) -> &'static str {
        match self {
            IndexMode::Exact => "exact",
            IndexMode::Approximate => "approximate",
        }
    }
}

/// Where the request went and how each attempt ended.
#[derive(Default)]
pub(super) struct Attempts {
    pub count: u32,
    pub backend: Option<usize>,
    pub reason: Option<Reason>,
    /// Backends that failed this request before answering.
    pub tried: Vec<usize>,
    pub stale_conn_retried: bool,
    /// Held once the request has retried (see `edge::retry_budget`).
    pub retrying: Option<Retrying>,
    /// The last failed attempt timed out (504 rather than 502 if nothing else answers).
    pub timed_out: bool,
    pub upstream_responded: bool,
    /// The current attempt's registration with the fleet's in-flight requests.
    pub watch: Option<Watch>,
}

/// The request's charge on its backend and what placement predicted for it.
#[derive(Default)]
pub(super) struct Charge {
    pub guard: Option<InflightGuard>,
    /// The LoRA adapter slot the request holds on its backend.
    pub adapter: Option<AdapterHold>,
    /// Estimated uncached prompt tokens charged to the chosen backend.
    pub prefill: u64,
    /// Prompt tokens kv_aware predicted cached on the backend it was sent to.
    pub predicted_cached: Option<u64>,
    /// When the request went to its backend, and kv_aware's TTFT estimate for it there.
    pub dispatched: Option<Instant>,
    pub est_ttft_s: f64,
    /// The part of `est_ttft_s` that was the adapter's, when the chosen backend had to load
    /// it: the first byte then shows how long the load took.
    pub adapter_load_s: Option<f64>,
    /// When the engine's response was complete, set by the read-ahead connection.
    pub engine_done: Option<Arc<std::sync::OnceLock<Instant>>>,
}

/// What the response showed.
#[derive(Default)]
pub(super) struct ResponseTap {
    pub first_byte: Option<Instant>,
    pub usage: Option<UsageTap>,
    pub stamp: Option<IdStamp>,
}

/// A stream that may go on elsewhere if its backend fails (see `super::migrate`).
#[derive(Default)]
pub(super) struct Resume {
    /// What the client has been sent (streams of the APIs continued, migrations allowed).
    pub transcript: Option<Transcript>,
    /// The body as the client sent it: every continuation is built from it and the whole
    /// text so far, not from the last continuation (whose prompt holds part of the text and
    /// whose limits were already reduced).
    pub original: Option<bytes::Bytes>,
    /// The running attempt continues the stream: its events are rewritten by this.
    pub splice: Option<Splice>,
    pub migrations: u32,
    /// Prompt tokens of the attempts before the running one, and of the running one (an
    /// estimate: the engines that failed never reported theirs).
    pub prompt_before: u64,
    pub prompt_now: u64,
    /// Tokens of the text so far that the running attempt's prompt replays.
    pub replayed: u64,
    /// When the client was last sent something, and when the running continuation started
    /// from there (for the gap metric, observed once).
    pub last_sent: Option<Instant>,
    pub cut_at: Option<Instant>,
    /// How the attempt being continued failed (the `cause` label of the gap).
    pub cause: &'static str,
    /// The cut stream's text was already whole: end it rather than report an error.
    pub ending: Option<Bytes>,
}

/// The caller's key (access control on) and the tokens charged to it up front.
#[derive(Default)]
pub(super) struct Quota {
    pub caller: Option<Caller>,
    pub charged_tokens: u64,
    /// Weighted tokens charged to its tenant's fair share so far.
    pub fair_charged: f64,
    /// The request's place among its key's `max_concurrent`, held to its end.
    pub holding: Option<Holding>,
}

impl Ctx {
    /// Whether the request is held to `limits.backend_max_inflight` and waits in the router
    /// queue when every backend is at it: a routed request, or a pass-through one with a body
    /// (admitted like a routed one). Reads (`/v1/models`, stored responses) are not.
    pub(super) fn under_caps(&self) -> bool {
        self.route.body.is_some()
    }

    pub(super) fn new(generation: Arc<Generation>, active: Active) -> Ctx {
        Ctx {
            start: Instant::now(),
            answered: None,
            generation,
            route: Route::default(),
            attempts: Attempts::default(),
            charge: Charge::default(),
            tap: ResponseTap::default(),
            quota: Quota::default(),
            resume: Resume::default(),
            pd: Disagg::default(),
            error: None,
            dialect: Dialect::default(),
            _active: active,
        }
    }

    /// The `model` label of this request's metrics (`none` before its body was parsed).
    pub(super) fn model_label(&self) -> &str {
        self.route.model_label.as_deref().unwrap_or("none")
    }

    pub(super) fn backend_name(&self) -> &str {
        match self.attempts.backend {
            Some(i) => &self.generation.fleet.backends()[i].name,
            None => "none",
        }
    }
}
