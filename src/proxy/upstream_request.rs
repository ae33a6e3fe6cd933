//! The request as the backend gets it: the body's framing, what only kvroute may say (the
//! engine rank, the engine's key), and what must not pass (a protocol switch, the client's key);
//! and what of the backend's response head stays behind (`response_headers.strip`).

use bytes::Bytes;
use pingora::http::{RequestHeader, ResponseHeader};
use pingora::{Error, ErrorType, Result};

use super::ctx::Ctx;
use crate::config::EnginePriority;
use crate::request::{bootstrap, nixl};

/// vLLM's and SGLang's header pinning a request to one data-parallel rank of the engine.
const DP_RANK_HEADER: &str = "x-data-parallel-rank";

/// Rewrite the upstream request header of `ctx`'s current attempt (and its body, where the
/// backend's engine takes the priority).
pub(super) fn rewrite(upstream: &mut RequestHeader, ctx: &mut Ctx) -> Result<()> {
    ctx.route.attempt_body = attempt_body(ctx);
    if let Some(body) = ctx.route.attempt_body.as_ref().or(ctx.route.body.as_ref()) {
        // The body is already here in full: the backend must not wait for a 100-continue
        // handshake or a chunked stream.
        upstream.remove_header(&http::header::EXPECT);
        upstream.remove_header(&http::header::TRANSFER_ENCODING);
        upstream.insert_header(http::header::CONTENT_LENGTH, body.len().to_string())?;
    }
    // Which engine rank serves a request is kvroute's to say, never a client's: a pinned
    // rank bypasses the engine's own balancing.
    upstream.remove_header(DP_RANK_HEADER);
    // A switched protocol is a tunnel past the path filter and access control: only where
    // a pass-through rule allows it.
    if !ctx.route.allow_upgrade {
        upstream.remove_header(&http::header::UPGRADE);
    }
    if let Some(path) = &ctx.route.upstream_path {
        let uri = path
            .parse::<http::Uri>()
            .map_err(|e| Error::explain(ErrorType::InternalError, e.to_string()))?;
        upstream.set_uri(uri);
    }
    if let Some(r) = ctx.route.dp_rank {
        upstream.insert_header(DP_RANK_HEADER, r.to_string())?;
    }
    // Both legs of a disaggregated request carry one id: the decode server's notification
    // frees the prefill server's blocks by it.
    if let (Some(id), Some(_)) = (&ctx.pd.request_id, &ctx.pd.params) {
        upstream.insert_header(nixl::REQUEST_ID_HEADER, id.as_str())?;
    }
    // The client's key is kvroute's to check, not the engine's to see: an engine behind
    // access control gets its own key, or none.
    if ctx.generation.config.access.is_some() {
        upstream.remove_header(&http::header::AUTHORIZATION);
        upstream.remove_header("x-api-key");
    }
    let backend = ctx
        .attempts
        .backend
        .map(|i| &ctx.generation.fleet.backends()[i]);
    if let Some(auth) = backend.and_then(|b| b.engine_auth.as_deref()) {
        upstream.insert_header(http::header::AUTHORIZATION, auth)?;
    }
    Ok(())
}

/// The request's body as this attempt's backend gets it, where it differs from the client's
/// (`None`: the body as is): its priority band as the engine's `priority` field, where the
/// backend schedules by it (`backends[].engine_priority`), and the decode leg's
/// `kv_transfer_params` (a client's own never passes).
///
/// vLLM refuses a non-zero `priority` unless started with `--scheduling-policy priority` ("Got
/// priority .. but Priority scheduling is not enabled", its input processor), and SGLang
/// aborts one without `--enable-priority-scheduling` when started with
/// `--abort-on-priority-when-disabled` (server_args): only where the operator says the engine
/// takes it.
pub(super) fn attempt_body(ctx: &Ctx) -> Option<Bytes> {
    let i = ctx.attempts.backend?;
    // Routed requests only: their bodies are JSON objects kvroute has parsed.
    let profile = ctx.route.profile.as_ref()?;
    let body = ctx.route.body.as_ref()?;
    let sign = match ctx.generation.config.backends.get(i)?.engine_priority {
        EnginePriority::None => None,
        EnginePriority::HigherFirst => Some(1),
        EnginePriority::LowerFirst => Some(-1),
    };
    let params = ctx.pd.params.as_ref();
    let boot = ctx.pd.bootstrap.as_ref();
    if sign.is_none() && params.is_none() && boot.is_none() && !profile.has_handover_fields {
        return None;
    }
    let mut v: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(body).ok()?;
    if let Some(sign) = sign {
        v.insert(
            "priority".into(),
            serde_json::Value::from(sign * i64::from(ctx.route.priority)),
        );
    }
    nixl::set_params(&mut v, params);
    bootstrap::set(&mut v, boot);
    serde_json::to_vec(&v).ok().map(Bytes::from)
}

/// Remove from the backend's response head what `response_headers.strip` names.
pub(super) fn strip_response(upstream: &mut ResponseHeader, ctx: &Ctx) {
    let strip = &ctx.generation.config.response_headers;
    let gone: Vec<http::HeaderName> = upstream
        .headers
        .keys()
        .filter(|n| strip.strips(n.as_str()))
        .cloned()
        .collect();
    for name in gone {
        upstream.remove_header(&name);
    }
}
