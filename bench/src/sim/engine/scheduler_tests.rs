//! Physics of the scheduler, in model time, with no sleeping.

use std::collections::HashMap;

use serde_json::{json, Value};

use super::*;
use crate::sim::engine::kvcache::block_hashes;
use crate::sim::engine::profile::ProfileName;
use crate::sim::engine::scheduler::Prefilled;
use crate::sim::text::generate::{completion_text, reply_hashes, Reply};
use crate::sim::text::openai::{self, Endpoint};
use crate::sim::text::prompt::{count_tokens, TURN_END};
use crate::sim::text::tokenizer::{shipped_path, PromptTokenizer};

fn h100() -> Profile {
    Profile::get(ProfileName::H100Llama8b)
}

/// Distinct block hashes for prompt `seed`.
fn request(seed: u64, prompt_tokens: u64, max_tokens: u64) -> NewRequest {
    let blocks = prompt_tokens / BLOCK_TOKENS;
    NewRequest {
        prompt_tokens,
        hashes: (0..blocks).map(|j| (seed << 32) | j).collect(),
        reply_hashes: Vec::new(),
        max_tokens,
        tokens: Arc::default(),
        salt: None,
        kv_transfer: Default::default(),
    }
}

/// The canonical prompt the server renders from chat `messages`.
fn canonical(messages: &Value) -> Vec<u8> {
    let body = json!({"model": "m", "messages": messages});
    openai::parse(Endpoint::Chat, body.to_string().as_bytes())
        .unwrap()
        .prompt
}

/// A chat request as the server submits it to its engine.
fn chat(messages: &Value, max_tokens: u64) -> NewRequest {
    chat_counted_by(messages, max_tokens, &PromptTokenizer::default())
}

/// The same, with the prompt counted by `tokenizer` (`--tokenizer`).
fn chat_counted_by(messages: &Value, max_tokens: u64, tokenizer: &PromptTokenizer) -> NewRequest {
    let prompt = tokenizer.stream(canonical(messages)).unwrap();
    let hashes = block_hashes(&prompt);
    NewRequest {
        prompt_tokens: count_tokens(prompt.len()),
        reply_hashes: reply_hashes(
            Endpoint::Chat,
            &prompt,
            &hashes,
            0,
            Reply::Filler(max_tokens),
            tokenizer,
        ),
        hashes,
        max_tokens,
        tokens: Arc::default(),
        salt: None,
        kv_transfer: Default::default(),
    }
}

/// Turn 1 of a conversation, and turn 2 sending turn 1's reply back with a new question.
fn two_turns(reply_tokens: u64) -> (Value, Value) {
    let turn1 = json!([
        {"role": "system", "content": "You are a helpful assistant. ".repeat(70)},
        {"role": "user", "content": "Explain prefix caching in three paragraphs."},
    ]);
    let mut turn2 = turn1.clone();
    if let Some(list) = turn2.as_array_mut() {
        list.push(json!({"role": "assistant", "content": completion_text(reply_tokens)}));
        list.push(json!({"role": "user", "content": "And how does eviction work?"}));
    }
    (turn1, turn2)
}

/// What one request saw: model time to its first token, its cached tokens, its token count,
/// the clock when its first admission's step started, and its reported prefill.
#[derive(Debug, Default, Clone, Copy)]
struct Seen {
    ttft: Option<f64>,
    cached: Option<u64>,
    generated: u64,
    finished: bool,
    admitted_at: Option<f64>,
    prefill: Option<Prefilled>,
    /// Clock when its last token was emitted.
    done: Option<f64>,
}

/// Steps until idle (or `max_steps`), recording every request's view.
fn run(s: &mut Scheduler, max_steps: usize) -> (f64, HashMap<u64, Seen>) {
    let mut clock = 0.0;
    let mut seen: HashMap<u64, Seen> = HashMap::new();
    for _ in 0..max_steps {
        if s.is_idle() {
            break;
        }
        let out = s.step();
        let started = clock;
        clock += out.seconds;
        for a in out.admitted {
            let v = seen.entry(a.id).or_default();
            v.cached = Some(a.cached_tokens);
            v.admitted_at = Some(started);
        }
        for p in out.prefilled {
            let v = seen.entry(p.id).or_default();
            assert!(v.prefill.is_none(), "one prefill per request");
            assert_eq!(v.generated, 0, "prefill ends with the first token");
            // From the step that first scheduled the prompt to the end of this one.
            let span = clock - v.admitted_at.unwrap();
            assert!((p.seconds - span).abs() < 1e-9, "{} vs {span}", p.seconds);
            v.prefill = Some(p);
        }
        for e in out.emitted {
            let v = seen.entry(e.id).or_default();
            assert_eq!(e.generated, v.generated + 1, "tokens of {} in order", e.id);
            assert!(!v.finished);
            v.generated = e.generated;
            v.finished = e.finished;
            if e.finished {
                v.done = Some(clock);
            }
            v.ttft.get_or_insert(clock);
        }
    }
    (clock, seen)
}

#[test]
fn ten_k_prompt_miss_then_hit() {
    let p = h100();
    let mut s = Scheduler::new(p);
    let a = s.add(request(1, 10_000, 1));
    let (_, seen) = run(&mut s, 100);
    let ttft = seen[&a].ttft.unwrap();
    // Two chunks (8192 + 1808): 0.4 s of prefill plus two step overheads.
    let expected = 10_000.0 / 25_000.0 + 2.0 * p.t0;
    assert!(
        (ttft - expected).abs() / expected < 0.01,
        "{ttft} vs {expected}"
    );
    assert!((ttft - 0.4).abs() / 0.4 < 0.10, "{ttft}");
    assert_eq!(seen[&a].cached, Some(0));

    let b = s.add(request(1, 10_000, 1));
    let (_, seen) = run(&mut s, 100);
    // vLLM recomputes the last token: 9999 rounded down to a block.
    assert_eq!(seen[&b].cached, Some(9_984));
    let hit_ttft = seen[&b].ttft.unwrap();
    let one_step = p.t0 + 16.0 / p.prefill_rate;
    assert!((hit_ttft - one_step).abs() < 1e-9, "{hit_ttft}");
    assert_eq!(s.counters().prefix_hits, 9_984);
    assert_eq!(s.counters().prefix_queries, 20_000);
}

#[test]
fn small_pool_evicts_the_older_prompt() {
    // 1000 blocks: A (500 blocks) then B (938 blocks) do not fit together.
    let mut s = Scheduler::new(h100().with_kv_tokens(16_000));
    s.add(request(1, 8_000, 1));
    run(&mut s, 100);
    assert_eq!(s.pool().cached(), 500);
    s.add(request(2, 15_000, 1));
    run(&mut s, 100);
    let again = s.add(request(1, 8_000, 1));
    let (_, seen) = run(&mut s, 100);
    let cached = seen[&again].cached.unwrap();
    // B evicted A's tail (least recently released first); at most A's head survives.
    assert!(cached <= 16_000 - 15_000, "{cached}");
    let ttft = seen[&again].ttft.unwrap();
    assert!(
        ttft > 0.25,
        "A re-prefilled most of its 8000 tokens: {ttft}"
    );
}

fn decode_step(streams: u64, context: u64) -> StepOutcome {
    let mut s = Scheduler::new(h100());
    for i in 0..streams {
        s.add(request(i + 1, context, 1_000));
    }
    for _ in 0..1_000 {
        let out = s.step();
        if out.prefill_tokens == 0 && out.decode_seqs == streams {
            return out;
        }
    }
    panic!("never reached steady decode");
}

#[test]
fn decode_step_grows_with_batch() {
    let big = decode_step(64, 4_096);
    // 5 ms + 64 * 0.05 ms + 64 * ~4100 * 40 ns.
    let expected = 0.005 + 64.0 * 0.000_05 + 64.0 * 4_096.0 * 40e-9;
    assert!(
        (big.seconds - expected).abs() / expected < 0.02,
        "{} vs {expected}",
        big.seconds
    );
    let small = decode_step(8, 4_096);
    assert!(small.seconds < big.seconds / 2.0, "{}", small.seconds);
    let tiny = decode_step(1, 100);
    assert!((tiny.seconds - 0.005).abs() < 0.000_1, "{}", tiny.seconds);
}

#[test]
fn preemption_when_running_requests_outgrow_the_pool() {
    // 200 blocks; 8 requests of 16 prompt blocks each grow to ~35 blocks.
    let mut s = Scheduler::new(h100().with_kv_tokens(3_200));
    let ids: Vec<u64> = (0..8).map(|i| s.add(request(i + 1, 256, 300))).collect();
    let (_, seen) = run(&mut s, 100_000);
    assert!(s.is_idle());
    assert!(s.counters().preemptions > 0);
    for id in ids {
        assert_eq!(seen[&id].generated, 300, "request {id}");
        assert!(seen[&id].finished);
    }
    assert_eq!(s.pool().used(), 0);
}

#[test]
fn seats_budget_and_abort() {
    let mut s = Scheduler::new(h100());
    for i in 0..300 {
        s.add(request(i + 1, 16, 10));
    }
    let out = s.step();
    assert_eq!(s.running(), 256);
    assert_eq!(s.waiting(), 44);
    assert_eq!(out.prefill_tokens, 256 * 16);
    // Budget: one 10k prompt is chunked to what is left of 8192.
    let mut s = Scheduler::new(h100());
    s.add(request(1, 100, 10));
    s.add(request(2, 10_000, 10));
    let out = s.step();
    assert_eq!(out.prefill_tokens, 8_192);
    let used = s.pool().used();
    assert!(used > 0);
    s.abort(1);
    s.abort(0);
    assert!(s.is_idle());
    assert_eq!(s.pool().used(), 0);
    assert!(h100().fits(499_000, 1_000));
    assert!(!h100().fits(500_000, 1));
}

#[test]
fn next_turn_hits_the_previous_reply() {
    let p = h100();
    let mut s = Scheduler::new(p);
    let (turn1, turn2) = two_turns(200);
    let first = chat(&turn1, 200);
    let first_prompt = first.prompt_tokens;
    let first_blocks = first.hashes.len() as u64;
    s.add(first);
    run(&mut s, 10_000);
    assert_eq!(s.pool().used(), 0);

    let second = chat(&turn2, 10);
    let prompt_tokens = second.prompt_tokens;
    let id = s.add(second);
    let (_, seen) = run(&mut s, 10_000);
    let cached = seen[&id].cached.unwrap();
    // Everything turn 2 shares with turn 1's prompt + reply + turn end, to the block boundary:
    // only the template's `<|im_start|>user` and the new question are left to prefill.
    let shared = canonical(&turn1).len() + completion_text(200).len() + TURN_END.len();
    assert!(canonical(&turn2).starts_with(&canonical(&turn1)));
    assert_eq!(cached, (shared / 64) as u64 * BLOCK_TOKENS);
    assert!(cached > first_prompt + 200, "{cached} vs {first_prompt}");
    let new_tokens = count_tokens(canonical(&turn2).len() - shared);
    assert!(
        prompt_tokens - cached < new_tokens + BLOCK_TOKENS,
        "{prompt_tokens} {cached}"
    );
    // Before, only turn 1's full prompt blocks were there to hit.
    assert!(cached > first_blocks * BLOCK_TOKENS + 300);
    // One step prefills the uncached rest and samples the first token.
    let ttft = seen[&id].ttft.unwrap();
    let expected = p.t0 + (prompt_tokens - cached) as f64 / p.prefill_rate;
    assert!((ttft - expected).abs() < 1e-9, "{ttft} vs {expected}");

    // Without turn 1 cached, turn 2 prefills everything.
    let mut cold = Scheduler::new(p);
    let id = cold.add(chat(&turn2, 10));
    let (_, seen) = run(&mut cold, 10_000);
    assert_eq!(seen[&id].cached, Some(0));
    let cold_ttft = seen[&id].ttft.unwrap();
    assert!(cold_ttft > ttft + 0.03, "{cold_ttft} vs {ttft}");
}

#[test]
fn reply_blocks_are_evictable_once_unreferenced() {
    // 100 blocks.
    let mut s = Scheduler::new(h100().with_kv_tokens(1_600));
    let (turn1, turn2) = two_turns(200);
    let first = chat(&turn1, 200);
    let prompt_blocks = first.hashes.len();
    let stream_blocks = prompt_blocks + first.reply_hashes.len();
    s.add(first);
    run(&mut s, 10_000);
    // The reply's blocks outnumber those the 200 generated tokens held: all are cached.
    assert_eq!(s.pool().used(), 0);
    assert_eq!(s.pool().cached(), stream_blocks);
    let probe = chat(&turn2, 10).hashes;
    assert_eq!(s.pool().lookup(&probe), stream_blocks);

    // A 94-block request fits only by evicting, and the reply goes before the prompt.
    s.add(request(9, 1_500, 1));
    run(&mut s, 100);
    assert_eq!(s.counters().preemptions, 0);
    assert_eq!(s.pool().used(), 0);
    let left = s.pool().lookup(&probe);
    assert_eq!(left, 100 - 94);
    assert!(left < prompt_blocks);
}

#[test]
fn prefill_time_is_model_time_from_first_scheduled_step_to_first_token() {
    let p = h100();
    let mut s = Scheduler::new(p);
    let a = s.add(request(1, 10_000, 1));
    let (_, seen) = run(&mut s, 100);
    let prefill = seen[&a].prefill.unwrap();
    // Alone, prefill is the whole TTFT: two chunks, two step overheads.
    let expected = 10_000.0 / p.prefill_rate + 2.0 * p.t0;
    assert!((prefill.seconds - expected).abs() < 1e-9, "{prefill:?}");
    assert_eq!(prefill.computed_tokens, 10_000);
    assert!((seen[&a].ttft.unwrap() - prefill.seconds).abs() < 1e-9);

    // A hit computes only the uncached rest, in one step.
    let b = s.add(request(1, 10_000, 1));
    let (_, seen) = run(&mut s, 100);
    let prefill = seen[&b].prefill.unwrap();
    assert_eq!(prefill.computed_tokens, 10_000 - 9_984);
    assert!((prefill.seconds - (p.t0 + 16.0 / p.prefill_rate)).abs() < 1e-9);

    // Queued behind another prompt: the wait before the first scheduled step is not prefill.
    let mut s = Scheduler::new(p);
    let first = s.add(request(2, 10_000, 2));
    let second = s.add(request(3, 10_000, 2));
    let (_, seen) = run(&mut s, 100);
    let (one, two) = (seen[&first], seen[&second]);
    assert_eq!(one.admitted_at, Some(0.0));
    let waited = two.admitted_at.unwrap();
    // Step 1 was all the first request's (8192 tokens).
    assert!(
        (waited - (p.t0 + 8_192.0 / p.prefill_rate)).abs() < 1e-9,
        "{waited}"
    );
    let prefill = two.prefill.unwrap();
    assert!((prefill.seconds - (two.ttft.unwrap() - waited)).abs() < 1e-9);
    assert_eq!(prefill.computed_tokens, 10_000);
}

#[test]
fn preemption_before_the_first_token_stays_in_the_prefill_span() {
    // 48 blocks and 16-token steps: B's 512-token prompt takes ~35 steps while A decodes and
    // grows until it preempts B, which later recomputes what it lost.
    let mut p = h100().with_kv_tokens(48 * BLOCK_TOKENS);
    p.max_num_batched_tokens = 16;
    let mut s = Scheduler::new(p);
    let a = s.add(request(1, 256, 400));
    let b = s.add(request(2, 512, 1));
    let (_, seen) = run(&mut s, 100_000);
    assert!(s.is_idle());
    assert!(s.counters().preemptions > 0);
    assert_eq!(seen[&a].prefill.unwrap().computed_tokens, 256);
    let pb = seen[&b].prefill.unwrap();
    // B was preempted mid-prefill (A had long finished its own) and recomputed: every
    // computed prompt token counts, and the span runs from B's first scheduled step.
    assert!(pb.computed_tokens > 512, "{pb:?}");
    // It then waited for blocks until A finished, and that wait is inside its span.
    let (a_done, b_start) = (seen[&a].done.unwrap(), seen[&b].admitted_at.unwrap());
    assert!(b_start < seen[&a].ttft.unwrap() + 1e-9);
    assert!(seen[&b].ttft.unwrap() > a_done);
    assert!(pb.seconds > a_done - b_start, "{pb:?}");
}

/// With a real tokenizer, blocks are 16 token ids: turn 2 still finds every block of turn 1's
/// prompt and reply, and its count is the tokenizer's, not bytes / 4.
#[test]
fn a_real_tokenizer_keeps_the_next_turn_hitting_the_previous_one() {
    let bpe = PromptTokenizer::load(&shipped_path()).unwrap();
    let mut s = Scheduler::new(h100());
    let (turn1, turn2) = two_turns(200);
    let first = chat_counted_by(&turn1, 200, &bpe);
    assert_ne!(first.prompt_tokens, chat(&turn1, 200).prompt_tokens);
    let stream_blocks = first.hashes.len() + first.reply_hashes.len();
    s.add(first);
    run(&mut s, 10_000);
    let second = chat_counted_by(&turn2, 10, &bpe);
    assert_eq!(s.pool().lookup(&second.hashes), stream_blocks);
    let prompt_tokens = second.prompt_tokens;
    let id = s.add(second);
    let (_, seen) = run(&mut s, 10_000);
    let cached = seen[&id].cached.unwrap();
    assert_eq!(cached, stream_blocks as u64 * BLOCK_TOKENS);
    // Left to prefill: the new question and the partial blocks around it.
    assert!(
        prompt_tokens - cached < 3 * BLOCK_TOKENS,
        "{prompt_tokens} {cached}"
    );
}

fn smollm2() -> Profile {
    Profile::get(ProfileName::CpuSmollm2)
}

/// A ~700-token chat (a long system prompt and a question), and its next turn: the reply sent
/// back and ~18 tokens of new question and template.
fn smollm2_turns(reply_tokens: u64) -> (Value, Value) {
    let turn1 = json!([
        {"role": "system", "content": "You are a helpful assistant. ".repeat(95)},
        {"role": "user", "content": "Explain prefix caching in three paragraphs."},
    ]);
    let mut turn2 = turn1.clone();
    if let Some(list) = turn2.as_array_mut() {
        list.push(json!({"role": "assistant", "content": completion_text(reply_tokens)}));
        list.push(json!({"role": "user", "content": "And how does eviction work?"}));
    }
    (turn1, turn2)
}

/// llama-server with SmolLM2-135M on one CPU thread: a cold ~700-token prompt takes ~2.9 s
/// (2.6-2.8 s measured), the same prompt again hits the cache and takes one short step, and
/// the next turn of the conversation prefills only its new tokens (0.11 s measured), each
/// paying the prompt's fixed cost.
#[test]
fn cpu_smollm2_cold_prompt_hit_and_follow_up() {
    let p = smollm2();
    let mut s = Scheduler::new(p);
    let (turn1, turn2) = smollm2_turns(30);
    let cold = chat(&turn1, 30);
    let prompt = cold.prompt_tokens;
    assert!((650..750).contains(&prompt), "{prompt}");
    let a = s.add(cold);
    let (_, seen) = run(&mut s, 10_000);
    assert_eq!(seen[&a].cached, Some(0));
    let ttft = seen[&a].ttft.unwrap();
    // Under n_batch: one step, the prompt's fixed cost, and its attention over itself.
    let want = p.t0 + p.t_prompt + prompt as f64 / p.prefill_rate + p.context_seconds(prompt, 0);
    assert!((ttft - want).abs() < 1e-9, "{ttft} vs {want}");
    assert!((4.5..6.0).contains(&ttft), "{ttft}");
    assert_eq!(seen[&a].prefill.unwrap().computed_tokens, prompt);

    let b = s.add(chat(&turn1, 1));
    let (_, seen) = run(&mut s, 10_000);
    let cached = seen[&b].cached.unwrap();
    // Block grain: up to 16 recomputed (llama.cpp recomputes only the last token).
    assert_eq!(cached, (prompt - 1) / BLOCK_TOKENS * BLOCK_TOKENS);
    let hit_ttft = seen[&b].ttft.unwrap();
    assert!(hit_ttft < 0.25, "{hit_ttft}");

    let follow = chat(&turn2, 10);
    let follow_prompt = follow.prompt_tokens;
    let c = s.add(follow);
    let (_, seen) = run(&mut s, 10_000);
    let cached = seen[&c].cached.unwrap();
    assert!(
        cached > prompt + 30,
        "the prompt and the reply hit: {cached}"
    );
    let computed = seen[&c].prefill.unwrap().computed_tokens;
    assert_eq!(computed, follow_prompt - cached);
    assert!(computed < 18 + BLOCK_TOKENS, "{computed}");
    // Its new tokens attend to the ~700 cached ahead of them (20 new tokens after 700
    // cached took the real engine 266 ms).
    let follow_ttft = seen[&c].ttft.unwrap();
    let alone = p.t0 + p.t_prompt + computed as f64 / p.prefill_rate;
    assert!(follow_ttft > alone + 0.05, "{follow_ttft}");
    assert!((0.15..0.5).contains(&follow_ttft), "{follow_ttft}");
}

/// Every prompt pays llama.cpp's fixed cost once, in the step that ends its prefill, whatever
/// its size; decode steps do not. An engine sharing its core runs every step slower.
#[test]
fn cpu_smollm2_prompts_pay_a_fixed_cost_and_shared_cores_slow_steps() {
    let p = smollm2();
    assert_eq!(p.t_prompt, 0.002);
    assert_eq!(h100().t_prompt, 0.0);
    let mut s = Scheduler::new(p);
    s.add(request(1, 32, 3));
    s.add(request(2, 64, 3));
    let both = s.step();
    assert_eq!((both.prefill_tokens, both.prefilled.len()), (96, 2));
    let expected = p.t0
        + 2.0 * p.t_prompt
        + 96.0 / p.prefill_rate
        + p.context_seconds(32, 0)
        + p.context_seconds(64, 0);
    assert!((both.seconds - expected).abs() < 1e-9, "{}", both.seconds);
    let decode = s.step();
    assert!(decode.prefilled.is_empty());
    // A decode step pays no prompt's fixed cost: its two streams read their 96 tokens.
    let want = p.step_seconds(0, 2, 96);
    assert!(
        (decode.seconds - want).abs() < 1e-9,
        "{} vs {want}",
        decode.seconds
    );
    // The same engine beside one sharing its core, step for step.
    let mut slowed = Scheduler::new(p);
    slowed.add(request(1, 32, 3));
    slowed.add(request(2, 64, 3));
    for _ in 0..2 {
        slowed.step_slowed(1.0);
    }
    let (alone, shared) = (s.step(), slowed.step_slowed(1.5));
    assert!(
        (shared.seconds - 1.5 * alone.seconds).abs() < 1e-9,
        "{shared:?}"
    );
}

/// Two slots: a third request waits (deferred) until one of the first two ends, then runs.
#[test]
fn cpu_smollm2_runs_two_requests_and_defers_the_third() {
    let mut s = Scheduler::new(smollm2());
    for i in 0..3 {
        s.add(request(i + 1, 100, 50));
    }
    s.step();
    assert_eq!((s.running(), s.waiting()), (2, 1));

    let mut s = Scheduler::new(smollm2());
    let ids: Vec<u64> = (0..3).map(|i| s.add(request(i + 1, 100, 50))).collect();
    let (_, seen) = run(&mut s, 10_000);
    let first_done = seen[&ids[0]].done.unwrap().min(seen[&ids[1]].done.unwrap());
    let third = seen[&ids[2]];
    assert!(third.admitted_at.unwrap() >= first_done - 1e-9, "{third:?}");
    assert!(third.finished && third.generated == 50);
    let c = s.counters();
    // Busy slots per step: two while both ran, one for the third alone.
    let per_step = c.busy_seqs as f64 / c.steps as f64;
    assert!((1.0..2.0).contains(&per_step), "{per_step}");
    // The longest sequence: 100 prompt tokens and 49 outputs in KV.
    assert_eq!(c.max_seq_tokens, 149);
}

/// One `llama_decode` takes at most n_batch (2,048) tokens: a decoding slot's token plus
/// 2,047 of a long prompt, and the decoding slot waits the ~15 s that chunk takes. Decode
/// alone is ~18 ms a token at 700 of context, two streams ~2x that (one CPU thread gains nothing
/// by batching).
#[test]
fn cpu_smollm2_steps_follow_n_batch_and_the_measured_decode() {
    let p = smollm2();
    let mut s = Scheduler::new(p);
    s.add(request(1, 700, 1_000));
    s.step();
    let alone = s.step();
    assert_eq!((alone.decode_seqs, alone.prefill_tokens), (1, 0));
    assert!((0.016..0.021).contains(&alone.seconds), "{}", alone.seconds);
    s.add(request(2, 3_000, 1));
    let mixed = s.step();
    assert_eq!((mixed.decode_seqs, mixed.prefill_tokens), (1, 2_047));
    assert!(
        mixed.seconds > 2_047.0 / p.prefill_rate,
        "{}",
        mixed.seconds
    );
    let rest = s.step();
    assert_eq!((rest.decode_seqs, rest.prefill_tokens), (1, 953));
    assert_eq!(rest.emitted.len(), 2);

    let mut s = Scheduler::new(p);
    s.add(request(1, 700, 1_000));
    s.add(request(2, 700, 1_000));
    s.step();
    let two = s.step();
    assert_eq!((two.decode_seqs, two.prefill_tokens), (2, 0));
    assert!((0.032..0.038).contains(&two.seconds), "{}", two.seconds);
}

/// The pool is the slots' context plus the RAM cache (~19,840 tokens): five 3,600-token
/// prompts stay cached; a sixth evicts the least recently used, which then misses.
#[test]
fn cpu_smollm2_caches_the_slots_and_the_ram_cache() {
    let mut s = Scheduler::new(smollm2());
    let hit = |s: &mut Scheduler, seed: u64| {
        let id = s.add(request(seed, 3_600, 1));
        let (_, seen) = run(s, 100);
        seen[&id].cached.unwrap()
    };
    for seed in 1..=5 {
        assert_eq!(hit(&mut s, seed), 0);
    }
    for seed in 1..=5 {
        assert_eq!(hit(&mut s, seed), 3_584, "prompt {seed}");
    }
    assert_eq!(hit(&mut s, 6), 0);
    assert_eq!(hit(&mut s, 5), 3_584);
    let oldest = hit(&mut s, 1);
    assert!(oldest < 3_584, "{oldest}");
    assert_eq!(s.counters().preemptions, 0);
}

/// P/D, prefill side: a finished request asked to hold keeps its prompt's full blocks
/// referenced (used, never evicted) until they are released, then they are cached as usual.
#[test]
fn a_held_prompt_is_pinned_until_released() {
    // 100 blocks.
    let mut s = Scheduler::new(h100().with_kv_tokens(1_600));
    let mut req = request(1, 800, 1);
    let hashes = req.hashes.clone();
    req.kv_transfer.hold = Some("r1".into());
    s.add(req);
    let mut held = Vec::new();
    while !s.is_idle() {
        held.extend(s.step().held);
    }
    assert_eq!(held.len(), 1);
    assert_eq!((held[0].key.as_str(), &held[0].hashes), ("r1", &hashes));
    assert_eq!(s.pool().used(), 50);
    // Two requests that each need 49 of the other 50 blocks: the second evicts the first's
    // cached blocks, never the held ones.
    for seed in [2, 3] {
        let id = s.add(request(seed, 784, 1));
        let (_, seen) = run(&mut s, 10);
        assert!(seen[&id].finished);
        assert_eq!((s.pool().used(), s.lookup(&hashes)), (50, 50));
    }
    s.release_held(&hashes);
    assert_eq!(s.pool().used(), 0);
    s.add(request(4, 1_500, 1));
    run(&mut s, 10);
    assert!(s.lookup(&hashes) < 50, "released blocks are evictable");
}

/// P/D, decode side: transferred blocks are named as the request is queued, held for it
/// while it waits, and found by its admission: cached tokens, but not prefix-cache hits.
#[test]
fn imported_blocks_are_cached_for_the_request_but_not_counted_as_hits() {
    let mut s = Scheduler::new(h100().with_kv_tokens(1_600));
    let mut local = request(5, 800, 1);
    local.hashes.truncate(10);
    local.prompt_tokens = 160;
    s.add(local);
    run(&mut s, 10);
    let before = s.counters();
    // 10 blocks were local already; 40 more are read from the prefill server.
    let mut req = request(5, 800, 4);
    req.kv_transfer.import_blocks = 50;
    req.kv_transfer.transferred_blocks = 40;
    let hashes = req.hashes.clone();
    let id = s.add(req);
    assert_eq!(s.pool().used(), 50, "held while waiting");
    assert_eq!(s.lookup(&hashes), 50);
    let out = s.step();
    let a = out.admitted.iter().find(|a| a.id == id).unwrap();
    // vLLM recomputes the last token: 49 of the 50 blocks are reused, 10 local, 39 read.
    assert_eq!((a.cached_tokens, a.transferred_tokens), (784, 624));
    let c = s.counters();
    assert_eq!(c.prefix_hits - before.prefix_hits, 160);
    assert_eq!(c.prefix_queries - before.prefix_queries, 800);
    while !s.is_idle() {
        s.step();
    }
    assert_eq!(s.pool().used(), 0);
    // A request aborted while waiting gives its imported blocks back.
    let mut req = request(6, 320, 1);
    req.kv_transfer.import_blocks = 20;
    let id = s.add(req);
    assert_eq!(s.pool().used(), 20);
    s.abort(id);
    assert_eq!(s.pool().used(), 0);
}
