//! What a failed upstream attempt means: outlier detection, whether to retry (attempts, retry
//! budget), and how a response cut after it started ends for the client when it cannot be
//! continued (`super::migrate`).

use pingora::proxy::Session;
use pingora::Error;

use super::ctx::Ctx;
use super::metrics::ProxyMetrics;
use crate::edge::EdgeState;
use crate::error::ApiError;
use crate::fleet::outlier::Outcome;

/// How an attempt failed before the backend answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum FailureKind {
    /// The connection could not be made: the request never reached the backend.
    Connect,
    /// The connection broke or timed out before a response header.
    Io,
    /// The engine refused a stream's continuation (an option it does not know): nothing
    /// against its health.
    RefusedContinuation,
    /// kvroute cut the connection: the health check found the backend down while the request
    /// sat silent on it.
    BackendDown,
    /// kvroute cut the decode leg: its prefill leg, sent beside it, failed (SGLang's protocol).
    /// Nothing against the decode server, and no retry budget: the decode server had not
    /// started (it waits for the KV), the prefill server's work is lost with it as a hung
    /// backend's is, and an SGLang decode server cannot serve the request whole instead.
    PrefillLeg,
}

impl FailureKind {
    fn as_str(self) -> &'static str {
        match self {
            FailureKind::Connect => "connect",
            FailureKind::Io => "io",
            FailureKind::RefusedContinuation => "refused_continuation",
            FailureKind::BackendDown => "backend_down",
            FailureKind::PrefillLeg => "prefill_leg",
        }
    }
}

/// Whether a failed attempt is tried again, and why (the `outcome` label of
/// `kvroute_retries_total`, except for a stale pooled connection, which is not counted).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum RetryDecision {
    /// A pooled keep-alive connection the backend had already closed: once more on a fresh
    /// connection.
    FreshConnection,
    Retried,
    BudgetExhausted,
    AttemptsExhausted,
}

impl RetryDecision {
    fn as_str(self) -> &'static str {
        match self {
            RetryDecision::FreshConnection => "fresh_connection",
            RetryDecision::Retried => "retried",
            RetryDecision::BudgetExhausted => "budget_exhausted",
            RetryDecision::AttemptsExhausted => "attempts_exhausted",
        }
    }

    pub fn retries(self) -> bool {
        matches!(
            self,
            RetryDecision::FreshConnection | RetryDecision::Retried
        )
    }
}

/// Decides what follows a failed attempt.
pub(super) struct FailurePolicy<'a> {
    pub edge: &'a EdgeState,
    pub metrics: &'a ProxyMetrics,
}

impl FailurePolicy<'_> {
    /// The backend failed after the response started. A client reading an event stream gets a
    /// final error event (the OpenAI shape, as `data:`) and a properly ended body, so it can tell
    /// a cut stream from a finished one; other bodies can only be closed short.
    pub async fn end_cut_stream(&self, session: &mut Session, ctx: &Ctx, e: &Error, status: u16) {
        self.metrics
            .cut_streams
            .with_label_values(&[ctx.backend_name()])
            .inc();
        if status != 200 || !ctx.route.profile.as_ref().is_some_and(|p| p.stream) {
            return;
        }
        let err = if self.edge.draining.is_cut() {
            ApiError::upstream("kvroute is shutting down; the output is incomplete")
        } else {
            ApiError::upstream(format!(
                "backend {} failed after the response started ({}); the output is incomplete",
                ctx.backend_name(),
                e.etype().as_str()
            ))
        };
        if let Err(werr) = session
            .write_response_body(Some(err.sse_event_in(ctx.dialect)), true)
            .await
        {
            log::debug!("could not end the cut stream: {werr}");
        }
    }

    /// After a failed attempt: tell outlier detection, exclude that backend and decide whether
    /// another attempt is allowed (attempts left, retry budget).
    pub fn after_failure(
        &self,
        ctx: &mut Ctx,
        kind: FailureKind,
        stale_pooled_conn: bool,
    ) -> RetryDecision {
        let limits = &ctx.generation.config.limits;
        let (max_attempts, ratio, min) = (
            limits.max_attempts,
            limits.retry_budget_ratio,
            limits.retry_budget_min,
        );
        ctx.charge.guard = None;
        self.edge.queue.wake_one();
        self.metrics
            .upstream_failures
            .with_label_values(&[ctx.backend_name(), kind.as_str()])
            .inc();
        if stale_pooled_conn && !ctx.attempts.stale_conn_retried {
            // A pooled keep-alive connection the backend had already closed says nothing
            // about the backend: try it again once on a fresh connection (outside the budget,
            // at most once per request).
            ctx.attempts.stale_conn_retried = true;
            return if ctx.attempts.count < max_attempts {
                RetryDecision::FreshConnection
            } else {
                RetryDecision::AttemptsExhausted
            };
        }
        match (ctx.attempts.backend, kind) {
            (Some(_), FailureKind::PrefillLeg) | (None, _) => {}
            (Some(b), _) => {
                ctx.attempts.tried.push(b);
                if kind != FailureKind::RefusedContinuation {
                    self.report(ctx, b, Outcome::Failure);
                }
            }
        }
        let decision = if ctx.attempts.count >= max_attempts {
            RetryDecision::AttemptsExhausted
        } else if kind != FailureKind::Io {
            // A refused or failed connect never reached the backend, a refused continuation
            // was not started, and a hung backend's work is lost with it: retrying adds no
            // work anywhere, so it needs no budget (attempts still bound it).
            RetryDecision::Retried
        } else {
            self.budgeted(ctx, ratio, min)
        };
        self.metrics
            .retries
            .with_label_values(&[decision.as_str()])
            .inc();
        decision
    }

    /// Take the request's unit of the retry budget, unless it holds one already.
    fn budgeted(&self, ctx: &mut Ctx, ratio: f64, min: u64) -> RetryDecision {
        if ctx.attempts.retrying.is_some() {
            return RetryDecision::Retried;
        }
        match self.edge.retry_budget.try_retry(ratio, min) {
            Some(r) => {
                ctx.attempts.retrying = Some(r);
                RetryDecision::Retried
            }
            None => RetryDecision::BudgetExhausted,
        }
    }

    /// A prefill leg failed before its decode leg was sent: `true` if the request may be
    /// placed again (another prefill server, or whole), within the retry budget; else it is
    /// served whole on its decode server, which computes the prompt itself.
    pub fn retry_prefill(&self, ctx: &mut Ctx) -> bool {
        let limits = &ctx.generation.config.limits;
        let (ratio, min) = (limits.retry_budget_ratio, limits.retry_budget_min);
        let decision = self.budgeted(ctx, ratio, min);
        self.metrics
            .retries
            .with_label_values(&[decision.as_str()])
            .inc();
        decision == RetryDecision::Retried
    }

    /// The backend failed after the response started: release its charge, count the failure
    /// against it, and never send this request there again.
    pub fn cut(&self, ctx: &mut Ctx) {
        ctx.charge.guard = None;
        self.edge.queue.wake_one();
        self.metrics
            .upstream_failures
            .with_label_values(&[ctx.backend_name(), "cut"])
            .inc();
        if let Some(b) = ctx.attempts.backend {
            ctx.attempts.tried.push(b);
            self.report(ctx, b, Outcome::Failure);
        }
    }

    /// Feed an attempt's outcome on backend `b` to outlier detection.
    pub fn report(&self, ctx: &Ctx, b: usize, outcome: Outcome) {
        let fleet = &ctx.generation.fleet;
        let cfg = &ctx.generation.config.outlier;
        if let Some(d) = fleet.report(b, outcome, cfg) {
            let name = &fleet.backends()[b].name;
            self.metrics.ejections.with_label_values(&[name]).inc();
            log::warn!(
                "backend {name} ejected for {} ms after {} failed requests in a row",
                d.as_millis(),
                cfg.consecutive_failures
            );
        }
    }
}
