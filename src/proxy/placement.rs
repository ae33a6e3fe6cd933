//! Placement glue: the snapshot for the policy, recording a decision, the hard cap and the
//! router queue, and admission of a request for its caller (model, quotas).

use super::*;

impl Router {
    /// Choose a backend; `None` when none is eligible. Routed requests come back with their
    /// decision so it can be recorded once the charge succeeds.
    pub(super) fn place(
        &self,
        ctx: &mut Ctx,
        fleet: &Fleet,
    ) -> Option<(usize, Option<policy::Decision>)> {
        let Some(profile) = ctx.profile.as_ref() else {
            ctx.reason = "passthrough";
            return fleet.pick_passthrough(&ctx.tried).map(|i| (i, None));
        };
        let cfg = self.state.config();
        let mut params = cfg.routing.params();
        params.backend_max_inflight = cfg.limits.backend_max_inflight;
        let loads = fleet.loads();
        let matched = if params.policy == PolicyKind::KvAware {
            fleet.matches(&profile.prefix_blocks)
        } else {
            Vec::new()
        };
        let snap = Snapshot {
            backends: &loads,
            ring: fleet.ring(),
            matched: &matched,
        };
        let d = policy::choose(&params, profile, &snap, &ctx.tried, fleet.ticket())?;
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
            ctx.tried,
        );
        ctx.reason = d.reason.as_str();
        ctx.prefill = profile
            .est_prompt_tokens
            .saturating_sub(d.predicted_cached_tokens);
        // Only a sizeable prefill on a backend with nothing queued says much about its rate:
        // otherwise the wait is mostly other requests' work, which the estimate only guesses.
        ctx.learn_rate = cfg.routing.learn_prefill_rate
            && loads[d.backend].queued_prefill == 0
            && ctx.prefill >= MIN_LEARNING_PREFILL_TOKENS;
        Some((d.backend, Some(d)))
    }

    /// A placement went through: count it and, for kv_aware, believe the backend now holds
    /// the prompt's blocks.
    pub(super) fn record(&self, ctx: &Ctx, fleet: &Fleet, d: &policy::Decision) {
        let policy = self.state.config().routing.policy;
        self.state
            .metrics
            .decisions
            .with_label_values(&[policy.as_str(), d.reason.as_str()])
            .inc();
        if let (PolicyKind::KvAware, Some(p)) = (policy, ctx.profile.as_ref()) {
            fleet.record(d.backend, &p.prefix_blocks);
            self.state
                .metrics
                .predicted_cached
                .inc_by(d.predicted_cached_tokens);
        }
    }

    /// Serve this model for this caller? 404 for a model the fleet does not serve, 403 for one
    /// the key may not use, 429 over the key's rate limits (charged here when admitted).
    pub(super) fn admit(
        &self,
        ctx: &mut Ctx,
        cfg: &Config,
        p: &RequestProfile,
    ) -> Result<(), ApiError> {
        if !cfg.models.is_empty() && !cfg.models.contains(&p.model) {
            return Err(ApiError::model_not_found(&p.model));
        }
        let (Some(caller), Some(acl)) = (&ctx.caller, &cfg.access) else {
            return Ok(());
        };
        let Some(key) = acl.keys.get(caller.index) else {
            return Ok(());
        };
        access::check_model(key, &p.model)?;
        let tokens = p.est_prompt_tokens + p.est_output_tokens;
        self.state
            .limiter
            .admit(caller, key, tokens, Instant::now())
            .inspect_err(|_| {
                self.state
                    .metrics
                    .rate_limited
                    .with_label_values(&[&caller.tenant])
                    .inc();
            })?;
        ctx.charged_tokens = tokens;
        Ok(())
    }

    /// Every eligible (healthy, untried) backend is at its hard cap.
    pub(super) fn saturated(&self, ctx: &Ctx, fleet: &Fleet) -> bool {
        let cap = self.state.config().limits.backend_max_inflight;
        let loads = fleet.loads();
        let mut eligible = loads
            .iter()
            .enumerate()
            .filter(|(i, b)| b.healthy && !ctx.tried.contains(i))
            .peekable();
        eligible.peek().is_some() && eligible.all(|(_, b)| b.inflight >= cap * b.weight as u64)
    }

    /// Wait in the router queue while every eligible backend is at its hard cap.
    pub(super) async fn queue_for_capacity(
        &self,
        ctx: &Ctx,
        fleet: &Fleet,
    ) -> std::result::Result<(), ApiError> {
        let limits = self.state.config().limits.clone();
        self.state
            .admission
            .wait_for_capacity(
                &self.state.metrics,
                &limits,
                ctx.priority,
                ctx.start,
                || self.saturated(ctx, fleet),
            )
            .await
    }
}
