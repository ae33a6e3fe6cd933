//! The Pingora `ProxyHttp` phases. Each phase only wires the request to the module that owns
//! the work: parsing (`request`), placement (`policy`), accounting (`fleet`), metrics. The glue
//! around placement, failures and a request's end lives in `placement`, `failures`, `finish`.

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

mod failures;
mod finish;
mod placement;

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
        self.finish(session, e, ctx);
    }
}
