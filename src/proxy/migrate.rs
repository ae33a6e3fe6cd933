//! Migration: a stream whose backend fails after the response started (the connection reset or
//! closed, an engine error event, silence past the read deadline, silence on a backend the
//! health check found down) goes on on another backend,
//! from where its client is. The request layer says what the client has and how to ask for
//! the rest ([`crate::request::resume`]); this decides whether to, and wires it into the
//! attempt loop.

use bytes::Bytes;
use pingora::{Error, ErrorType, Result};
use std::time::Instant;

use super::ctx::Ctx;
use super::failures::FailurePolicy;
use super::metrics::ProxyMetrics;
use crate::request::resume::{self, Continuation, Splice, Transcript, Unfit};
use crate::request::Endpoint;

/// Decides what follows a cut stream, and runs its continuation.
pub(super) struct Migrator<'a> {
    pub metrics: &'a ProxyMetrics,
}

impl Migrator<'_> {
    /// A 200 response starts: a stream that could be continued keeps a transcript of what
    /// its client is sent. A continuation keeps the one it continues.
    pub fn watch(&self, ctx: &mut Ctx) {
        if ctx.resume.transcript.is_some() {
            return;
        }
        let Some(p) = ctx.route.profile.as_ref() else {
            return;
        };
        if p.stream
            && ctx.generation.config.limits.max_migrations > 0
            && resume::continues(p.endpoint)
        {
            ctx.resume.transcript = Some(Transcript::new(p.endpoint));
            ctx.resume.prompt_now = p.est_prompt_tokens;
        }
    }

    /// A continuation's answer: anything but 200 fails the attempt before a byte of it reaches
    /// the client, whose stream is already open. An engine that refuses the request itself
    /// (400, 422: it does not know `continue_final_message`, say) is not asked again.
    pub fn check_answer(&self, ctx: &Ctx, status: u16) -> Result<()> {
        if ctx.resume.splice.is_none() || status == 200 {
            return Ok(());
        }
        if let (400 | 422, Some(i)) = (status, ctx.attempts.backend) {
            let b = &ctx.generation.fleet.backends()[i];
            if b.mark_refuses_continuation() {
                log::warn!(
                    "backend {} refused to continue a stream (HTTP {status}): it is no longer a migration target",
                    b.name
                );
            }
        }
        Err(Error::explain(
            ErrorType::HTTPStatus(status),
            format!("the continuation was answered with HTTP {status}"),
        )
        .into_up())
    }

    /// What goes to the client: a continuation's events rewritten to the stream's identity,
    /// then recorded. An engine's error event is taken out and fails the attempt.
    pub fn on_body(&self, ctx: &mut Ctx, body: &mut Option<Bytes>) -> Result<()> {
        if let Some(s) = ctx.resume.splice.as_mut() {
            s.filter(body);
        }
        let Some(t) = ctx.resume.transcript.as_mut() else {
            return Ok(());
        };
        if let Err(message) = t.observe(body) {
            return Err(Error::explain(
                ErrorType::HTTPStatus(502),
                format!("the engine reported an error mid-stream: {message}"),
            )
            .into_up());
        }
        if body.as_ref().is_some_and(|b| !b.is_empty()) {
            let now = Instant::now();
            if let Some(cut) = ctx.resume.cut_at.take() {
                self.metrics
                    .migration_gap
                    .with_label_values(&[ctx.backend_name(), ctx.resume.cause])
                    .observe(now.duration_since(cut).as_secs_f64());
            }
            ctx.resume.last_sent = Some(now);
        }
        Ok(())
    }

    /// The backend failed after the client's stream started, which has `written` body bytes:
    /// go on elsewhere (`true`: the attempt loop places the continuation) or end the stream
    /// (with its end when the text is whole, else with an error event).
    pub fn after_cut(
        &self,
        failures: &FailurePolicy,
        ctx: &mut Ctx,
        e: &Error,
        written: u64,
    ) -> bool {
        failures.cut(ctx);
        ctx.resume.cause = match e.etype() {
            _ if super::hung::was_cut(ctx) => "backend_down",
            ErrorType::ReadTimedout => "silent",
            ErrorType::HTTPStatus(_) => "engine_error",
            _ => "connection",
        };
        if let Some(t) = ctx.resume.transcript.as_mut() {
            t.settle(written);
        }
        let outcome = self.decide(ctx);
        self.metrics.migrations.with_label_values(&[outcome]).inc();
        if outcome != "migrated" {
            log::info!(
                "stream on backend {} cut after it started: not continued ({outcome})",
                ctx.backend_name()
            );
        }
        outcome == "migrated"
    }

    fn decide(&self, ctx: &mut Ctx) -> &'static str {
        let limits = &ctx.generation.config.limits;
        // A whole body cut after its head and part of it reached the client: it cannot be
        // sent again, and there is no stream to go on with.
        let Some(p) = ctx.route.profile.as_ref().filter(|p| p.stream) else {
            return "not_streamed";
        };
        let endpoint = p.endpoint;
        let Some(t) = ctx.resume.transcript.as_ref() else {
            return if limits.max_migrations == 0 {
                "disabled"
            } else {
                Unfit::Api.as_str()
            };
        };
        let seen = t.seen();
        // The usage the client asked for, if the end is all that is left to send: every
        // attempt's prompt (estimated: the failed engines never reported theirs) and the
        // tokens the client has.
        // Messages and Responses streams always end with their usage.
        let with_usage = (p.include_usage && !ctx.route.strip_usage)
            || matches!(endpoint, Endpoint::Messages | Endpoint::Responses);
        let usage = with_usage.then(|| {
            (
                ctx.resume.prompt_before + ctx.resume.prompt_now,
                seen.tokens,
            )
        });
        // A Messages text block closed: the engine had ended its text, only the end is lost.
        if seen.finished || seen.closing > 0 {
            ctx.resume.ending = Some(resume::final_events(endpoint, seen, false, usage));
            return "finished";
        }
        if ctx.resume.migrations >= limits.max_migrations {
            return "limit";
        }
        if ctx.resume.original.is_none() {
            ctx.resume.original = ctx.route.body.clone();
        }
        let body = ctx.resume.original.as_deref().unwrap_or_default();
        let next = match resume::continuation(endpoint, body, seen) {
            Ok(Continuation::Body(b)) => b,
            Ok(Continuation::Complete) => {
                ctx.resume.ending = Some(resume::final_events(endpoint, seen, true, usage));
                return "finished";
            }
            Err(u) => return u.as_str(),
        };
        // Outside the retry budget: the failed engine's work is gone with it, so the
        // continuation replaces work rather than adding any, and a backend that dies with a
        // hundred streams must not leave most of them cut for want of budget.
        // `limits.max_migrations` bounds what one request can cost.
        let first_prompt = ctx.resume.prompt_now.saturating_sub(ctx.resume.replayed);
        ctx.resume.prompt_before += ctx.resume.prompt_now;
        ctx.resume.replayed = seen.tokens;
        ctx.resume.prompt_now = first_prompt + seen.tokens;
        ctx.resume.splice = Some(Splice::new(endpoint, seen, ctx.resume.prompt_before));
        ctx.resume.migrations += 1;
        ctx.resume.cut_at = ctx.resume.last_sent;
        ctx.route.body = Some(next);
        if let Some(path) = resume::continuation_path(endpoint) {
            ctx.route.upstream_path = Some(path.to_owned());
        }
        // The engines' token ids were for the prompt without the text so far.
        ctx.route.exact = None;
        if let Some(p) = ctx.route.profile.as_mut() {
            p.est_prompt_tokens = ctx.resume.prompt_now;
        }
        ctx.attempts.upstream_responded = false;
        // Engines that refused a continuation before are not asked.
        let generation = ctx.generation.clone();
        for (i, b) in generation.fleet.backends().iter().enumerate() {
            if b.refuses_continuation() && !ctx.attempts.tried.contains(&i) {
                ctx.attempts.tried.push(i);
            }
        }
        "migrated"
    }
}
