//! End-to-end: a real server on 127.0.0.1:0, driven over HTTP.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use serde_json::{json, Value};

use super::config::SimConfig;
use super::generate::completion_text;
use super::inference::body_hash_hex;
use super::server;

struct Sim {
    base: String,
    http: reqwest::Client,
}

impl Sim {
    async fn start() -> Self {
        Self::with_config(SimConfig::for_tests()).await
    }

    async fn with_config(config: SimConfig) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = server::spawn(listener, 3, Arc::new(config)).unwrap();
        Self {
            base: format!("http://{addr}"),
            http: reqwest::Client::new(),
        }
    }

    async fn post(&self, path: &str, body: &Value) -> reqwest::Response {
        self.http
            .post(format!("{}{path}", self.base))
            .header("x-session-id", "s1")
            .json(body)
            .send()
            .await
            .unwrap()
    }

    async fn get_json(&self, path: &str) -> Value {
        let res = self
            .http
            .get(format!("{}{path}", self.base))
            .send()
            .await
            .unwrap();
        res.json().await.unwrap()
    }
}

fn chat_body(stream: bool) -> Value {
    json!({
        "model": "sim-llama-8b",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant. ".repeat(20)},
            {"role": "user", "content": "Tell me about prefix caching."},
        ],
        "max_tokens": 5,
        "stream": stream,
        "stream_options": {"include_usage": true},
    })
}

#[tokio::test]
async fn non_streaming_chat_and_prefix_hits() {
    let sim = Sim::start().await;
    let body = chat_body(false);
    let res = sim.post("/v1/chat/completions", &body).await;
    assert_eq!(res.status(), 200);
    let h = res.headers().clone();
    assert_eq!(h["x-kvbench-server"], "3");
    assert!(h["x-kvbench-addr"]
        .to_str()
        .unwrap()
        .starts_with("127.0.0.1:"));
    let raw = serde_json::to_vec(&body).unwrap();
    assert_eq!(
        h["x-kvbench-body-xxh3"].to_str().unwrap(),
        body_hash_hex(&raw)
    );
    assert_eq!(
        h["x-kvbench-body-len"].to_str().unwrap(),
        raw.len().to_string()
    );
    let v: Value = res.json().await.unwrap();
    assert_eq!(
        v["choices"][0]["message"]["content"],
        " tok0 tok1 tok2 tok3 tok4"
    );
    assert_eq!(v["usage"]["completion_tokens"], 5);
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let prompt_tokens = v["usage"]["prompt_tokens"].as_u64().unwrap();

    let again: Value = sim
        .post("/v1/chat/completions", &body)
        .await
        .json()
        .await
        .unwrap();
    let cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        cached > 0 && cached <= prompt_tokens && cached % 16 == 0,
        "{cached}"
    );

    let log = sim.get_json("/debug/requests").await;
    assert_eq!(log.as_array().unwrap().len(), 2);
    assert_eq!(log[1]["seq"], 1);
    assert_eq!(log[1]["session"], "s1");
    assert_eq!(log[1]["cached_tokens"], cached);
    assert_eq!(log[1]["status"], 200);
    assert_eq!(log[1]["body_xxh3"], body_hash_hex(&raw));
}

#[tokio::test]
async fn streaming_chat_sends_chunks_usage_and_done() {
    let sim = Sim::start().await;
    let res = sim.post("/v1/chat/completions", &chat_body(true)).await;
    assert_eq!(res.status(), 200);
    assert_eq!(res.headers()["content-type"], "text/event-stream");
    let mut text = String::new();
    let mut reads = 0;
    let mut stream = res.bytes_stream();
    while let Some(chunk) = stream.next().await {
        text.push_str(std::str::from_utf8(&chunk.unwrap()).unwrap());
        reads += 1;
    }
    // Events arrive as they are produced, not in one buffered write.
    assert!(reads >= 5, "{reads}");
    let events: Vec<&str> = text.split_terminator("\n\n").collect();
    assert_eq!(events.len(), 7, "{text}");
    assert_eq!(*events.last().unwrap(), "data: [DONE]");
    let chunks: Vec<Value> = events[..6]
        .iter()
        .map(|e| serde_json::from_str(e.strip_prefix("data: ").unwrap()).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let content: String = chunks[..5]
        .iter()
        .map(|c| c["choices"][0]["delta"]["content"].as_str().unwrap())
        .collect();
    assert_eq!(content, " tok0 tok1 tok2 tok3 tok4");
    assert_eq!(chunks[4]["choices"][0]["finish_reason"], "length");
    assert_eq!(chunks[5]["choices"], json!([]));
    assert_eq!(chunks[5]["usage"]["completion_tokens"], 5);

    let state = sim.get_json("/debug/state").await;
    assert_eq!(state["running"], 0);
    assert_eq!(state["generation_tokens_total"], 5);
}

#[tokio::test]
async fn bad_requests_get_openai_errors() {
    let sim = Sim::start().await;
    let res = sim
        .http
        .post(format!("{}/v1/completions", sim.base))
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 400);
    assert_eq!(res.headers()["x-kvbench-body-len"], "9");
    let v: Value = res.json().await.unwrap();
    assert_eq!(v["error"]["type"], "invalid_request_error");
    let log = sim.get_json("/debug/requests").await;
    assert_eq!(log[0]["status"], 400);
}

#[tokio::test]
async fn hang_holds_requests_until_cleared() {
    let sim = Arc::new(Sim::start().await);
    let faults = sim.post("/debug/faults", &json!({"hang": true})).await;
    assert_eq!(faults.status(), 200);
    let held = {
        let sim = sim.clone();
        tokio::spawn(async move {
            let body = json!({"model": "m", "prompt": "hello", "max_tokens": 2});
            sim.post("/v1/completions", &body).await.status()
        })
    };
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert!(!held.is_finished());
    assert_eq!(sim.get_json("/debug/state").await["waiting"], 1);
    // Other endpoints stay responsive while a request is held.
    let metrics = sim
        .http
        .get(format!("{}/metrics", sim.base))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(metrics.contains("vllm:num_requests_waiting{model_name=\"sim-llama-8b\"} 1"));
    sim.post("/debug/faults", &json!({"hang": false})).await;
    let status = tokio::time::timeout(Duration::from_secs(5), held)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(status, 200);
}

#[tokio::test]
async fn fail_rate_and_unhealthy() {
    let sim = Sim::start().await;
    sim.post(
        "/debug/faults",
        &json!({"fail_rate": 1.0, "unhealthy": true}),
    )
    .await;
    let res = sim
        .post("/v1/completions", &json!({"model": "m", "prompt": "x"}))
        .await;
    assert_eq!(res.status(), 500);
    let health = sim
        .http
        .get(format!("{}/health", sim.base))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), 503);
    let bad = sim.post("/debug/faults", &json!({"fail_rate": 3})).await;
    assert_eq!(bad.status(), 400);
    let models = sim.get_json("/v1/models").await;
    assert_eq!(models["data"][0]["id"], "sim-llama-8b");
}

#[tokio::test]
async fn slow_start_answers_503_then_serves() {
    let config = SimConfig {
        slow_start: Duration::from_millis(300),
        ..SimConfig::for_tests()
    };
    let sim = Sim::with_config(config).await;
    let health = sim
        .http
        .get(format!("{}/health", sim.base))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), 503);
    let body = json!({"model": "m", "prompt": "x", "max_tokens": 1});
    assert_eq!(sim.post("/v1/completions", &body).await.status(), 503);
    tokio::time::sleep(Duration::from_millis(400)).await;
    let health = sim
        .http
        .get(format!("{}/health", sim.base))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), 200);
    assert_eq!(health.text().await.unwrap(), "ok");
    assert_eq!(sim.post("/v1/completions", &body).await.status(), 200);
}

#[tokio::test]
async fn large_bodies_are_accepted() {
    let sim = Sim::start().await;
    let prompt = "abcd".repeat(5 << 20 >> 2);
    let body = json!({"model": "m", "prompt": prompt, "max_tokens": 1});
    let res = sim.post("/v1/completions", &body).await;
    assert_eq!(res.status(), 200);
    let raw_len = serde_json::to_vec(&body).unwrap().len();
    assert_eq!(
        res.headers()["x-kvbench-body-len"],
        raw_len.to_string().as_str()
    );
    let v: Value = res.json().await.unwrap();
    assert_eq!(v["usage"]["prompt_tokens"], 5 << 20 >> 2);
}

/// Engine mode, time scale 10, a 64k-token pool.
async fn engine_sim() -> Sim {
    Sim::with_config(SimConfig::for_engine_tests(64_000, 10.0)).await
}

#[tokio::test]
async fn engine_mode_answers_caches_and_reports() {
    let sim = engine_sim().await;
    let prompt = "The quick brown fox jumps over the lazy dog. ".repeat(400);
    let body = json!({"model": "m", "prompt": prompt, "max_tokens": 4});
    let first: Value = sim
        .post("/v1/completions", &body)
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(first["choices"][0]["text"], " tok0 tok1 tok2 tok3");
    let prompt_tokens = first["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(prompt_tokens, 4_500);
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let again: Value = sim
        .post("/v1/completions", &body)
        .await
        .json()
        .await
        .unwrap();
    // vLLM recomputes the last token: (4500 - 1) rounded down to 16.
    assert_eq!(
        again["usage"]["prompt_tokens_details"]["cached_tokens"],
        4_496
    );

    let log = sim.get_json("/debug/requests").await;
    assert_eq!(log[1]["cached_tokens"], 4_496);
    let state = sim.get_json("/debug/state").await;
    assert_eq!(state["running"], 0);
    assert_eq!(state["generation_tokens_total"], 8);
    assert_eq!(state["prefix_cache_hits_total"], 4_496);
    assert_eq!(state["engine"]["num_gpu_blocks"], 4_000);
    assert!(state["engine"]["cached_blocks"].as_u64().unwrap() >= 281);
    let metrics = sim
        .http
        .get(format!("{}/metrics", sim.base))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for line in [
        "vllm:cache_config_info{model_name=\"sim-llama-8b\",block_size=\"16\",num_gpu_blocks=\"4000\"} 1",
        "vllm:num_preemptions_total{model_name=\"sim-llama-8b\"} 0",
        "vllm:prefix_cache_queries_total{model_name=\"sim-llama-8b\"} 9000",
        "vllm:time_to_first_token_seconds_count{model_name=\"sim-llama-8b\"} 2",
    ] {
        assert!(metrics.lines().any(|l| l == line), "missing {line}\n{metrics}");
    }
}

#[tokio::test]
async fn engine_mode_streams_every_token_once() {
    let sim = engine_sim().await;
    let res = sim
        .post(
            "/v1/chat/completions",
            &json!({
                "model": "m",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 20,
                "stream": true,
                "stream_options": {"include_usage": true},
            }),
        )
        .await;
    assert_eq!(res.status(), 200);
    let text = res.text().await.unwrap();
    let events: Vec<&str> = text.split_terminator("\n\n").collect();
    assert_eq!(*events.last().unwrap(), "data: [DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e.strip_prefix("data: ").unwrap()).unwrap())
        .collect();
    let (usage, tokens) = chunks.split_last().unwrap();
    assert_eq!(usage["usage"]["completion_tokens"], 20);
    let content: String = tokens
        .iter()
        .map(|c| c["choices"][0]["delta"]["content"].as_str().unwrap())
        .collect();
    assert_eq!(content, completion_text(20));
    assert_eq!(
        tokens.last().unwrap()["choices"][0]["finish_reason"],
        "length"
    );
    assert_eq!(tokens[0]["choices"][0]["delta"]["role"], "assistant");
}

#[tokio::test]
async fn engine_mode_rejects_what_cannot_fit_and_keeps_faults() {
    let sim = engine_sim().await;
    let big = json!({"model": "m", "prompt": "abcd".repeat(70_000), "max_tokens": 1});
    let res = sim.post("/v1/completions", &big).await;
    assert_eq!(res.status(), 400);
    sim.post("/debug/faults", &json!({"fail_rate": 1.0})).await;
    let small = json!({"model": "m", "prompt": "x", "max_tokens": 1});
    assert_eq!(sim.post("/v1/completions", &small).await.status(), 500);
}

/// A conversation's next turn sends the reply back after its prompt; both modes keep the
/// reply cached with the prompt, so the next turn misses only what it adds (and the partial
/// block before it).
#[tokio::test]
async fn next_turn_hits_the_previous_reply_in_both_modes() {
    const N: u64 = 40;
    for sim in [Sim::start().await, engine_sim().await] {
        let question = json!({"role": "user", "content": "Tell me about caches. ".repeat(30)});
        let turn1 = json!({"model": "m", "messages": [question], "max_tokens": N, "stream": true});
        let res = sim.post("/v1/chat/completions", &turn1).await;
        assert!(res.text().await.unwrap().contains("[DONE]"));
        let turn2 = json!({"model": "m", "max_tokens": 1, "messages": [
            question,
            {"role": "assistant", "content": completion_text(N)},
            {"role": "user", "content": "More."},
        ]});
        let v: Value = sim
            .post("/v1/chat/completions", &turn2)
            .await
            .json()
            .await
            .unwrap();
        let prompt = v["usage"]["prompt_tokens"].as_u64().unwrap();
        let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        // "<|im_start|>user\nMore.<|im_end|>\n<|im_start|>assistant\n" is 14 tokens.
        assert!(prompt - cached < 14 + 16, "{prompt} {cached}");

        let story = "Once upon a time, ".repeat(40);
        let body = json!({"model": "m", "prompt": story, "max_tokens": N});
        let r: Value = sim
            .post("/v1/completions", &body)
            .await
            .json()
            .await
            .unwrap();
        let reply = r["choices"][0]["text"].as_str().unwrap();
        let next =
            json!({"model": "m", "prompt": format!("{story}{reply} The end."), "max_tokens": 1});
        let v: Value = sim
            .post("/v1/completions", &next)
            .await
            .json()
            .await
            .unwrap();
        let prompt = v["usage"]["prompt_tokens"].as_u64().unwrap();
        let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        assert!(prompt - cached < 3 + 16, "{prompt} {cached}");
    }
}
