//! KV events: the payload against msgspec's bytes, and the events against the pool they
//! describe.

use std::collections::{HashMap, HashSet};

use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::*;
use crate::sim::engine::kvcache::{block_hashes, salt_seed};
use crate::sim::engine::profile::{Profile, ProfileName};
use crate::sim::engine::scheduler::{NewRequest, Scheduler};
use crate::sim::text::generate::{completion_text, reply_hashes, reply_hashes_and_tokens, Reply};
use crate::sim::text::openai::Endpoint;
use crate::sim::text::prompt::{count_tokens, render_chat, TURN_END};
use crate::sim::text::tokenizer::{shipped_path, PromptTokenizer};

/// `bench/scripts/kv_events_reference.py`'s `encode_batch` (msgspec 0.23, vLLM's struct
/// options) on the events of `golden_events` at ts 1757500000.25.
const MSGSPEC_HEX: &[&str] = &[
    "93cb41da3054981000009388a474797065ab426c6f636b53746f726564ac626c6f636b5f6861736865739201cfffffff",
    "ffffffffffb1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473dc00206465666768696a6b6c6d6e",
    "6f707172737475767778797a7b7c7d7e7fcc80cc81cc82cc83aa626c6f636b5f73697a6510a76c6f72615f6964c0a66d",
    "656469756da3475055a96c6f72615f6e616d65c088a474797065ab426c6f636b53746f726564ac626c6f636b5f686173",
    "6865739107b1706172656e745f626c6f636b5f68617368cfdeadbeef12345678a9746f6b656e5f696473dc0010007fcc",
    "80ccffcd0100cdffffce00010000ce74736574ceffffffff01010101010101aa626c6f636b5f73697a6510a76c6f7261",
    "5f6964c0a66d656469756da3475055a96c6f72615f6e616d65c083a474797065ac426c6f636b52656d6f766564ac626c",
    "6f636b5f686173686573920203a66d656469756da347505500",
];

/// Token ids across msgpack's integer widths; hashes at both ends of u64.
fn golden_events() -> Vec<KvEvent> {
    let mut odd = vec![0, 127, 128, 255, 256, 65535, 65536, 1_953_719_668, u32::MAX];
    odd.resize(16, 1);
    vec![
        KvEvent::BlockStored {
            block_hashes: vec![1, u64::MAX],
            parent_block_hash: None,
            token_ids: (100..132).collect(),
            salt: None,
        },
        KvEvent::BlockStored {
            block_hashes: vec![7],
            parent_block_hash: Some(0xDEAD_BEEF_1234_5678),
            token_ids: odd,
            salt: None,
        },
        KvEvent::BlockRemoved {
            block_hashes: vec![2, 3],
        },
    ]
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

#[test]
fn payload_is_byte_for_byte_what_msgspec_encodes() {
    let ours = encode_batch(1_757_500_000.25, &golden_events()).unwrap();
    assert_eq!(ours, unhex(&MSGSPEC_HEX.concat()));
    let (ts, events) = decode_batch(&ours).unwrap();
    assert_eq!(ts, 1_757_500_000.25);
    assert_eq!(events, golden_events());
}

/// `encode_batch` with vLLM's newer fields, on one salted prompt's two blocks (extra keys
/// `[["tenant-a"], null]`) at ts 1757500000.25.
const MSGSPEC_SALTED_HEX: &str = concat!(
    "93cb41da3054981000009189a474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573920102b170",
    "6172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473dc00206465666768696a6b6c6d6e6f7071727374",
    "75767778797a7b7c7d7e7fcc80cc81cc82cc83aa626c6f636b5f73697a6510a76c6f72615f6964c0a66d656469756d",
    "a3475055a96c6f72615f6e616d65c0aa65787472615f6b6579739291a874656e616e742d61c000",
);

#[test]
fn a_salted_prompt_names_its_salt_as_vllm_does() {
    let events = vec![KvEvent::BlockStored {
        block_hashes: vec![1, 2],
        parent_block_hash: None,
        token_ids: (100..132).collect(),
        salt: Some("tenant-a".into()),
    }];
    let ours = encode_batch(1_757_500_000.25, &events).unwrap();
    assert_eq!(ours, unhex(MSGSPEC_SALTED_HEX));
    assert_eq!(decode_batch(&ours).unwrap().1, events);
}

/// What a consumer of the stream holds: applies `events`, checking that each stored block
/// is new and its hash follows from its parent and token ids, and each removed one is held.
fn apply(held: &mut HashSet<u64>, events: &[KvEvent], tally: &mut Tally) {
    for e in events {
        match e {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                salt,
            } => {
                assert_eq!(token_ids.len(), 16 * block_hashes.len(), "{e:?}");
                tally.stored_events += 1;
                tally.longest_run = tally.longest_run.max(block_hashes.len());
                tally.roots += usize::from(parent_block_hash.is_none());
                let mut parent = parent_block_hash.unwrap_or_else(|| salt_seed(salt.as_deref()));
                for (&h, ids) in block_hashes.iter().zip(token_ids.chunks(16)) {
                    let bytes: Vec<u8> = ids.iter().flat_map(|t| t.to_le_bytes()).collect();
                    assert_eq!(h, xxh3_64_with_seed(&bytes, parent), "{e:?}");
                    assert!(held.insert(h), "block {h:x} stored twice");
                    parent = h;
                }
            }
            KvEvent::BlockRemoved { block_hashes } => {
                tally.removed += block_hashes.len();
                for h in block_hashes {
                    assert!(held.remove(h), "block {h:x} removed but not held");
                }
            }
        }
    }
}

#[derive(Debug, Default)]
struct Tally {
    stored_events: usize,
    longest_run: usize,
    roots: usize,
    removed: usize,
}

/// xorshift64*, so the sequence is the same everywhere.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// A request for the token stream `prompt`, built as `engine_answer` builds it when the
/// engine publishes events.
fn request(prompt: &[u8], max_tokens: u64, tokenizer: &PromptTokenizer) -> NewRequest {
    let hashes = block_hashes(prompt);
    let (reply, tokens) = reply_hashes_and_tokens(
        Endpoint::Chat,
        prompt,
        &hashes,
        0,
        Reply::Filler(max_tokens),
        tokenizer,
    );
    NewRequest {
        prompt_tokens: count_tokens(prompt.len()),
        hashes,
        reply_hashes: reply,
        max_tokens,
        tokens,
        salt: None,
        kv_transfer: Default::default(),
    }
}

/// Between `min` and `min + spread` random letters.
fn text(rng: &mut Rng, min: u64, spread: u64) -> Vec<u8> {
    let len = min + rng.below(spread.max(1));
    (0..len).map(|_| b'a' + rng.below(26) as u8).collect()
}

/// A small pool under a random mix of shared system prompts, follow-up turns that send the
/// reply back, fresh prompts and aborts: after every step, the set a consumer builds from the
/// events is exactly the pool's set of named blocks.
#[test]
fn replayed_events_reproduce_the_pools_named_blocks() {
    let mut profile = Profile::get(ProfileName::H100Llama8b).with_kv_tokens(16 * 96);
    profile.max_num_batched_tokens = 192;
    profile.max_num_seqs = 8;
    let mut s = Scheduler::new(profile);
    s.record_kv_events();
    let tok = PromptTokenizer::default();
    let mut rng = Rng(0x5eed_1234_abcd_0001);
    let systems: Vec<Vec<u8>> = (0..3).map(|i| text(&mut rng, 200 + 150 * i, 1)).collect();
    // Finished prompts with their reply length, for follow-up turns.
    let mut finished: Vec<(Vec<u8>, u64)> = Vec::new();
    let mut live: HashMap<u64, (Vec<u8>, u64)> = HashMap::new();
    let mut held = HashSet::new();
    let mut tally = Tally::default();
    for step in 0.. {
        if step >= 2400 && s.is_idle() {
            break;
        }
        assert!(step < 100_000, "the engine never drained");
        if step < 2400 && rng.below(3) == 0 {
            let max_tokens = 1 + rng.below(120);
            let prompt = match rng.below(4) {
                0 if !finished.is_empty() => {
                    let (prev, n) = &finished[rng.below(finished.len() as u64) as usize];
                    let mut p = prev.clone();
                    p.extend_from_slice(completion_text(*n).as_bytes());
                    p.extend_from_slice(TURN_END.as_bytes());
                    p.extend(text(&mut rng, 40, 200));
                    p
                }
                0 | 1 => text(&mut rng, 30, 900),
                _ => {
                    let mut p = systems[rng.below(3) as usize].clone();
                    p.extend(text(&mut rng, 10, 300));
                    p
                }
            };
            if count_tokens(prompt.len()) + max_tokens < 16 * 80 {
                let id = s.add(request(&prompt, max_tokens, &tok));
                live.insert(id, (prompt, max_tokens));
            }
        }
        if rng.below(40) == 0 {
            if let Some(&id) = live.keys().min() {
                s.abort(id);
                live.remove(&id);
            }
        }
        if s.is_idle() {
            continue;
        }
        let out = s.step();
        apply(&mut held, &out.kv_events, &mut tally);
        assert_eq!(held, s.pool().hashed_blocks(), "step {step}");
        for e in out.emitted.iter().filter(|e| e.finished) {
            if let Some(done) = live.remove(&e.id) {
                finished.push(done);
            }
        }
    }
    let c = s.counters();
    // The mix did what it is for: thousands of evictions, reuse of shared and replied
    // prefixes, preemptions, events merged along chains, chains that start at block 0.
    assert!(tally.removed > 2000, "{tally:?}");
    assert!(c.prefix_hits > 10_000 && c.preemptions > 20, "{c:?}");
    assert!(tally.longest_run >= 4 && tally.roots > 100, "{tally:?}");
    assert!(finished.len() > 300, "{}", finished.len());
    assert!(!held.is_empty());
}

/// With `--tokenizer`, `token_ids` are the tokenizer's ids, the reply's included.
#[test]
fn token_ids_are_the_tokenizers_ids() {
    let tok = PromptTokenizer::load(&shipped_path()).unwrap();
    let messages = serde_json::json!([
        {"role": "system", "content": "You are a helpful assistant. ".repeat(8)},
        {"role": "user", "content": "Explain how a prefix cache decides what to evict."},
    ]);
    let stream = tok.stream(render_chat(&messages).unwrap()).unwrap();
    let req = request(&stream, 24, &tok);
    let prompt_blocks = req.hashes.len();
    let want_reply = reply_hashes(
        Endpoint::Chat,
        &stream,
        &req.hashes,
        0,
        Reply::Filler(24),
        &tok,
    );
    assert_eq!(req.reply_hashes, want_reply);
    let reply_blocks = req.reply_hashes.len();
    assert!(prompt_blocks >= 2 && reply_blocks >= 1);
    let mut ids: Vec<u32> = stream
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let reply = tok.reply_stream(24, TURN_END).unwrap().unwrap();
    ids.extend(
        reply
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])),
    );

    let mut s = Scheduler::new(Profile::get(ProfileName::H100Llama8b));
    s.record_kv_events();
    s.add(req);
    let mut stored = Vec::new();
    while !s.is_idle() {
        for e in s.step().kv_events {
            let KvEvent::BlockStored {
                block_hashes,
                token_ids,
                ..
            } = e
            else {
                panic!("nothing is evicted from a large pool: {e:?}");
            };
            stored.extend(
                block_hashes
                    .into_iter()
                    .zip(token_ids.chunks(16).map(<[u32]>::to_vec)),
            );
        }
    }
    assert_eq!(stored.len(), prompt_blocks + reply_blocks);
    for (j, (_, block)) in stored.iter().enumerate() {
        assert_eq!(block[..], ids[16 * j..16 * (j + 1)], "block {j}");
    }
    // Every id is a real one, far below the stand-in's 4 bytes of text read as a u32.
    assert!(ids.iter().all(|&id| id < 8192));
}

fn stored(events: &[KvEvent]) -> Vec<(Vec<u64>, Option<u64>)> {
    events
        .iter()
        .map(|e| match e {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                ..
            } => (block_hashes.clone(), *parent_block_hash),
            other => panic!("nothing is evicted from a large pool: {other:?}"),
        })
        .collect()
}

/// Blocks named one after another along a chain share one event; a cached block that a
/// request reuses is not stored again; a prompt that leaves a cached prefix names its parent.
#[test]
fn one_event_per_run_reuse_is_silent_and_parents_link() {
    let tok = PromptTokenizer::default();
    // 5 full blocks and 60 bytes: with " tok0<|im_end|>\n" the reply completes a 6th block.
    let prompt: Vec<u8> = (0..64 * 5 + 60).map(|i| b'a' + (i % 23) as u8).collect();
    let mut s = Scheduler::new(Profile::get(ProfileName::H100Llama8b));
    s.record_kv_events();
    let first = request(&prompt, 1, &tok);
    let mut chain = first.hashes.clone();
    assert_eq!((chain.len(), first.reply_hashes.len()), (5, 1));
    chain.extend(&first.reply_hashes);
    s.add(first);
    // Prefilled, answered and finished in one step: the prompt's blocks, then its reply's.
    assert_eq!(stored(&s.step().kv_events), [(chain.clone(), None)]);

    s.add(request(&prompt, 1, &tok));
    let again = s.step();
    assert_eq!(again.admitted[0].cached_tokens, 16 * 5);
    assert!(again.kv_events.is_empty(), "{:?}", again.kv_events);

    let mut diverging = prompt[..64 * 3].to_vec();
    diverging.extend(vec![b'z'; 64 * 2]);
    let third = request(&diverging, 1, &tok);
    let fresh = third.hashes[3..].to_vec();
    s.add(third);
    let out = s.step();
    assert_eq!(out.admitted[0].cached_tokens, 16 * 3);
    assert_eq!(stored(&out.kv_events), [(fresh, Some(chain[2]))]);
}

/// P/D: blocks brought in by a transfer are stored (with their token ids) in the step after
/// the request is queued, a held prompt is never removed while held, and the events still
/// give a consumer exactly the pool's named blocks, through eviction of both once let go.
#[test]
fn transferred_and_held_blocks_keep_the_events_in_step() {
    let tok = PromptTokenizer::default();
    let mut s = Scheduler::new(Profile::get(ProfileName::H100Llama8b).with_kv_tokens(16 * 12));
    s.record_kv_events();
    let mut held = HashSet::new();
    let mut tally = Tally::default();
    let prompt = |seed: u8| -> Vec<u8> {
        (0..64 * 4 + 8)
            .map(|i| b'a' + ((i + seed as usize) % 26) as u8)
            .collect()
    };
    // Prefill side: 4 blocks held past the request's end.
    let mut p = request(&prompt(0), 1, &tok);
    p.kv_transfer.hold = Some("p".into());
    s.add(p);
    let mut pinned = Vec::new();
    while !s.is_idle() {
        let out = s.step();
        apply(&mut held, &out.kv_events, &mut tally);
        pinned.extend(out.held.into_iter().flat_map(|h| h.hashes));
    }
    assert_eq!(pinned.len(), 4);
    // Decode side: a prompt whose 4 blocks were read elsewhere.
    let mut d = request(&prompt(1), 1, &tok);
    d.kv_transfer.import_blocks = 4;
    d.kv_transfer.transferred_blocks = 4;
    let read = d.hashes.clone();
    s.add(d);
    let out = s.step();
    assert_eq!(stored(&out.kv_events[..1]), [(read, None)]);
    apply(&mut held, &out.kv_events, &mut tally);
    assert_eq!(held, s.pool().hashed_blocks());
    // Pressure from other prompts: the held blocks stay, the rest come and go in step.
    for seed in 2..8 {
        s.add(request(&prompt(seed), 1, &tok));
        while !s.is_idle() {
            let out = s.step();
            apply(&mut held, &out.kv_events, &mut tally);
            assert_eq!(held, s.pool().hashed_blocks(), "seed {seed}");
        }
        assert!(pinned.iter().all(|h| held.contains(h)), "seed {seed}");
    }
    s.release_held(&pinned);
    for seed in 8..12 {
        s.add(request(&prompt(seed), 1, &tok));
        while !s.is_idle() {
            let out = s.step();
            apply(&mut held, &out.kv_events, &mut tally);
        }
    }
    assert_eq!(held, s.pool().hashed_blocks());
    assert!(
        pinned.iter().any(|h| !held.contains(h)),
        "released, then evicted"
    );
    assert!(tally.removed > 8, "{tally:?}");
}
