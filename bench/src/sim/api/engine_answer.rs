//! Engine-mode answers: the request is handed to the server's engine and the answer follows
//! the engine's steps.
//!
//! Streaming sends one SSE event per engine step that produced tokens for this stream. An
//! engine step yields at most one token per request, so normally that is one token per event,
//! as on vLLM. When the client (or this process) reads slower than the engine steps, the
//! engine does not wait: the tokens the stream has not yet sent are coalesced into the next
//! event's text, and the last event still carries `finish_reason`.
//!
//! A profile with a per-request context (llama.cpp's slot, `cpu-smollm2`) refuses a prompt
//! that fills it, as llama.cpp does, and cuts the output where the context is full. A server
//! speaking llama.cpp adds its `timings` beside `usage`, in model milliseconds.
//!
//! P/D: a prefill request's hold and a decode request's transferred blocks go to the engine
//! with the request (`KvTransfer`); the engine reports the blocks it held with the last token,
//! and a whole answer names them in `kv_transfer_params`.

use std::sync::Arc;

use axum::body::Bytes;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::BytesMut;
use tokio::sync::watch;
use tokio::time::Instant;

use super::admission::Admitted;
use super::answer_body;
use super::response::{Answer, Timings, Usage};
use super::sse::{sse_response, StreamWriter};
use super::state::ServerState;
use crate::sim::config::Engine;
use crate::sim::engine::scheduler::NewRequest;
use crate::sim::engine::task::Progress;
use crate::sim::error::ApiError;
use crate::sim::faults::{stream_fault, StreamFault};
use crate::sim::text::generate::{
    continued_text, reply_hashes, reply_hashes_and_tokens, token_text, Reply,
};

pub async fn serve(s: Arc<ServerState>, a: Admitted, answer: Answer, arrived: Instant) -> Response {
    let Some(engine) = s.engine.as_ref() else {
        return ApiError::unavailable("kvbench-sim: no engine").into_response();
    };
    let prompt_tokens = a.usage.prompt_tokens;
    let profile = &s.config.profile;
    let Some(n) = profile.output_within_context(prompt_tokens, a.req.max_tokens) else {
        // llama.cpp's words.
        let msg = format!(
            "request ({prompt_tokens} tokens) exceeds the available context size ({} tokens), \
             try increasing it",
            profile.slot_ctx()
        );
        return ApiError::bad_request(msg).into_response();
    };
    if !engine.fits(prompt_tokens, n) {
        let msg = format!(
            "this server's KV cache holds {} tokens, but the request needs {} \
             ({prompt_tokens} prompt + {n} output tokens)",
            engine.num_gpu_blocks() * 16,
            prompt_tokens + n
        );
        return ApiError::bad_request(msg).into_response();
    }
    // Only now that `n` is known to fit the pool: the hashes cost a few bytes per token.
    let tokenizer = &s.config.tokenizer;
    let (endpoint, prompt) = (a.req.endpoint, &a.req.prompt);
    let first = a.req.first_token;
    let reply_text = continued_text(first, n);
    let rendered = answer
        .rendered_reply(&reply_text)
        .or_else(|| (first > 0).then(|| reply_text.clone()));
    let reply = rendered
        .as_deref()
        .map_or(Reply::Filler(n), Reply::Rendered);
    let (reply_hashes, tokens) = if engine.publishes_kv_events() {
        reply_hashes_and_tokens(endpoint, prompt, &a.blocks, a.seed, reply, tokenizer)
    } else {
        let hashes = reply_hashes(endpoint, prompt, &a.blocks, a.seed, reply, tokenizer);
        (hashes, Arc::default())
    };
    // The held blocks are the prompt's leading ones: their hashes, for the answer.
    let hold = a.kv_transfer.hold.clone().map(|id| (id, a.blocks.clone()));
    let req = NewRequest {
        prompt_tokens,
        hashes: a.blocks,
        reply_hashes,
        max_tokens: n,
        tokens,
        salt: a.req.cache_salt.clone(),
        kv_transfer: a.kv_transfer,
    };
    let Some(rx) = engine.submit(req, a.dp_rank) else {
        return ApiError::unavailable("kvbench-sim: engine stopped").into_response();
    };
    let mut watcher = Watcher {
        s: s.clone(),
        rx,
        arrived,
        seq: a.seq,
        sent: 0,
        n,
    };
    let mut usage = a.usage;
    usage.completion_tokens = n;
    let llamacpp = s.config.engine == Engine::Llamacpp;
    if a.req.stream {
        let cut_at = s.faults().cut_point(a.seq, s.index, n);
        let stream = EngineStream {
            cut_at,
            watcher,
            writer: StreamWriter::new(answer),
            first,
            usage: a.req.include_usage.then_some(usage),
            start: usage,
            timings: llamacpp,
            done: false,
        };
        return sse_response(futures_util::stream::unfold(stream, |mut st| async move {
            let event = st.next_event().await?;
            Some((event, st))
        }));
    }
    while watcher.sent < n {
        if watcher.next().await.is_none() {
            return engine_gone();
        }
    }
    usage.cached_tokens = watcher.cached_tokens();
    let timings = llamacpp.then(|| watcher.timings());
    let mut body = answer_body::whole(&answer, &reply_text, usage, timings);
    // SGLang's prefill answer names nothing: D asks for the room (`pd_bootstrap`).
    let vllm = s.pd.config.protocol == crate::sim::pd::PdProtocol::VllmNixl;
    if let (true, Some((id, hashes)), Some(obj)) = (vllm, hold, body.as_object_mut()) {
        let held = watcher.rx.borrow().held_blocks.min(hashes.len());
        let params = crate::sim::pd::prefill_answer(&s.pd, &id, &hashes[..held]);
        obj.insert("kv_transfer_params".into(), params);
    }
    Json(body).into_response()
}

fn engine_gone() -> Response {
    ApiError::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "kvbench-sim: the engine dropped the request",
    )
    .into_response()
}

/// Follows one request's progress; dropping it tells the engine the client is gone.
struct Watcher {
    s: Arc<ServerState>,
    rx: watch::Receiver<Progress>,
    arrived: Instant,
    seq: u64,
    /// Tokens already passed on to the client.
    sent: u64,
    n: u64,
}

impl Watcher {
    /// Waits for new tokens; returns the range `sent..upto` now available. None if the engine
    /// dropped the request.
    async fn next(&mut self) -> Option<(u64, u64)> {
        let sent = self.sent;
        let upto = self
            .rx
            .wait_for(|p| p.generated > sent)
            .await
            .ok()?
            .generated
            .min(self.n);
        if sent == 0 {
            let s = &self.s;
            s.stats.observe_ttft(s.model_seconds_since(self.arrived));
            let cached = self.cached_tokens();
            s.log().update(self.seq, |e| e.cached_tokens = Some(cached));
        }
        self.sent = upto;
        Some((sent, upto))
    }

    fn cached_tokens(&self) -> u64 {
        self.rx.borrow().cached_tokens.unwrap_or(0)
    }

    /// llama.cpp's `timings` of the request, once its last token is out.
    fn timings(&self) -> Timings {
        let p = *self.rx.borrow();
        Timings {
            cache_n: p.cached_tokens.unwrap_or(0),
            prompt_n: p.prompt_computed,
            prompt_ms: p.prompt_seconds * 1e3,
            predicted_n: p.generated.min(self.n),
            predicted_ms: p.decode_seconds * 1e3,
        }
    }
}

struct EngineStream {
    watcher: Watcher,
    writer: StreamWriter,
    /// The reply's first token (a continuation starts past 0).
    first: u64,
    /// Where `cut_rate` drops this stream, if it does.
    cut_at: Option<u64>,
    usage: Option<Usage>,
    /// The prompt's usage; its cached tokens are the engine's, known at the first token.
    start: Usage,
    /// Whether the usage chunk carries llama.cpp's `timings`.
    timings: bool,
    done: bool,
}

impl EngineStream {
    async fn next_event(&mut self) -> Option<Result<Bytes, std::io::Error>> {
        let w = &mut self.watcher;
        if w.sent < w.n {
            let cut = (self.cut_at == Some(w.sent)).then_some(StreamFault::Cut);
            if let Some(fault) = w.s.faults().at_token(w.sent).or(cut) {
                self.usage = None;
                self.done = true;
                w.n = w.sent;
                return Some(stream_fault(fault).await);
            }
            // A dropped request ends the stream without [DONE], as a crashed engine would.
            let (from, upto) = w.next().await?;
            let start = Usage {
                cached_tokens: w.cached_tokens(),
                ..self.start
            };
            // One event a token, as llama.cpp and SGLang stream, even when a slow reader
            // lets several build up: a client counts tokens by events.
            let mut out = BytesMut::new();
            for i in from..upto {
                let text = token_text(self.first + i);
                out.extend_from_slice(&self.writer.token(&text, i == 0, i + 1 == w.n, start));
            }
            return Some(Ok(out.freeze()));
        }
        if let Some(mut usage) = self.usage.take() {
            usage.cached_tokens = w.cached_tokens();
            let timings = self.timings.then(|| w.timings());
            return Some(Ok(self.writer.usage(usage, timings)));
        }
        if !self.done {
            self.done = true;
            return self.writer.done().map(Ok);
        }
        None
    }
}
