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

/// An engine without a KV connector: it answers every request (a prefill leg included) in
/// full, holding nothing for a remote decode, as vLLM started without `--kv-transfer-config`
/// does. Counts the POSTs it answered and keeps their bodies.
struct PlainEngine {
    addr: std::net::SocketAddr,
    bodies: std::sync::Arc<std::sync::Mutex<Vec<Vec<u8>>>>,
}

impl PlainEngine {
    fn start() -> PlainEngine {
        use std::io::{BufRead, BufReader, Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let bodies = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = bodies.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { continue };
                let seen = seen.clone();
                std::thread::spawn(move || {
                    let mut reader = BufReader::new(stream.try_clone().unwrap());
                    let mut line = String::new();
                    let (mut len, mut post) = (0usize, false);
                    while reader.read_line(&mut line).unwrap_or(0) > 0 {
                        let l = line.trim_end().to_ascii_lowercase();
                        if l.is_empty() {
                            break;
                        }
                        post |= l.starts_with("post ");
                        if let Some(v) = l.strip_prefix("content-length:") {
                            len = v.trim().parse().unwrap_or(0);
                        }
                        line.clear();
                    }
                    let mut body = vec![0; len];
                    if reader.read_exact(&mut body).is_err() {
                        return;
                    }
                    if post {
                        seen.lock().unwrap().push(body);
                    }
                    let answer = r#"{"id":"x","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"a"},"finish_reason":"length"}],"usage":{"prompt_tokens":5,"completion_tokens":1,"total_tokens":6}}"#;
                    let _ = write!(
                        stream,
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{answer}",
                        answer.len()
                    );
                });
            }
        });
        PlainEngine { addr, bodies }
    }

    fn bodies(&self) -> Vec<Value> {
        let bodies = self.bodies.lock().unwrap();
        bodies
            .iter()
            .map(|b| serde_json::from_slice(b).unwrap())
            .collect()
    }
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
/// priced at 100 prompt tokens a second, the prefill server at a million, a transfer at a
/// second: a long prompt (2,000 tokens) is cheaper prefilled there and moved, a short one (up
/// to 100 tokens to compute) is served where it is.
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
        "  disaggregation:\n    protocol: vllm_nixl\n    transfer_base_ms: 1000\n",
    )
}

/// A prefill leg that comes back holding nothing (this engine has no KV connector) is not a
/// hung decode: the request is served whole on its decode server, counted, and the prefill
/// server got exactly the NIXL prefill body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_leg_holding_nothing_is_served_whole_on_the_decode_server() {
    let (p, d) = (PlainEngine::start(), Sim::start(&["--ttft-ms", "1"]));
    let kv = split_fleet(p.addr, d.addr);
    let long = format!("summarise {}", "lorem ipsum dolor sit amet ".repeat(300));
    let body = chat(&long, false);
    let (status, text) = send(&kv, &body).await;
    assert_eq!(status, 200, "{text}");
    assert!(text.contains("chat.completion"), "{text}");

    let prefilled = p.bodies();
    assert_eq!(prefilled.len(), 1, "{prefilled:?}");
    let expected = kvroute::request::nixl::prefill_body(body.to_string().as_bytes()).unwrap();
    assert_eq!(
        prefilled[0],
        serde_json::from_slice::<Value>(&expected).unwrap()
    );
    assert_eq!(prefilled[0]["max_tokens"], 1);
    assert_eq!(prefilled[0]["kv_transfer_params"]["do_remote_decode"], true);
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
    assert_eq!(p.bodies().len(), 2);
    for i in 0..4 {
        let (status, _) = send(&kv, &chat(&format!("hello {i}"), false)).await;
        assert_eq!(status, 200);
    }
    assert_eq!(p.bodies().len(), 2);
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

/// The whole protocol against engines that speak it: the prefill server holds the prompt's
/// blocks under the id both legs carry, the decode server reads them and streams the reply,
/// the client's usage says the prefill server's cache hit (not the prefix the decode server
/// read), and nothing stays held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_split_request_is_prefilled_moved_and_decoded() {
    let nixl = |role| {
        [
            "--ttft-ms",
            "1",
            "--role",
            role,
            "--pd-protocol",
            "vllm_nixl",
        ]
    };
    let (p, d) = (Sim::start(&nixl("prefill")), Sim::start(&nixl("decode")));
    let kv = split_fleet(p.addr, d.addr);
    let long = format!("summarise {}", "lorem ipsum dolor sit amet ".repeat(300));
    let mut body = chat(&long, true);
    body["stream_options"] = json!({"include_usage": true});
    let (status, text) = send(&kv, &body).await;
    assert_eq!(status, 200, "{text}");
    assert!(text.contains("[DONE]"), "{text}");
    let usage: Value = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find_map(|v| v.get("usage").filter(|u| u.is_object()).cloned())
        .expect("a usage chunk");
    assert!(usage["prompt_tokens"].as_u64().unwrap() > 1000, "{usage}");
    // Nothing was cached on the prefill server: the client's hit is 0, whatever the decode
    // server read.
    assert_eq!(
        usage["prompt_tokens_details"]["cached_tokens"], 0,
        "{usage}"
    );

    let state = |s: &Sim| -> Value {
        let (_, body) = http_get(s.addr, "/debug/state");
        serde_json::from_slice(&body).unwrap()
    };
    let (ps, ds) = (state(&p), state(&d));
    assert_eq!(ds["pd"]["transfers_total"], 1, "{ds}");
    assert!(
        ds["pd"]["transfer_tokens_total"].as_u64().unwrap() > 1000,
        "{ds}"
    );
    assert_eq!(ds["pd"]["failed_transfers_total"], 0, "{ds}");
    assert_eq!(ps["pd"]["released_total"], 1, "{ps}");
    assert_eq!(ps["pd"]["held_requests"], 0, "{ps}");
    let text = kv.metrics();
    assert_eq!(
        metric_sum(&text, "kvroute_pd_prefill_legs_total", &[("outcome", "ok")]),
        1.0
    );
    // The next turn's history sits on the decode server: served there whole.
    let mut next = body.clone();
    next["messages"] = json!([
        {"role": "user", "content": long},
        {"role": "assistant", "content": "tok0 tok1 tok2 tok3"},
        {"role": "user", "content": "and in one line?"}
    ]);
    let (status, _) = send(&kv, &next).await;
    assert_eq!(status, 200);
    assert_eq!(p.requests().len(), 1, "the follow-up is not split");
    assert_eq!(
        kv.metric_sum("kvroute_pd_decisions_total", &[("outcome", "whole")]),
        1.0
    );
}

/// A client that goes away while its prefill leg runs leaves no blocks held on the prefill
/// server past the moment kvroute finds it gone: the decode leg is still sent (the prefill
/// server holds the prompt for it), cut with the client, and the decode server's abort
/// notifies the prefill server, which frees the blocks at once rather than after its abort
/// timeout (480 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_mid_prefill_leaves_nothing_held() {
    let (p, d) = (
        Sim::start(&[
            "--ttft-ms",
            "400",
            "--role",
            "prefill",
            "--pd-protocol",
            "vllm_nixl",
        ]),
        // A read of ~50 s: only the cut ends it within the test.
        Sim::start(&[
            "--ttft-ms",
            "1",
            "--itl-ms",
            "50",
            "--role",
            "decode",
            "--pd-protocol",
            "vllm_nixl",
            "--kv-transfer-gbps",
            "0.005",
        ]),
    );
    let kv = split_fleet(p.addr, d.addr);
    let long = format!("summarise {}", "lorem ipsum dolor sit amet ".repeat(300));
    let mut body = chat(&long, true);
    body["max_tokens"] = json!(200);
    let gone = client()
        .post(kv.url("/v1/chat/completions"))
        .json(&body)
        .timeout(std::time::Duration::from_millis(150))
        .send()
        .await;
    assert!(gone.is_err(), "the client left before any answer");
    let state = |s: &Sim| -> Value {
        let (_, body) = http_get(s.addr, "/debug/state");
        serde_json::from_slice(&body).unwrap()
    };
    // The prefill leg ends (400 ms), the decode leg starts reading and is cut: nothing held.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let ps = state(&p);
        if ps["pd"]["released_total"] == 1 && ps["pd"]["held_requests"] == 0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the prefill server still holds the blocks: {ps}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(state(&p)["pd"]["expired_total"], 0);
    assert_eq!(
        kv.metric_sum("kvroute_pd_prefill_legs_total", &[("outcome", "ok")]),
        1.0
    );
}
