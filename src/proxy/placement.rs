//! Placement glue: the snapshot for the policy, recording a decision, the hard cap and the
//! router queue, and admission of a request for its caller (model, quotas).

use prometheus::IntGauge;
use std::time::Instant;

use super::ctx::{Ctx, IndexMode};
use super::metrics::ProxyMetrics;
use super::pd;
use crate::config::{PdDecision, Role};
use crate::edge::{access, EdgeState};
use crate::error::ApiError;
use crate::fleet::adapters::AdapterSlot;
use crate::fleet::kv_events::Matches;
use crate::fleet::InflightGuard;
use crate::placement::{self, disagg, Decision, Params, PolicyKind, Reason, Snapshot};
use crate::request::RequestProfile;

/// One request counted in its model's queue depth while it waits.
struct Waiting(IntGauge);

impl Waiting {
    fn new(g: IntGauge) -> Waiting {
        g.inc();
        Waiting(g)
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// Places one request on the fleet its context pinned.
pub(super) struct Placer<'a> {
    pub edge: &'a EdgeState,
    pub metrics: &'a ProxyMetrics,
}

impl Placer<'_> {
    /// Charge backend `idx` with the request, in one step with the check of its hard cap
    /// (`limits.backend_max_inflight`) and, for bounded_hash, of the decision's bound (requests
    /// in flight): two decisions made at once cannot both take a backend's last place. `None`:
    /// it is full (the caller places the request again).
    pub fn charge(
        &self,
        ctx: &Ctx,
        idx: usize,
        decision: Option<Decision>,
    ) -> Option<InflightGuard> {
        let (fleet, cfg) = (&ctx.generation.fleet, &ctx.generation.config);
        let output = ctx
            .route
            .profile
            .as_ref()
            .map_or(0, |p| p.est_output_tokens);
        let expected = fleet.expected(idx, decision.map_or(0.0, |d| d.est_ttft_s), output);
        let (prefill, rank) = (ctx.charge.prefill, ctx.route.dp_rank);
        let bound = decision
            .filter(|_| cfg.routing.policy == PolicyKind::BoundedHash)
            .and_then(|d| d.bound);
        let cap = (cfg.limits.backend_max_inflight, bound);
        // A request pinned to the backend that stored its response goes there or nowhere:
        // capping it would only place it on the same backend again.
        let capped = decision.is_some() || (ctx.under_caps() && ctx.route.pinned.is_none());
        if capped {
            fleet.try_charge(idx, prefill, rank, cap, expected)
        } else {
            Some(fleet.charge(idx, prefill, rank, expected))
        }
    }

    /// Choose a backend; `None` when none is eligible. Routed requests come back with their
    /// decision so it can be recorded once the charge succeeds.
    pub fn place(&self, ctx: &mut Ctx) -> Option<(usize, Option<Decision>)> {
        self.place_as(ctx, false)
    }

    /// What placement would decide for a routed request if no backend were at its hard cap:
    /// the best TTFT the fleet offers it once it leaves the router queue. It leaves the
    /// request's placement fields to be overwritten by the real placement.
    pub fn predict(&self, ctx: &mut Ctx) -> Option<Decision> {
        self.place_as(ctx, true).and_then(|(_, d)| d)
    }

    fn place_as(&self, ctx: &mut Ctx, what_if: bool) -> Option<(usize, Option<Decision>)> {
        let generation = ctx.generation.clone();
        let fleet = &generation.fleet;
        if let Some(i) = ctx.route.pinned {
            ctx.attempts.reason = Some(Reason::Stored);
            return (!ctx.attempts.tried.contains(&i)).then_some((i, None));
        }
        let cfg = &generation.config;
        // A prefill server serves nothing whole: it is passed over as if it had failed. Nor,
        // with SGLang, does a decode server: it takes only a split request, and only while a
        // prefill server can take the other leg.
        let split_ok = ctx
            .route
            .profile
            .as_ref()
            .is_some_and(|p| pd::splittable(ctx, p))
            && prefill_room(ctx) == Room::Free;
        let excluded = excluded(cfg, &ctx.attempts.tried, split_ok);
        let Some(profile) = ctx.route.profile.as_ref() else {
            ctx.attempts.reason = Some(Reason::Passthrough);
            return fleet.pick_passthrough(&excluded).map(|i| (i, None));
        };
        let cap = match what_if {
            true => u64::MAX,
            false => cfg.limits.backend_max_inflight,
        };
        let params = Params::from_config(&cfg.routing, cap);
        let mut loads = fleet.loads();
        // Among the model's own pool: its backends, their ring, their load bound.
        let pool = ctx
            .route
            .pool
            .clone()
            .unwrap_or_else(|| fleet.pool(&profile.model));
        let mut slots = Vec::new();
        if pool.adapter {
            // Where the adapter is not loaded, the request waits for it to load (and may evict
            // another, which then loads again elsewhere, or wait for a slot).
            let load_s = cfg.routing.lora_load_ms as f64 / 1000.0;
            slots = vec![None; loads.len()];
            for &i in &pool.members {
                let (slot, cost) = fleet.adapter_cost(i, &profile.model, load_s);
                loads[i].adapter_load_s = cost;
                slots[i] = Some(slot);
            }
        }
        let matched = if params.policy == PolicyKind::KvAware {
            let mut m = fleet.matches(
                &profile.prefix_blocks,
                ctx.route.exact.as_ref(),
                profile.session_key,
                params.duplicate_prefill_weight,
            );
            placement::credit_unseen_history(
                &mut m.tokens,
                &m.exact,
                pool.owner(fleet.ring(), profile.session_key),
                profile.history_blocks as u64 * cfg.routing.block_tokens(),
            );
            m
        } else {
            Matches::default()
        };
        let snap = Snapshot {
            backends: &loads,
            ring: fleet.ring(),
            matched: &matched.tokens,
            // Only kv_aware's affinity credit reads it: no lock for the other policies.
            later_turns: match params.policy {
                PolicyKind::KvAware => fleet.later_turns(),
                _ => 1.0,
            },
        };
        let d = placement::choose_in(&params, profile, &snap, &pool, &excluded, fleet.ticket())?;
        if what_if {
            return Some((d.backend, Some(d)));
        }
        let pd = cfg
            .disaggregation
            .as_ref()
            .filter(|_| params.policy == PolicyKind::KvAware && pd::splittable(ctx, profile))
            .map(|dis| {
                let prefills = |p: usize| {
                    let b = &loads[p];
                    cfg.backends.get(p).is_some_and(|c| c.role.prefills())
                        && pool.local(p).is_some()
                        && b.healthy
                        && b.inflight < cap.saturating_mul(u64::from(b.weight))
                        && !ctx.attempts.tried.contains(&p)
                        && !ctx.pd.failed.contains(&p)
                };
                let role = cfg.backends.get(d.backend).map_or(Role::Both, |c| c.role);
                let terms = disagg::SplitTerms {
                    decode_stall_weight: dis.decode_stall_weight,
                    duplicate_prefill_weight: params.duplicate_prefill_weight,
                    transfer: pd::transfer(dis, fleet.transfer_bytes_per_s()),
                    bias: fleet.pd_bias(),
                    must_split: dis.decision == PdDecision::Always
                        || !dis.protocol.serves_whole(role),
                };
                disagg::decide(
                    &snap,
                    d.backend,
                    profile.est_prompt_tokens,
                    &terms,
                    &prefills,
                )
            });
        if pd.is_some_and(|c| c.prefill.is_none()) && !whole_ok(cfg, d.backend) {
            // Every prefill server filled up since `split_ok` was read.
            return None;
        }
        log::debug!(
            "placement key={:016x} source={:?} prompt_tokens~{} policy={} -> backend={} reason={} load={} bound={:?} predicted_cached={} est_ttft_ms={:.1} tried={:?}",
            profile.session_key,
            profile.session_source,
            profile.est_prompt_tokens,
            params.policy.as_str(),
            fleet.backends()[d.backend].name,
            d.reason.as_str(),
            d.load,
            d.bound,
            d.predicted_cached_tokens,
            d.est_ttft_s * 1000.0,
            ctx.attempts.tried,
        );
        if let Some(c) = pd {
            let ms =
                |s: Option<f64>| s.map_or_else(|| "-".into(), |s| format!("{:.1}", s * 1000.0));
            let dec = &loads[d.backend];
            log::debug!(
                "disaggregation key={:016x} decode={} -> prefill={} whole_ms={:.1} whole_ttft_ms={:.1} split_ms={} split_ttft_ms={} bias_ms={:.1}/{:.1} transfer_ms={:.1} transfer_tokens={} prefill_tokens={} decoding={} rate={:.0}",
                profile.session_key,
                fleet.backends()[d.backend].name,
                c.prefill.map_or("none", |p| fleet.backends()[p].name.as_str()),
                c.whole_s * 1000.0,
                c.whole_ttft_s * 1000.0,
                ms(c.split_s),
                ms(c.split_ttft_s),
                c.bias.whole_s * 1000.0,
                c.bias.split_s * 1000.0,
                c.transfer_s * 1000.0,
                c.transfer_tokens,
                c.prefill_tokens,
                dec.decoding,
                dec.prefill_rate,
            );
        }
        ctx.attempts.reason = Some(d.reason);
        ctx.route.dp_rank = matched.rank.get(d.backend).copied().flatten();
        ctx.route.index = (params.policy == PolicyKind::KvAware).then(|| {
            if matched.exact.get(d.backend) == Some(&true) {
                IndexMode::Exact
            } else {
                IndexMode::Approximate
            }
        });
        // Split, the decode server computes nothing of the prompt: it reads it.
        ctx.charge.prefill = match pd.and_then(|c| c.prefill) {
            Some(_) => 0,
            None => profile
                .est_prompt_tokens
                .saturating_sub(d.predicted_cached_tokens),
        };
        ctx.pd.choice = pd;
        ctx.pd.params = None;
        ctx.pd.bootstrap = None;
        // A running prefill leg belonged to the attempt this placement replaces.
        ctx.pd.leg = None;
        // Only kv_aware predicts a TTFT for the load time to be read against.
        let slot = slots.get(d.backend).copied().flatten();
        ctx.charge.adapter_load_s = match (params.policy, slot) {
            (PolicyKind::KvAware, Some(AdapterSlot::Free | AdapterSlot::EvictsIdle)) => {
                Some(loads[d.backend].adapter_load_s)
            }
            _ => None,
        };
        Some((d.backend, Some(d)))
    }

    /// A placement went through: count it and, for kv_aware, believe the backend now holds
    /// the prompt's blocks.
    pub fn record(&self, ctx: &mut Ctx, d: &Decision) {
        let policy = ctx.generation.config.routing.policy;
        self.metrics
            .decisions
            .with_label_values(&[policy.as_str(), d.reason.as_str(), ctx.model_label()])
            .inc();
        if let Some(index) = ctx.route.index {
            self.metrics.decided_on(index).inc();
        }
        if let Some(c) = ctx.pd.choice {
            let outcome = if c.prefill.is_some() {
                "split"
            } else {
                "whole"
            };
            self.metrics
                .pd_decisions
                .with_label_values(&[outcome])
                .inc();
        }
        if let Some(p) = ctx
            .route
            .profile
            .as_ref()
            .filter(|_| ctx.attempts.tried.is_empty())
        {
            // Once per request, not per attempt: a retry is not another turn.
            ctx.generation.fleet.record_turn(p.has_history);
        }
        if let (Some(p), Some(pool)) = (ctx.route.profile.as_ref(), ctx.route.pool.as_ref()) {
            if pool.adapter {
                // Replacing a retried attempt's hold releases it.
                ctx.charge.adapter =
                    Some(ctx.generation.fleet.backends()[d.backend].hold_adapter(&p.model));
            }
        }
        if policy == PolicyKind::KvAware {
            // A split request reaches its decode server only once its prefill leg went: a
            // leg that fails leaves the decode server without the prompt, and placement
            // must not believe otherwise when it places the request again.
            if ctx.pd.choice.is_none_or(|c| c.prefill.is_none()) {
                record_blocks(ctx, d.backend);
            }
            self.metrics
                .predicted_cached
                .inc_by(d.predicted_cached_tokens);
        }
    }

    /// Serve this model for this caller? 404 for a model the fleet does not serve, 403 for one
    /// the key may not use, 429 over the key's rate limits (charged here when admitted).
    pub fn admit(&self, ctx: &mut Ctx, p: &RequestProfile) -> Result<(), ApiError> {
        let cfg = &ctx.generation.config;
        if !cfg.models.is_empty() && !cfg.models.contains(&p.model) {
            return Err(ApiError::model_not_found(&p.model));
        }
        let pool = ctx.generation.fleet.pool(&p.model);
        let known = pool.listed || cfg.models.contains(&p.model);
        ctx.route.model_label = Some(if known {
            p.model.clone()
        } else {
            "other".into()
        });
        let served = !pool.members.is_empty();
        ctx.route.pool = Some(pool);
        if !served {
            return Err(ApiError::model_not_found(&p.model));
        }
        let (Some(caller), Some(acl)) = (&ctx.quota.caller, &cfg.access) else {
            return Ok(());
        };
        let Some(key) = acl.keys.get(caller.index) else {
            return Ok(());
        };
        access::check_model(key, &p.model)?;
        ctx.quota.charged_tokens =
            self.charge_key(caller, key, p.est_prompt_tokens + p.est_output_tokens)?;
        Ok(())
    }

    /// The key's rates admit `tokens` more now (429 otherwise, counted): the tokens charged.
    fn charge_key(
        &self,
        caller: &crate::edge::Caller,
        key: &crate::config::ApiKeyConfig,
        tokens: u64,
    ) -> Result<u64, ApiError> {
        self.edge
            .limiter
            .admit(caller, key, tokens, Instant::now())
            .inspect_err(|_| {
                self.edge
                    .metrics
                    .rate_limited
                    .with_label_values(&[&caller.tenant])
                    .inc();
            })?;
        Ok(tokens)
    }

    /// A pass-through request with a body (`/v1/embeddings`, `/v1/messages/count_tokens`, an
    /// allowed route) is admitted for its caller as a routed one is: the model its body names
    /// against the key's, and the key's rates (its input estimated from the body's size; no
    /// output).
    pub fn admit_passthrough(&self, ctx: &mut Ctx, body: bytes::Bytes) -> Result<(), ApiError> {
        let cfg = &ctx.generation.config;
        if let (Some(caller), Some(acl)) = (&ctx.quota.caller, &cfg.access) {
            if let Some(key) = acl.keys.get(caller.index) {
                let model = super::passthrough::model_of(&body);
                // A key held to some models may not reach the engine's default one.
                access::check_model(key, model.as_deref().unwrap_or(""))?;
                let tokens = super::passthrough::estimated_tokens(&body);
                ctx.quota.charged_tokens = self.charge_key(caller, key, tokens)?;
            }
        }
        ctx.route.body = Some(body);
        Ok(())
    }

    /// Every eligible (healthy, untried) backend of the request's model is at its hard cap.
    pub fn saturated(&self, ctx: &Ctx) -> bool {
        let cfg = &ctx.generation.config;
        let cap = cfg.limits.backend_max_inflight;
        let fleet = &ctx.generation.fleet;
        let pool = ctx.route.pool.as_ref();
        let now = Instant::now();
        // Checked before every placement: health and in-flight counts only, not the whole
        // load snapshot placement builds.
        let eligible = fleet
            .backends()
            .iter()
            .enumerate()
            .filter(|(i, _)| pool.is_none_or(|p| p.local(*i).is_some()))
            .filter(|(i, _)| !ctx.attempts.tried.contains(i) && fleet.available(*i, now))
            .filter(|(i, _)| decodes(cfg, *i))
            .peekable();
        // With SGLang a decode server takes a request only with a prefill server beside it:
        // while every prefill server is busy, the decode servers are as good as full.
        let room = prefill_room(ctx);
        let usable = |i: usize| whole_ok(cfg, i) || room != Room::None;
        let mut eligible = eligible.filter(|(i, _)| usable(*i)).peekable();
        eligible.peek().is_some()
            && eligible.all(|(i, b)| {
                b.inflight() >= cap * b.weight as u64 || (!whole_ok(cfg, i) && room == Room::Full)
            })
    }

    /// Seconds the request would wait in the router queue with `ahead` waiters before it.
    pub fn router_wait_s(&self, ctx: &Ctx, ahead: usize) -> f64 {
        let fleet = &ctx.generation.fleet;
        let pool = ctx.route.pool.as_ref();
        let now = Instant::now();
        let eligible: Vec<usize> = (0..fleet.backends().len())
            .filter(|&i| pool.is_none_or(|p| p.local(i).is_some()))
            .filter(|&i| !ctx.attempts.tried.contains(&i) && fleet.available(i, now))
            .filter(|&i| decodes(&ctx.generation.config, i))
            .collect();
        let cap = ctx.generation.config.limits.backend_max_inflight;
        fleet.router_wait_s(&eligible, cap, ahead)
    }

    /// Wait in the router queue while every eligible backend is at its hard cap.
    pub async fn queue_for_capacity(&self, ctx: &Ctx) -> Result<(), ApiError> {
        let _waiting = Waiting::new(
            self.metrics
                .queued_by_model
                .with_label_values(&[ctx.model_label()]),
        );
        self.edge
            .queue
            .wait_for_capacity(
                &ctx.generation.config.limits,
                ctx.generation.config.tenants.band(ctx.route.priority),
                super::tenant::who(ctx),
                ctx.start,
                || self.saturated(ctx),
            )
            .await
    }
}

/// Believe that backend `i` now holds the request's prompt (kv_aware's index).
pub(super) fn record_blocks(ctx: &Ctx, i: usize) {
    if let Some(p) = ctx.route.profile.as_ref() {
        let token_blocks = ctx.route.exact.as_ref().map_or(&[][..], |e| &e.blocks);
        ctx.generation
            .fleet
            .record(i, &p.prefix_blocks, token_blocks, ctx.route.dp_rank);
    }
}

/// Backend `i` decodes: serves requests whole or after another's prefill (`backends[].role`
/// other than `prefill`).
fn decodes(cfg: &crate::config::Config, i: usize) -> bool {
    cfg.backends.get(i).is_none_or(|b| b.role.decodes())
}

/// Backend `i` may be sent a request whole, unsplit (its role, as its engine's protocol
/// allows).
fn whole_ok(cfg: &crate::config::Config, i: usize) -> bool {
    let role = cfg.backends.get(i).map_or(Role::Both, |b| b.role);
    cfg.disaggregation
        .as_ref()
        .is_none_or(|d| d.protocol.serves_whole(role))
}

/// What the prefill servers leave a request's split.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Room {
    /// One that has not failed it is healthy and below its hard cap.
    Free,
    /// Some are healthy, all at their cap.
    Full,
    /// None is healthy (or each has failed it).
    None,
}

fn prefill_room(ctx: &Ctx) -> Room {
    let cfg = &ctx.generation.config;
    if cfg.disaggregation.is_none() {
        return Room::None;
    }
    let fleet = &ctx.generation.fleet;
    let cap = cfg.limits.backend_max_inflight;
    let pool = ctx.route.pool.as_ref();
    let now = Instant::now();
    let mut room = Room::None;
    for (i, b) in fleet.backends().iter().enumerate() {
        let prefills = cfg.backends.get(i).is_some_and(|c| c.role.prefills());
        if !prefills
            || pool.is_some_and(|p| p.local(i).is_none())
            || ctx.attempts.tried.contains(&i)
            || ctx.pd.failed.contains(&i)
            || !fleet.available(i, now)
        {
            continue;
        }
        if b.inflight() < cap * b.weight as u64 {
            return Room::Free;
        }
        room = Room::Full;
    }
    room
}

/// The backends a request may not be placed on: those that failed it, prefill servers, and
/// servers that take no request whole unless it can be split (`split_ok`).
fn excluded<'a>(
    cfg: &crate::config::Config,
    tried: &'a [usize],
    split_ok: bool,
) -> std::borrow::Cow<'a, [usize]> {
    if cfg.disaggregation.is_none() {
        return std::borrow::Cow::Borrowed(tried);
    }
    let mut out = tried.to_vec();
    out.extend(
        (0..cfg.backends.len()).filter(|&i| !decodes(cfg, i) || !(split_ok || whole_ok(cfg, i))),
    );
    std::borrow::Cow::Owned(out)
}
