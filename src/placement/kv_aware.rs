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
//! est_ttft(b) = (queued_prefill(b) + uncached(b)) / prefill_rate(b) + step(b) + adapter(b)
//! score(b)    = est_ttft(b) + decode_stall_weight * decoding(b) * uncached(b) / prefill_rate(b)
//!               + duplicate_prefill_weight * dup(b) / prefill_rate(b)
//!               - [b is the key's owner] * min_prefix_saving_tokens / prefill_rate(b)
//! ```
//!
//! `step(b)` is the engine step time the backend's decode gaps show (0 until known): even a
//! fully cached prompt waits for one step, and a backend with a heavy decode batch has slow
//! ones.
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
use super::snapshot::Snapshot;
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
        let est_ttft_s =
            b.queued_prefill as f64 / rate + prefill_s + b.decode_step_s + b.adapter_load_s;
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
                // must beat the owner by the prefill of `min_prefix_saving_tokens`.
                let rate = snap.backends[i].prefill_rate.max(1.0);
                t.score -= params.min_prefix_saving_tokens as f64 / rate;
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
                    t.score -= t.uncached as f64 / rate;
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
mod tests {
    use super::*;
    use crate::placement::Ring;
    use crate::placement::{choose as policy_choose, BackendLoad, PolicyKind};
    use crate::request::{Endpoint, SessionSource};
    use proptest::prelude::*;
    use std::net::SocketAddr;

    fn ring(n: usize) -> Ring {
        let v: Vec<(SocketAddr, u32)> = (0..n)
            .map(|i| (SocketAddr::from(([127, 0, 0, 1], 9100 + i as u16)), 1))
            .collect();
        Ring::new(&v)
    }

    fn req(key: u64, prompt: u64) -> RequestProfile {
        RequestProfile {
            endpoint: Endpoint::Chat,
            model: "m".into(),
            stream: true,
            include_usage: false,
            has_stream_options: false,
            session_key: key,
            session_source: SessionSource::Content,
            has_history: false,
            history_blocks: 0,
            prefix_blocks: vec![],
            tail: None,
            prompt_bytes: prompt as usize * 4,
            est_prompt_tokens: prompt,
            est_output_tokens: 100,
            cache_salt: None,
        }
    }

    fn params() -> Params {
        Params::new(PolicyKind::KvAware, 0.5, 1)
    }

    /// `matched`: blocks of the approximate index's size.
    fn pick(loads: &[BackendLoad], r: &Ring, matched: &[u32], p: &RequestProfile) -> Decision {
        let tokens: Vec<u64> = matched
            .iter()
            .map(|&m| m as u64 * params().block_tokens)
            .collect();
        decide(&params(), loads, r, &tokens, p)
    }

    /// The decision under `params`; `matched`: tokens.
    fn decide(
        params: &Params,
        loads: &[BackendLoad],
        r: &Ring,
        matched: &[u64],
        p: &RequestProfile,
    ) -> Decision {
        let snap = Snapshot {
            backends: loads,
            ring: r,
            matched,
        };
        policy_choose(params, p, &snap, &[], 0).unwrap()
    }

    #[test]
    fn idle_fleet_without_matches_goes_to_the_owner() {
        let r = ring(4);
        let loads = vec![BackendLoad::idle(); 4];
        for key in 0..50 {
            let d = pick(&loads, &r, &[0; 4], &req(key, 1000));
            assert_eq!(d.backend, r.walk(key, 1).next().unwrap());
            assert_eq!(d.reason, Reason::Affinity);
        }
    }

    #[test]
    fn balanced_new_conversations_go_to_the_least_work_per_weight() {
        let r = ring(4);
        let key = 13;
        let order: Vec<usize> = r.walk(key, 4).collect();
        let mut loads = vec![BackendLoad::idle(); 4];
        let one = |loads: &[BackendLoad], p: &RequestProfile, balance: bool, replicas: u32| {
            let params = Params {
                balance_new_conversations: balance,
                replicas,
                ..params()
            };
            decide(&params, loads, &r, &[], p)
        };
        let new = req(key, 1_000);
        // An idle fleet: ties go to ring order, so the owner.
        let d = one(&loads, &new, true, 1);
        assert_eq!((d.backend, d.reason), (order[0], Reason::Affinity));
        // The last ring position has the least work per unit of weight: past the candidates'
        // ring window, it is still the one chosen.
        for (rank, &i) in order.iter().enumerate() {
            loads[i].inflight = [3, 3, 2, 1][rank];
        }
        loads[order[2]].weight = 2;
        let d = one(&loads, &new, true, 1);
        assert_eq!((d.backend, d.reason), (order[2], Reason::LeastLoad));
        assert_eq!(one(&loads, &new, false, 1).backend, order[0]);
        // Not for a turn with history, a prompt of a work unit or more (its stall is priced),
        // or several replicas.
        let later = RequestProfile {
            has_history: true,
            ..req(key, 1_000)
        };
        assert_eq!(one(&loads, &later, true, 1).backend, order[0]);
        assert_eq!(one(&loads, &new, true, 2).backend, order[0]);
        for tokens in [4_096, 20_000] {
            let d = one(&loads, &req(key, tokens), true, 1);
            assert_ne!(d.reason, Reason::LeastLoad, "{tokens} tokens");
        }
    }

    #[test]
    fn balanced_new_conversations_weigh_work_by_the_decode_step() {
        let r = ring(4);
        let key = 13;
        let order: Vec<usize> = r.walk(key, 4).collect();
        let params = Params {
            balance_new_conversations: true,
            ..params()
        };
        let pick = |loads: &[BackendLoad]| decide(&params, loads, &r, &[], &req(key, 1_000));
        // Two fast engines (7 ms a step) and two at twice the step. With this stream, the owner
        // (slow, 3 streams) has 4 x 2 and the fast one with 5 streams 6 x 1: the fast one,
        // though it holds more streams.
        let mut loads = vec![BackendLoad::idle(); 4];
        for (rank, &i) in order.iter().enumerate() {
            loads[i].decode_step_s = [0.014, 0.014, 0.007, 0.007][rank];
            loads[i].inflight = [3, 3, 5, 6][rank];
        }
        let d = pick(&loads);
        assert_eq!((d.backend, d.reason), (order[2], Reason::LeastLoad));
        // With 8 streams on each fast engine, the slow owner is better (9 x 1 against 4 x 2).
        loads[order[2]].inflight = 8;
        loads[order[3]].inflight = 8;
        assert_eq!(pick(&loads).backend, order[0]);
        // A backend with no step learned yet counts as the median of the known ones (7 ms:
        // 14, 7 and 7 are known), so its 2 streams win: 3 x 1 against 4 x 2 and 9 x 1.
        loads[order[1]].decode_step_s = 0.0;
        loads[order[1]].inflight = 2;
        loads[order[3]].decode_step_s = 0.007;
        assert_eq!(pick(&loads).backend, order[1]);
        // None learned: streams alone, as before.
        for l in loads.iter_mut() {
            l.decode_step_s = 0.0;
        }
        assert_eq!(pick(&loads).backend, order[1]);
        // A step that is not a number is not learned.
        loads[order[1]].decode_step_s = f64::NAN;
        assert_eq!(pick(&loads).backend, order[1]);
    }

    #[test]
    fn balanced_conversations_return_to_the_backend_holding_their_history() {
        let r = ring(4);
        let key = 17;
        let order: Vec<usize> = r.walk(key, 4).collect();
        let loads = vec![BackendLoad::idle(); 4];
        // The first turn went to the last ring position; its 4 blocks (256 tokens, short of
        // min_prefix_saving_tokens) are all this turn's history.
        let turn = RequestProfile {
            has_history: true,
            history_blocks: 4,
            ..req(key, 600)
        };
        let block = params().block_tokens;
        let mut matched = vec![0u64; 4];
        matched[order[3]] = 5 * block;
        let one = |matched: &[u64], p: &RequestProfile, balance: bool| {
            let params = Params {
                balance_new_conversations: balance,
                ..params()
            };
            decide(&params, &loads, &r, matched, p)
        };
        let d = one(&matched, &turn, true);
        assert_eq!((d.backend, d.reason), (order[3], Reason::CachedPrefix));
        // Unbalanced, the owner keeps it: the saving is short of the affinity credit.
        assert_eq!(one(&matched, &turn, false).backend, order[0]);
        // A backend holding only part of the history (a shared system prompt) is no home.
        matched[order[3]] = 2 * block;
        assert_eq!(one(&matched, &turn, true).backend, order[0]);
        // A first prompt shorter than a block: the reply's blocks show the home.
        let short = RequestProfile {
            history_blocks: 0,
            ..turn.clone()
        };
        let d = one(&matched, &short, true);
        assert_eq!((d.backend, d.reason), (order[3], Reason::CachedPrefix));
    }

    #[test]
    fn replicas_keep_a_new_conversation_on_its_owner_unless_it_is_over_its_bound() {
        let r = ring(4);
        let key = 5;
        let order: Vec<usize> = r.walk(key, 4).collect();
        let mut loads = vec![BackendLoad::idle(); 4];
        // The owner has a third of a second of prefill queued, yet is under its bound.
        loads[order[0]].queued_prefill = 8_000;
        let one = |loads: &[BackendLoad], matched: &[u64], p: &RequestProfile, replicas: u32| {
            let snap = Snapshot {
                backends: loads,
                ring: &r,
                matched,
            };
            let params = Params {
                replicas,
                ..params()
            };
            policy_choose(&params, p, &snap, &[], 0).unwrap()
        };
        let new = req(key, 2_000);
        let alone = one(&loads, &[], &new, 1);
        assert_eq!(alone.reason, Reason::LeastCost);
        assert_ne!(alone.backend, order[0]);
        let d = one(&loads, &[], &new, 2);
        assert_eq!((d.backend, d.reason), (order[0], Reason::Affinity));
        // A prefix cached elsewhere, or a history, is priced as before.
        let mut matched = vec![0u64; 4];
        matched[order[3]] = 1_920;
        let d = one(&loads, &matched, &new, 2);
        assert_eq!((d.backend, d.reason), (order[3], Reason::CachedPrefix));
        let later = RequestProfile {
            has_history: true,
            ..req(key, 2_000)
        };
        let (two, alone) = (one(&loads, &[], &later, 2), one(&loads, &[], &later, 1));
        assert_eq!((two.backend, two.reason), (alone.backend, alone.reason));
        // Over its bound the owner sheds a new conversation all the same.
        loads[order[0]].inflight = 50;
        for replicas in [1, 2] {
            let d = one(&loads, &[], &new, replicas);
            assert_eq!(d.reason, Reason::Spill);
            assert_ne!(d.backend, order[0]);
        }
    }

    #[test]
    fn cached_prefix_found_off_the_ring_owner() {
        let r = ring(4);
        let key = 11;
        let order: Vec<usize> = r.walk(key, 4).collect();
        let loads = vec![BackendLoad::idle(); 4];
        let holder = order[3]; // last on the ring, outside the candidate window
        let mut matched = [0u32; 4];
        matched[holder] = 150; // 9,600 of 10,000 tokens
        let d = pick(&loads, &r, &matched, &req(key, 10_000));
        assert_eq!((d.backend, d.reason), (holder, Reason::CachedPrefix));
        assert_eq!(d.predicted_cached_tokens, 9_600);
        assert!((d.est_ttft_s - 400.0 / 25_000.0).abs() < 1e-9);
    }

    #[test]
    fn an_adapter_goes_where_it_is_loaded_even_off_the_ring_window() {
        let r = ring(4);
        let key = 11;
        let order: Vec<usize> = r.walk(key, 4).collect();
        let mut loads = vec![BackendLoad::idle(); 4];
        for l in loads.iter_mut() {
            l.adapter_load_s = 0.2;
        }
        // Loaded only on the last ring position, outside the candidate window.
        loads[order[3]].adapter_load_s = 0.0;
        let d = pick(&loads, &r, &[0; 4], &req(key, 1000));
        assert_eq!(d.backend, order[3]);
        // Loaded nowhere: the key's owner, as for any request.
        loads[order[3]].adapter_load_s = 0.2;
        let d = pick(&loads, &r, &[0; 4], &req(key, 1000));
        assert_eq!((d.backend, d.reason), (order[0], Reason::Affinity));
    }

    #[test]
    fn history_with_no_holder_known_goes_to_the_owner_though_busier() {
        let r = ring(4);
        let key = 7;
        let order: Vec<usize> = r.walk(key, 4).collect();
        let mut loads = vec![BackendLoad::idle(); 4];
        // The owner has 0.1 s of prefill queued: a fresh 4,000-token chat (0.16 s of prefill)
        // goes to the idle second candidate...
        loads[order[0]].queued_prefill = 2_500;
        loads[order[0]].inflight = 1;
        let fresh = req(key, 4_000);
        assert_ne!(pick(&loads, &r, &[0; 4], &fresh).backend, order[0]);
        // ...but one with earlier replies that this kvroute never saw was most likely placed
        // at the owner by another replica.
        let mut later_turn = req(key, 4_000);
        later_turn.has_history = true;
        let d = pick(&loads, &r, &[0; 4], &later_turn);
        assert_eq!((d.backend, d.reason), (order[0], Reason::Affinity));
        // Where this kvroute knows a holder, that knowledge wins as before.
        let mut matched = [0u32; 4];
        matched[order[1]] = 40;
        assert_eq!(pick(&loads, &r, &matched, &later_turn).backend, order[1]);
    }

    #[test]
    fn queued_prefill_outweighs_a_short_match() {
        let r = ring(3);
        let key = 5;
        let order: Vec<usize> = r.walk(key, 3).collect();
        let mut loads = vec![BackendLoad::idle(); 3];
        // The owner holds 640 tokens of this prompt but has 2 s of prefill queued.
        loads[order[0]].queued_prefill = 50_000;
        loads[order[0]].inflight = 2;
        let mut matched = [0u32; 3];
        matched[order[0]] = 10;
        let d = pick(&loads, &r, &matched, &req(key, 2_000));
        assert_ne!(d.backend, order[0]);
        assert_eq!(d.reason, Reason::Spill);
    }

    #[test]
    fn a_group_waits_for_the_prefix_its_owner_is_computing() {
        let r = ring(4);
        let key = 17;
        let order: Vec<usize> = r.walk(key, 4).collect();
        let mut loads = vec![BackendLoad::idle(); 4];
        // The group's first request is still prefilling its 8k-token prefix on the owner:
        // counted as work, the owner is over its bound (4 >= 3), but that prefix is work the
        // request saves the fleet (2 units).
        loads[order[0]].inflight = 2;
        loads[order[0]].queued_prefill = 8_192;
        let mut matched = [0u32; 4];
        matched[order[0]] = 128;
        let d = pick(&loads, &r, &matched, &req(key, 8_300));
        assert_eq!((d.backend, d.reason), (order[0], Reason::Affinity));
        assert_eq!(d.predicted_cached_tokens, 8_192);
    }

    #[test]
    fn a_popular_holder_keeps_its_hits_a_little_past_the_bound() {
        let r = ring(4);
        let key = 29;
        let order: Vec<usize> = r.walk(key, 4).collect();
        let mut loads = vec![BackendLoad::idle(); 4];
        for l in loads.iter_mut() {
            l.inflight = 1;
        }
        loads[order[0]].inflight = 7;
        let mut matched = [0u32; 4];
        matched[order[0]] = 128;
        // Over its bound by 1, within the 2 units its 8k-token prefix saves.
        let d = pick(&loads, &r, &matched, &req(key, 8_300));
        assert_eq!((d.backend, d.reason), (order[0], Reason::Affinity));
        assert_eq!(d.bound, Some(6));
        // A short match earns little headroom: the same load spills.
        matched[order[0]] = 16;
        let d = pick(&loads, &r, &matched, &req(key, 8_300));
        assert_eq!(d.reason, Reason::Spill);
    }

    #[test]
    fn a_copy_of_a_held_prefix_is_priced_for_the_fleet() {
        let r = ring(4);
        let key = 23;
        let order: Vec<usize> = r.walk(key, 4).collect();
        let mut loads = vec![BackendLoad::idle(); 4];
        let holder = order[1];
        let mut matched = [0u32; 4];
        matched[holder] = 128;
        // The holder has as much queued as the miss would cost the idle owner: this request
        // alone would not care, but the copy is 8k tokens of work for the owner's next ones.
        loads[holder].inflight = 1;
        loads[holder].queued_prefill = 8_192;
        let d = pick(&loads, &r, &matched, &req(key, 8_300));
        assert_eq!((d.backend, d.reason), (holder, Reason::CachedPrefix));
        // Far busier, it loses after all.
        loads[holder].queued_prefill = 40_000;
        loads[holder].inflight = 5;
        let d = pick(&loads, &r, &matched, &req(key, 8_300));
        assert_eq!(d.backend, order[0]);
    }

    #[test]
    fn heavy_request_avoids_a_busy_decoder() {
        let r = ring(3);
        let key = 9;
        let order: Vec<usize> = r.walk(key, 3).collect();
        let mut loads = vec![BackendLoad::idle(); 3];
        loads[order[0]].decoding = 60;
        loads[order[0]].inflight = 1;
        for l in loads.iter_mut() {
            l.inflight = l.inflight.max(1);
        }
        let d = pick(&loads, &r, &[0; 3], &req(key, 30_000));
        assert_ne!(
            d.backend, order[0],
            "a 30k-token prefill should not stall 60 streams"
        );
        assert_eq!(d.reason, Reason::LeastCost);
    }

    #[test]
    fn full_kv_cache_is_a_last_resort() {
        let r = ring(2);
        let key = 21;
        let order: Vec<usize> = r.walk(key, 2).collect();
        let mut loads = vec![BackendLoad::idle(); 2];
        loads[order[0]].kv_usage = Some(0.97);
        let d = pick(&loads, &r, &[0; 2], &req(key, 100));
        assert_eq!(d.backend, order[1]);
        loads[order[1]].kv_usage = Some(0.99);
        let d = pick(&loads, &r, &[0; 2], &req(key, 100));
        assert_eq!(d.backend, order[0], "both full: back to ring order");
    }

    #[test]
    fn engine_reported_load_counts_in_the_bound() {
        let r = ring(3);
        let key = 8;
        let order: Vec<usize> = r.walk(key, 3).collect();
        let mut loads = vec![BackendLoad::idle(); 3];
        // Another router filled the owner: kvroute sent nothing there itself.
        loads[order[0]].engine_load = Some(40);
        let d = pick(&loads, &r, &[0; 3], &req(key, 100));
        assert_ne!(d.backend, order[0]);
    }

    #[test]
    fn tiny_request_avoids_a_queued_document() {
        let r = ring(4);
        let key = 3;
        let order: Vec<usize> = r.walk(key, 4).collect();
        let mut loads = vec![BackendLoad::idle(); 4];
        loads[order[0]].queued_prefill = 30_000;
        loads[order[0]].inflight = 1;
        let d = pick(&loads, &r, &[0; 4], &req(key, 20));
        assert_eq!(d.backend, order[1]);
        assert!(d.est_ttft_s < 0.01);
    }

    proptest! {
        /// Whatever the loads and matches, the chosen backend is eligible and under its work
        /// bound, and the same inputs give the same decision.
        #[test]
        fn admissible_and_deterministic(
            n in 2usize..9,
            key in any::<u64>(),
            prompt in 1u64..60_000,
            loads in proptest::collection::vec((0u64..20, 0u64..100_000, 0u64..50, any::<bool>()), 9),
            matched in proptest::collection::vec(0u64..64_000, 9),
        ) {
            let r = ring(n);
            let mut bl: Vec<BackendLoad> = loads[..n].iter().map(|&(inflight, q, dec, up)| BackendLoad {
                healthy: up, inflight, queued_prefill: q, decoding: dec, ..BackendLoad::idle()
            }).collect();
            bl[0].healthy = true;
            let snap = Snapshot { backends: &bl, ring: &r, matched: &matched[..n] };
            let p = req(key, prompt);
            let d = policy_choose(&params(), &p, &snap, &[], 0).unwrap();
            prop_assert!(bl[d.backend].healthy);
            prop_assert_ne!(d.reason, Reason::Fallback);
            let again = policy_choose(&params(), &p, &snap, &[], 0).unwrap();
            prop_assert_eq!(d, again);
        }
    }
}
