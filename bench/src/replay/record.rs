//! What is planned for one request and what was measured for it.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Message {
    pub role: String,
    pub content: String,
    /// An assistant turn's tool call; on a `tool` message, the call it answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub call: Option<ToolCall>,
}

impl Message {
    pub fn new(role: &str, content: impl Into<String>) -> Self {
        Self {
            role: role.to_owned(),
            content: content.into(),
            call: None,
        }
    }
}

/// A tool call as the server made it: sent back in the next turn as the API spells it
/// (Responses `function_call`, Messages `tool_use`, chat `tool_calls`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    /// The arguments' JSON text as streamed.
    pub arguments: String,
    /// The Responses output item's own id (`fc_...`), sent back with the item as agents do
    /// (some routers refuse a `function_call` item without it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub item_id: Option<String>,
}

/// How an agent session sends a request (the `agentic` workload's options).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AgentTurn {
    /// Sends the agent's tools and asks for a tool call (`tool_choice`).
    pub tools: bool,
    /// Responses `store: true`, the engine keeping the answer.
    pub store: bool,
    /// A stored previous answer's id and where the messages it does not hold start: only
    /// those are sent, with `previous_response_id` (Responses; other APIs send everything).
    pub previous: Option<(String, usize)>,
    /// Waited before sending: the tool running and the agent reading its output.
    pub think: std::time::Duration,
}

/// Who a request is for and how urgent it is, sent as kvroute's headers: `x-tenant-id`,
/// `x-kvroute-priority` (below 0: sheddable) and `x-slo-ttft-ms` (a TTFT deadline). Workload
/// files carry these as optional fields of a conversation, prompt or trace line.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Tenancy {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slo_ttft_ms: Option<u64>,
}

impl Tenancy {
    /// Each field this leaves unset, taken from `fallback`: a workload's own values win over
    /// `--tenants`, which wins over `--header`.
    pub fn or(self, fallback: &Tenancy) -> Tenancy {
        Tenancy {
            tenant: self.tenant.or_else(|| fallback.tenant.clone()),
            priority: self.priority.or(fallback.priority),
            slo_ttft_ms: self.slo_ttft_ms.or(fallback.slo_ttft_ms),
        }
    }

    /// Takes kvroute's tenancy headers out of `--header`s, so that they are recorded with
    /// each request and a workload's own values replace them rather than being sent twice.
    /// A priority that is not an integer (a name such as `bulk`) stays a plain header.
    pub fn from_headers(headers: Vec<(String, String)>) -> (Tenancy, Vec<(String, String)>) {
        let mut t = Tenancy::default();
        let mut rest = Vec::new();
        for (name, value) in headers {
            let n = name.to_ascii_lowercase();
            if n == TENANT_HEADER {
                t.tenant = Some(value);
            } else if let (PRIORITY_HEADER, Ok(p)) = (n.as_str(), value.parse()) {
                t.priority = Some(p);
            } else if let (SLO_HEADER, Ok(ms)) = (n.as_str(), value.parse()) {
                t.slo_ttft_ms = Some(ms);
            } else {
                rest.push((name, value));
            }
        }
        (t, rest)
    }

    /// The request headers that carry it. The deadline is model time, like every time
    /// kvbench reports; kvroute keeps the wall clock, so against a simulator `time_scale`
    /// times faster the header says the deadline divided by it (at least 1 ms).
    pub fn headers(&self, time_scale: f64) -> Vec<(&'static str, String)> {
        let mut h = Vec::new();
        if let Some(t) = &self.tenant {
            h.push((TENANT_HEADER, t.clone()));
        }
        if let Some(p) = self.priority {
            h.push((PRIORITY_HEADER, p.to_string()));
        }
        if let Some(ms) = self.slo_ttft_ms {
            let wall = (ms as f64 / time_scale).round().max(1.0);
            h.push((SLO_HEADER, format!("{wall:.0}")));
        }
        h
    }
}

pub const TENANT_HEADER: &str = "x-tenant-id";
pub const PRIORITY_HEADER: &str = "x-kvroute-priority";
pub const SLO_HEADER: &str = "x-slo-ttft-ms";

/// One request as a workload wants it sent.
#[derive(Debug, Clone)]
pub struct ChatRequest {
    pub messages: Vec<Message>,
    pub max_tokens: u32,
    /// Sent as `x-session-id` only with `--session-header`.
    pub session: Option<String>,
    /// The model to name, when not `--model`.
    pub model: Option<String>,
    /// Ladder rate step, for per-step summaries.
    pub step: Option<usize>,
    /// Which turn of its conversation this is (0: the first), for multi-turn workloads.
    pub turn: Option<u32>,
    /// Oracle accounting, in workload-specific units (blocks, bytes or tokens): the part of
    /// this prompt one infinite cache would already hold, given everything sent before it.
    pub oracle_hit: f64,
    pub oracle_total: f64,
    pub agent: AgentTurn,
    pub tenancy: Tenancy,
}

/// Measurements of one request. Times are milliseconds; `send_ms` counts from the run start.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct RequestRecord {
    pub id: u64,
    pub send_ms: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<usize>,
    /// Turn of its conversation (0: the first), for multi-turn workloads.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub turn: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<String>,
    /// The model the request named, when not `--model`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    pub status: Option<u16>,
    pub error: Option<String>,
    pub ttft_ms: Option<f64>,
    pub e2e_ms: f64,
    /// Median of this request's per-token gaps (the gaps themselves are not serialised: a
    /// long run has millions of them).
    pub itl_p50_ms: Option<f64>,
    #[serde(skip)]
    pub itl_ms: Vec<f64>,
    pub prompt_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
    /// From `x-kvbench-server` (or `x-kvbench-addr`): which simulated backend answered.
    pub backend: Option<String>,
    pub oracle_hit: f64,
    pub oracle_total: f64,
    /// A stored answer's id (`agentic --store`), and the stored answer this request continued
    /// (`previous_response_id`): which backend holds which chain.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous_response_id: Option<String>,
    /// The tenant, priority and deadline the request was sent with.
    #[serde(flatten)]
    pub tenancy: Tenancy,
    /// A shed request's `x-kvroute-dropped-reason` (`queue_full`, `queue_timeout`,
    /// `sheddable`, `slo_unattainable`); its `e2e_ms` is the time to that answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dropped_reason: Option<String>,
    /// An admitted deadline request's `x-kvroute-slo`: `on_track`, or `at_risk` when kvroute
    /// predicted its TTFT past the deadline.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slo: Option<String>,
}

impl RequestRecord {
    pub fn ok(&self) -> bool {
        self.error.is_none()
    }

    pub fn end_ms(&self) -> f64 {
        self.send_ms + self.e2e_ms
    }

    /// Answered by the router's shedding rather than served.
    pub fn shed(&self) -> bool {
        self.dropped_reason.is_some()
    }

    /// Prompt tokens plus twice the completion tokens, from usage: kvroute's fair-share
    /// weights (`tenants.fair_share`), a decode token costing a step of its own.
    pub fn service(&self) -> u64 {
        self.prompt_tokens.unwrap_or(0) + 2 * self.completion_tokens.unwrap_or(0)
    }
}
