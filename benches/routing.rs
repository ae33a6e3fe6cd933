//! Placement cost on the request path: body parse + canonical prompt + block hashing + session
//! key + ring walk + bound check, for 1 KB and 100 KB chat bodies.
//!
//! `cargo bench --bench routing`

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvroute::policy::{self, BackendLoad, Params, PolicyKind, Snapshot};
use kvroute::prefix::DEFAULT_BLOCK_BYTES;
use kvroute::request::{self, Endpoint};
use kvroute::ring::Ring;
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
            healthy: true,
            weight: 1,
            inflight: (i as u64 * 7) % 13,
        })
        .collect();
    (Ring::new(&addrs), loads)
}

fn routing(c: &mut Criterion) {
    let params = Params {
        policy: PolicyKind::BoundedHash,
        epsilon: 0.5,
        slack: 1,
    };
    let (ring, loads) = fleet(16);
    let mut g = c.benchmark_group("profile_and_place");
    for size in [1_000usize, 100_000] {
        let b = body(size);
        g.throughput(Throughput::Bytes(b.len() as u64));
        g.bench_with_input(BenchmarkId::from_parameter(size), &b, |bench, b| {
            bench.iter(|| {
                let p = request::profile(Endpoint::Chat, black_box(b), None, DEFAULT_BLOCK_BYTES)
                    .unwrap();
                let snap = Snapshot {
                    backends: &loads,
                    ring: &ring,
                };
                black_box(policy::choose(&params, &p, &snap, &[], 0))
            })
        });
    }
    g.finish();

    let p = request::profile(Endpoint::Chat, &body(1_000), None, DEFAULT_BLOCK_BYTES).unwrap();
    let mut g = c.benchmark_group("place_only");
    for n in [8usize, 64] {
        let (ring, loads) = fleet(n);
        g.bench_with_input(BenchmarkId::from_parameter(n), &n, |bench, _| {
            bench.iter(|| {
                let snap = Snapshot {
                    backends: &loads,
                    ring: &ring,
                };
                black_box(policy::choose(&params, black_box(&p), &snap, &[], 0))
            })
        });
    }
    g.finish();
}

criterion_group!(benches, routing);
criterion_main!(benches);
