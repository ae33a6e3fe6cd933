//! Prefill/decode disaggregation through real processes: kvroute decides per request whether
//! to prefill on a prefill server, sends that leg in vLLM's NIXL shape, and serves the request
//! whole on its decode server when the prefill leg holds nothing; a prefill server never
//! serves a request whole.

mod common;

use common::*;
use serde_json::{json, Value};

fn chat(text: &str, stream: bool) -> Value {
    json!({"model": MODEL, "messages": [{"role": "user", "content": text}],
           "max_tokens": 4, "stream": stream})
}

async fn send(kv: &Kvroute, body: &Value) -> (u16, String) {
    let r = client()
        .post(kv.url("/v1/chat/completions"))
        .json(body)
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

/// kvroute's config for a prefill server `p` and a decode server `d`. The decode server is
/// priced at 100 prompt tokens a second, the prefill server at a million, a transfer at 200 ms:
/// a long prompt is cheaper prefilled there and moved, a short one is served where it is.
fn split_fleet(p: std::net::SocketAddr, d: std::net::SocketAddr) -> Kvroute {
    Kvroute::start_with(
        &[
            (
                p,
                "      role: prefill\n      prefill_tokens_per_s: 1000000\n".into(),
            ),
            (
                d,
                "      role: decode\n      prefill_tokens_per_s: 100\n".into(),
            ),
        ],
        "  disaggregation:\n    protocol: vllm_nixl\n    transfer_base_ms: 200\n",
    )
}

/// A prefill leg that comes back holding nothing (this engine does not speak NIXL) is not a
/// hung decode: the request is served whole on its decode server, counted, and the prefill
/// server got exactly the NIXL prefill body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_leg_holding_nothing_is_served_whole_on_the_decode_server() {
    let (p, d) = (
        Sim::start(&["--ttft-ms", "1"]),
        Sim::start(&["--ttft-ms", "1"]),
    );
    let kv = split_fleet(p.addr, d.addr);
    let long = format!("summarise {}", "lorem ipsum dolor sit amet ".repeat(300));
    let body = chat(&long, false);
    let (status, text) = send(&kv, &body).await;
    assert_eq!(status, 200, "{text}");
    assert!(text.contains("chat.completion"), "{text}");

    let prefilled = p.requests();
    assert_eq!(prefilled.len(), 1, "{prefilled:?}");
    let expected = kvroute::request::nixl::prefill_body(body.to_string().as_bytes()).unwrap();
    assert_eq!(
        prefilled[0]["body_xxh3"],
        format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&expected)),
        "the prefill server gets the NIXL prefill body"
    );
    assert_eq!(prefilled[0]["stream"], false);
    // Served whole on the decode server, with the client's own body.
    let decoded = d.requests();
    assert_eq!(decoded.len(), 1);
    assert_eq!(
        decoded[0]["body_xxh3"],
        format!(
            "{:016x}",
            xxhash_rust::xxh3::xxh3_64(body.to_string().as_bytes())
        )
    );

    let text = kv.metrics();
    let count = |name, labels: &[(&str, &str)]| metric_sum(&text, name, labels);
    assert_eq!(
        count("kvroute_pd_decisions_total", &[("outcome", "split")]),
        1.0
    );
    assert_eq!(
        count("kvroute_pd_prefill_legs_total", &[("outcome", "no_params")]),
        1.0
    );

    // The prefill server failed that request's leg, not every request's: the next long
    // prompt is split again. A short prompt is served whole where it is, and the prefill
    // server never serves one whole.
    let (status, _) = send(&kv, &chat(&format!("again {long}"), true)).await;
    assert_eq!(status, 200);
    assert_eq!(p.requests().len(), 2);
    for i in 0..4 {
        let (status, _) = send(&kv, &chat(&format!("hello {i}"), false)).await;
        assert_eq!(status, 200);
    }
    assert_eq!(p.requests().len(), 2);
    assert_eq!(d.requests().len(), 6);
    let text = kv.metrics();
    assert_eq!(
        metric_sum(&text, "kvroute_pd_decisions_total", &[("outcome", "whole")]),
        4.0
    );
    let (_, view) = http_get(kv.admin, "/debug/backends");
    let view: Value = serde_json::from_slice(&view).unwrap();
    let roles: Vec<&str> = view["backends"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["role"].as_str().unwrap())
        .collect();
    assert_eq!(roles, ["prefill", "decode"]);
}

/// A prefill server that fails the leg (500) costs the request nothing but the attempt: it is
/// served whole on its decode server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_prefill_leg_leaves_the_request_whole() {
    let (p, d) = (
        Sim::start(&["--ttft-ms", "1", "--fail-rate", "1"]),
        Sim::start(&["--ttft-ms", "1"]),
    );
    let kv = split_fleet(p.addr, d.addr);
    let long = format!("summarise {}", "lorem ipsum dolor sit amet ".repeat(300));
    let (status, text) = send(&kv, &chat(&long, true)).await;
    assert_eq!(status, 200, "{text}");
    assert!(text.contains("[DONE]"), "{text}");
    assert_eq!((p.requests().len(), d.requests().len()), (1, 1));
    assert_eq!(
        kv.metric_sum("kvroute_pd_prefill_legs_total", &[("outcome", "failed")]),
        1.0
    );
}
