//! TTFT deadlines (`x-slo-ttft-ms`): a request that says how soon it needs its first token is
//! judged once, before it first queues or is placed, by its predicted TTFT on the best backend
//! (the router queue's wait included). Predicted past its deadline, a sheddable request is
//! answered at once (429 `slo_unattainable`: the client can go elsewhere while it still has
//! time), any other is served, first among its tenant's by slack, and told `at_risk`.

use http::HeaderMap;
use std::time::Duration;

use super::ctx::{Ctx, Slo};
use super::placement::Placer;
use super::tenant;
use crate::edge::Shed;
use crate::error::ApiError;

/// Deadline headers, first present wins: kvroute's, and llm-d's name for the same.
pub const SLO_HEADERS: [&str; 2] = ["x-slo-ttft-ms", "x-llm-d-slo-ttft-ms"];
/// The answer's verdict: `on_track` or `at_risk`.
pub const VERDICT_HEADER: &str = "x-kvroute-slo";
/// The TTFT predicted when the request was judged, in ms.
pub const PREDICTED_HEADER: &str = "x-kvroute-predicted-ttft-ms";

/// The request's deadline: a positive integer of milliseconds (400 otherwise).
pub(super) fn read(headers: &HeaderMap) -> Result<Option<Slo>, ApiError> {
    let Some((name, v)) = SLO_HEADERS
        .iter()
        .find_map(|h| headers.get(*h).map(|v| (h, v)))
    else {
        return Ok(None);
    };
    match v.to_str().ok().and_then(|s| s.trim().parse::<u64>().ok()) {
        Some(ms) if ms > 0 => Ok(Some(Slo {
            ttft_ms: ms,
            predicted_ms: None,
            latest_start: None,
        })),
        _ => Err(ApiError::bad_request(
            "invalid_slo",
            format!("{name} must be a positive integer of milliseconds"),
        )),
    }
}

/// Judge the request's deadline, once: predict its TTFT, keep the latest it may leave the
/// router queue, and shed it if it is sheddable and the prediction is past the deadline.
pub(super) fn judge(placer: &Placer<'_>, ctx: &mut Ctx) -> Result<(), ApiError> {
    let Some(slo) = ctx.route.slo.filter(|s| s.predicted_ms.is_none()) else {
        return Ok(());
    };
    // The engine's part: the best backend's predicted TTFT were it free of the hard cap
    // (only kv_aware predicts one; other policies are judged by the queue's wait alone).
    let service_s = placer.predict(ctx).map_or(0.0, |d| d.est_ttft_s);
    let deadline = ctx.start + Duration::from_millis(slo.ttft_ms);
    let latest_start = deadline
        .checked_sub(Duration::from_secs_f64(service_s))
        .unwrap_or(ctx.start);
    ctx.route.slo = Some(Slo {
        latest_start: Some(latest_start),
        ..slo
    });
    let wait_s = if ctx.under_caps() && placer.saturated(ctx) {
        let ahead = placer.edge.queue.ahead(&tenant::who(ctx));
        placer.router_wait_s(ctx, ahead)
    } else {
        0.0
    };
    let spent_s = ctx.start.elapsed().as_secs_f64();
    let predicted_ms = ((spent_s + wait_s + service_s) * 1000.0).ceil() as u64;
    ctx.route.slo = Some(Slo {
        predicted_ms: Some(predicted_ms),
        latest_start: Some(latest_start),
        ..slo
    });
    if predicted_ms <= slo.ttft_ms || ctx.route.priority >= 0 {
        return Ok(());
    }
    placer
        .edge
        .queue
        .count_shed(&tenant::who(ctx), Shed::SloUnattainable, 0.0);
    Err(ApiError::shed(
        Shed::SloUnattainable.as_str(),
        format!(
            "the predicted time to first token ({predicted_ms} ms) is past the request's deadline ({} ms) on every backend, and its priority ({}) is sheddable",
            slo.ttft_ms, ctx.route.priority
        ),
        ctx.generation.config.limits.retry_after_seconds,
    ))
}

/// The verdict headers for an answer to a request with a deadline.
pub(super) fn verdict(ctx: &Ctx) -> Option<(&'static str, String)> {
    let slo = ctx.route.slo?;
    let predicted = slo.predicted_ms?;
    let verdict = if slo.at_risk() { "at_risk" } else { "on_track" };
    Some((verdict, predicted.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_deadline_is_a_positive_integer_of_milliseconds() {
        let mut h = HeaderMap::new();
        assert!(read(&h).unwrap().is_none());
        h.insert("x-llm-d-slo-ttft-ms", " 250 ".parse().unwrap());
        assert_eq!(read(&h).unwrap().map(|s| s.ttft_ms), Some(250));
        // kvroute's own name wins over llm-d's.
        h.insert("x-slo-ttft-ms", "900".parse().unwrap());
        assert_eq!(read(&h).unwrap().map(|s| s.ttft_ms), Some(900));
        for bad in ["0", "-5", "1.5", "soon"] {
            h.insert("x-slo-ttft-ms", bad.parse().unwrap());
            let e = read(&h).unwrap_err();
            assert_eq!((e.status, e.code), (400, "invalid_slo"), "{bad}");
            assert!(e.message.contains("x-slo-ttft-ms"));
        }
    }
}
