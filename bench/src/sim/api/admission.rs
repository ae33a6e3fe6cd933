//! Admission of a POST request: slow start, parsing, tokenizing (with `--tokenizer`), the hang
//! and failure faults and, in fixed-timing mode, the prefix-cache lookup. Both answer paths take its `Admitted` (fixed
//! timing in `inference`, engine mode in `engine_answer`), so it sits below both.

use std::sync::Arc;

use axum::http::StatusCode;

use super::response::Usage;
use super::state::ServerState;
use crate::sim::engine::kvcache::{salt_seed, seeded_block_hashes, BLOCK_TOKENS};
use crate::sim::engine::scheduler::KvTransfer;
use crate::sim::error::ApiError;
use crate::sim::faults::{hits, FAIL_SALT, HANG_SALT};
use crate::sim::text::openai::{self, Endpoint, SimRequest};
use crate::sim::text::prompt::count_tokens;
use crate::sim::text::tokenizer::PromptTokenizer;
use crate::sim::text::{anthropic, responses};

/// A request that passed admission, with its prefix-cache result (fixed mode; the engine
/// looks up its own pool when it schedules the request).
pub struct Admitted {
    pub req: SimRequest,
    pub seq: u64,
    pub usage: Usage,
    /// Chained hashes of the prompt's full blocks, from `seed` (the request's salt).
    pub blocks: Vec<u64>,
    pub seed: u64,
    /// The engine rank the request's `X-Data-Parallel-Rank` pins it to (`--dp-size`), or
    /// the rank a decode request's transfer went to.
    pub dp_rank: Option<usize>,
    /// P/D disaggregation's part (`api::pd`): a hold to keep, blocks to import.
    pub kv_transfer: KvTransfer,
}

pub async fn admit(
    s: &Arc<ServerState>,
    seq: u64,
    endpoint: Endpoint,
    body: &[u8],
) -> Result<Admitted, ApiError> {
    if s.in_slow_start() {
        return Err(ApiError::unavailable("kvbench-sim: server is starting"));
    }
    let mut req = match endpoint {
        Endpoint::Responses => responses::parse(body, |id| s.responses.thread(id))?,
        Endpoint::Messages => anthropic::parse(body, true)?,
        _ => openai::parse(endpoint, body)?,
    };
    if req.continues && s.faults().refuse_continuation {
        return Err(ApiError::bad_request(
            "kvbench-sim: unknown field 'continue_final_message' (refuse_continuation)",
        ));
    }
    if !req.token_ids && !s.config.tokenizer.is_stand_in() {
        req.prompt = tokenize(&s.config.tokenizer, std::mem::take(&mut req.prompt)).await?;
    }
    let prompt_tokens = count_tokens(req.prompt.len());
    s.log().update(seq, |e| {
        e.model = Some(req.model.clone());
        e.stream = req.stream;
        e.prompt_tokens = Some(prompt_tokens);
    });
    hold_if_hung(s, seq).await;
    if hits(s.faults().fail_rate, seq, s.index, FAIL_SALT) {
        return Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "kvbench-sim: injected failure",
        ));
    }
    let mut usage = Usage {
        prompt_tokens,
        completion_tokens: req.max_tokens,
        cached_tokens: 0,
    };
    // Embedding models keep no prefix cache.
    let seed = salt_seed(req.cache_salt.as_deref());
    let blocks = if endpoint == Endpoint::Embeddings {
        Vec::new()
    } else {
        seeded_block_hashes(&req.prompt, seed)
    };
    if endpoint != Endpoint::Embeddings && s.engine.is_none() {
        usage.cached_tokens = s.kv().match_prefix(&blocks) as u64 * BLOCK_TOKENS;
        s.stats.admitted(prompt_tokens, usage.cached_tokens);
    }
    if s.engine.is_none() || endpoint == Endpoint::Embeddings {
        s.log()
            .update(seq, |e| e.cached_tokens = Some(usage.cached_tokens));
    }
    Ok(Admitted {
        req,
        seq,
        usage,
        blocks,
        seed,
        dp_rank: None,
        kv_transfer: KvTransfer::default(),
    })
}

/// The prompt's token stream (`tokenizer`), made on tokio's blocking pool: a long prompt takes
/// milliseconds, which must not stall the server's other connections.
pub(super) async fn tokenize(
    tokenizer: &Arc<PromptTokenizer>,
    canonical: Vec<u8>,
) -> Result<Vec<u8>, ApiError> {
    let tokenizer = tokenizer.clone();
    tokio::task::spawn_blocking(move || tokenizer.stream(canonical))
        .await
        .map_err(|e| e.to_string())
        .and_then(|counted| counted)
        .map_err(|e| {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("kvbench-sim: {e}"),
            )
        })
}

/// Holds a request the hang faults select: forever for `hang_rate`, until the `hang` knob is
/// cleared for `hang`. Only this request's task waits; the server keeps serving others.
async fn hold_if_hung(s: &Arc<ServerState>, seq: u64) {
    let faults = s.faults();
    let by_rate = hits(faults.hang_rate, seq, s.index, HANG_SALT);
    if !by_rate && !faults.hang {
        return;
    }
    let _waiting = s.stats.start_waiting();
    if by_rate {
        std::future::pending::<()>().await;
    }
    let mut rx = s.faults.subscribe();
    // Err only if the sender is gone, which means the server is going away: stop holding.
    let _ = rx.wait_for(|f| !f.hang).await;
}
