//! A prompt tokenized as the engines tokenize it, for the exact index: off the proxy's threads
//! and within `kv_events.tokenize_budget_ms`. A prompt not ready in time is placed on the
//! approximate index; its tokenization finishes anyway and is remembered for the next turn,
//! as is the reply once answered.

use bytes::Bytes;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::ctx::Ctx;
use super::metrics::ProxyMetrics;
use crate::config::KvEventsConfig;
use crate::fleet::kv_events::ExactBlocks;
use crate::placement::PolicyKind;
use crate::request::engine_tokens::EngineTokenizer;
use crate::request::{Endpoint, RequestProfile};

/// The engine tokenizer for `p`'s model and kvroute's limits on its use, when the exact index
/// is in use: kv_aware, with some backend publishing KV events.
fn tokenizer<'a>(
    ctx: &'a Ctx,
    p: &RequestProfile,
) -> Option<(&'a KvEventsConfig, &'a Arc<EngineTokenizer>)> {
    let cfg = &ctx.generation.config;
    let (Some(k), Some(tok)) = (&cfg.kv_events, &ctx.generation.engine_tokens) else {
        return None;
    };
    if cfg.routing.policy != PolicyKind::KvAware
        || !cfg.backends.iter().any(|b| b.kv_events.is_some())
    {
        return None;
    }
    // The tokenizer of the request's model: another model's tokens never match its engines.
    Some((k, tok.for_model(k, &p.model)?))
}

/// After a chat answer: tokenize the conversation with its reply in the background, so the
/// next turn waits only for its new message (see [`EngineTokenizer::remember_reply`]). Only
/// on a free tokenizing slot, so it never delays a request's own tokenizing.
pub(super) fn remember_reply(ctx: &Ctx, p: &RequestProfile, reply: &str, m: &ProxyMetrics) {
    let Some((k, tok)) = tokenizer(ctx, p) else {
        return;
    };
    let Some(body) = ctx.route.body.as_ref() else {
        return;
    };
    if p.endpoint == Endpoint::Completions || body.len() + reply.len() > k.tokenize_max_bytes {
        return;
    }
    let outcomes = m.exact_replies.clone();
    let Some(permit) = tok.idle_slot() else {
        outcomes.with_label_values(&["skipped"]).inc();
        return;
    };
    let (tok, body, reply, endpoint) = (tok.clone(), body.clone(), reply.to_owned(), p.endpoint);
    tokio::task::spawn_blocking(move || {
        let _permit = permit;
        match tok.remember_reply(&body, endpoint, &reply) {
            Ok(()) => outcomes.with_label_values(&["tokenized"]).inc(),
            Err(e) => {
                outcomes.with_label_values(&["failed"]).inc();
                log::debug!("reply not tokenized for the next turn: {e}");
            }
        }
    });
}

pub(super) async fn exact_blocks(
    ctx: &Ctx,
    p: &RequestProfile,
    body: &Bytes,
    m: &ProxyMetrics,
) -> Option<ExactBlocks> {
    let (k, tok) = tokenizer(ctx, p)?;
    // A continuation's history is on the engine that stored it, where it is pinned: nothing
    // to tokenize, nothing to place.
    if p.previous_response_id.is_some() {
        return None;
    }
    let outcome = |o: &str| m.exact_tokenize.with_label_values(&[o]).inc();
    if body.len() > k.tokenize_max_bytes {
        outcome("too_large");
        return None;
    }
    // The budget covers waiting for a slot and tokenizing.
    let started = Instant::now();
    let budget = Duration::from_millis(k.tokenize_budget_ms);
    let Ok(Some(permit)) = tokio::time::timeout(budget, tok.slot()).await else {
        outcome("busy");
        return None;
    };
    let lora = ctx
        .route
        .pool
        .as_ref()
        .is_some_and(|pool| pool.adapter)
        .then(|| p.model.clone());
    let salt = p.cache_salt.clone();
    let (tok, body, endpoint) = (tok.clone(), body.clone(), p.endpoint);
    let job = tokio::task::spawn_blocking(move || {
        let _permit = permit;
        let tokens = tok.prompt_tokens(&body, endpoint)?;
        Ok::<_, String>(ExactBlocks {
            blocks: tok.blocks(&tokens, lora.as_deref(), salt.as_deref()),
            block_tokens: tok.block_size as u64,
            prompt_tokens: tokens.len() as u64,
        })
    });
    match tokio::time::timeout(budget.saturating_sub(started.elapsed()), job).await {
        Ok(Ok(Ok(blocks))) => {
            outcome("tokenized");
            m.exact_tokenize_seconds
                .observe(started.elapsed().as_secs_f64());
            Some(blocks)
        }
        Ok(Ok(Err(e))) => {
            outcome("failed");
            log::debug!("prompt not tokenized for the exact index: {e}");
            None
        }
        Ok(Err(e)) => {
            outcome("failed");
            log::error!("the prompt tokenizer failed: {e}");
            None
        }
        Err(_) => {
            outcome("late");
            None
        }
    }
}
