//! Prefill/decode disaggregation under failure, both protocols: a prefill server killed in
//! the middle of a burst loses no request (each is split again on the other prefill server,
//! or served whole where the decode server can), none hangs, and a storm of clients that
//! leave mid-request leaves no prefill server holding blocks for a decode that will not come.

mod common;

use common::*;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

const PROTOCOLS: [&str; 2] = ["vllm_nixl", "sglang_bootstrap"];

fn chat(i: usize, stream: bool) -> Value {
    let text = format!(
        "case {i}: {}",
        "the quick brown fox jumps over it ".repeat(60)
    );
    json!({"model": MODEL, "messages": [{"role": "user", "content": text}],
           "max_tokens": 8, "stream": stream})
}

/// Two prefill and two decode servers speaking `protocol`, every request split
/// (`decision: always`); the prefill servers take `prefill_ms` a request.
struct Fleet {
    prefill: Vec<Sim>,
    decode: Vec<Sim>,
    kv: Kvroute,
}

fn fleet(protocol: &str, prefill_ms: &str, extra: &[&str]) -> Fleet {
    let start = |role: &str, ttft: &str| {
        let mut args = vec!["--ttft-ms", ttft, "--itl-ms", "5", "--role", role];
        args.extend(["--pd-protocol", protocol]);
        args.extend_from_slice(extra);
        Sim::start(&args)
    };
    let prefill: Vec<Sim> = (0..2).map(|_| start("prefill", prefill_ms)).collect();
    let decode: Vec<Sim> = (0..2).map(|_| start("decode", "1")).collect();
    let mut backends: Vec<(std::net::SocketAddr, String)> = prefill
        .iter()
        .map(|s| {
            let lines = format!(
                "      role: prefill\n      bootstrap_port: {}\n",
                s.addr.port()
            );
            (s.addr, lines)
        })
        .collect();
    backends.extend(
        decode
            .iter()
            .map(|s| (s.addr, "      role: decode\n".into())),
    );
    let kv = Kvroute::start_with(
        &backends,
        &format!(
            "  disaggregation:\n    protocol: {protocol}\n    decision: always\n  health_check:\n    interval_ms: 100\n"
        ),
    );
    Fleet {
        prefill,
        decode,
        kv,
    }
}

fn state(s: &Sim) -> Value {
    let (_, body) = http_get(s.addr, "/debug/state");
    serde_json::from_slice(&body).unwrap_or(Value::Null)
}

/// Wait until no live server holds blocks or waits for a leg: what is left at the end of a run
/// is stranded.
fn wait_unstranded(sims: &[&Sim], within: Duration) {
    let deadline = Instant::now() + within;
    loop {
        let held: Vec<Value> = sims.iter().map(|s| state(s)["pd"].clone()).collect();
        let clear = held.iter().all(|pd| {
            ["held_requests", "waiting_decodes", "waiting_prefill_legs"]
                .iter()
                .all(|k| pd[k].as_u64().unwrap_or(0) == 0)
        });
        if clear {
            return;
        }
        assert!(Instant::now() < deadline, "stranded: {held:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_server_killed_mid_burst_loses_and_strands_nothing() {
    for protocol in PROTOCOLS {
        let mut f = fleet(protocol, "300", &[]);
        let url = f.kv.url("/v1/chat/completions");
        let c = client();
        let started = Instant::now();
        let burst: Vec<_> = (0..16)
            .map(|i| {
                let (c, url) = (c.clone(), url.clone());
                tokio::spawn(async move {
                    let r = c.post(&url).json(&chat(i, i % 2 == 0)).send().await;
                    match r {
                        Ok(r) => (r.status().as_u16(), r.text().await.unwrap_or_default()),
                        Err(e) => (0, e.to_string()),
                    }
                })
            })
            .collect();
        // Every prefill server is busy with the burst's legs: kill one.
        tokio::time::sleep(Duration::from_millis(150)).await;
        f.prefill[0].kill();
        for (i, task) in burst.into_iter().enumerate() {
            let (status, body) = task.await.unwrap();
            assert_eq!(
                status,
                200,
                "{protocol} request {i}: {body}\n{}",
                f.kv.log()
            );
            let whole = if i % 2 == 0 {
                body.contains("[DONE]") && !body.contains("\"error\"")
            } else {
                body.contains("chat.completion")
            };
            assert!(whole, "{protocol} request {i}: {body}");
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{protocol}: the burst took {:?}",
            started.elapsed()
        );
        let m = f.kv.metrics();
        assert!(
            metric_sum(
                &m,
                "kvroute_pd_prefill_legs_total",
                &[("outcome", "failed")]
            ) >= 1.0,
            "{protocol}: the kill failed no leg; log:\n{}",
            f.kv.log()
        );
        let live: Vec<&Sim> = f.prefill[1..].iter().chain(f.decode.iter()).collect();
        wait_unstranded(&live, Duration::from_secs(10));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_leaving_mid_request_leave_no_blocks_held() {
    for protocol in PROTOCOLS {
        // SGLang frees a room its decode server never fetched at its bootstrap timeout: 2 s
        // here, where the run ends.
        let f = fleet(protocol, "200", &["--pd-bootstrap-timeout-s", "2"]);
        let url = f.kv.url("/v1/chat/completions");
        let storm: Vec<_> = (0..12)
            .map(|i| {
                let url = url.clone();
                tokio::spawn(async move {
                    let c = client();
                    let leave = Duration::from_millis(20 + 30 * (i as u64 % 8));
                    let _ = tokio::time::timeout(
                        leave,
                        c.post(&url).json(&chat(100 + i, i % 2 == 0)).send(),
                    )
                    .await;
                })
            })
            .collect();
        for t in storm {
            t.await.unwrap();
        }
        // The fleet still serves, and nothing is left held once the legs have settled.
        let (status, body) = {
            let r = client()
                .post(&url)
                .json(&chat(999, false))
                .send()
                .await
                .unwrap();
            (r.status().as_u16(), r.text().await.unwrap_or_default())
        };
        assert_eq!(status, 200, "{protocol}: {body}");
        let all: Vec<&Sim> = f.prefill.iter().chain(f.decode.iter()).collect();
        wait_unstranded(&all, Duration::from_secs(15));
    }
}
