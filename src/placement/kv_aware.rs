//! The `kv_aware` placement: consistent hashing with bounded loads, the bound measured in
//! work, and among the admissible candidates the lowest estimated time to first token.
//!
//! For a request with `P` estimated prompt tokens and backend `b` holding `m(b)` of its prefix
//! blocks (`B` tokens each) per the prefix index:
//!
//! ```text
//! uncached(b) = max(0, P - m(b) * B)
//! work(b)     = inflight(b) + queued_prefill(b) / U          (U = work_unit_tokens)
//! saved(b)    = min(m(b) * B, P) / U                         (work its cache saves the fleet)
//! cost(b)     = 1 + uncached(b) / U                          (this request, in work units)
//! admissible  = healthy, untried, and
//!               work(b) < ceil((1 + epsilon) * (W + cost(b)) * w(b) / sum w) + slack + saved(b)
//! dup(b)      = min(P, max_c m(c) * B) - min(P, m(b) * B)    (a prefix held elsewhere, recomputed)
//! backlog(b)  = max(queued_prefill(b) * spread(b) / prefill_rate(b), slot_wait(b))
//! est_ttft(b) = backlog(b) + uncached(b) / prefill_rate(b) + step(b) + adapter(b)
//! score(b)    = est_ttft(b) + decode_stall_weight * decoding(b) * uncached(b) / prefill_rate(b)
//!               + duplicate_prefill_weight * dup(b) / prefill_rate(b)
//!               - [b is the conversation's home] * credit * min_prefix_saving_tokens / prefill_rate(b)
//! ```
//!
//! `step(b)` is the engine step time the backend's decode gaps show (0 until known): even a
//! fully cached prompt waits for one step, and a backend with a heavy decode batch has slow
//! ones. `slot_wait(b)` is how long a request past the engine's running batch (llama.cpp's
//! slots) waits for one of the requests there to finish; `spread(b)` how far its rate may be
//! off (see [`BackendLoad::prefill_spread`]).
//!
//! The home's credit (the key's owner, or with `balance_new_conversations` the backend holding
//! the history) is the future value of affinity: a conversation's later turns follow it
//! wherever it goes, so a move must be worth it (`credit` 1). A first turn has nothing to
//! move: with one replica, the owner keeps its credit for one only while it could start it at
//! once, so a new conversation does not wait behind another's prefill while a backend idles,
//! and, where it would compute again a longer prefix cached elsewhere, only as far as
//! conversations on recent traffic have later turns (`credit` = later turns per conversation,
//! at most 1; see `fleet::turns`).
//!
//! An invariant holds over every choice: a request is never sent where it waits for a slot
//! while another admissible backend has one free and would answer it sooner (its cached
//! prefix saving more than the wait costs is the only reason to queue).
//!
//! With `replicas` > 1, other kvroutes route the same conversations and share no state: a
//! turn this one places off the key's owner is one they never see, so they send the next turns
//! to the owner, which then computes this prompt as well. A new conversation (no history, no
//! prefix cached anywhere) therefore stays with an admissible owner, whatever the scores.
//!
//! `W` is the eligible fleet's work. As in the unit-request rule (`load + 1 <= bound`), a
//! backend below its bound may take the request whatever its size: a request heavier than a
//! fair share must still fit somewhere.
//!
//! A miss costs more than its own TTFT: the copy of the prefix is work the other requests on
//! that backend then wait behind, and it splits the group's later requests between two
//! holders. `dup` prices that in the score. In the bound, a backend may carry more than its
//! share by the work its cache saves the fleet (`saved`): spilling a request off it costs
//! that much more work elsewhere. Without it, the second request of a group spills off the
//! backend still computing the group's prefix (that prefill counts as its work) and computes
//! the prefix again elsewhere, and a popular group's holder sheds hits to misses. The credit
//! is at most the prompt, so the request count in `work` still bounds a hot prefix.
//!
//! Candidates, in ring order from the session key: the first `candidates` admissible ring
//! positions, plus every admissible backend whose match is at least half the best match and
//! saves at least `min_prefix_saving_tokens` over the owner's match; a
//! heavy request (uncached prefill above `heavy_prefill_tokens` even on the best match) may go
//! to any admissible backend. The lowest score wins; ties go to ring order, so the decision is
//! deterministic. When no backend is admissible (cannot happen with this bound), the least
//! loaded eligible backend takes it.
//!
//! With `balance_new_conversations` (one replica), a new conversation shorter than a work
//! unit that needs no adapter loaded goes to the admissible backend with the least work per
//! unit of weight, each backend's work weighed by its learned decode step (a slower engine's
//! streams take longer): nothing is cached for it anywhere, so load alone tells the backends
//! apart (a longer prompt's stall on the streams decoding beside it is the cost model's to
//! price).
//! A later turn's home, which takes the owner's place in the affinity credit and is always a
//! candidate, is then the backend holding the longest match when that covers the turn's
//! history.

use super::decision::{Decision, Params, Reason};
use super::least_load;
use super::ring::capacity;
use super::snapshot::{BackendLoad, Snapshot};
use crate::request::RequestProfile;

/// The terms behind one backend's score, for the debug log and tests.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Terms {
    pub backend: usize,
    pub matched_tokens: u64,
    pub uncached: u64,
    /// The backend's work before this request.
    pub work: f64,
    /// Work the backend's cached prefix saves the fleet: headroom over the bound.
    pub saved: f64,
    pub bound: u64,
    pub est_ttft_s: f64,
    pub score: f64,
}

/// Seconds before a request's own prefill can start on `b`: the prefill queued there, priced
/// at the pessimistic end of its rate's spread, or the wait for a free slot, the longer.
pub fn backlog_s(b: &BackendLoad) -> f64 {
    let rate = b.prefill_rate.max(1.0);
    (b.queued_prefill as f64 * b.prefill_spread.max(1.0) / rate).max(b.slot_wait_s)
}

/// Estimated time to first token on `b` for a request with `uncached` prompt tokens there.
pub fn est_ttft_s(b: &BackendLoad, uncached: u64) -> f64 {
    backlog_s(b) + uncached as f64 / b.prefill_rate.max(1.0) + b.decode_step_s + b.adapter_load_s
}

#[inline]
pub(super) fn choose(
    params: &Params,
    profile: &RequestProfile,
    snap: &Snapshot,
    eligible: &dyn Fn(usize) -> bool,
    ticket: u64,
) -> Option<Decision> {
    let n = snap.backends.len();
    let unit = params.work_unit_tokens.max(1) as f64;
    let matched = |i: usize| snap.matched.get(i).copied().unwrap_or(0);
    // Fresh engine telemetry counts requests other routers sent there too.
    let work = |i: usize| {
        let b = &snap.backends[i];
        b.inflight.max(b.engine_load.unwrap_or(0)) as f64 + b.queued_prefill as f64 / unit
    };
    let (mut total_work, mut total_weight) = (0.0f64, 0u64);
    let mut best_match = 0u64;
    let mut adapter_missing = false;
    for i in (0..n).filter(|&i| eligible(i)) {
        total_work += work(i);
        total_weight += snap.backends[i].weight as u64;
        best_match = best_match.max(matched(i));
        adapter_missing |= snap.backends[i].adapter_load_s > 0.0;
    }
    let prompt = profile.est_prompt_tokens;
    let history_elsewhere = best_match == 0 && profile.has_history;
    let new_conversation = best_match == 0 && !profile.has_history;
    let heavy = prompt.saturating_sub(best_match) > params.heavy_prefill_tokens;
    // Leaving the key's owner for a cached prefix must save real prefill: otherwise every
    // conversation that shares a short system prompt would follow its first holder.
    let owner_match = snap
        .ring
        .walk(profile.session_key, 1)
        .next()
        .filter(|&o| eligible(o))
        .map_or(0, matched);

    let terms = |i: usize| {
        let b = &snap.backends[i];
        let m = matched(i).min(prompt);
        let uncached = prompt - m;
        let cost = 1.0 + uncached as f64 / unit;
        let bound = capacity(
            (total_work + cost - 1.0).ceil() as u64,
            b.weight,
            total_weight,
            params.epsilon,
            params.slack,
        );
        let rate = b.prefill_rate.max(1.0);
        let prefill_s = uncached as f64 / rate;
        let est_ttft_s = est_ttft_s(b, uncached);
        let dup = best_match.min(prompt).saturating_sub(m) as f64 / rate;
        Terms {
            backend: i,
            matched_tokens: m,
            uncached,
            work: work(i),
            saved: m as f64 / unit,
            bound,
            est_ttft_s,
            score: est_ttft_s
                + params.decode_stall_weight * b.decoding as f64 * prefill_s
                + params.duplicate_prefill_weight * dup,
        }
    };

    // Nothing anywhere is worth going to and its prefill costs the same everywhere: only load
    // tells the backends apart. Its key's owner would leave the fleet's conversations spread
    // as unevenly as their hashes and their lengths, and every stream decodes as slowly as its
    // backend's batch. A prompt of a work unit or more stays with the cost model: its prefill
    // stalls the streams decoding where it lands, which load alone does not see.
    let balancing = params.balance_new_conversations && params.replicas <= 1;
    let balance = balancing
        && new_conversation
        && prompt < params.work_unit_tokens
        && !heavy
        && !adapter_missing;
    // Work counts streams; a stream on a backend whose decode step is twice as long takes twice
    // as long, so each backend's work with this request is weighed by its learned step (a
    // backend not yet heard from counts as the median of the known steps; none known: all
    // alike). Alike engines learn steps within a few percent of each other, so there it only
    // breaks near-ties.
    let step =
        |i: usize| Some(snap.backends[i].decode_step_s).filter(|s| s.is_finite() && *s > 0.0);
    let typical_step = if balance {
        let mut steps: Vec<f64> = (0..n).filter(|&i| eligible(i)).filter_map(step).collect();
        steps.sort_by(f64::total_cmp);
        steps.get(steps.len() / 2).copied().unwrap_or(1.0)
    } else {
        1.0
    };
    let pace = |i: usize| step(i).map_or(1.0, |s| s / typical_step);
    let per_weight =
        |i: usize| (work(i) + 1.0) * pace(i) / f64::from(snap.backends[i].weight.max(1));
    // Balanced, a conversation lives where its first turn went, not at its key's owner: its
    // home is the backend holding the longest match when that covers its whole history (a
    // shared system prompt alone does not; a history shorter than a block is covered by the
    // blocks of its reply), and the affinity credit and a candidate's place go there.
    let history_tokens = profile.history_blocks as u64 * params.block_tokens;
    let home = (balancing && profile.has_history && best_match > 0 && best_match >= history_tokens)
        .then(|| {
            snap.ring
                .walk(profile.session_key, n)
                .find(|&i| eligible(i) && matched(i) == best_match)
        })
        .flatten();
    // A backend whose KV cache is nearly full would evict or preempt: a last resort.
    let scan = |allow_full: bool| {
        let mut best: Option<Terms> = None;
        let mut owner = None;
        let mut owner_admissible = false;
        let mut ring_taken = 0usize;
        for (rank, i) in snap.ring.walk(profile.session_key, n).enumerate() {
            if rank == 0 {
                owner = Some(i);
            }
            if !eligible(i) {
                continue;
            }
            let full = snap.backends[i]
                .kv_usage
                .is_some_and(|u| u > params.kv_usage_ceiling);
            let mut t = terms(i);
            if t.work >= t.bound as f64 + t.saved || (full && !allow_full) {
                continue;
            }
            if balance {
                if rank == 0 {
                    owner_admissible = true;
                }
                if best.is_none_or(|b| per_weight(i) < per_weight(b.backend)) {
                    best = Some(t);
                }
                continue;
            }
            if rank == 0 {
                owner_admissible = true;
            }
            if home.map_or(rank == 0, |h| h == i) {
                // Affinity has future value (the conversation's next turns): another backend
                // must beat the owner by the prefill of `min_prefix_saving_tokens`. A first
                // turn has no turns to keep together yet: with one replica it earns the credit
                // only where it starts at once, against the noise of learned rates and so
                // that conversations sharing a short system prompt still spread. Waiting
                // behind another prefill it does not earn: two cold prefills sharing one
                // engine each take twice as long while another backend idles.
                //
                // Nor, where a longer prefix is cached elsewhere, is a first turn's credit worth
                // more than the later turns that follow it: traffic of single questions sharing
                // a system prompt brings none, and the credit would only send each away from
                // the backend holding that prompt to compute it again. With nothing to compute
                // again it costs nothing, and keeps new conversations spread by their keys
                // against the noise of learned rates.
                let b = &snap.backends[i];
                let copies = t.matched_tokens < best_match.min(prompt);
                let credit = if profile.has_history || params.replicas > 1 {
                    1.0
                } else if backlog_s(b) > 0.0 {
                    0.0
                } else if copies {
                    snap.later_turns.clamp(0.0, 1.0)
                } else {
                    1.0
                };
                t.score -=
                    credit * params.min_prefix_saving_tokens as f64 / b.prefill_rate.max(1.0);
                // A new conversation the owner can take stays there when other replicas
                // route its next turns: they cannot see a placement elsewhere and bring it
                // back to the owner, which then computes this prompt again.
                if params.replicas > 1 && new_conversation {
                    return (Some(t), owner, true);
                }
                // A conversation with history but no holder known was placed by another
                // replica (or before a restart), most likely at its owner: priced as if cached
                // there.
                if history_elsewhere {
                    t.score -= t.uncached as f64 / b.prefill_rate.max(1.0);
                }
            }
            let long_match = best_match > 0
                && t.matched_tokens * 2 >= best_match
                && t.matched_tokens >= owner_match + params.min_prefix_saving_tokens;
            let in_ring_window = ring_taken < params.candidates || Some(i) == home;
            ring_taken += 1;
            // A LoRA adapter's request may go wherever its adapter is loaded: otherwise every
            // new conversation would load it on its own key's owners.
            let adapter_loaded = adapter_missing && snap.backends[i].adapter_load_s == 0.0;
            if !(in_ring_window || long_match || heavy || adapter_loaded) {
                continue;
            }
            if best.is_none_or(|b| t.score < b.score) {
                best = Some(t);
            }
        }
        (best, owner, owner_admissible)
    };
    let (best, owner, owner_admissible) = match scan(false) {
        (None, ..) => scan(true),
        found => found,
    };
    let Some(t) = best else {
        return least_load::choose(snap, eligible, ticket, Reason::Fallback);
    };
    // Never queue for a slot while an admissible backend with a free one answers sooner.
    let t = if snap.backends[t.backend].slot_wait_s > 0.0 {
        (0..n)
            .filter(|&i| i != t.backend && eligible(i) && snap.backends[i].slot_wait_s == 0.0)
            .filter(|&i| {
                !snap.backends[i]
                    .kv_usage
                    .is_some_and(|u| u > params.kv_usage_ceiling)
            })
            .map(terms)
            .filter(|o| o.work < o.bound as f64 + o.saved && o.est_ttft_s < t.est_ttft_s)
            .min_by(|a, b| a.score.total_cmp(&b.score))
            .unwrap_or(t)
    } else {
        t
    };
    let reason = match owner {
        Some(o) if o == t.backend => Reason::Affinity,
        _ if t.matched_tokens > 0 && t.matched_tokens == best_match.min(prompt) => {
            Reason::CachedPrefix
        }
        Some(o) if !eligible(o) => Reason::Failover,
        _ if !owner_admissible => Reason::Spill,
        _ if balance => Reason::LeastLoad,
        _ => Reason::LeastCost,
    };
    log::debug!(
        "kv_aware key={:016x} prompt={} best_match={} heavy={} -> {:?} reason={}",
        profile.session_key,
        prompt,
        best_match,
        heavy,
        t,
        reason.as_str()
    );
    Some(Decision {
        backend: t.backend,
        reason,
        bound: Some(t.bound),
        load: snap.backends[t.backend].inflight,
        predicted_cached_tokens: t.matched_tokens,
        est_ttft_s: t.est_ttft_s,
    })
}

#[cfg(test)]
#[path = "kv_aware_tests.rs"]
mod tests;
