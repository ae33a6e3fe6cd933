//! The Pingora `ProxyHttp` phases. Each phase only wires the request to the module that owns
//! the work: parsing (`request`), placement (`policy`), accounting (`fleet`), metrics.

use async_trait::async_trait;
use bytes::Bytes;
use pingora::http::{RequestHeader, ResponseHeader};
use pingora::prelude::HttpPeer;
use pingora::proxy::{FailToProxy, ProxyHttp, Session};
use pingora::{Error, ErrorSource, ErrorType, Result};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::access::{self, Caller};
use crate::body;
use crate::config::Config;
use crate::error::ApiError;
use crate::fleet::{Fleet, InflightGuard};
use crate::outlier::Outcome;
use crate::policy::{self, PolicyKind, Snapshot};
use crate::prefix::DEFAULT_BLOCK_BYTES;
use crate::request::{self, Endpoint, RequestProfile, SESSION_HEADER};
use crate::retry_budget::{Active, Retrying};
use crate::state::State;
use crate::usage::{self, UsageTap};

/// Request header carrying a queue priority (integer, higher first, default 0).
pub const PRIORITY_HEADER: &str = "x-priority";

/// Only prefills at least this long teach the prefill rate: shorter ones are mostly step
/// overhead and network.
const MIN_LEARNING_PREFILL_TOKENS: u64 = 2048;

pub struct Router {
    pub state: Arc<State>,
}

/// Per-request state carried across phases.
pub struct Ctx {
    start: Instant,
    profile: Option<RequestProfile>,
    /// The whole request body, read before placement.
    body: Option<Bytes>,
    /// The fleet this request was placed on (indices below refer to it).
    fleet: Option<Arc<Fleet>>,
    backend: Option<usize>,
    reason: &'static str,
    /// Backends that failed this request before answering.
    tried: Vec<usize>,
    attempts: u32,
    stale_conn_retried: bool,
    guard: Option<InflightGuard>,
    /// Estimated uncached prompt tokens charged to the chosen backend.
    prefill: u64,
    upstream_responded: bool,
    first_byte: Option<Instant>,
    /// A specific error to render instead of the generic one for the Pingora error.
    error: Option<ApiError>,
    /// kvroute added `stream_options.include_usage`: remove the usage chunk from the stream.
    strip_usage: bool,
    usage: Option<UsageTap>,
    /// `x-priority`: higher leaves the router queue first.
    priority: i32,
    /// When the request went to its backend, and kv_aware's TTFT estimate for it there.
    dispatched: Option<Instant>,
    est_ttft_s: f64,
    /// This request's TTFT is a clean sample of its backend's prefill rate.
    learn_rate: bool,
    /// Counts toward the retry budget's base while the request runs.
    _active: Active,
    /// Held once the request has retried (see `retry_budget`).
    retrying: Option<Retrying>,
    /// The last failed attempt timed out (504 rather than 502 if nothing else answers).
    timed_out: bool,
    /// The API key's owner, when access control is on, and the tokens charged up front.
    caller: Option<Caller>,
    charged_tokens: u64,
}

impl Ctx {
    fn backend_name(&self) -> &str {
        match (&self.fleet, self.backend) {
            (Some(f), Some(i)) => &f.backends()[i].name,
            _ => "none",
        }
    }
}

/// Answer `err` now and end the request (for use in `request_filter`).
async fn reject(
    session: &mut Session,
    ctx: &mut Ctx,
    err: ApiError,
    body_unread: bool,
) -> Result<bool> {
    log::debug!("rejecting request: {err}");
    err.send(session, !body_unread).await?;
    ctx.error = Some(err);
    Ok(true)
}

impl Router {
    /// Choose a backend; `None` when none is eligible. Routed requests come back with their
    /// decision so it can be recorded once the charge succeeds.
    fn place(&self, ctx: &mut Ctx, fleet: &Fleet) -> Option<(usize, Option<policy::Decision>)> {
        let Some(profile) = ctx.profile.as_ref() else {
            ctx.reason = "passthrough";
            return fleet.pick_passthrough(&ctx.tried).map(|i| (i, None));
        };
        let cfg = self.state.config();
        let mut params = cfg.routing.params();
        params.backend_max_inflight = cfg.limits.backend_max_inflight;
        let loads = fleet.loads();
        let matched = if params.policy == PolicyKind::KvAware {
            fleet.matches(&profile.prefix_blocks)
        } else {
            Vec::new()
        };
        let snap = Snapshot {
            backends: &loads,
            ring: fleet.ring(),
            matched: &matched,
        };
        let d = policy::choose(&params, profile, &snap, &ctx.tried, fleet.ticket())?;
        log::debug!(
            "placement key={:016x} source={:?} prompt_tokens~{} policy={} -> backend={} reason={} load={} bound={:?} predicted_cached={} est_ttft_ms={:.1} tried={:?}",
            profile.session_key,
            profile.session_source,
            profile.est_prompt_tokens,
            params.policy.as_str(),
            fleet.backends()[d.backend].name,
            d.reason.as_str(),
            d.load,
            d.bound,
            d.predicted_cached_tokens,
            d.est_ttft_s * 1000.0,
            ctx.tried,
        );
        ctx.reason = d.reason.as_str();
        ctx.prefill = profile
            .est_prompt_tokens
            .saturating_sub(d.predicted_cached_tokens);
        // Only a sizeable prefill on a backend with nothing queued says much about its rate:
        // otherwise the wait is mostly other requests' work, which the estimate only guesses.
        ctx.learn_rate = cfg.routing.learn_prefill_rate
            && loads[d.backend].queued_prefill == 0
            && ctx.prefill >= MIN_LEARNING_PREFILL_TOKENS;
        Some((d.backend, Some(d)))
    }

    /// A placement went through: count it and, for kv_aware, believe the backend now holds
    /// the prompt's blocks.
    fn record(&self, ctx: &Ctx, fleet: &Fleet, d: &policy::Decision) {
        let policy = self.state.config().routing.policy;
        self.state
            .metrics
            .decisions
            .with_label_values(&[policy.as_str(), d.reason.as_str()])
            .inc();
        if let (PolicyKind::KvAware, Some(p)) = (policy, ctx.profile.as_ref()) {
            fleet.record(d.backend, &p.prefix_blocks);
            self.state
                .metrics
                .predicted_cached
                .inc_by(d.predicted_cached_tokens);
        }
    }

    /// Serve this model for this caller? 404 for a model the fleet does not serve, 403 for one
    /// the key may not use, 429 over the key's rate limits (charged here when admitted).
    fn admit(&self, ctx: &mut Ctx, cfg: &Config, p: &RequestProfile) -> Result<(), ApiError> {
        if !cfg.models.is_empty() && !cfg.models.contains(&p.model) {
            return Err(ApiError::model_not_found(&p.model));
        }
        let (Some(caller), Some(acl)) = (&ctx.caller, &cfg.access) else {
            return Ok(());
        };
        let Some(key) = acl.keys.get(caller.index) else {
            return Ok(());
        };
        access::check_model(key, &p.model)?;
        let tokens = p.est_prompt_tokens + p.est_output_tokens;
        self.state
            .limiter
            .admit(caller, key, tokens, Instant::now())
            .inspect_err(|_| {
                self.state
                    .metrics
                    .rate_limited
                    .with_label_values(&[&caller.tenant])
                    .inc();
            })?;
        ctx.charged_tokens = tokens;
        Ok(())
    }

    /// The backend failed after the response started. A client reading an event stream gets a
    /// final error event (the OpenAI shape, as `data:`) and a properly ended body, so it can tell
    /// a cut stream from a finished one; other bodies can only be closed short.
    async fn end_cut_stream(&self, session: &mut Session, ctx: &Ctx, e: &Error, status: u16) {
        self.state
            .metrics
            .cut_streams
            .with_label_values(&[ctx.backend_name()])
            .inc();
        if status != 200 || !ctx.profile.as_ref().is_some_and(|p| p.stream) {
            return;
        }
        let err = ApiError::upstream(format!(
            "backend {} failed after the response started ({}); the output is incomplete",
            ctx.backend_name(),
            e.etype().as_str()
        ));
        if let Err(werr) = session
            .write_response_body(Some(err.sse_event()), true)
            .await
        {
            log::debug!("could not end the cut stream: {werr}");
        }
    }

    /// Every eligible (healthy, untried) backend is at its hard cap.
    fn saturated(&self, ctx: &Ctx, fleet: &Fleet) -> bool {
        let cap = self.state.config().limits.backend_max_inflight;
        let loads = fleet.loads();
        let mut eligible = loads
            .iter()
            .enumerate()
            .filter(|(i, b)| b.healthy && !ctx.tried.contains(i))
            .peekable();
        eligible.peek().is_some() && eligible.all(|(_, b)| b.inflight >= cap * b.weight as u64)
    }

    /// Wait in the router queue while every eligible backend is at its hard cap.
    async fn queue_for_capacity(
        &self,
        ctx: &Ctx,
        fleet: &Fleet,
    ) -> std::result::Result<(), ApiError> {
        let limits = self.state.config().limits.clone();
        self.state
            .admission
            .wait_for_capacity(
                &self.state.metrics,
                &limits,
                ctx.priority,
                ctx.start,
                || self.saturated(ctx, fleet),
            )
            .await
    }

    /// After a failed attempt: tell outlier detection, exclude that backend and decide whether
    /// another attempt is allowed (attempts left, retry budget).
    fn after_failure(&self, ctx: &mut Ctx, kind: &str, stale_pooled_conn: bool) -> bool {
        let cfg = self.state.config();
        let m = &self.state.metrics;
        ctx.guard = None;
        self.state.admission.wake_one();
        m.upstream_failures
            .with_label_values(&[ctx.backend_name(), kind])
            .inc();
        if stale_pooled_conn && !ctx.stale_conn_retried {
            // A pooled keep-alive connection the backend had already closed says nothing
            // about the backend: try it again once on a fresh connection (outside the budget,
            // at most once per request).
            ctx.stale_conn_retried = true;
            return ctx.attempts < cfg.limits.max_attempts;
        }
        if let Some(b) = ctx.backend {
            ctx.tried.push(b);
            self.report(ctx, b, Outcome::Failure);
        }
        let outcome = if ctx.attempts >= cfg.limits.max_attempts {
            "attempts_exhausted"
        } else if ctx.retrying.is_some() || kind == "connect" {
            // A refused or failed connect never reached the backend: retrying it adds no work
            // anywhere, so it needs no budget (attempts still bound it).
            "retried"
        } else {
            match self
                .state
                .retry_budget
                .try_retry(cfg.limits.retry_budget_ratio, cfg.limits.retry_budget_min)
            {
                Some(r) => {
                    ctx.retrying = Some(r);
                    "retried"
                }
                None => "budget_exhausted",
            }
        };
        m.retries.with_label_values(&[outcome]).inc();
        outcome == "retried"
    }

    /// Feed an attempt's outcome on backend `b` to outlier detection.
    fn report(&self, ctx: &Ctx, b: usize, outcome: Outcome) {
        let Some(fleet) = ctx.fleet.as_ref() else {
            return;
        };
        let cfg = self.state.config();
        if let Some(d) = fleet.report(b, outcome, &cfg.outlier) {
            let name = &fleet.backends()[b].name;
            self.state
                .metrics
                .ejections
                .with_label_values(&[name])
                .inc();
            log::warn!(
                "backend {name} ejected for {} ms after {} failed requests in a row",
                d.as_millis(),
                cfg.outlier.consecutive_failures
            );
        }
    }
}

#[async_trait]
impl ProxyHttp for Router {
    type CTX = Ctx;

    fn new_ctx(&self) -> Ctx {
        Ctx {
            start: Instant::now(),
            profile: None,
            body: None,
            fleet: None,
            backend: None,
            reason: "",
            tried: Vec::new(),
            attempts: 0,
            stale_conn_retried: false,
            guard: None,
            prefill: 0,
            upstream_responded: false,
            first_byte: None,
            error: None,
            strip_usage: false,
            usage: None,
            priority: 0,
            dispatched: None,
            est_ttft_s: 0.0,
            learn_rate: false,
            _active: self.state.retry_budget.start(),
            retrying: None,
            timed_out: false,
            caller: None,
            charged_tokens: 0,
        }
    }

    async fn early_request_filter(&self, session: &mut Session, _ctx: &mut Ctx) -> Result<()> {
        // The header is complete: the edge's header deadline no longer applies.
        if let Some(peer) = session.client_addr().and_then(|a| a.as_inet()) {
            self.state.headers.header_seen(*peer);
        }
        Ok(())
    }

    async fn request_filter(&self, session: &mut Session, ctx: &mut Ctx) -> Result<bool> {
        if self.state.draining() {
            // Tell keep-alive clients to reconnect (to the new process) after this response,
            // rather than leave an idle connection for the old process to close under them.
            session.set_keepalive(None);
        }
        let cfg = self.state.config();
        if let Some(acl) = &cfg.access {
            let authorization = session
                .req_header()
                .headers
                .get(http::header::AUTHORIZATION)
                .map(|v| v.as_bytes());
            match access::authenticate(acl, authorization) {
                Ok(c) => ctx.caller = Some(c),
                Err(e) => return reject(session, ctx, e, true).await,
            }
        }
        let Some(endpoint) = Endpoint::from_path(session.req_header().uri.path()) else {
            return Ok(false);
        };
        if session.req_header().method != http::Method::POST {
            let err = ApiError::method_not_allowed(format!(
                "{} is not allowed on {}; use POST",
                session.req_header().method,
                session.req_header().uri.path()
            ));
            return reject(session, ctx, err, true).await;
        }
        match session
            .req_header()
            .headers
            .get(PRIORITY_HEADER)
            .map(|v| v.to_str().ok().and_then(|s| s.trim().parse::<i32>().ok()))
        {
            None => {}
            Some(Some(p)) => ctx.priority = p,
            Some(None) => {
                let err =
                    ApiError::bad_request("invalid_priority", "x-priority must be an integer");
                return reject(session, ctx, err, true).await;
            }
        }
        let per_read = Duration::from_millis(cfg.timeouts.client_body_read_ms);
        let body = match body::read_body(
            session,
            cfg.limits.max_body_bytes,
            per_read,
            Duration::from_millis(cfg.timeouts.client_body_ms),
            &self.state.metrics,
        )
        .await
        {
            Ok(b) => b,
            Err(e) => return reject(session, ctx, e, true).await,
        };
        let header = session
            .req_header()
            .headers
            .get(SESSION_HEADER)
            .map(|v| v.as_bytes());
        match request::profile(endpoint, &body, header, DEFAULT_BLOCK_BYTES) {
            Ok(p) => {
                if let Err(e) = self.admit(ctx, &cfg, &p) {
                    return reject(session, ctx, e, false).await;
                }
                // Engines report usage on streams only when asked; ask, and hide it again.
                let body = match (p.stream && !p.has_stream_options)
                    .then(|| usage::ask_for_usage(&body))
                    .flatten()
                {
                    Some(with_usage) => {
                        ctx.strip_usage = true;
                        with_usage
                    }
                    None => body,
                };
                ctx.profile = Some(p);
                ctx.body = Some(body);
                Ok(false)
            }
            Err(e) => reject(session, ctx, e, false).await,
        }
    }

    async fn upstream_peer(&self, _session: &mut Session, ctx: &mut Ctx) -> Result<Box<HttpPeer>> {
        let fleet = ctx.fleet.get_or_insert_with(|| self.state.fleet()).clone();
        ctx.attempts += 1;
        let cap = self.state.config().limits.backend_max_inflight;
        // Placement and the hard cap race with concurrent requests: a charge that finds its
        // backend full since the decision places again (or queues).
        let idx = loop {
            if ctx.profile.is_some() {
                if let Err(err) = self.queue_for_capacity(ctx, &fleet).await {
                    ctx.error = Some(err.clone());
                    return Err(err.into_pingora());
                }
            }
            let placing = Instant::now();
            let placed = self.place(ctx, &fleet);
            if placed.as_ref().is_some_and(|p| p.1.is_some()) {
                self.state
                    .metrics
                    .decision_time
                    .observe(placing.elapsed().as_secs_f64());
            }
            let Some((idx, decision)) = placed else {
                if ctx.profile.is_some() && self.saturated(ctx, &fleet) {
                    continue;
                }
                let err = if ctx.tried.is_empty() {
                    ApiError::unavailable(
                        "no_healthy_backend",
                        "no healthy backend is available",
                        self.state.config().limits.retry_after_seconds,
                    )
                } else if ctx.timed_out {
                    ApiError::gateway_timeout(format!(
                        "{} backend(s) sent nothing within timeouts.upstream_read_ms and no other healthy backend is left",
                        ctx.tried.len()
                    ))
                } else {
                    ApiError::upstream(format!(
                        "{} backend(s) failed before responding and no other healthy backend is left",
                        ctx.tried.len()
                    ))
                };
                ctx.error = Some(err.clone());
                return Err(err.into_pingora());
            };
            let guard = match decision {
                Some(_) => fleet.try_charge(idx, ctx.prefill, cap),
                None => Some(fleet.charge(idx, ctx.prefill)),
            };
            if let Some(g) = guard {
                if let Some(d) = decision {
                    self.record(ctx, &fleet, &d);
                    ctx.est_ttft_s = d.est_ttft_s;
                }
                ctx.dispatched = Some(Instant::now());
                ctx.guard = Some(g);
                break idx;
            }
        };
        ctx.backend = Some(idx);
        let cfg = self.state.config();
        let mut peer = HttpPeer::new(fleet.backends()[idx].addr, false, String::new());
        let t = &cfg.timeouts;
        peer.options.connection_timeout = Some(Duration::from_millis(t.connect_ms));
        peer.options.read_timeout = Some(Duration::from_millis(t.upstream_read_ms));
        peer.options.write_timeout = Some(Duration::from_millis(t.upstream_read_ms));
        peer.options.idle_timeout = Some(Duration::from_secs(60));
        Ok(Box::new(peer))
    }

    async fn upstream_request_filter(
        &self,
        _session: &mut Session,
        upstream: &mut RequestHeader,
        ctx: &mut Ctx,
    ) -> Result<()> {
        if let Some(body) = &ctx.body {
            // The body is already here in full: the backend must not wait for a 100-continue
            // handshake or a chunked stream.
            upstream.remove_header(&http::header::EXPECT);
            upstream.remove_header(&http::header::TRANSFER_ENCODING);
            upstream.insert_header(http::header::CONTENT_LENGTH, body.len().to_string())?;
        }
        Ok(())
    }

    async fn request_body_filter(
        &self,
        _session: &mut Session,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        ctx: &mut Ctx,
    ) -> Result<()> {
        if let Some(full) = &ctx.body {
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
        ctx.upstream_responded = true;
        // The retry was answered: it no longer multiplies load, so free its budget unit.
        ctx.retrying = None;
        if let Some(b) = ctx.backend {
            self.report(ctx, b, Outcome::of_status(upstream.status.as_u16()));
        }
        if let (Some(p), 200) = (&ctx.profile, upstream.status.as_u16()) {
            let collect_reply = self.state.config().routing.policy == PolicyKind::KvAware;
            ctx.usage = Some(UsageTap::new(p.stream, ctx.strip_usage, collect_reply));
            if ctx.strip_usage {
                // The body will be shorter than the backend said.
                upstream.remove_header(&http::header::CONTENT_LENGTH);
            }
        }
        Ok(())
    }

    fn response_body_filter(
        &self,
        _session: &mut Session,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        ctx: &mut Ctx,
    ) -> Result<Option<Duration>> {
        if ctx.first_byte.is_none() && body.as_ref().is_some_and(|b| !b.is_empty()) {
            ctx.first_byte = Some(Instant::now());
            if let Some(g) = ctx.guard.as_mut() {
                g.first_byte();
            }
        }
        if let Some(tap) = ctx.usage.as_mut() {
            tap.filter(body, end_of_stream);
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
        let retry = self.after_failure(ctx, "connect", false);
        e.set_retry(retry);
        e
    }

    fn error_while_proxy(
        &self,
        peer: &HttpPeer,
        _session: &mut Session,
        e: Box<Error>,
        ctx: &mut Ctx,
        client_reused: bool,
    ) -> Box<Error> {
        let mut e = e.more_context(format!("Peer: {peer}"));
        ctx.timed_out = matches!(
            e.etype(),
            ErrorType::ReadTimedout | ErrorType::WriteTimedout
        );
        // Retry only while nothing has come back from the backend: once a response has started,
        // the client may already hold part of it.
        let retry = !ctx.upstream_responded
            && *e.esource() == ErrorSource::Upstream
            && self.after_failure(ctx, "io", client_reused);
        e.set_retry(retry);
        e
    }

    async fn fail_to_proxy(&self, session: &mut Session, e: &Error, ctx: &mut Ctx) -> FailToProxy {
        let api = ctx
            .error
            .clone()
            .or_else(|| ApiError::for_proxy_error(e, ctx.backend_name()));
        let mut code = 0;
        if let Some(api) = api {
            if session.response_written().is_none() {
                code = api.status;
                if let Err(werr) = api.send(session, false).await {
                    log::debug!("could not send error response: {werr}");
                }
            } else {
                code = session.response_written().map_or(0, |r| r.status.as_u16());
                self.end_cut_stream(session, ctx, e, code).await;
            }
            ctx.error = Some(api);
        }
        FailToProxy {
            error_code: code,
            can_reuse_downstream: false,
        }
    }

    async fn logging(&self, session: &mut Session, e: Option<&Error>, ctx: &mut Ctx) {
        if ctx.guard.take().is_some() {
            // A slot freed up: the router queue's best waiter may go.
            self.state.admission.wake_one();
        }
        let status = session.response_written().map_or(0, |r| r.status.as_u16());
        let backend = ctx.backend_name().to_owned();
        let m = &self.state.metrics;
        let elapsed = ctx.start.elapsed();
        m.duration
            .with_label_values(&[&backend])
            .observe(elapsed.as_secs_f64());
        let streamed = ctx.profile.as_ref().is_some_and(|p| p.stream);
        let ttft = ctx.first_byte.map(|t| t.duration_since(ctx.start));
        // Teach the backend's prefill rate from clean samples (see `learn_rate`).
        if let (Some(f), Some(i), Some(sent), Some(first), 200) = (
            &ctx.fleet,
            ctx.backend,
            ctx.dispatched,
            ctx.first_byte,
            status,
        ) {
            if ctx.learn_rate && streamed {
                f.backends()[i]
                    .observe_ttft(ctx.est_ttft_s, first.duration_since(sent).as_secs_f64());
            }
        }
        if let (true, Some(t), 200) = (streamed, ttft, status) {
            m.ttft
                .with_label_values(&[&backend])
                .observe(t.as_secs_f64());
        }
        // The engine now also holds the reply's KV: the next turn's prefix.
        if let (Some(f), Some(i), Some(p), Some(body), Some(reply), 200) = (
            &ctx.fleet,
            ctx.backend,
            &ctx.profile,
            &ctx.body,
            ctx.usage.as_ref().and_then(|t| t.reply.as_deref()),
            status,
        ) {
            if !reply.is_empty() {
                if let Ok(blocks) =
                    request::blocks_with_reply(p.endpoint, body, reply, DEFAULT_BLOCK_BYTES)
                {
                    f.record(i, &blocks);
                }
            }
        }
        if let (Some(caller), Some(acl)) = (&ctx.caller, &self.state.config().access) {
            if let (Some(key), true) = (acl.keys.get(caller.index), ctx.charged_tokens > 0) {
                // Settle the up-front estimate with what the engine reports; a request that
                // never reached a backend used nothing.
                let used = match ctx.usage.as_ref().and_then(|t| t.usage) {
                    Some(u) => u.prompt_tokens + u.completion_tokens,
                    None if ctx.backend.is_none() => 0,
                    None => ctx.charged_tokens,
                };
                self.state
                    .limiter
                    .settle(caller, key, ctx.charged_tokens, used);
            }
        }
        if let Some(u) = ctx.usage.as_ref().and_then(|t| t.usage) {
            m.prompt_tokens
                .with_label_values(&[&backend])
                .inc_by(u.prompt_tokens);
            m.cached_prompt_tokens
                .with_label_values(&[&backend])
                .inc_by(u.cached_tokens);
        }
        // Counted last: a scrape that sees the request counted sees its histograms too.
        m.requests
            .with_label_values(&[&backend, &status.to_string()])
            .inc();
        let req = session.req_header();
        log::info!(
            target: "kvroute::access",
            "{} \"{} {}\" {} backend={} reason={} attempts={} dur_ms={:.1} ttft_ms={} body_bytes={}{}",
            session
                .client_addr()
                .map_or_else(|| "-".to_string(), |a| a.to_string()),
            req.method,
            req.uri.path(),
            status,
            backend,
            if ctx.reason.is_empty() { "-" } else { ctx.reason },
            ctx.attempts,
            elapsed.as_secs_f64() * 1000.0,
            ttft.map_or_else(|| "-".to_string(), |t| format!("{:.1}", t.as_secs_f64() * 1000.0)),
            ctx.body.as_ref().map_or(0, |b| b.len()),
            e.map_or_else(String::new, |e| format!(" error=\"{e}\"")),
        );
    }
}
