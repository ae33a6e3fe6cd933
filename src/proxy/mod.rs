//! The Pingora `ProxyHttp` phases. Each phase only wires the request to the type that owns the
//! work: parsing (`request`), the [`Placer`] (placement, admission, the router queue), the
//! [`FailurePolicy`] (retries, outlier reports, cut streams) and [`finish::end_request`]
//! (accounting, learning, metrics, the access log). Per-request state is [`Ctx`].

use async_trait::async_trait;
use bytes::Bytes;
use pingora::http::{RequestHeader, ResponseHeader};
use pingora::prelude::HttpPeer;
use pingora::proxy::{FailToProxy, ProxyHttp, Session};
use pingora::{Error, ErrorSource, ErrorType, Result};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::edge::EdgeState;
use crate::error::{ApiError, Dialect};
use crate::fleet::outlier::Outcome;
use crate::fleet::Current;
use crate::placement::PolicyKind;
use crate::request::surface::{self, Route};
use crate::request::usage::{self, UsageTap};
use crate::request::{self, PromptText, SessionKeys, TokenEstimator, DEFAULT_BLOCK_BYTES};

pub mod access_log;
mod bootstrap_leg;
mod ctx;
mod deadline;
mod engine_done;
mod exact;
mod failures;
mod finish;
mod hung;
mod intake;
mod metrics;
mod migrate;
mod models;
mod passthrough;
mod pd;
mod peer;
mod placement;
mod prefill_leg;
mod reject;
mod split;
mod stored;
mod tenant;
mod upstream_request;

pub use ctx::Ctx;
pub use metrics::ProxyMetrics;

use failures::{FailureKind, FailurePolicy};
use migrate::Migrator;
use placement::Placer;
use reject::reject;

/// kvroute's `ProxyHttp`: each phase hands its work to the type that owns it.
pub struct Router {
    current: Arc<Current>,
    edge: Arc<EdgeState>,
    tokens: Arc<TokenEstimator>,
    metrics: Arc<ProxyMetrics>,
}

impl Router {
    pub fn new(
        current: Arc<Current>,
        edge: Arc<EdgeState>,
        tokens: Arc<TokenEstimator>,
        metrics: Arc<ProxyMetrics>,
    ) -> Router {
        for b in current.load().fleet.backends() {
            metrics.init_backend(&b.name);
        }
        Router {
            current,
            edge,
            tokens,
            metrics,
        }
    }

    fn placer(&self) -> Placer<'_> {
        Placer {
            edge: &self.edge,
            metrics: &self.metrics,
        }
    }

    fn failures(&self) -> FailurePolicy<'_> {
        FailurePolicy {
            edge: &self.edge,
            metrics: &self.metrics,
        }
    }

    fn migrator(&self) -> Migrator<'_> {
        Migrator {
            metrics: &self.metrics,
        }
    }
}

#[async_trait]
impl ProxyHttp for Router {
    type CTX = Ctx;

    fn new_ctx(&self) -> Ctx {
        Ctx::new(self.current.load(), self.edge.retry_budget.start())
    }

    async fn early_request_filter(&self, session: &mut Session, _ctx: &mut Ctx) -> Result<()> {
        // The header is complete: the edge's header deadline no longer applies.
        if let Some(peer) = session.client_addr().and_then(|a| a.as_inet()) {
            self.edge.conns.header_seen(*peer);
        }
        Ok(())
    }

    async fn request_filter(&self, session: &mut Session, ctx: &mut Ctx) -> Result<bool> {
        if self.edge.draining.is_on() {
            // Tell keep-alive clients to reconnect (to the new process) after this response,
            // rather than leave an idle connection for the old process to close under them.
            session.set_keepalive(None);
        }
        let generation = ctx.generation.clone();
        let cfg = &generation.config;
        // A client that stops reading must not hold its backend's place for as long as it
        // keeps the connection open.
        session.set_write_timeout(Some(Duration::from_millis(cfg.timeouts.client_write_ms)));
        // The edge's surface first: a route kvroute does not serve is refused whoever asks,
        // and never reaches a backend.
        let (method, path) = (
            session.req_header().method.as_str(),
            session.req_header().uri.path(),
        );
        ctx.dialect = Dialect::of_path(path);
        if let Err(e) =
            request::host_present(session.req_header(), session.as_downstream().is_http2())
        {
            return reject(session, ctx, e, true).await;
        }
        let route = surface::route(method, path, &cfg.passthrough.allow);
        ctx.route.allow_upgrade = route == Route::Forward
            && cfg
                .passthrough
                .allow
                .iter()
                .any(|r| r.upgrade && r.matches(method, path));
        let refused = match route {
            Route::NotFound => Some(ApiError::not_found(format!(
                "{method} {path} is not served here: kvroute serves the OpenAI inference API"
            ))),
            Route::WrongMethod(allowed) => Some(ApiError::method_not_allowed(format!(
                "{method} is not allowed on {path}; use {allowed}"
            ))),
            Route::Forward | Route::Inference(_) | Route::Stored => None,
        };
        if let Some(err) = refused {
            return reject(session, ctx, err, true).await;
        }
        let headers = &session.req_header().headers;
        let identified = tenant::authenticate(&self.edge, cfg, headers, ctx)
            .and_then(|()| tenant::identify(cfg, headers, ctx))
            .and_then(|()| deadline::read(headers));
        match identified {
            Ok(slo) => ctx.route.slo = slo,
            Err(e) => return reject(session, ctx, e, true).await,
        }
        if route == Route::Stored {
            let uri = session.req_header().uri.clone();
            if let Err(e) = stored::route_call(ctx, &uri) {
                return reject(session, ctx, e, true).await;
            }
            return Ok(false);
        }
        let Route::Inference(endpoint) = route else {
            if route == Route::Forward && passthrough::has_body(method) {
                let body = match intake::read_whole_body(&self.edge, session, ctx, false).await {
                    Ok((b, _lease)) => b,
                    Err(e) => return reject(session, ctx, e, true).await,
                };
                if let Err(e) = self.placer().admit_passthrough(ctx, body) {
                    return reject(session, ctx, e, false).await;
                }
                return Ok(false);
            }
            return models::answer_models(session, ctx).await;
        };
        let (body, lease) = match intake::read_whole_body(&self.edge, session, ctx, true).await {
            Ok(b) => b,
            Err(e) => return reject(session, ctx, e, true).await,
        };
        let keys = SessionKeys::new(
            &cfg.routing.session_keys,
            Some(&session.req_header().headers),
        );
        let count = self.tokens.limits(&cfg.routing);
        let profiled =
            request::profile_with_text(endpoint, &body, keys, DEFAULT_BLOCK_BYTES, count.text());
        // Parsed: the body is whole and bounded by admission from here on.
        drop(lease);
        match profiled {
            Ok((mut p, text)) => {
                let body = match (&p.previous_response_id, endpoint) {
                    (Some(prev), _) => match stored::route_continuation(ctx, prev, body) {
                        Ok(b) => b,
                        Err(e) => return reject(session, ctx, e, false).await,
                    },
                    (None, request::Endpoint::Responses) => {
                        ctx.route.stamp_ids = Some(None);
                        body
                    }
                    (None, _) => body,
                };
                // Token ids are already an exact count; text is counted (a long prompt off the
                // worker thread, awaited here so placement sees the count) or sized.
                let estimate = match text {
                    PromptText::TokenIds => None,
                    PromptText::Text(t) => {
                        Some(self.tokens.count(&p.model, t, p.prompt_bytes, count).await)
                    }
                    PromptText::TooLong => {
                        Some(self.tokens.estimate(&p.model, None, p.prompt_bytes, 0))
                    }
                };
                if let Some(e) = estimate {
                    p.est_prompt_tokens = e.tokens;
                    ctx.route.tokens = Some(e);
                }
                if let Err(e) = self.placer().admit(ctx, &p) {
                    return reject(session, ctx, e, false).await;
                }
                if let Some(x) = exact::exact_blocks(ctx, &p, &body, &self.metrics).await {
                    // The engine's own count, exactly.
                    p.est_prompt_tokens = x.prompt_tokens;
                    ctx.route.exact = Some(x);
                }
                // Engines report usage on streams only when asked; ask, and hide it again.
                let body =
                    match (p.stream && !p.has_stream_options && p.endpoint.usage_on_request())
                        .then(|| usage::ask_for_usage(&body))
                        .flatten()
                    {
                        Some(with_usage) => {
                            ctx.route.strip_usage = true;
                            with_usage
                        }
                        None => body,
                    };
                ctx.route.profile = Some(p);
                ctx.route.body = Some(body);
                Ok(false)
            }
            Err(e) => reject(session, ctx, e, false).await,
        }
    }

    async fn upstream_peer(&self, session: &mut Session, ctx: &mut Ctx) -> Result<Box<HttpPeer>> {
        let generation = ctx.generation.clone();
        let (fleet, cfg) = (&generation.fleet, &generation.config);
        ctx.attempts.count += 1;
        let placer = self.placer();
        if let Err(err) = deadline::judge(&placer, ctx) {
            ctx.error = Some(err.clone());
            return Err(err.into_pingora());
        }
        // Placement and the hard cap (and bounded_hash's bound) race with concurrent requests:
        // a charge that finds its backend full since the decision places again (or queues).
        let idx = loop {
            if ctx.under_caps() {
                if let Err(err) = placer.queue_for_capacity(ctx).await {
                    ctx.error = Some(err.clone());
                    return Err(err.into_pingora());
                }
            }
            let placing = Instant::now();
            let placed = placer.place(ctx);
            if placed.as_ref().is_some_and(|p| p.1.is_some()) {
                self.metrics
                    .decision_time
                    .observe(placing.elapsed().as_secs_f64());
            }
            let Some((idx, decision)) = placed else {
                if ctx.under_caps() && placer.saturated(ctx) {
                    continue;
                }
                let tried = ctx.attempts.tried.len();
                let err = if tried == 0 {
                    ApiError::unavailable(
                        "no_healthy_backend",
                        "no healthy backend is available",
                        cfg.limits.retry_after_seconds,
                    )
                } else if ctx.attempts.timed_out {
                    ApiError::gateway_timeout(format!(
                        "{tried} backend(s) sent nothing in time (timeouts.first_byte_floor_ms for streams, else timeouts.upstream_read_ms) and no other healthy backend is left"
                    ))
                } else {
                    ApiError::upstream(format!(
                        "{tried} backend(s) failed before responding and no other healthy backend is left"
                    ))
                };
                ctx.error = Some(err.clone());
                return Err(err.into_pingora());
            };
            let guard = placer.charge(ctx, idx, decision);
            if let Some(g) = guard {
                if let Some(d) = decision {
                    placer.record(ctx, &d);
                    ctx.charge.est_ttft_s = d.est_ttft_s;
                    ctx.charge.predicted_cached = Some(d.predicted_cached_tokens);
                }
                ctx.charge.dispatched = Some(Instant::now());
                ctx.charge.guard = Some(g);
                tenant::charge_dispatch(&self.edge, ctx);
                ctx.attempts.backend = Some(idx);
                if let Some(p) = ctx.pd.choice.and_then(|c| c.prefill) {
                    if !split::send(&self.edge, &self.metrics, &self.failures(), ctx, p).await {
                        // Its prefill leg could not go: placed again, that server excluded.
                        ctx.charge.guard = None;
                        self.edge.queue.wake_one();
                        continue;
                    }
                }
                break idx;
            }
        };
        let peer = peer::for_attempt(fleet, idx, cfg, session, ctx);
        Ok(Box::new(peer))
    }

    async fn connected_to_upstream(
        &self,
        _session: &mut Session,
        _reused: bool,
        peer: &HttpPeer,
        fd: std::os::unix::io::RawFd,
        digest: Option<&pingora::protocols::Digest>,
        ctx: &mut Ctx,
    ) -> Result<()> {
        let link = engine_done::arm(&self.edge, peer, ctx);
        hung::watch(ctx, fd, digest, link);
        Ok(())
    }

    async fn upstream_request_filter(
        &self,
        _session: &mut Session,
        upstream: &mut RequestHeader,
        ctx: &mut Ctx,
    ) -> Result<()> {
        upstream_request::rewrite(upstream, ctx)
    }

    async fn request_body_filter(
        &self,
        _session: &mut Session,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        ctx: &mut Ctx,
    ) -> Result<()> {
        if let Some(full) = ctx.route.attempt_body.as_ref().or(ctx.route.body.as_ref()) {
            // Replace Pingora's retry-buffer tail with the whole body (see `read_body`).
            *body = Some(if end_of_stream {
                full.clone()
            } else {
                Bytes::new()
            });
        }
        Ok(())
    }

    async fn upstream_response_filter(
        &self,
        _session: &mut Session,
        upstream: &mut ResponseHeader,
        ctx: &mut Ctx,
    ) -> Result<()> {
        hung::progress(ctx, false);
        upstream_request::strip_response(upstream, ctx);
        if let Some((verdict, predicted)) = deadline::verdict(ctx) {
            upstream.insert_header(deadline::VERDICT_HEADER, verdict)?;
            upstream.insert_header(deadline::PREDICTED_HEADER, predicted)?;
        }
        if upstream.status == http::StatusCode::SWITCHING_PROTOCOLS && !ctx.route.allow_upgrade {
            return Err(Error::explain(
                ErrorType::HTTPStatus(502),
                "the backend switched protocols on a route not allowed to upgrade",
            ));
        }
        self.migrator()
            .check_answer(ctx, upstream.status.as_u16())?;
        ctx.attempts.upstream_responded = true;
        // The retry was answered: it no longer multiplies load, so free its budget unit.
        ctx.attempts.retrying = None;
        if let Some(b) = ctx.attempts.backend {
            self.failures()
                .report(ctx, b, Outcome::of_status(upstream.status.as_u16()));
        }
        if upstream.status.is_success() {
            let stream = upstream
                .headers
                .get(http::header::CONTENT_TYPE)
                .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
            // A continuation in chat has no ids of its own to stamp: its events take the
            // stamped ones the client has.
            let translated = ctx.resume.splice.as_ref().is_some_and(|s| s.speaks_chat());
            ctx.tap.stamp = stored::stamper(ctx, stream).filter(|_| !translated);
            if ctx.tap.stamp.is_some() {
                // Stamped ids are longer than the engine's.
                upstream.remove_header(&http::header::CONTENT_LENGTH);
            }
        }
        if let (Some(p), 200) = (&ctx.route.profile, upstream.status.as_u16()) {
            let collect_reply = ctx.generation.config.routing.policy == PolicyKind::KvAware;
            let api = match &ctx.resume.splice {
                Some(s) if s.speaks_chat() => request::Endpoint::Chat,
                _ => p.endpoint,
            };
            let mut tap =
                UsageTap::new(p.stream, ctx.route.strip_usage, collect_reply).speaking(api);
            if let (Some(_), Some(t)) = (&ctx.resume.splice, &ctx.resume.transcript) {
                tap.replying_after(&t.seen().text);
            }
            // Split: the decode server counts the prefix it read as cached; the client's hit is
            // the prefill server's.
            let split = ctx.pd.split_sent();
            if split {
                tap = tap.rewriting_cached(ctx.pd.prefill_cached());
            }
            ctx.tap.usage = Some(tap);
            self.migrator().watch(ctx);
            if ctx.route.strip_usage || split {
                // The body will be shorter than the backend said.
                upstream.remove_header(&http::header::CONTENT_LENGTH);
            }
        }
        Ok(())
    }

    fn upstream_response_body_filter(
        &self,
        _session: &mut Session,
        _body: &mut Option<Bytes>,
        end_of_stream: bool,
        ctx: &mut Ctx,
    ) -> Result<Option<Duration>> {
        hung::progress(ctx, end_of_stream);
        Ok(None)
    }

    fn response_body_filter(
        &self,
        _session: &mut Session,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        ctx: &mut Ctx,
    ) -> Result<Option<Duration>> {
        if ctx.tap.first_byte.is_none() && body.as_ref().is_some_and(|b| !b.is_empty()) {
            ctx.tap.first_byte = Some(Instant::now());
            if let Some(g) = ctx.charge.guard.as_ref() {
                g.first_byte();
            }
        }
        if let Some(stamp) = ctx.tap.stamp.as_mut() {
            stamp.filter(body, end_of_stream);
        }
        if let Some(tap) = ctx.tap.usage.as_mut() {
            if let Some(leg) = &ctx.pd.leg {
                tap.update_cached(leg.cached());
            }
            tap.filter(body, end_of_stream);
        }
        self.migrator().on_body(ctx, body)?;
        // The drain is cut short: end a running stream now; `fail_to_proxy` sends it the SSE
        // error event.
        if !end_of_stream
            && self.edge.draining.is_cut()
            && ctx.route.profile.as_ref().is_some_and(|p| p.stream)
        {
            let err = ApiError::upstream("kvroute is shutting down; the output is incomplete");
            ctx.error = Some(err);
            return Err(Error::explain(
                ErrorType::InternalError,
                "kvroute is shutting down",
            ));
        }
        Ok(None)
    }

    fn fail_to_connect(
        &self,
        _session: &mut Session,
        _peer: &HttpPeer,
        ctx: &mut Ctx,
        mut e: Box<Error>,
    ) -> Box<Error> {
        let kind = match bootstrap_leg::settle(ctx) {
            true => FailureKind::PrefillLeg,
            false => FailureKind::Connect,
        };
        let retry = self.failures().after_failure(ctx, kind, false);
        e.set_retry(retry.retries());
        e
    }

    fn error_while_proxy(
        &self,
        peer: &HttpPeer,
        session: &mut Session,
        e: Box<Error>,
        ctx: &mut Ctx,
        client_reused: bool,
    ) -> Box<Error> {
        let mut e = e.more_context(format!("Peer: {peer}"));
        ctx.attempts.timed_out = matches!(
            e.etype(),
            ErrorType::ReadTimedout | ErrorType::WriteTimedout
        );
        if *e.esource() != ErrorSource::Upstream {
            e.set_retry(false);
            return e;
        }
        // Before the client has anything, the request is sent again whole. A reused connection
        // that broke may have been closed by the backend while pooled (nothing to hold against
        // the backend); one that timed out was open and unanswered: the backend is hung, and
        // the retry goes elsewhere. Once the client's stream has started, it is continued
        // elsewhere from where the client is, if it can be.
        let prefill_failed = bootstrap_leg::settle(ctx);
        let cut = hung::was_cut(ctx);
        let retry = if !ctx.attempts.upstream_responded || session.response_written().is_none() {
            let kind = match e.etype() {
                ErrorType::HTTPStatus(400 | 422) if ctx.resume.splice.is_some() => {
                    FailureKind::RefusedContinuation
                }
                _ if prefill_failed => FailureKind::PrefillLeg,
                _ if cut => FailureKind::BackendDown,
                _ => FailureKind::Io,
            };
            let stale = client_reused && !ctx.attempts.timed_out && !cut && !prefill_failed;
            self.failures().after_failure(ctx, kind, stale).retries()
        } else {
            let written = session.body_bytes_sent() as u64;
            session.response_written().map(|r| r.status.as_u16()) == Some(200)
                && self
                    .migrator()
                    .after_cut(&self.failures(), ctx, &e, written)
        };
        e.set_retry(retry);
        e
    }

    async fn fail_to_proxy(&self, session: &mut Session, e: &Error, ctx: &mut Ctx) -> FailToProxy {
        let api = ctx
            .error
            .clone()
            .or_else(|| ApiError::for_proxy_error(e, ctx.backend_name()));
        if let (Some(_), Some(end)) = (session.response_written(), ctx.resume.ending.take()) {
            // The text was whole when the backend failed: the stream only needed its end.
            if let Err(werr) = session.write_response_body(Some(end), true).await {
                log::debug!("could not end the stream: {werr}");
            }
            return FailToProxy {
                error_code: 200,
                can_reuse_downstream: false,
            };
        }
        let mut code = 0;
        if let Some(api) = api {
            if session.response_written().is_none() {
                code = api.status;
                if let Err(werr) = api.send(session, false, ctx.dialect).await {
                    log::debug!("could not send error response: {werr}");
                }
            } else {
                code = session.response_written().map_or(0, |r| r.status.as_u16());
                self.failures().end_cut_stream(session, ctx, e, code).await;
            }
            ctx.error = Some(api);
        }
        FailToProxy {
            error_code: code,
            can_reuse_downstream: false,
        }
    }

    async fn logging(&self, session: &mut Session, e: Option<&Error>, ctx: &mut Ctx) {
        // An HTTP/2 stream the client reset or left: the listener's rapid-reset defence counts
        // these per connection.
        if let (Some(e), true) = (e, session.as_downstream().is_http2()) {
            if *e.esource() == ErrorSource::Downstream || e.etype() == &ErrorType::H2Error {
                if let Some(peer) = session.client_addr().and_then(|a| a.as_inet()) {
                    self.edge.conns.stream_abandoned(*peer);
                }
            }
        }
        engine_done::settle(&self.metrics, ctx);
        finish::end_request(&self.edge, &self.tokens, &self.metrics, session, e, ctx);
    }
}
