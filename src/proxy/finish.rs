//! The end of a request: accounting, learning, metrics and the access log.

use super::access_log;
use crate::config::LogFormat;
use pingora::proxy::Session;
use pingora::Error;

use super::ctx::Ctx;
use super::metrics::ProxyMetrics;
use crate::edge::EdgeState;
use crate::request::TokenEstimator;

/// The request is over, however it ended: release its charge, teach the fleet what the
/// response showed, settle the caller's quota, count it and write the access log line.
pub(super) fn end_request(
    edge: &EdgeState,
    tokens: &TokenEstimator,
    m: &ProxyMetrics,
    session: &Session,
    e: Option<&Error>,
    ctx: &mut Ctx,
) {
    if ctx.charge.guard.take().is_some() {
        // A slot freed up: the router queue's best waiter may go.
        edge.queue.wake_one();
    }
    super::pd::release_orphaned_prefill(ctx);
    let status = session.response_written().map_or(0, |r| r.status.as_u16());
    let backend = ctx.backend_name();
    let elapsed = ctx
        .answered
        .map_or_else(|| ctx.start.elapsed(), |at| at.duration_since(ctx.start));
    m.duration
        .with_label_values(&[backend])
        .observe(elapsed.as_secs_f64());
    let streamed = ctx.route.profile.as_ref().is_some_and(|p| p.stream);
    let ttft = ctx.tap.first_byte.map(|t| t.duration_since(ctx.start));
    let fleet = &ctx.generation.fleet;
    // A migrated stream's continuation: its usage counts the attempts before it too (see
    // `request::resume::Splice`), and its first byte and prompt are not the first attempt's.
    let migrated = ctx.resume.splice.as_ref();
    let engine_usage = ctx.tap.usage.as_ref().and_then(|t| t.usage);
    let usage = match (engine_usage, migrated) {
        (Some(u), Some(s)) => Some(s.summed(u)),
        (u, _) => u,
    };
    // How far kv_aware's TTFT prediction was off, as the first byte tells it.
    if let (Some(sent), Some(first), true, 200, None) = (
        ctx.charge.dispatched,
        ctx.tap.first_byte,
        streamed,
        status,
        migrated,
    ) {
        if ctx.charge.est_ttft_s > 0.0 {
            m.first_byte_ratio
                .with_label_values(&[backend])
                .observe(first.duration_since(sent).as_secs_f64() / ctx.charge.est_ttft_s);
        }
        // What the adapter load took: the first byte's wait beyond the prediction without it.
        if let (Some(cost), Some(i)) = (ctx.charge.adapter_load_s, ctx.attempts.backend) {
            let took = first.duration_since(sent).as_secs_f64() - (ctx.charge.est_ttft_s - cost);
            if let Some(b) = fleet.backends().get(i) {
                b.observe_adapter_load(took);
            }
        }
    }
    if let (Some(first), 200) = (ctx.tap.first_byte, status) {
        super::pd::observe_first_token(ctx, first);
    }
    if let (Some(slo), Some(t), 200) = (ctx.route.slo, ttft, status) {
        let met = t.as_millis() <= u128::from(slo.ttft_ms);
        edge.queue.count_slo(super::tenant::who(ctx).label, met);
    }
    if let (true, Some(t), 200) = (streamed, ttft, status) {
        m.ttft
            .with_label_values(&[backend, ctx.model_label()])
            .observe(t.as_secs_f64());
    }
    // A continuation of a stored response sends only its new input: its canonical stream is
    // not the engine's prompt, so it neither extends the index nor teaches the token model
    // (an engine count of the whole thread against an estimate of the new items would move
    // every later estimate).
    let profile = ctx
        .route
        .profile
        .as_ref()
        .filter(|p| p.previous_response_id.is_none());
    // The engine now also holds the reply's KV: the next turn's prefix, its tool calls
    // included.
    let calls = ctx.tap.usage.as_ref().map_or(&[][..], |t| &t.calls[..]);
    if let (Some(i), Some(p), Some(reply), 200) = (
        ctx.attempts.backend,
        profile,
        ctx.tap.usage.as_ref().and_then(|t| t.reply.as_deref()),
        status,
    ) {
        if !reply.is_empty() || !calls.is_empty() {
            if let Some(blocks) = p.reply_blocks(reply, calls) {
                fleet.record(i, &blocks, &[], None);
            }
        }
        // The exact index's tokenizer remembers text replies (its engines' KV events name
        // the calls' blocks anyway).
        if !reply.is_empty() && calls.is_empty() {
            super::exact::remember_reply(ctx, p, reply, m);
        }
    }
    if let (Some(caller), Some(acl)) = (&ctx.quota.caller, &ctx.generation.config.access) {
        if let (Some(key), true) = (acl.keys.get(caller.index), ctx.quota.charged_tokens > 0) {
            // Settle the up-front estimate with what the engine reports; a request that
            // never reached a backend used nothing.
            let used = match usage {
                Some(u) => u.prompt_tokens + u.completion_tokens,
                None if ctx.attempts.backend.is_none() => 0,
                None => ctx.quota.charged_tokens,
            };
            edge.limiter
                .settle(caller, key, ctx.quota.charged_tokens, used);
        }
    }
    // The engine's count of the prompt settles the estimate and teaches the model's ratios.
    if let (Some(u), Some(est), Some(p), None) =
        (engine_usage, ctx.route.tokens.as_ref(), profile, migrated)
    {
        if est.tokens > 0 && u.prompt_tokens > 0 {
            m.token_estimate_ratio
                .with_label_values(&[est.method.as_str()])
                .observe(u.prompt_tokens as f64 / est.tokens as f64);
        }
        tokens.learn(&p.model, est, u.prompt_tokens);
    }
    if let Some(u) = usage {
        super::tenant::settle(edge, ctx, u.prompt_tokens, u.completion_tokens);
        fleet.observe_output(u.completion_tokens);
        let api = ctx
            .route
            .profile
            .as_ref()
            .map_or("", |p| p.endpoint.as_str());
        m.prompt_tokens
            .with_label_values(&[backend, ctx.model_label(), api])
            .inc_by(u.prompt_tokens);
        m.cached_prompt_tokens
            .with_label_values(&[backend, ctx.model_label(), api])
            .inc_by(u.cached_tokens);
        // Predicted and reported for the same requests, so their ratio scores each index.
        if let (Some(index), Some(predicted)) = (ctx.route.index, ctx.charge.predicted_cached) {
            let index = index.as_str();
            m.cached_by_index
                .with_label_values(&[index, "predicted", api])
                .inc_by(predicted);
            m.cached_by_index
                .with_label_values(&[index, "reported", api])
                .inc_by(u.cached_tokens);
        }
    }
    // Counted last: a scrape that sees the request counted sees its histograms too.
    // The status's own text, not a string formatted afresh for every request.
    let code = http::StatusCode::from_u16(status).ok();
    let code = code.as_ref().map_or("0", |s| s.as_str());
    m.requests.with_label_values(&[backend, code]).inc();
    let req = session.req_header();
    // Formatted only for a line that is written.
    let client = || {
        session
            .client_addr()
            .map_or_else(|| "-".to_string(), |a| a.to_string())
    };
    if ctx.generation.config.log.format == LogFormat::Json {
        let entry = serde_json::json!({
            "ts": unix_now(),
            "client": client(),
            "method": req.method.as_str(),
            "path": req.uri.path(),
            "status": status,
            "backend": backend,
            "model": ctx.route.profile.as_ref().map(|p| p.model.as_str()),
            "reason": ctx.attempts.reason.map(|r| r.as_str()),
            "attempts": ctx.attempts.count,
            "duration_ms": elapsed.as_secs_f64() * 1000.0,
            "ttft_ms": ttft.map(|t| t.as_secs_f64() * 1000.0),
            "body_bytes": ctx.route.body.as_ref().map_or(0, |b| b.len()),
            "error": e.map(|e| e.to_string()),
        });
        access_log::write_json(&entry, &m.access_log_dropped);
        return;
    }
    if !log::log_enabled!(target: "kvroute::access", log::Level::Info) {
        return;
    }
    let line =
        format!(
        "{} \"{} {}\" {} backend={} reason={} attempts={} dur_ms={:.1} ttft_ms={} body_bytes={}{}",
        client(),
        req.method,
        req.uri.path(),
        status,
        backend,
        ctx.attempts.reason.map_or("-", |r| r.as_str()),
        ctx.attempts.count,
        elapsed.as_secs_f64() * 1000.0,
        ttft.map_or_else(|| "-".to_string(), |t| format!("{:.1}", t.as_secs_f64() * 1000.0)),
        ctx.route.body.as_ref().map_or(0, |b| b.len()),
        e.map_or_else(String::new, |e| format!(" error=\"{e}\"")),
    );
    access_log::write_text(line, &m.access_log_dropped);
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}
