//! What a failed upstream attempt means: outlier detection, whether to retry (attempts, retry
//! budget), and how a response cut after it started ends for the client.

use super::*;

impl Router {
    /// The backend failed after the response started. A client reading an event stream gets a
    /// final error event (the OpenAI shape, as `data:`) and a properly ended body, so it can tell
    /// a cut stream from a finished one; other bodies can only be closed short.
    pub(super) async fn end_cut_stream(
        &self,
        session: &mut Session,
        ctx: &Ctx,
        e: &Error,
        status: u16,
    ) {
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

    /// After a failed attempt: tell outlier detection, exclude that backend and decide whether
    /// another attempt is allowed (attempts left, retry budget).
    pub(super) fn after_failure(&self, ctx: &mut Ctx, kind: &str, stale_pooled_conn: bool) -> bool {
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
    pub(super) fn report(&self, ctx: &Ctx, b: usize, outcome: Outcome) {
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
