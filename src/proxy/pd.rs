//! Prefill/decode disaggregation on the request path: when placement split a request
//! (`placement::disagg`), the prefill leg is sent to its prefill server here, before the
//! decode leg goes to the decode server through the proxy. vLLM's NixlConnector protocol
//! (`vllm_nixl`): the legs are sequential, the decode leg naming what the prefill leg returned.
//!
//! A prefill leg that fails, is refused, or comes back holding nothing (an abort) never
//! becomes a hung decode: the request is served whole on its decode server, and that prefill
//! server is not tried again for it.

use std::time::{Duration, Instant};

use super::ctx::Ctx;
use super::metrics::ProxyMetrics;
use crate::config::DisaggregationConfig;
use crate::edge::EdgeState;
use crate::placement::disagg::Transfer;
use crate::request::{nixl, Endpoint, RequestProfile};

use crate::request::nixl::REQUEST_ID_HEADER;
/// A prefill leg's answer is one token and its usage: anything larger is not one.
const MAX_ANSWER_BYTES: usize = 1 << 20;

/// What moving the KV costs: at the rate the engines' own transfers have shown
/// (`fleet::transfer`), else as `kvroute.disaggregation` says.
pub(super) fn transfer(d: &DisaggregationConfig, learned_bytes_per_s: Option<f64>) -> Transfer {
    Transfer {
        bytes_per_token: d.kv_bytes_per_token as f64,
        bytes_per_s: learned_bytes_per_s.unwrap_or(d.transfer_gbytes_per_s * 1e9),
        base_s: d.transfer_base_ms / 1000.0,
    }
}

/// The first token of a request the disaggregation decision judged: its path's learned bias
/// moves toward how far from the prediction it came. A split request is timed from its
/// prefill leg, a whole one from its dispatch; a split that fell back to whole teaches
/// neither.
pub(super) fn observe_first_token(ctx: &Ctx, first: Instant) {
    let Some(choice) = ctx.pd.choice else {
        return;
    };
    let fleet = &ctx.generation.fleet;
    match (choice.prefill, ctx.pd.split_sent()) {
        (Some(_), true) => {
            if let (Some(started), Some(predicted)) = (ctx.pd.leg_started, choice.split_ttft_s) {
                let took = first.saturating_duration_since(started).as_secs_f64();
                fleet.observe_pd_error(true, took - predicted);
            }
        }
        (None, _) => {
            if let Some(sent) = ctx.charge.dispatched {
                let took = first.saturating_duration_since(sent).as_secs_f64();
                fleet.observe_pd_error(false, took - choice.whole_ttft_s);
            }
        }
        (Some(_), false) => {}
    }
}

/// May this request be split? vLLM's and SGLang's prefill/decode protocols speak chat and
/// completions; a migrated stream's continuation is served whole where it lands.
pub(super) fn splittable(ctx: &Ctx, p: &RequestProfile) -> bool {
    matches!(p.endpoint, Endpoint::Chat | Endpoint::Completions)
        && ctx.resume.splice.is_none()
        && ctx.generation.config.disaggregation.is_some()
}

/// How a prefill leg ended, as metrics name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Leg {
    /// It returned the parameters the decode leg needs.
    Ok,
    /// No room on the prefill server since the decision.
    Full,
    /// A transport error, a timeout, or an error status.
    Failed,
    /// It answered, holding nothing for a remote decode.
    NoParams,
}

impl Leg {
    #[cfg(test)]
    pub const ALL: [Leg; 4] = [Leg::Ok, Leg::Full, Leg::Failed, Leg::NoParams];

    pub fn as_str(self) -> &'static str {
        match self {
            Leg::Ok => "ok",
            Leg::Full => "full",
            Leg::Failed => "failed",
            Leg::NoParams => "no_params",
        }
    }
}

/// A request id both legs share: unique per process and start, not guessable from outside
/// (a client never sees it).
pub(super) fn request_id(ctx: &Ctx) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let salt = std::process::id() as u64 ^ ctx.start.elapsed().as_nanos() as u64;
    let h = xxhash_rust::xxh3::xxh3_128(&[n.to_le_bytes(), salt.to_le_bytes()].concat());
    format!("kvroute-{h:032x}")
}

/// Send the prefill leg of a request placement split onto prefill server `p`; on success the
/// decode leg's body names what it returned (`ctx.pd.params`). Otherwise `p` is not tried
/// again for it: the caller places it again or serves it whole.
pub(super) async fn prefill_leg(
    edge: &EdgeState,
    m: &ProxyMetrics,
    ctx: &mut Ctx,
    p: usize,
) -> Leg {
    let generation = ctx.generation.clone();
    let fleet = &generation.fleet;
    let started = Instant::now();
    ctx.pd.leg_started = Some(started);
    let outcome = send(ctx, p).await;
    m.pd_legs.with_label_values(&[outcome.as_str()]).inc();
    m.pd_prefill_seconds
        .with_label_values::<&str>(&[])
        .observe(started.elapsed().as_secs_f64());
    let name = fleet.backends().get(p).map_or("?", |b| b.name.as_str());
    if outcome != Leg::Ok {
        ctx.pd.failed.push(p);
        log::warn!(
            "prefill leg on {name} ended {}: the request is placed again, or served whole on its decode server",
            outcome.as_str()
        );
    }
    // The prefill server's slot is free again: the router queue's best waiter may go.
    edge.queue.wake_one();
    outcome
}

/// The request ends with its prefill leg done and its decode leg never answered (the client
/// left first): the prefill server holds the prompt's blocks for a decode that will not come,
/// and vLLM's would keep them for its abort timeout (`VLLM_NIXL_ABORT_REQUEST_TIMEOUT`, 480
/// s). The decode leg is sent anyway and cut at once: the decode server's abort notifies the
/// prefill server, which frees them (vLLM sends an empty-block notification for a request
/// aborted before its read).
pub(super) fn release_orphaned_prefill(ctx: &Ctx) {
    let (Some(d), Some(_), false) = (
        ctx.attempts.backend,
        ctx.pd.params.as_ref(),
        ctx.attempts.upstream_responded,
    ) else {
        return;
    };
    let (Some(id), Some(profile)) = (ctx.pd.request_id.clone(), ctx.route.profile.as_ref()) else {
        return;
    };
    let Some(body) = super::upstream_request::attempt_body(ctx) else {
        return;
    };
    let fleet = ctx.generation.fleet.clone();
    let path = profile.endpoint.path();
    tokio::spawn(async move {
        let headers = [(REQUEST_ID_HEADER, id.as_str())];
        match fleet
            .send_and_cut(d, path, &headers, body, Duration::from_millis(50))
            .await
        {
            Ok(()) => log::debug!("decode leg {id}: sent and cut, its client gone"),
            Err(e) => log::warn!(
                "decode leg {id} could not be sent after its client left ({e}): the prefill server holds its blocks until its own timeout"
            ),
        }
    });
}

/// Charge prefill server `p` with the split request's prefill, within its hard cap; `None`:
/// it is full.
pub(super) fn charge_prefill(ctx: &Ctx, p: usize) -> Option<crate::fleet::InflightGuard> {
    let (fleet, cfg) = (&ctx.generation.fleet, &ctx.generation.config);
    let profile = ctx.route.profile.as_ref()?;
    let prefill = ctx
        .pd
        .choice
        .map_or(profile.est_prompt_tokens, |c| c.prefill_tokens);
    let expected = fleet.expected(p, 0.0, 1);
    let cap = (cfg.limits.backend_max_inflight, None);
    fleet.try_charge(p, prefill, None, cap, expected)
}

async fn send(ctx: &mut Ctx, p: usize) -> Leg {
    let generation = ctx.generation.clone();
    let (fleet, cfg) = (&generation.fleet, &generation.config);
    let Some(profile) = ctx.route.profile.as_ref() else {
        return Leg::Failed;
    };
    let Some(body) = ctx.route.body.as_ref().and_then(|b| nixl::prefill_body(b)) else {
        return Leg::Failed;
    };
    // Held until the prefill server answers: its work in flight counts there meanwhile.
    let Some(_charge) = charge_prefill(ctx, p) else {
        return Leg::Full;
    };
    let id = request_id(ctx);
    let timeout = Duration::from_millis(cfg.timeouts.upstream_read_ms);
    let answer = fleet
        .post_json(
            p,
            profile.endpoint.path(),
            &[(REQUEST_ID_HEADER, id.as_str())],
            body,
            timeout,
            MAX_ANSWER_BYTES,
        )
        .await;
    let answer = match answer {
        Ok(a) if a.status == 200 => a,
        Ok(a) => {
            log::debug!("prefill leg: status {}", a.status);
            return Leg::Failed;
        }
        Err(e) => {
            log::debug!("prefill leg: {e}");
            return Leg::Failed;
        }
    };
    let Some(parsed) = nixl::prefill_answer(&answer.body) else {
        return Leg::Failed;
    };
    ctx.pd.prefill_cached = parsed.cached_tokens;
    // The prefill server computed the prompt and keeps it cached once the decode server has
    // read it: a later request sharing the prefix can be prefilled there from it.
    let token_blocks = ctx.route.exact.as_ref().map_or(&[][..], |e| &e.blocks);
    fleet.record(p, &profile.prefix_blocks, token_blocks, None);
    match parsed.params {
        Some(params) => {
            ctx.pd.params = Some(params);
            ctx.pd.request_id = Some(id);
            Leg::Ok
        }
        None => Leg::NoParams,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_leg_outcome_is_exported_from_start() {
        let r = prometheus::Registry::new();
        let _m = ProxyMetrics::register(&r).unwrap();
        let families = r.gather();
        let legs = families
            .iter()
            .find(|f| f.name() == "kvroute_pd_prefill_legs_total")
            .unwrap();
        let mut exported: Vec<&str> = legs
            .get_metric()
            .iter()
            .map(|m| m.get_label()[0].value())
            .collect();
        let mut ours: Vec<&str> = Leg::ALL.iter().map(|l| l.as_str()).collect();
        exported.sort_unstable();
        ours.sort_unstable();
        assert_eq!(exported, ours);
    }
}
