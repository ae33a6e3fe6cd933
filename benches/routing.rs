//! Placement cost on the request path: body parse + canonical prompt + block hashing + session
//! key + ring walk + bound check, for 1 KB and 100 KB chat bodies; kv_aware's whole decision,
//! on one model's fleet and on one model's pool of a 4-model fleet.
//!
//! `cargo bench --bench routing`

// The binary's allocator (src/main.rs), so the figures are the proxy's.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvroute::placement::{self, BackendLoad, Params, PolicyKind, PrefixIndex, Ring, Snapshot};
use kvroute::request::DEFAULT_BLOCK_BYTES;
use kvroute::request::{self, Endpoint, PromptText, SessionKeys, TokenEstimator};
use std::hint::black_box;
use std::net::SocketAddr;

/// A multi-turn conversation whose JSON body is about `bytes` long.
fn body(bytes: usize) -> Vec<u8> {
    let mut messages = vec![
        serde_json::json!({"role": "system", "content": "You are a helpful assistant.\nAnswer briefly."}),
    ];
    let mut turn = 0;
    while serde_json::to_vec(&messages).unwrap().len() < bytes {
        messages.push(serde_json::json!({"role": "user", "content": format!("Question {turn}: explain \"prefix caching\" in detail, with examples.\n{}", "lorem ipsum dolor sit amet ".repeat(20))}));
        messages.push(serde_json::json!({"role": "assistant", "content": format!("Answer {turn}: {}", "the key/value cache holds attention state; ".repeat(20))}));
        turn += 1;
    }
    serde_json::to_vec(
        &serde_json::json!({"model": "llama-8b", "stream": true, "messages": messages}),
    )
    .unwrap()
}

fn fleet(n: usize) -> (Ring, Vec<BackendLoad>) {
    let addrs: Vec<(SocketAddr, u32)> = (0..n)
        .map(|i| {
            (
                SocketAddr::from(([10, 0, (i / 256) as u8, (i % 256) as u8], 8000)),
                1,
            )
        })
        .collect();
    let loads = (0..n)
        .map(|i| BackendLoad {
            inflight: (i as u64 * 7) % 13,
            queued_prefill: (i as u64 * 3_001) % 40_000,
            decoding: (i as u64 * 5) % 31,
            ..BackendLoad::idle()
        })
        .collect();
    (Ring::new(&addrs), loads)
}

fn routing(c: &mut Criterion) {
    let params = Params::new(PolicyKind::BoundedHash, 0.5, 1);
    let (ring, loads) = fleet(16);
    let mut g = c.benchmark_group("profile_and_place");
    for size in [1_000usize, 100_000] {
        let b = body(size);
        g.throughput(Throughput::Bytes(b.len() as u64));
        g.bench_with_input(BenchmarkId::from_parameter(size), &b, |bench, b| {
            bench.iter(|| {
                let p = request::profile(
                    Endpoint::Chat,
                    black_box(b),
                    SessionKeys::default(),
                    DEFAULT_BLOCK_BYTES,
                )
                .unwrap();
                let snap = Snapshot {
                    backends: &loads,
                    ring: &ring,
                    matched: &[],
                    later_turns: 1.0,
                };
                black_box(placement::choose(&params, &p, &snap, &[], 0))
            })
        });
    }
    g.finish();

    // The same with the prompt's tokens counted (o200k_base), as kvroute does for prompts up
    // to routing.count_tokens_max_bytes.
    let tokens = TokenEstimator::default();
    tokens.warm_now();
    let mut g = c.benchmark_group("profile_count_and_place");
    for size in [1_000usize, 4_000] {
        let b = body(size);
        g.throughput(Throughput::Bytes(b.len() as u64));
        g.bench_with_input(BenchmarkId::from_parameter(size), &b, |bench, b| {
            bench.iter(|| {
                let (mut p, text) = request::profile_with_text(
                    Endpoint::Chat,
                    black_box(b),
                    SessionKeys::default(),
                    DEFAULT_BLOCK_BYTES,
                    8192,
                )
                .unwrap();
                if let PromptText::Text(t) = &text {
                    p.est_prompt_tokens = tokens.estimate(&p.model, Some(t), t.len(), 8192).tokens;
                }
                let snap = Snapshot {
                    backends: &loads,
                    ring: &ring,
                    matched: &[],
                    later_turns: 1.0,
                };
                black_box(placement::choose(&params, &p, &snap, &[], 0))
            })
        });
    }
    g.finish();

    let p = request::profile(
        Endpoint::Chat,
        &body(1_000),
        SessionKeys::default(),
        DEFAULT_BLOCK_BYTES,
    )
    .unwrap();
    let mut g = c.benchmark_group("place_only");
    for n in [8usize, 64] {
        let (ring, loads) = fleet(n);
        g.bench_with_input(BenchmarkId::from_parameter(n), &n, |bench, _| {
            bench.iter(|| {
                let snap = Snapshot {
                    backends: &loads,
                    ring: &ring,
                    matched: &[],
                    later_turns: 1.0,
                };
                black_box(placement::choose(&params, black_box(&p), &snap, &[], 0))
            })
        });
    }
    g.finish();
}

/// kv_aware's whole decision for a 100 KB prompt on 64 backends whose index holds 1 M blocks:
/// parse and hash, longest-match lookup, cost model, ring walk.
fn kv_aware(c: &mut Criterion) {
    let n = 64;
    let (ring, loads) = fleet(n);
    let params = Params::new(PolicyKind::KvAware, 0.5, 1);
    let b = body(100_000);
    let p = request::profile(
        Endpoint::Chat,
        &b,
        SessionKeys::default(),
        DEFAULT_BLOCK_BYTES,
    )
    .unwrap();
    let per_backend = 1_000_000 / n;
    let mut index = PrefixIndex::new(&vec![per_backend; n]);
    for slot in 0..n {
        // Unrelated conversations fill each backend...
        let mut filler = 0u64;
        while index.blocks_of(slot) < per_backend - p.prefix_blocks.len() {
            let blocks: Vec<u64> = (0..64)
                .map(|k| ((slot as u64) << 40) ^ (filler << 8) ^ k)
                .collect();
            index.insert(slot, &blocks);
            filler += 1;
        }
        // ...and some hold part of this prompt's prefix.
        let share = p.prefix_blocks.len() * (slot % 4) / 4;
        index.insert(slot, &p.prefix_blocks[..share]);
    }
    eprintln!(
        "index: {} blocks, {:.1} bytes per block",
        index.blocks(),
        index.bytes() as f64 / index.blocks() as f64
    );
    let mut matched = vec![0u32; n];
    // As the fleet reports matches to placement: tokens.
    let block_tokens = params.block_tokens;
    let tokens_of =
        |m: &[u32]| -> Vec<u64> { m.iter().map(|&b| b as u64 * block_tokens).collect() };
    c.bench_function("kv_aware_decision/100000B_64backends_1Mblocks", |bench| {
        bench.iter(|| {
            let p = request::profile(
                Endpoint::Chat,
                black_box(&b),
                SessionKeys::default(),
                DEFAULT_BLOCK_BYTES,
            )
            .unwrap();
            index.longest_matches(&p.prefix_blocks, &mut matched);
            let tokens = tokens_of(&matched);
            let snap = Snapshot {
                backends: &loads,
                ring: &ring,
                matched: &tokens,
                later_turns: 1.0,
            };
            black_box(placement::choose(&params, &p, &snap, &[], 0))
        })
    });
    // The same on a fleet of 4 models x 16 backends: the decision runs on one model's pool
    // (its part of the snapshot, its own ring) and maps back to fleet indices.
    let addrs: Vec<(SocketAddr, u32)> = (0..n)
        .map(|i| (SocketAddr::from(([10, 0, 0, i as u8], 8000)), 1))
        .collect();
    let members: Vec<usize> = (32..48).collect();
    let pool = placement::Pool {
        ring: Some(Ring::new(
            &members.iter().map(|&i| addrs[i]).collect::<Vec<_>>(),
        )),
        members,
        listed: true,
        adapter: false,
    };
    c.bench_function(
        "kv_aware_decision_4models/100000B_64backends_1Mblocks",
        |bench| {
            bench.iter(|| {
                let p = request::profile(
                    Endpoint::Chat,
                    black_box(&b),
                    SessionKeys::default(),
                    DEFAULT_BLOCK_BYTES,
                )
                .unwrap();
                index.longest_matches(&p.prefix_blocks, &mut matched);
                let tokens = tokens_of(&matched);
                let snap = Snapshot {
                    backends: &loads,
                    ring: &ring,
                    matched: &tokens,
                    later_turns: 1.0,
                };
                black_box(placement::choose_in(&params, &p, &snap, &pool, &[], 0))
            })
        },
    );
}

criterion_group!(benches, routing, kv_aware);
criterion_main!(benches);
