//! A request placement split between a prefill and a decode server: its prefill leg sent as
//! the fleet's protocol has it (`pd` for vLLM's sequential legs, `bootstrap_leg` for SGLang's
//! legs at once), and what follows for the request when that leg cannot go.

use std::sync::Arc;

use super::bootstrap_leg;
use super::ctx::Ctx;
use super::failures::FailurePolicy;
use super::metrics::ProxyMetrics;
use super::pd;
use super::placement;
use crate::config::PdProtocol;
use crate::edge::EdgeState;

/// Send the prefill leg of a request placement split onto prefill server `p` (its decode
/// server charged). `false`: the request is to be placed again (that server had no room, or
/// failed it and the retry budget allows another).
pub(super) async fn send(
    edge: &Arc<EdgeState>,
    metrics: &Arc<ProxyMetrics>,
    failures: &FailurePolicy<'_>,
    ctx: &mut Ctx,
    p: usize,
) -> bool {
    let protocol = ctx
        .generation
        .config
        .disaggregation
        .as_ref()
        .map(|d| d.protocol);
    let sent = if protocol == Some(PdProtocol::SglangBootstrap) {
        bootstrap_leg::start(edge, metrics, ctx, p)
    } else {
        match pd::prefill_leg(edge, metrics, ctx, p).await {
            pd::Leg::Ok | pd::Leg::NoParams => true,
            pd::Leg::Full => false,
            pd::Leg::Failed => !failures.retry_prefill(ctx),
        }
    };
    // The decode server gets the prompt now, read or computed.
    if let (true, Some(d)) = (sent, ctx.attempts.backend) {
        placement::record_blocks(ctx, d);
    }
    sent
}
