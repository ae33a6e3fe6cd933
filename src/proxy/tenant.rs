//! Who a request is for and how urgent it is: its tenant (the API key's, else a tenant header
//! where the config trusts one) and its priority (a header, clamped by the key's maximum), and
//! what it costs its tenant's fair share of a saturated fleet.

use http::HeaderMap;
use std::time::Instant;

use super::ctx::Ctx;
use crate::config::{metric_label, valid_tenant, Config, DEFAULT_TENANT};
use crate::edge::{access, EdgeState, Who};
use crate::error::ApiError;

/// Priority headers, first present wins: kvroute's, then its older name. Either takes an
/// integer or a name from `tenants.priority_names`.
pub const PRIORITY_HEADERS: [&str; 2] = ["x-kvroute-priority", "x-priority"];
/// llm-d's objective name, mapped through `tenants.priority_names`; a name not there is the
/// default priority (the gateway's objectives are its own).
const OBJECTIVE_HEADER: &str = "x-llm-d-inference-objective";

/// Check the caller's API key, where the config has keys, and take one of the key's places
/// (`max_concurrent`); both into `ctx.quota`.
pub(super) fn authenticate(
    edge: &EdgeState,
    cfg: &Config,
    headers: &HeaderMap,
    ctx: &mut Ctx,
) -> Result<(), ApiError> {
    let Some(acl) = &cfg.access else {
        return Ok(());
    };
    let authorization = headers
        .get(http::header::AUTHORIZATION)
        .map(|v| v.as_bytes());
    let x_api_key = headers.get("x-api-key").map(|v| v.as_bytes());
    let caller = access::authenticate(acl, authorization, x_api_key)?;
    let key = acl.keys.get(caller.index);
    // Known before the key's places are checked: a refusal is logged under its tenant.
    let caller = ctx.quota.caller.insert(caller);
    if let Some(key) = key {
        ctx.quota.holding = edge.limiter.enter(caller, key)?;
    }
    Ok(())
}

/// Read the request's tenant and priority into `ctx.route`.
pub(super) fn identify(cfg: &Config, headers: &HeaderMap, ctx: &mut Ctx) -> Result<(), ApiError> {
    let key = match (&ctx.quota.caller, &cfg.access) {
        (Some(c), Some(acl)) => acl.keys.get(c.index),
        _ => None,
    };
    let from_header = || -> Result<Option<String>, ApiError> {
        let Some((name, v)) = cfg
            .tenants
            .headers
            .iter()
            .find_map(|h| headers.get(h.as_str()).map(|v| (h, v)))
        else {
            return Ok(None);
        };
        match v.to_str().map(str::trim) {
            Ok(t) if valid_tenant(t) => Ok(Some(t.to_owned())),
            _ => Err(ApiError::bad_request(
                "invalid_tenant",
                format!("{name} must be 1-64 visible ASCII characters"),
            )),
        }
    };
    let tenant = match key {
        Some(k) if !k.tenant_from_header => k.tenant.clone(),
        Some(k) => from_header()?.unwrap_or_else(|| k.tenant.clone()),
        None => from_header()?.unwrap_or_else(|| DEFAULT_TENANT.to_owned()),
    };
    ctx.route.tenant = tenant;

    let asked = match PRIORITY_HEADERS
        .iter()
        .find_map(|h| headers.get(*h).map(|v| (h, v)))
    {
        Some((name, v)) => Some(
            v.to_str()
                .ok()
                .and_then(|s| cfg.tenants.priority_of(s))
                .ok_or_else(|| {
                    let names: Vec<_> = cfg.tenants.priority_names.keys().cloned().collect();
                    ApiError::bad_request(
                        "invalid_priority",
                        format!("{name} must be an integer or one of: {}", names.join(", ")),
                    )
                })?,
        ),
        None => headers
            .get(OBJECTIVE_HEADER)
            .and_then(|v| v.to_str().ok())
            .and_then(|s| cfg.tenants.priority_of(s)),
    };
    // A key's requests go no higher than it may (access control on).
    if let Some(p) = asked {
        ctx.route.priority = key.map_or(p, |k| p.min(k.max_priority));
    }
    Ok(())
}

/// The request as the router queue orders it.
pub(super) fn who(ctx: &Ctx) -> Who<'_> {
    let cfg = &ctx.generation.config;
    Who {
        priority: ctx.route.priority,
        tenant: &ctx.route.tenant,
        label: metric_label(&cfg.tenants, cfg.access.as_ref(), &ctx.route.tenant),
        bytes: ctx.route.body.as_ref().map_or(0, |b| b.len() as u64),
        cost: ctx
            .route
            .profile
            .as_ref()
            .map_or(0, |p| p.est_prompt_tokens),
        latest_start: ctx.route.slo.and_then(|s| s.latest_start),
    }
}

/// The request was sent to a backend: its tenant is charged its prompt now, so its work in
/// flight already counts against it.
pub(super) fn charge_dispatch(edge: &EdgeState, ctx: &mut Ctx) {
    let f = &ctx.generation.config.tenants.fair_share;
    edge.queue.fair.set_half_life(f.half_life_ms);
    let prompt = ctx
        .route
        .profile
        .as_ref()
        .map_or(0, |p| p.est_prompt_tokens);
    let cost = prompt as f64 * f.prompt_weight;
    if ctx.quota.fair_charged == 0.0 {
        edge.queue
            .fair
            .charge(&ctx.route.tenant, cost, Instant::now());
        ctx.quota.fair_charged = cost;
    }
}

/// The request ended: its tenant is charged what the engine reports beyond the estimate.
pub(super) fn settle(edge: &EdgeState, ctx: &Ctx, prompt: u64, completion: u64) {
    let f = &ctx.generation.config.tenants.fair_share;
    let cost = prompt as f64 * f.prompt_weight + completion as f64 * f.completion_weight;
    edge.queue.fair.charge(
        &ctx.route.tenant,
        cost - ctx.quota.fair_charged,
        Instant::now(),
    );
}
