//! SGLang's bootstrap protocol (`sglang_bootstrap`) on the request path: the prefill leg is
//! sent at the same time as the decode leg, which the proxy carries, both with the same body
//! naming the prefill server's bootstrap server and a fresh room (`request::bootstrap`). The
//! decode server waits for the KV under that room; SGLang's waits up to
//! `SGLANG_DISAGGREGATION_WAITING_TIMEOUT` (300 s) for a prefill that may never come.
//!
//! So neither leg outlives the other's failure: a prefill leg that fails (transport error,
//! timeout, error status) cuts the decode leg's connection at once (or as soon as it is
//! made), and the request is placed again, that prefill server excluded, within the retry
//! budget, as sgl-router does with a fresh room; a decode leg that fails, is replaced or ends
//! drops its prefill leg (the task is aborted, its connection closed: SGLang aborts a request
//! whose client left).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::ctx::Ctx;
use super::metrics::ProxyMetrics;
use super::pd::Leg;
use super::prefill_leg::{PrefillLeg, Shared, UNKNOWN};
use crate::edge::EdgeState;
use crate::request::bootstrap::{self, Bootstrap};

/// The prefill leg's answer is its one token (streamed or not) and its usage.
const MAX_ANSWER_BYTES: usize = 1 << 20;

/// Start the prefill leg of the request placement split onto prefill server `p` (its decode
/// server already charged); the decode leg's body then names the same room. `false`: `p` has
/// no room since the decision (the caller places the request again).
pub(super) fn start(edge: &Arc<EdgeState>, m: &Arc<ProxyMetrics>, ctx: &mut Ctx, p: usize) -> bool {
    let generation = ctx.generation.clone();
    let (fleet, cfg) = (&generation.fleet, &generation.config);
    let Some(profile) = ctx.route.profile.as_ref() else {
        return false;
    };
    let path = profile.endpoint.path();
    let Some(charge) = super::pd::charge_prefill(ctx, p) else {
        m.pd_legs.with_label_values(&[Leg::Full.as_str()]).inc();
        return false;
    };
    let (Some(b), Some(c)) = (fleet.backends().get(p), cfg.backends.get(p)) else {
        return false;
    };
    // Unique per request and process, as the NIXL legs' shared id.
    let seed = super::pd::request_id(ctx);
    ctx.pd.bootstrap = Some(Bootstrap {
        host: b.addr.ip().to_string(),
        port: c.bootstrap_port,
        room: Bootstrap::room(seed.as_bytes()),
    });
    // Both legs get the same body: the decode leg's, with the room.
    let Some(body) = super::upstream_request::attempt_body(ctx) else {
        ctx.pd.bootstrap = None;
        return false;
    };
    let shared = Arc::new(Shared {
        cached: AtomicU64::new(UNKNOWN),
        ..Shared::default()
    });
    let timeout = Duration::from_millis(cfg.timeouts.upstream_read_ms);
    let (fleet, edge, m, sh) = (fleet.clone(), edge.clone(), m.clone(), shared.clone());
    let name = b.name.clone();
    let started = Instant::now();
    let task = tokio::spawn(async move {
        let answer = fleet
            .post_json(p, path, &[], body, timeout, MAX_ANSWER_BYTES)
            .await;
        drop(charge);
        edge.queue.wake_one();
        let outcome = match answer {
            Ok(a) if a.status == 200 => {
                let cached = bootstrap::answer_cached(&a.body).unwrap_or(UNKNOWN);
                sh.cached.store(cached, Ordering::Relaxed);
                Leg::Ok
            }
            Ok(a) => {
                log::warn!(
                    "prefill leg on {name} answered {}: its decode leg is cut",
                    a.status
                );
                Leg::Failed
            }
            Err(e) => {
                log::warn!("prefill leg on {name} failed ({e}): its decode leg is cut");
                Leg::Failed
            }
        };
        m.pd_legs.with_label_values(&[outcome.as_str()]).inc();
        m.pd_prefill_seconds
            .with_label_values::<&str>(&[])
            .observe(started.elapsed().as_secs_f64());
        if outcome == Leg::Failed {
            let mut s = sh.lock();
            s.failed = true;
            if let Some(d) = s.decode.take() {
                d.cut();
            }
        }
    });
    ctx.pd.leg_started = Some(started);
    ctx.pd.leg = Some(PrefillLeg {
        shared,
        task,
        server: p,
    });
    true
}

/// The decode leg failed: drop its prefill leg (aborting it if it still runs). `true` if the
/// prefill leg had failed first (kvroute cut the decode leg for it): that prefill server is
/// not tried again for the request.
pub(super) fn settle(ctx: &mut Ctx) -> bool {
    let Some(leg) = ctx.pd.leg.take() else {
        return false;
    };
    let failed = leg.failed();
    if failed {
        ctx.pd.failed.push(leg.server);
    }
    failed
}
