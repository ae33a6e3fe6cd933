//! The POST endpoints. A request is logged on arrival, admitted (`admission`: slow start,
//! parse, hang and failure faults, prefix-cache lookup), then answered: in engine mode by the
//! server's engine (`engine_answer`), in fixed-timing mode here, with the first token after the
//! TTFT and then one token per inter-token interval.
//!
//! P/D disaggregation (`pd`) wraps both: a decode request reads its prompt's blocks from the
//! prefill server between admission and serving; a prefill request's blocks are held when it
//! finishes, and its whole answer names them in `kv_transfer_params` (vLLM), or is held back
//! until the decode server has read them (SGLang, `pd_bootstrap`).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderName, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::StreamExt as _;
use tokio::time::{sleep_until, Instant};
use xxhash_rust::xxh3::xxh3_64;

use super::admission::{admit, Admitted};
use super::answer_body;
use super::engine_answer;
use super::pd;
use super::pd_bootstrap::{self, Leg};
use super::reqlog::Entry;
use super::response::{Answer, Timings, Usage};
use super::sse::{sse_response, StreamWriter};
use super::state::{header_value, ServerState};
use crate::sim::config::Engine;
use crate::sim::engine::kvcache::BLOCK_TOKENS;
use crate::sim::engine::lora::AdapterUse;
use crate::sim::engine::stats::Gauge;
use crate::sim::faults::{stream_fault, StreamFault};
use crate::sim::text::generate::{continued_text, reply_hashes, token_text, Reply, Schedule};
use crate::sim::text::ids::random_id;
use crate::sim::text::openai::Endpoint;

pub const BODY_HASH_HEADER: HeaderName = HeaderName::from_static("x-kvbench-body-xxh3");
pub const BODY_LEN_HEADER: HeaderName = HeaderName::from_static("x-kvbench-body-len");
const SESSION_HEADER: &str = "x-session-id";

pub async fn chat(State(s): State<Arc<ServerState>>, headers: HeaderMap, body: Bytes) -> Response {
    handle(s, Endpoint::Chat, &headers, body).await
}

pub async fn completions(
    State(s): State<Arc<ServerState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    handle(s, Endpoint::Completions, &headers, body).await
}

pub async fn embeddings(
    State(s): State<Arc<ServerState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    handle(s, Endpoint::Embeddings, &headers, body).await
}

/// Formats a body hash as tests compute it: 16 lowercase hex digits, zero-padded.
pub fn body_hash_hex(body: &[u8]) -> String {
    format!("{:016x}", xxh3_64(body))
}

/// The body's fields read before admission: `priority`, for the request log (the engine
/// itself does not schedule by it), and P/D's `kv_transfer_params` or `bootstrap_*`. Values,
/// so that a malformed one loses only itself.
#[derive(serde::Deserialize)]
struct EarlyFields {
    priority: Option<serde_json::Value>,
    kv_transfer_params: Option<serde_json::Value>,
    #[serde(flatten)]
    bootstrap: pd_bootstrap::Fields,
}

pub(super) async fn handle(
    s: Arc<ServerState>,
    endpoint: Endpoint,
    headers: &HeaderMap,
    body: Bytes,
) -> Response {
    let arrived = Instant::now();
    let hash = body_hash_hex(&body);
    let session = headers
        .get(SESSION_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let mut entry = Entry::arrival(endpoint.path(), session, body.len(), hash.clone());
    entry.dp_rank = headers
        .get(DP_RANK_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let dp_rank = entry.dp_rank.as_deref().and_then(|r| r.trim().parse().ok());
    let early = serde_json::from_slice::<EarlyFields>(&body).ok();
    entry.priority = early
        .as_ref()
        .and_then(|f| f.priority.as_ref())
        .and_then(serde_json::Value::as_i64);
    let leg = pd_bootstrap::classify(&s, endpoint, early.as_ref().map(|f| &f.bootstrap));
    let params = early.and_then(|f| f.kv_transfer_params);
    let incoming = pd::classify(&s, endpoint, params.as_ref(), headers);
    let seq = s.log().push(entry);
    let request_id = headers.get("x-request-id").and_then(|v| v.to_str().ok());
    let mut res = match leg {
        Err(e) => e.into_response(),
        Ok(leg) => match admit(&s, seq, endpoint, &body).await {
            Ok(mut admitted) => {
                admitted.dp_rank =
                    dp_rank.or_else(|| leg.as_ref().and_then(|l| pd_bootstrap::rank_of(&s, l)));
                admitted.kv_transfer.hold = incoming.hold;
                if let Some(guard) = incoming.pull {
                    pd::pull(&s, &mut admitted, guard).await;
                }
                match leg {
                    None => answer(s.clone(), admitted, arrived).await,
                    Some(leg) => {
                        let rid = request_id
                            .map(str::to_owned)
                            .unwrap_or_else(|| random_id("kvbench-"));
                        bootstrap_leg(&s, admitted, leg, &rid, arrived).await
                    }
                }
            }
            Err(e) => e.into_response(),
        },
    };
    let status = res.status().as_u16();
    s.log().update(seq, |e| e.status = Some(status));
    let headers = res.headers_mut();
    headers.insert(BODY_HASH_HEADER, header_value(&hash));
    headers.insert(BODY_LEN_HEADER, HeaderValue::from(body.len()));
    res
}

/// Serves an admitted request (its adapter loaded first: the load is part of the TTFT).
async fn answer(s: Arc<ServerState>, admitted: Admitted, arrived: Instant) -> Response {
    let (adapter, wait) = AdapterUse::start(&s.lora, &s.config.lora, &admitted.req.model).await;
    if !wait.is_zero() {
        tokio::time::sleep(wait).await;
    }
    let res = serve(s, admitted, arrived).await;
    match adapter {
        Some(a) => held_until_body_ends(res, a),
        None => res,
    }
}

/// A leg of SGLang's protocol: P serves one token and answers once its room is read; D waits
/// for P's KV and reads it first, or fails as SGLang does.
async fn bootstrap_leg(
    s: &Arc<ServerState>,
    mut a: Admitted,
    leg: Leg,
    rid: &str,
    arrived: Instant,
) -> Response {
    let stream = a.req.stream;
    match leg {
        Leg::Prefill(b) => {
            let waiter = pd_bootstrap::start_prefill(s, &mut a, &b);
            let res = answer(s.clone(), a, arrived).await;
            pd_bootstrap::finish_prefill(s, res, waiter, &b, rid, stream).await
        }
        Leg::Decode(b) => match pd_bootstrap::decode(s, &mut a, &b, rid).await {
            Ok(()) => answer(s.clone(), a, arrived).await,
            Err(e) => pd_bootstrap::failure(stream, e),
        },
    }
}

/// A streamed answer is still running when the handler returns: `guard` is released when its
/// body ends or the client goes away.
fn held_until_body_ends<G: Send + Sync + 'static>(res: Response, guard: G) -> Response {
    res.map(|body| {
        let stream = body.into_data_stream().map(move |chunk| {
            let _held = &guard;
            chunk
        });
        axum::body::Body::from_stream(stream)
    })
}

/// vLLM's and SGLang's header pinning a request to one data-parallel rank.
const DP_RANK_HEADER: &str = "x-data-parallel-rank";

async fn serve(s: Arc<ServerState>, mut a: Admitted, arrived: Instant) -> Response {
    let answer = Answer::new(a.req.endpoint, s.index, a.seq, &a.req.model)
        .with_responses(a.req.responses.take(), &s.responses)
        .with_tool(a.req.tool_call.as_deref());
    if a.req.endpoint == Endpoint::Embeddings {
        return Json(answer.embeddings(a.usage.prompt_tokens)).into_response();
    }
    if s.engine.is_some() {
        return engine_answer::serve(s, a, answer, arrived).await;
    }
    let n = a.req.max_tokens;
    let first = a.req.first_token;
    let reply_text = continued_text(first, n);
    let kv_blocks = (a.usage.prompt_tokens + n).div_ceil(BLOCK_TOKENS);
    let stream = a.req.stream;
    let include_usage = a.req.include_usage;
    let mut gen = Generation {
        running: s.stats.start_running(kv_blocks),
        schedule: Schedule {
            start: Instant::now(),
            ttft: s.config.ttft,
            itl: s.config.itl,
        },
        state: s,
        arrived,
        processed_tokens: a.usage.prompt_tokens.saturating_sub(a.usage.cached_tokens),
        blocks: a.blocks,
        seed: a.seed,
        endpoint: a.req.endpoint,
        prompt: a.req.prompt,
        rendered: answer
            .rendered_reply(&reply_text)
            .or_else(|| (first > 0).then(|| reply_text.clone())),
        hold: a.kv_transfer.hold.take(),
    };
    if stream {
        let cut_at = gen.state.faults().cut_point(a.seq, gen.state.index, n);
        let stream = TokenStream {
            cut_at,
            gen,
            writer: StreamWriter::new(answer),
            first,
            next: 0,
            n,
            usage: include_usage.then_some(a.usage),
            start: a.usage,
            done: false,
        };
        return sse_response(futures_util::stream::unfold(stream, |mut st| async move {
            let event = st.next_event().await?;
            Some((event, st))
        }));
    }
    gen.token(0).await;
    gen.rest(n).await;
    let held = gen.replied(n);
    let timings = gen.timings(a.usage.cached_tokens, n);
    drop(gen.running);
    let mut body = answer_body::whole(&answer, &reply_text, a.usage, timings);
    let vllm = gen.state.pd.config.protocol == crate::sim::pd::PdProtocol::VllmNixl;
    if let (true, Some((id, blocks)), Some(obj)) = (vllm, held, body.as_object_mut()) {
        let params = crate::sim::pd::prefill_answer(&gen.state.pd, &id, &blocks);
        obj.insert("kv_transfer_params".into(), params);
    }
    Json(body).into_response()
}

/// One request on the simulated engine: holds its KV blocks (the running gauge) until dropped.
struct Generation {
    state: Arc<ServerState>,
    schedule: Schedule,
    arrived: Instant,
    /// Prompt tokens not served from the prefix cache.
    processed_tokens: u64,
    /// Prompt blocks, entered into the prefix cache once prefill is done.
    blocks: Vec<u64>,
    /// Their chain's seed (the request's salt).
    seed: u64,
    endpoint: Endpoint,
    /// Canonical prompt, to continue the block chain over the reply once it is out.
    prompt: Vec<u8>,
    /// The reply as the next turn sends it back, when that is not its text (a tool call).
    rendered: Option<String>,
    running: Gauge,
    /// P/D: the id to hold the prompt's blocks under for a decode server, once done.
    hold: Option<String>,
}

impl Generation {
    /// Waits until token `i` is due and accounts for it.
    async fn token(&mut self, i: u64) {
        sleep_until(self.schedule.token_due(i)).await;
        if i == 0 {
            self.prefilled();
        }
        self.state.stats.generated(1);
    }

    /// Waits out tokens 1..n at once (the non-streaming answer is sent whole).
    async fn rest(&mut self, n: u64) {
        if n > 1 {
            sleep_until(self.schedule.token_due(n - 1)).await;
            self.state.stats.generated(n - 1);
        }
    }

    /// The prompt's KV exists once prefill is done, so it is cached from the first token on:
    /// a concurrent request with the same prefix hits it, as on vLLM.
    fn prefilled(&mut self) {
        let s = &self.state;
        s.stats.observe_ttft(s.model_seconds_since(self.arrived));
        // Fixed timing has no queue: prefill takes exactly the configured TTFT.
        let prefill = s.config.ttft.as_secs_f64() * s.config.time_scale;
        s.stats.prefilled(self.processed_tokens, prefill);
        s.kv().insert(&self.blocks);
    }

    /// Model seconds of one inter-token interval.
    fn itl_seconds(&self) -> f64 {
        self.schedule.itl.as_secs_f64() * self.state.config.time_scale
    }

    /// llama.cpp's `timings` of a reply of `n` tokens, when the server speaks llama.cpp: the
    /// prompt took the TTFT, the rest one interval a token.
    fn timings(&self, cached_tokens: u64, n: u64) -> Option<Timings> {
        let config = &self.state.config;
        (config.engine == Engine::Llamacpp).then(|| Timings {
            cache_n: cached_tokens,
            prompt_n: self.processed_tokens,
            prompt_ms: config.ttft.as_secs_f64() * config.time_scale * 1e3,
            predicted_n: n,
            predicted_ms: n.saturating_sub(1) as f64 * self.itl_seconds() * 1e3,
        })
    }

    /// The whole reply is out: the next turn will send it back after this prompt, so its
    /// blocks are cached too, as the engine mode's pool does. Prompt and reply go in together
    /// so that the cache's LRU order keeps the prompt's head the most recent. A prefill for a
    /// decode server then holds its prompt's blocks: returned with the id they are held under.
    fn replied(&mut self, n: u64) -> Option<(String, Vec<u64>)> {
        let decode = n.saturating_sub(1) as f64 * self.itl_seconds();
        self.state.stats.predicted(n, decode);
        let prompt = std::mem::take(&mut self.prompt);
        let mut blocks = std::mem::take(&mut self.blocks);
        let tokenizer = &self.state.config.tokenizer;
        let reply = self
            .rendered
            .as_deref()
            .map_or(Reply::Filler(n), Reply::Rendered);
        let prompt_blocks = blocks.len();
        blocks.extend(reply_hashes(
            self.endpoint,
            &prompt,
            &blocks,
            self.seed,
            reply,
            tokenizer,
        ));
        self.state.kv().insert(&blocks);
        let id = self.hold.take()?;
        let held = pd::hold_fixed(&self.state, id.clone(), &blocks[..prompt_blocks]);
        Some((id, held))
    }
}

/// Streamed answer: each event is produced by the body stream when its token is due, so it is
/// written to the socket at that moment, and a client that disconnects drops the generation.
struct TokenStream {
    gen: Generation,
    writer: StreamWriter,
    /// The reply's first token (a continuation starts past 0).
    first: u64,
    /// Where `cut_rate` drops this stream, if it does.
    cut_at: Option<u64>,
    next: u64,
    n: u64,
    usage: Option<Usage>,
    /// The prompt's usage, known from admission.
    start: Usage,
    done: bool,
}

impl TokenStream {
    async fn next_event(&mut self) -> Option<Result<Bytes, std::io::Error>> {
        if self.next < self.n {
            let i = self.next;
            let cut = (self.cut_at == Some(i)).then_some(StreamFault::Cut);
            if let Some(fault) = self.gen.state.faults().at_token(i).or(cut) {
                self.next = self.n;
                self.usage = None;
                self.done = true;
                return Some(stream_fault(fault).await);
            }
            self.next += 1;
            self.gen.token(i).await;
            let last = i + 1 == self.n;
            if last {
                // A streamed answer carries no `kv_transfer_params`: the hold waits for
                // its timeout unless a decode server learns of it some other way.
                let _ = self.gen.replied(self.n);
            }
            let text = token_text(self.first + i);
            return Some(Ok(self.writer.token(&text, i == 0, last, self.start)));
        }
        if let Some(usage) = self.usage.take() {
            let timings = self.gen.timings(self.start.cached_tokens, self.n);
            return Some(Ok(self.writer.usage(usage, timings)));
        }
        if !self.done {
            self.done = true;
            return self.writer.done().map(Ok);
        }
        None
    }
}
