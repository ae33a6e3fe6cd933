//! kv_aware's decisions, one scenario a test, and its invariants as properties.

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
        has_handover_fields: false,
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
        previous_response_id: None,
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
        later_turns: 1.0,
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
    let with = |matched: &[u64], p: &RequestProfile, balance: bool, replicas: u32| {
        let params = Params {
            balance_new_conversations: balance,
            replicas,
            ..params()
        };
        decide(&params, &loads, &r, matched, p)
    };
    let one = |matched: &[u64], p: &RequestProfile, balance: bool| with(matched, p, balance, 1);
    let d = one(&matched, &turn, true);
    assert_eq!((d.backend, d.reason), (order[3], Reason::CachedPrefix));
    // Unbalanced, the owner keeps it: the saving is short of the affinity credit.
    assert_eq!(one(&matched, &turn, false).backend, order[0]);
    assert_eq!(with(&matched, &turn, true, 2).backend, order[0]);
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
            later_turns: 1.0,
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
        let snap = Snapshot { backends: &bl, ring: &r, matched: &matched[..n], later_turns: 1.0 };
        let p = req(key, prompt);
        let d = policy_choose(&params(), &p, &snap, &[], 0).unwrap();
        prop_assert!(bl[d.backend].healthy);
        prop_assert_ne!(d.reason, Reason::Fallback);
        let again = policy_choose(&params(), &p, &snap, &[], 0).unwrap();
        prop_assert_eq!(d, again);
    }
}

/// Two CPU engines of two slots at ~130 prompt tokens/s, as on two llama-servers.
fn cpu_fleet() -> Vec<BackendLoad> {
    let cpu = BackendLoad {
        prefill_rate: 130.0,
        decode_step_s: 0.01,
        ..BackendLoad::idle()
    };
    vec![cpu; 2]
}

#[test]
fn a_new_conversation_does_not_wait_behind_a_cold_prefill_while_a_backend_idles() {
    let r = ring(2);
    let key = 41;
    let order: Vec<usize> = r.walk(key, 2).collect();
    let mut loads = cpu_fleet();
    // The owner is computing another conversation's 850-token document (6.5 s); an idle
    // backend would answer this one's in 6.5 s, the owner only after 13.
    loads[order[0]].inflight = 1;
    loads[order[0]].queued_prefill = 850;
    let d = pick(&loads, &r, &[0; 2], &req(key, 850));
    assert_eq!((d.backend, d.reason), (order[1], Reason::LeastCost));
    // Idle, the owner keeps it whatever a rate's noise says of the other.
    let mut idle = cpu_fleet();
    idle[order[1]].prefill_rate = 160.0;
    let d = pick(&idle, &r, &[0; 2], &req(key, 850));
    assert_eq!((d.backend, d.reason), (order[0], Reason::Affinity));
    // A later turn keeps its credit at a busy owner: its history is there.
    let mut turn = req(key, 900);
    turn.has_history = true;
    let mut matched = [0u32; 2];
    matched[order[0]] = 13; // 832 of its 900 tokens
    let d = pick(&loads, &r, &matched, &turn);
    assert_eq!((d.backend, d.reason), (order[0], Reason::Affinity));
    // With other replicas routing its next turns to the owner, the owner keeps it.
    let params = Params {
        replicas: 2,
        ..params()
    };
    let d = decide(&params, &loads, &r, &[], &req(key, 850));
    assert_eq!((d.backend, d.reason), (order[0], Reason::Affinity));
}

/// Three CPU engines at 240 prompt tokens/s, and key 77's ring order over them: a group's
/// users asking questions that share its system prompt.
fn group_fleet() -> (Ring, u64, Vec<usize>, Vec<BackendLoad>) {
    let r = ring(3);
    let key = 77;
    let order: Vec<usize> = r.walk(key, 3).collect();
    let cpu = BackendLoad {
        prefill_rate: 240.0,
        ..BackendLoad::idle()
    };
    (r, key, order, vec![cpu; 3])
}

#[test]
fn a_first_turn_does_not_wait_on_its_owner_to_compute_a_prompt_its_holder_has() {
    let (r, key, order, mut loads) = group_fleet();
    // A group's 600-token system prompt is being computed on the last ring position (2.5 s
    // left); this user's first question shares it. The owner is busy with a prompt of its own
    // and would compute the group's again after it (2.6 s, and a second copy the group's next
    // users split over): no affinity credit for a first turn that would wait.
    let holder = order[2];
    loads[holder].inflight = 1;
    loads[holder].queued_prefill = 600;
    loads[order[0]].inflight = 1;
    loads[order[0]].queued_prefill = 100;
    let mut matched = [0u32; 3];
    matched[holder] = 9; // 576 tokens
    let d = pick(&loads, &r, &matched, &req(key, 630));
    assert_eq!((d.backend, d.reason), (holder, Reason::CachedPrefix));
    // A later turn of the owner's own conversation keeps its credit.
    let mut later = req(key, 630);
    later.has_history = true;
    let mut owned = matched;
    owned[order[0]] = 9;
    let d = pick(&loads, &r, &owned, &later);
    assert_eq!((d.backend, d.reason), (order[0], Reason::Affinity));
}

#[test]
fn a_single_question_stays_with_its_prompt_when_conversations_bring_no_later_turns() {
    let (r, key, order, mut loads) = group_fleet();
    // The holder of a group's 576-token prompt is prefilling another user's question (1.2
    // s); the question's owner is idle and would compute the whole 630 tokens (2.6 s).
    let holder = order[2];
    loads[holder].inflight = 1;
    loads[holder].queued_prefill = 300;
    let mut matched = [0u64; 3];
    matched[holder] = 576;
    let first = req(key, 630);
    let with = |later_turns: f64| {
        let snap = Snapshot {
            backends: &loads,
            ring: &r,
            matched: &matched,
            later_turns,
        };
        policy_choose(&params(), &first, &snap, &[], 0).unwrap()
    };
    // Conversations that come back: the owner's credit spreads them, as before.
    let d = with(1.0);
    assert_eq!((d.backend, d.reason), (order[0], Reason::Affinity));
    let d = with(3.0);
    assert_eq!(d.backend, order[0]);
    // Single questions: the copy buys no later turn, and the holder answers first.
    let d = with(0.1);
    assert_eq!((d.backend, d.reason), (holder, Reason::CachedPrefix));
    // With nothing cached anywhere, single questions still spread by their keys: the owner
    // keeps the whole credit against another backend's noisier rate.
    let mut idle = loads.clone();
    idle[holder].inflight = 0;
    idle[holder].queued_prefill = 0;
    idle[order[1]].prefill_rate = 300.0;
    let snap = Snapshot {
        backends: &idle,
        ring: &r,
        matched: &[0; 3],
        later_turns: 0.1,
    };
    let d = policy_choose(&params(), &first, &snap, &[], 0).unwrap();
    assert_eq!((d.backend, d.reason), (order[0], Reason::Affinity));
    // A later turn keeps the whole credit whatever the traffic.
    let mut later = req(key, 630);
    later.has_history = true;
    let mut owned = matched;
    owned[order[0]] = 600;
    let snap = Snapshot {
        backends: &loads,
        ring: &r,
        matched: &owned,
        later_turns: 0.0,
    };
    let d = policy_choose(&params(), &later, &snap, &[], 0).unwrap();
    assert_eq!((d.backend, d.reason), (order[0], Reason::Affinity));
}

#[test]
fn a_request_never_waits_for_a_slot_while_another_backend_answers_it_sooner() {
    let r = ring(2);
    let key = 8;
    let order: Vec<usize> = r.walk(key, 2).collect();
    let mut loads = cpu_fleet();
    // The conversation's home holds 832 of its 900 tokens but both its slots are taken for
    // another 10 s: recomputing 900 tokens on the idle backend (6.9 s) is sooner.
    loads[order[0]].inflight = 2;
    loads[order[0]].decoding = 2;
    loads[order[0]].slot_wait_s = 10.0;
    let mut turn = req(key, 900);
    turn.has_history = true;
    let mut matched = [0u32; 2];
    matched[order[0]] = 13;
    let d = pick(&loads, &r, &matched, &turn);
    assert_eq!(d.backend, order[1]);
    assert!(
        (d.est_ttft_s - (900.0 / 130.0 + 0.01)).abs() < 1e-9,
        "{d:?}"
    );
    // A slot frees in 2 s: the cached prefix saves more than the wait costs, so it waits.
    loads[order[0]].slot_wait_s = 2.0;
    let d = pick(&loads, &r, &matched, &turn);
    assert_eq!((d.backend, d.reason), (order[0], Reason::Affinity));
    assert!(
        (d.est_ttft_s - (2.0 + 68.0 / 130.0 + 0.01)).abs() < 1e-9,
        "{d:?}"
    );
    // A slot wait counts even where a short queued prefill alone would not.
    loads[order[0]].slot_wait_s = 10.0;
    loads[order[0]].queued_prefill = 10;
    let d = pick(&loads, &r, &matched, &turn);
    assert_eq!(d.backend, order[1]);
}

#[test]
fn a_backend_nothing_is_measured_of_is_explored_not_flooded() {
    // A burst of new 850-token conversations on a backend whose rate is measured and one
    // priced at the fleet's median with nothing measured yet. Alike and both measured, they
    // share the burst evenly; the unmeasured one takes its first at once (explored) but not
    // a share of the queue on a guess (not flooded).
    let burst = |spread: f64| {
        let r = ring(2);
        let mut loads = cpu_fleet();
        loads[1].prefill_spread = spread;
        let mut on = [0u32; 2];
        for key in 0..8u64 {
            let d = pick(&loads, &r, &[0; 2], &req(key * 7919, 850));
            loads[d.backend].inflight += 1;
            loads[d.backend].queued_prefill += 850;
            on[d.backend] += 1;
        }
        on
    };
    assert_eq!(burst(1.0), [4, 4]);
    let unmeasured = burst(crate::placement::UNMEASURED_RATE_SPREAD);
    assert!(
        (1..=2).contains(&unmeasured[1]),
        "the unmeasured backend took {unmeasured:?}"
    );
}

proptest! {
    /// Load-aware affinity: whatever the loads, matches, rates and slot waits, a request is
    /// sent where it must wait for a slot only if no admissible backend with a free slot
    /// would answer it sooner.
    #[test]
    fn never_queued_while_a_free_backend_answers_sooner(
        n in 2usize..6,
        key in any::<u64>(),
        prompt in 1u64..8_000,
        history in any::<bool>(),
        replicas in 1u32..3,
        loads in proptest::collection::vec(
            (0u64..6, 0u64..3_000, 0u64..4, 0u32..3, 50.0f64..30_000.0, 1.0f64..4.0),
            6,
        ),
        matched in proptest::collection::vec(0u64..8_000, 6),
    ) {
        let r = ring(n);
        let bl: Vec<BackendLoad> = loads[..n]
            .iter()
            .map(|&(inflight, q, dec, wait, rate, spread)| BackendLoad {
                inflight,
                queued_prefill: q,
                decoding: dec,
                slot_wait_s: [0.0, 0.5, 20.0][wait as usize],
                prefill_rate: rate,
                prefill_spread: spread,
                ..BackendLoad::idle()
            })
            .collect();
        let snap = Snapshot { backends: &bl, ring: &r, matched: &matched[..n], later_turns: 1.0 };
        let mut p = req(key, prompt);
        p.has_history = history;
        let params = Params { replicas, ..params() };
        let d = policy_choose(&params, &p, &snap, &[], 0).unwrap();
        if bl[d.backend].slot_wait_s > 0.0 {
            for i in (0..n).filter(|&i| bl[i].slot_wait_s == 0.0 && bl[i].inflight == 0) {
                let uncached = prompt - matched[i].min(prompt);
                prop_assert!(
                    est_ttft_s(&bl[i], uncached) >= d.est_ttft_s,
                    "queued on {} ({:?}) while idle {} answers in {}",
                    d.backend, d, i, est_ttft_s(&bl[i], uncached)
                );
            }
        }
    }
}
