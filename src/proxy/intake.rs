//! A request's body as kvroute takes it in: read whole, within the size limit, the body
//! deadlines and the process's body memory.

use bytes::Bytes;
use pingora::proxy::Session;
use std::time::Duration;

use super::ctx::Ctx;
use crate::edge::body_budget::{self, BodyLease};
use crate::edge::EdgeState;
use crate::error::ApiError;
use crate::request::body::{parse_cost, read_body};

/// The request's whole body, within `limits.max_body_bytes`, the body deadlines and the
/// process's body memory (`limits.body_memory_bytes`), with the lease that holds its share
/// of that memory: drop it once the body is parsed. `parsed`: the body will be parsed
/// whole, and its parse's cost is taken too.
pub(super) async fn read_whole_body(
    edge: &EdgeState,
    session: &mut Session,
    ctx: &Ctx,
    parsed: bool,
) -> Result<(Bytes, BodyLease), ApiError> {
    let cfg = &ctx.generation.config;
    let capacity = cfg.limits.body_memory_bytes;
    let timeouts = edge.metrics.client_timeouts.with_label_values(&["body"]);
    let mut lease = edge.bodies.lease();
    let body = read_body(
        session,
        cfg.limits.max_body_bytes,
        Duration::from_millis(cfg.timeouts.client_body_read_ms),
        Duration::from_millis(cfg.timeouts.client_body_ms),
        &timeouts,
        &mut |n| match lease.grow(n, capacity) {
            true => Ok(()),
            false => Err(body_budget::spent(cfg.limits.retry_after_seconds)),
        },
    )
    .await?;
    let cost = if parsed { parse_cost(&body) } else { 0 };
    if body.len().saturating_add(cost) > capacity {
        return Err(ApiError::too_large(format!(
            "request body of {} bytes would take about {} more to parse, past \
             limits.body_memory_bytes ({capacity})",
            body.len(),
            cost
        )));
    }
    if !lease.grow(cost, capacity) {
        return Err(body_budget::spent(cfg.limits.retry_after_seconds));
    }
    Ok((body, lease))
}
