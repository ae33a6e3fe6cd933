//! Load-aware affinity end to end: on engines that run a fixed number of requests at once
//! (llama.cpp's slots, here the simulator's `cpu-smollm2` stand-in for two `llama-server`s of
//! two slots), kvroute never queues a request behind a full engine while another one idles,
//! even when the requests' session key names the full one.

mod common;

use common::*;
use serde_json::json;
use std::time::Duration;

/// The simulated llama.cpp engines' model name.
const LLAMA_MODEL: &str = "smollm2-135m";

fn gauge(addr: std::net::SocketAddr, name: &str) -> f64 {
    let (_, body) = http_get(addr, "/metrics");
    metric_sum(&String::from_utf8_lossy(&body), name, &[])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_is_not_queued_behind_full_slots_while_another_engine_idles() {
    // Ten times real time: a reply of 1,500 tokens holds its slot for ~1.5 s of wall time.
    let sims = Sim::start_n(
        2,
        &[
            "--profile",
            "cpu-smollm2",
            "--model",
            LLAMA_MODEL,
            "--time-scale",
            "10",
        ],
    );
    let backends: Vec<_> = sims
        .iter()
        .map(|s| (s.addr, "      engine: llamacpp\n".to_string()))
        .collect();
    let kv = Kvroute::start_with(
        &backends,
        "  routing:\n    policy: kv_aware\n  telemetry:\n    interval_ms: 100\n",
    );
    // kvroute must know the engines' slots (from llama.cpp's /props) before it can see them
    // full.
    let known = || {
        let (_, body) = http_get(kv.admin, "/backends");
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
        v.as_array()
            .is_some_and(|l| l.len() == 2 && l.iter().all(|b| b["slots"] == 2))
    };
    for _ in 0..100 {
        if known() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(known(), "slots never learned; log:\n{}", kv.log());

    let c = client();
    let url = kv.url("/v1/chat/completions");
    // Three conversations of one session: one ring owner for all three.
    let question = |i: usize| format!("Question {i} about rivers and bridges.");
    let send = |messages: serde_json::Value| {
        let (c, url) = (c.clone(), url.clone());
        let body = chat_body(LLAMA_MODEL, messages, true, 1500);
        async move {
            let resp = c
                .post(&url)
                .header("x-session-id", "one-owner")
                .json(&body)
                .send()
                .await
                .expect("request");
            assert_eq!(resp.status(), 200);
            let served = resp.headers()["x-kvbench-addr"]
                .to_str()
                .unwrap()
                .to_string();
            // Until the first token the request is still being placed and prefilled.
            let mut stream = resp;
            let first = stream.chunk().await.expect("first chunk");
            assert!(first.is_some());
            (served, stream)
        }
    };
    let first = |i: usize| json!([{"role": "user", "content": question(i)}]);
    let (a, sa) = send(first(0)).await;
    let (b, sb) = send(first(1)).await;
    // The owner runs two streams: both its slots are taken.
    assert_eq!(a, b, "an idle owner takes its second conversation");
    let (third, sc) = send(first(2)).await;
    assert_ne!(
        third,
        a,
        "queued behind two running streams while another engine idled; log:\n{}",
        kv.log()
    );
    // A later turn of a conversation the full owner holds: its short history is cheaper to
    // compute again on the engine with a free slot than the wait for one there.
    let later = json!([
        {"role": "user", "content": question(0)},
        {"role": "assistant", "content": "Rivers run under bridges."},
        {"role": "user", "content": "And the bridges?"},
    ]);
    let (fourth, sd) = send(later).await;
    assert_ne!(
        fourth,
        a,
        "a follow-up waited for a slot; log:\n{}",
        kv.log()
    );
    for s in &sims {
        assert_eq!(gauge(s.addr, "llamacpp:requests_deferred"), 0.0);
    }
    // The streams run to their end.
    for mut s in [sa, sb, sc, sd] {
        while s.chunk().await.expect("chunk").is_some() {}
    }
}
