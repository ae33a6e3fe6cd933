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

/// A simulator's `/debug/state`.
fn state(s: &Sim) -> Value {
    let (_, body) = http_get(s.addr, "/debug/state");
    serde_json::from_slice(&body).unwrap()
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
/// to 100 tokens to compute) is served where it is. Learning is off: the fixed-timing
/// simulator's counters would replace the decode server's price once a scrape saw its first
/// prefill, and the tests' decisions would depend on when that scrape came.
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
        "  routing:\n    learn_prefill_rate: false\n  disaggregation:\n    protocol: vllm_nixl\n    transfer_base_ms: 1000\n  telemetry:\n    interval_ms: 100\n",
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

/// A prefill server that fails the leg is not the request's last chance: placed again, it is
/// split on another prefill server (within the retry budget), which the decode server then
/// reads from.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_prefill_leg_is_retried_on_another_prefill_server() {
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
    let failing = Sim::start(&["--ttft-ms", "1", "--fail-rate", "1"]);
    let (p, d) = (Sim::start(&nixl("prefill")), Sim::start(&nixl("decode")));
    let prefill = "      role: prefill\n      prefill_tokens_per_s: 1000000\n";
    // Priced alike, the failing server is first by index: it is tried first.
    let kv = Kvroute::start_with(
        &[
            (failing.addr, prefill.into()),
            (p.addr, prefill.into()),
            (
                d.addr,
                "      role: decode\n      prefill_tokens_per_s: 100\n".into(),
            ),
        ],
        "  disaggregation:\n    protocol: vllm_nixl\n    transfer_base_ms: 1000\n",
    );
    let long = format!("summarise {}", "lorem ipsum dolor sit amet ".repeat(300));
    let (status, text) = send(&kv, &chat(&long, true)).await;
    assert_eq!(status, 200, "{text}");
    assert!(text.contains("[DONE]"), "{text}");
    let counts = (
        failing.requests().len(),
        p.requests().len(),
        d.requests().len(),
    );
    let m = kv.metrics();
    assert_eq!(counts, (1, 1, 1), "{}", kv.log());
    let count = |labels: &[(&str, &str)]| metric_sum(&m, "kvroute_pd_prefill_legs_total", labels);
    assert_eq!(count(&[("outcome", "failed")]), 1.0);
    assert_eq!(count(&[("outcome", "ok")]), 1.0);
    assert_eq!(
        metric_sum(&m, "kvroute_retries_total", &[("outcome", "retried")]),
        1.0
    );
    let ds = state(&d);
    assert_eq!(ds["pd"]["transfers_total"], 1, "{ds}");
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

    let (ps, ds) = (state(&p), state(&d));
    assert_eq!(ds["pd"]["transfers_total"], 1, "{ds}");
    assert!(
        ds["pd"]["transfer_tokens_total"].as_u64().unwrap() > 1000,
        "{ds}"
    );
    assert_eq!(ds["pd"]["failed_transfers_total"], 0, "{ds}");
    assert_eq!(ps["pd"]["released_total"], 1, "{ps}");
    assert_eq!(ps["pd"]["held_requests"], 0, "{ps}");
    // The decode server's NIXL telemetry teaches the link's rate: the simulator's 25 GB/s,
    // in place of the configured figure.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let learned = loop {
        let (_, body) = http_get(kv.admin, "/debug/backends");
        let view: Value = serde_json::from_slice(&body).unwrap();
        let d = view["disaggregation"].clone();
        if d["transfer_learned"] == true {
            break d;
        }
        assert!(std::time::Instant::now() < deadline, "nothing learned: {d}");
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let gbps = learned["transfer_gbytes_per_s"].as_f64().unwrap();
    assert!((gbps - 25.0).abs() < 0.25, "{learned}");
    assert_eq!(learned["protocol"], "vllm_nixl");
    assert_eq!(learned["decode_stall_weight"], 1.0);
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

fn sglang(role: &str, extra: &[&'static str]) -> Sim {
    let mut args = vec!["--ttft-ms", "1", "--pd-protocol", "sglang_bootstrap"];
    let role: &'static str = match role {
        "prefill" => "prefill",
        _ => "decode",
    };
    args.extend(["--role", role]);
    args.extend_from_slice(extra);
    Sim::start(&args)
}

/// kvroute in front of SGLang prefill servers `ps` (each its own bootstrap server on its HTTP
/// port, as the simulator has it) and decode server `d`.
fn sglang_fleet(ps: &[std::net::SocketAddr], d: std::net::SocketAddr) -> Kvroute {
    let mut backends: Vec<(std::net::SocketAddr, String)> = ps
        .iter()
        .map(|p| {
            (
                *p,
                format!("      role: prefill\n      bootstrap_port: {}\n", p.port()),
            )
        })
        .collect();
    backends.push((d, "      role: decode\n".into()));
    Kvroute::start_with(
        &backends,
        "  disaggregation:\n    protocol: sglang_bootstrap\n",
    )
}

/// SGLang's protocol: both legs at once, the same body naming the prefill server's bootstrap
/// server and a fresh room; the decode server fetches the KV and answers the client, whose
/// usage says the prefill server's hit. A decode server takes nothing whole, so even a short
/// prompt is split.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_legs_go_at_once_with_one_room() {
    let (p, d) = (sglang("prefill", &[]), sglang("decode", &[]));
    let kv = sglang_fleet(&[p.addr], d.addr);
    for (i, stream) in [false, true].into_iter().enumerate() {
        let text = format!("hello {i} {}", "lorem ipsum dolor sit amet ".repeat(40));
        let mut body = chat(&text, stream);
        if stream {
            body["stream_options"] = json!({"include_usage": true});
        }
        let (status, text) = send(&kv, &body).await;
        assert_eq!(status, 200, "{text}");
        let (pr, dr) = (p.requests(), d.requests());
        assert_eq!((pr.len(), dr.len()), (i + 1, i + 1));
        // One body for both legs, and not the client's.
        assert_eq!(pr[i]["body_xxh3"], dr[i]["body_xxh3"]);
        let client = format!(
            "{:016x}",
            xxhash_rust::xxh3::xxh3_64(body.to_string().as_bytes())
        );
        assert_ne!(dr[i]["body_xxh3"], client);
        let usage = if stream {
            text.lines()
                .filter_map(|l| l.strip_prefix("data: "))
                .filter_map(|l| serde_json::from_str::<Value>(l).ok())
                .find_map(|v| v.get("usage").filter(|u| u.is_object()).cloned())
                .expect("a usage chunk")
        } else {
            serde_json::from_str::<Value>(&text).unwrap()["usage"].clone()
        };
        assert_eq!(
            usage["prompt_tokens_details"]["cached_tokens"], 0,
            "{usage}"
        );
    }
    let (ps, ds) = (state(&p), state(&d));
    assert_eq!(ds["pd"]["transfers_total"], 2, "{ds}");
    assert_eq!(ps["pd"]["held_requests"], 0, "{ps}");
    let m = kv.metrics();
    assert_eq!(
        metric_sum(&m, "kvroute_pd_decisions_total", &[("outcome", "split")]),
        2.0
    );
    assert_eq!(
        metric_sum(&m, "kvroute_pd_prefill_legs_total", &[("outcome", "ok")]),
        2.0
    );
}

/// A prefill leg that fails cuts its decode leg at once (SGLang's would wait 300 s for the
/// KV), and the request is placed again with another prefill server and a fresh room;
/// nothing is held against the decode server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_sglang_prefill_leg_cuts_its_decode_leg_and_goes_again() {
    let failing = sglang("prefill", &["--fail-rate", "1"]);
    let (p, d) = (sglang("prefill", &[]), sglang("decode", &[]));
    let kv = sglang_fleet(&[failing.addr, p.addr], d.addr);
    let started = std::time::Instant::now();
    let (status, text) = send(&kv, &chat("hello there", true)).await;
    assert_eq!(status, 200, "{text}\n{}", kv.log());
    assert!(text.contains("[DONE]"), "{text}");
    assert!(
        started.elapsed() < std::time::Duration::from_secs(10),
        "the cut decode leg was waited for"
    );
    // The first decode leg may be cut before the decode server read it.
    let counts = (
        failing.requests().len(),
        p.requests().len(),
        d.requests().len(),
    );
    assert!(matches!(counts, (1, 1, 1 | 2)), "{counts:?}\n{}", kv.log());
    let m = kv.metrics();
    assert_eq!(
        metric_sum(
            &m,
            "kvroute_pd_prefill_legs_total",
            &[("outcome", "failed")]
        ),
        1.0
    );
    assert_eq!(
        metric_sum(
            &m,
            "kvroute_upstream_failures_total",
            &[("kind", "prefill_leg")]
        ),
        1.0
    );
    let (_, body) = http_get(kv.admin, "/debug/backends");
    let view: Value = serde_json::from_slice(&body).unwrap();
    let d_view = view["backends"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["role"] == "decode")
        .cloned()
        .unwrap();
    assert_ne!(d_view["healthy"], false, "{d_view}");
}
