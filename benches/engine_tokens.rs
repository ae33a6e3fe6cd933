//! The exact index's cost on a request: rendering the chat template and tokenizing the prompt
//! as the engine does (`kvroute.kv_events`, off the proxy's threads), then chain-hashing its
//! token blocks; and matching those blocks against a fleet's exact index.
//!
//! - `cold`: every piece of the prompt is new (a first request of its text);
//! - `next_turn`: the conversation so far was tokenized for the previous turn (the memo holds
//!   its pieces), so only the new messages are.
//!
//! `cargo bench --bench engine_tokens`

// The binary's allocator (src/main.rs), so the figures are the proxy's.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvroute::config::KvEventsConfig;
use kvroute::placement::{ExactIndex, Stored, SyncState};
use kvroute::request::engine_tokens::EngineTokenizer;
use kvroute::request::Endpoint;
use std::hint::black_box;
use std::path::PathBuf;

fn tokenizer() -> EngineTokenizer {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("bench/data/tokenizer/chatml-bpe8k");
    EngineTokenizer::load(&KvEventsConfig::new(
        dir.join("tokenizer.json"),
        dir.join("tokenizer_config.json"),
    ))
    .expect("the shipped tokenizer loads")
}

/// A conversation of about `bytes` of message text; `salt` makes its text unique.
fn conversation(bytes: usize, salt: u64) -> Vec<serde_json::Value> {
    let mut messages = vec![
        serde_json::json!({"role": "system", "content": format!("You are assistant {salt}. Answer briefly.")}),
    ];
    let mut turn = 0;
    let mut len = 0;
    while len < bytes {
        let user = format!(
            "Question {salt}-{turn}: explain prefix caching in detail, with examples. {}",
            "The cache keeps attention state for tokens already seen. ".repeat(8)
        );
        let reply = format!(
            "Answer {salt}-{turn}: {}",
            "the key and value tensors of every layer stay on the GPU; ".repeat(8)
        );
        len += user.len() + reply.len();
        messages.push(serde_json::json!({"role": "user", "content": user}));
        messages.push(serde_json::json!({"role": "assistant", "content": reply}));
        turn += 1;
    }
    messages.push(serde_json::json!({"role": "user", "content": format!("And finally {salt}?")}));
    messages
}

fn body(messages: &[serde_json::Value]) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({"model": "m", "messages": messages})).unwrap()
}

/// What a request pays: its prompt's tokens, then their chain-hashed blocks.
fn measured(t: &EngineTokenizer, bytes: &[u8]) -> Vec<u64> {
    let tokens = t.prompt_tokens(bytes, Endpoint::Chat).expect("tokens");
    black_box(t.blocks(&tokens, None, None))
}

fn tokenize(c: &mut Criterion) {
    let t = tokenizer();
    let mut g = c.benchmark_group("engine_tokens");
    for &kb in &[1usize, 10, 100] {
        g.throughput(Throughput::Bytes((kb * 1024) as u64));
        let mut salt = 0u64;
        g.bench_with_input(
            BenchmarkId::new("cold", format!("{kb}KB")),
            &kb,
            |b, &kb| {
                b.iter_batched(
                    || {
                        salt += 1;
                        body(&conversation(kb * 1024, salt))
                    },
                    |bytes| measured(&t, &bytes),
                    criterion::BatchSize::SmallInput,
                )
            },
        );
        // The previous turn (all but the last two messages) was tokenized already.
        g.bench_with_input(
            BenchmarkId::new("next_turn", format!("{kb}KB")),
            &kb,
            |b, &kb| {
                b.iter_batched(
                    || {
                        salt += 1;
                        let mut m = conversation(kb * 1024, salt);
                        let prev = body(&m[..m.len() - 2]);
                        let _ = t.prompt_tokens(&prev, Endpoint::Chat);
                        m.push(serde_json::json!({"role": "assistant", "content": "Sure."}));
                        m.push(serde_json::json!({"role": "user", "content": "Go on."}));
                        body(&m)
                    },
                    |bytes| measured(&t, &bytes),
                    criterion::BatchSize::SmallInput,
                )
            },
        );
    }
    g.finish();
}

/// Matching a 100 KB prompt's blocks against 64 synced backends holding 1M blocks in all.
fn matching(c: &mut Criterion) {
    let t = tokenizer();
    let tokens = t
        .prompt_tokens(&body(&conversation(100 * 1024, 7)), Endpoint::Chat)
        .unwrap();
    let blocks = t.blocks(&tokens, None, None);
    let mut ix = ExactIndex::new(64);
    let filler: Vec<u32> = (0..16 * 16_384).map(|i| (i % 8000) as u32).collect();
    for slot in 0..64usize {
        ix.reset(slot, SyncState::Synced);
        // Each engine holds its own 16k blocks, and part of this prompt.
        let base = (slot as u64) << 32;
        let hashes: Vec<u64> = (0..16_384u64).map(|i| base + i).collect();
        let adapter = slot.to_string();
        let other = Stored {
            lora: Some(&adapter),
            ..Stored::tokens(&filler, 16)
        };
        ix.stored(slot, &hashes, None, other);
        let share = blocks.len() * (slot % 4) / 4;
        let own: Vec<u64> = (0..share as u64).map(|i| base + (1 << 20) + i).collect();
        ix.stored(slot, &own, None, Stored::tokens(&tokens[..share * 16], 16));
    }
    let mut out = vec![None; 64];
    c.bench_function("exact_match/100KB_64backends_1Mblocks", |b| {
        b.iter(|| {
            ix.longest_matches(black_box(&blocks), &mut out);
            black_box(&out);
        })
    });
}

criterion_group!(benches, tokenize, matching);
criterion_main!(benches);
