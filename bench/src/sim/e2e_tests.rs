//! End-to-end: a real server on 127.0.0.1:0, driven over HTTP.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use serde_json::{json, Value};

use super::api::inference::body_hash_hex;
use super::api::server;
use super::config::SimConfig;
use super::text::generate::completion_text;

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
        let addr = server::spawn(listener, 3, Arc::new(config), Vec::new()).unwrap();
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

impl Sim {
    async fn metrics(&self) -> String {
        let res = self
            .http
            .get(format!("{}/metrics", self.base))
            .send()
            .await
            .unwrap();
        res.text().await.unwrap()
    }
}

/// The value of the one sample named `name` (labels ignored).
fn sample(text: &str, name: &str) -> f64 {
    let mut found = text.lines().filter(|l| {
        l.strip_prefix(name)
            .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
    });
    let line = found.next().unwrap_or_else(|| panic!("no {name}\n{text}"));
    assert!(found.next().is_none(), "{name} twice");
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9 * b.abs().max(1.0)
}

/// A 4,500-token prompt twice: a miss, then a hit on all but its last 4 tokens.
async fn miss_then_hit(sim: &Sim) {
    let prompt = "The quick brown fox jumps over the lazy dog. ".repeat(400);
    let body = json!({"model": "m", "prompt": prompt, "max_tokens": 4});
    for cached in [0, 4_496] {
        let v: Value = sim
            .post("/v1/completions", &body)
            .await
            .json()
            .await
            .unwrap();
        assert_eq!(v["usage"]["prompt_tokens"], 4_500);
        assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], cached);
    }
}

/// Prefill time is taken from the engine's steps in model time: at time scale 10 the wall
/// clock sees a tenth of it, and a scrape still reports the model's seconds.
#[tokio::test]
async fn engine_prefill_telemetry_in_each_engines_names_and_model_time() {
    use super::config::Engine;
    use super::engine::profile::{Profile, ProfileName};
    let p = Profile::get(ProfileName::H100Llama8b);
    // One step each: all 4,500 tokens, then the 4 the cache did not have.
    let (miss, hit) = (p.t0 + 4_500.0 / p.prefill_rate, p.t0 + 4.0 / p.prefill_rate);
    for engine in [Engine::Vllm, Engine::Llamacpp, Engine::Sglang] {
        let config = SimConfig {
            engine,
            ..SimConfig::for_engine_tests(64_000, 10.0)
        };
        let sim = Sim::with_config(config).await;
        miss_then_hit(&sim).await;
        let m = sim.metrics().await;
        match engine {
            Engine::Vllm => {
                let name = "vllm:request_prefill_time_seconds";
                assert!(close(sample(&m, &format!("{name}_sum")), miss + hit), "{m}");
                assert_eq!(sample(&m, &format!("{name}_count")), 2.0);
                let le = format!("{name}_bucket{{model_name=\"sim-llama-8b\",le=\"0.3\"}} 2");
                assert!(m.lines().any(|l| l == le), "{m}");
                // Every prompt token of admitted requests; the cache counters in tokens.
                assert_eq!(sample(&m, "vllm:prompt_tokens_total"), 9_000.0);
                assert_eq!(sample(&m, "vllm:prefix_cache_queries_total"), 9_000.0);
                assert_eq!(sample(&m, "vllm:prefix_cache_hits_total"), 4_496.0);
                // What each prefill computed, observed with its prefill time: 4,500 then 4.
                let computed = "vllm:request_prefill_kv_computed_tokens";
                assert_eq!(sample(&m, &format!("{computed}_sum")), 4_504.0);
                assert_eq!(sample(&m, &format!("{computed}_count")), 2.0);
            }
            Engine::Llamacpp => {
                // Only the computed prompt tokens: 4,500 then 4.
                assert_eq!(sample(&m, "llamacpp:prompt_tokens_total"), 4_504.0);
                let seconds = sample(&m, "llamacpp:prompt_seconds_total");
                assert!(close(seconds, miss + hit), "{m}");
                let rate = sample(&m, "llamacpp:prompt_tokens_seconds");
                assert!(close(rate, 4_504.0 / (miss + hit)), "{m}");
                assert_eq!(sample(&m, "llamacpp:prompt_tokens_cached_total"), 4_496.0);
                // Two requests of 4 tokens, counted when they ended.
                assert_eq!(sample(&m, "llamacpp:tokens_predicted_total"), 8.0);
                // llama-server 0.6.0 exports no KV usage.
                assert!(!m.contains("kv_cache"), "{m}");
                assert!(!m.contains("vllm:"));
                // The scrape reset the throughput gauge, not the counters.
                let again = sim.metrics().await;
                assert_eq!(sample(&again, "llamacpp:prompt_tokens_seconds"), 0.0);
                assert_eq!(sample(&again, "llamacpp:prompt_tokens_total"), 4_504.0);
            }
            Engine::Sglang => {
                assert_eq!(sample(&m, "sglang:prompt_tokens_total"), 9_000.0);
                assert_eq!(sample(&m, "sglang:cached_tokens_total"), 4_496.0);
                assert_eq!(sample(&m, "sglang:num_used_tokens"), 0.0);
            }
        }
    }
}

/// KV tokens in use follow a running request's blocks and return to 0 when it is gone.
#[tokio::test]
async fn kv_tokens_in_use_while_a_request_runs() {
    use super::config::Engine;
    for (engine, name) in [(Engine::Sglang, "sglang:num_used_tokens")] {
        let config = SimConfig {
            engine,
            ..SimConfig::for_engine_tests(64_000, 1.0)
        };
        let sim = Sim::with_config(config).await;
        // 1,000 prompt tokens and 500 output tokens of ~5 ms each: a few seconds of decode.
        let body = json!({"model": "m", "prompt": "abcd".repeat(1_000), "max_tokens": 500,
            "stream": true});
        let res = sim.post("/v1/completions", &body).await;
        let mut stream = res.bytes_stream();
        stream.next().await.unwrap().unwrap();
        let used = sample(&sim.metrics().await, name);
        assert!((1_008.0..=1_520.0).contains(&used), "{name} {used}");
        assert_eq!(used % 16.0, 0.0);
        let state = sim.get_json("/debug/state").await;
        assert_eq!(state["kv_tokens_used"].as_f64().unwrap() % 16.0, 0.0);
        drop(stream);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while sample(&sim.metrics().await, name) != 0.0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{name} stays in use"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// A server of another profile runs that profile's physics and says so in `/debug/state`.
#[tokio::test]
async fn server_reports_its_profile_and_runs_its_rate() {
    use super::engine::profile::{Profile, ProfileName};
    let l40s = Profile::get(ProfileName::L40sLlama8b);
    let config = SimConfig::for_engine_tests(64_000, 10.0).with_profile(l40s.name, Some(64_000));
    let sim = Sim::with_config(config).await;
    let state = sim.get_json("/debug/state").await;
    assert_eq!(state["profile"], "l40s-llama8b");
    assert_eq!(state["prefill_tokens_per_s"], 9_000.0);
    assert_eq!(state["engine"]["profile"], "l40s-llama8b");
    assert_eq!(state["engine"]["prefill_tokens_per_s"], 9_000.0);
    miss_then_hit(&sim).await;
    let m = sim.metrics().await;
    let sum = sample(&m, "vllm:request_prefill_time_seconds_sum");
    let expected = 2.0 * l40s.t0 + 4_504.0 / l40s.prefill_rate;
    assert!(close(sum, expected), "{sum} vs {expected}");
    // Fixed timing has no engine rate to report; the profile still sizes its cache.
    let fixed = Sim::start().await;
    let state = fixed.get_json("/debug/state").await;
    assert_eq!(state["profile"], "h100-llama8b");
    assert!(state["prefill_tokens_per_s"].is_null());
}

/// Fixed timing: prefill is the configured TTFT, and llama.cpp counts computed tokens only.
#[tokio::test]
async fn fixed_timing_reports_prefill_as_its_ttft() {
    use super::config::Engine;
    let config = SimConfig {
        engine: Engine::Llamacpp,
        ..SimConfig::for_tests()
    };
    let sim = Sim::with_config(config).await;
    let body = chat_body(false);
    let mut computed = 0;
    for _ in 0..2 {
        let v: Value = sim
            .post("/v1/chat/completions", &body)
            .await
            .json()
            .await
            .unwrap();
        let prompt = v["usage"]["prompt_tokens"].as_u64().unwrap();
        let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        computed += prompt - cached;
    }
    let m = sim.metrics().await;
    assert_eq!(sample(&m, "llamacpp:prompt_tokens_total"), computed as f64);
    assert!(
        close(sample(&m, "llamacpp:prompt_seconds_total"), 0.04),
        "{m}"
    );
    // Two requests of 5 tokens, four intervals of 5 ms after the first.
    assert_eq!(sample(&m, "llamacpp:tokens_predicted_total"), 10.0);
    assert!(close(
        sample(&m, "llamacpp:tokens_predicted_seconds_total"),
        0.04
    ));
    let v: Value = sim
        .post("/v1/chat/completions", &body)
        .await
        .json()
        .await
        .unwrap();
    let t = &v["timings"];
    assert!(close(t["prompt_ms"].as_f64().unwrap(), 20.0), "{t}");
    assert!(close(t["predicted_ms"].as_f64().unwrap(), 20.0), "{t}");
    assert_eq!(t["predicted_n"], 5);
}

/// With `--tokenizer`, `usage.prompt_tokens` is the tokenizer's count of the rendered prompt
/// (not bytes / 4), token-id prompts count one token per id, and a conversation's next turn
/// still hits its previous prompt and reply, in both modes.
#[tokio::test]
async fn usage_counts_with_the_tokenizer_when_given() {
    use super::text::prompt::{render_chat, TURN_END};
    use super::text::tokenizer::{shipped_path, PromptTokenizer};
    let path = shipped_path();
    let tokenizer = Arc::new(PromptTokenizer::load(&path).unwrap());
    // Counted here with the tokenizers crate directly, independently of the simulator.
    let hf = tokenizers::Tokenizer::from_file(path.join("tokenizer.json")).unwrap();
    let count = |messages: &Value| {
        let text = String::from_utf8(render_chat(messages).unwrap()).unwrap();
        (
            hf.encode(text.as_str(), false).unwrap().len() as u64,
            text.len() as u64,
        )
    };
    let fixed = SimConfig {
        tokenizer: tokenizer.clone(),
        ..SimConfig::for_tests()
    };
    let engine = SimConfig {
        tokenizer,
        ..SimConfig::for_engine_tests(64_000, 10.0)
    };
    for sim in [
        Sim::with_config(fixed).await,
        Sim::with_config(engine).await,
    ] {
        let body = chat_body(false);
        let (want, bytes) = count(&body["messages"]);
        let v: Value = sim
            .post("/v1/chat/completions", &body)
            .await
            .json()
            .await
            .unwrap();
        assert_eq!(v["usage"]["prompt_tokens"], want);
        assert_ne!(want, bytes.div_ceil(4), "must differ from the stand-in");
        let streamed = sim.post("/v1/chat/completions", &chat_body(true)).await;
        let text = streamed.text().await.unwrap();
        assert!(
            text.contains(&format!("\"prompt_tokens\":{want}")),
            "{text}"
        );
        let log = sim.get_json("/debug/requests").await;
        assert_eq!(log[0]["prompt_tokens"], want);

        let ids = json!({"model": "m", "prompt": [5, 6, 7, 8, 9], "max_tokens": 1});
        let v: Value = sim
            .post("/v1/completions", &ids)
            .await
            .json()
            .await
            .unwrap();
        assert_eq!(v["usage"]["prompt_tokens"], 5);

        const N: u64 = 40;
        let question = json!({"role": "user", "content": "Tell me about caches. ".repeat(30)});
        let turn1 = json!({"model": "m", "messages": [question], "max_tokens": N, "stream": true});
        let res = sim.post("/v1/chat/completions", &turn1).await;
        assert!(res.text().await.unwrap().contains("[DONE]"));
        let messages = json!([
            question,
            {"role": "assistant", "content": completion_text(N)},
            {"role": "user", "content": "More."},
        ]);
        let turn2 = json!({"model": "m", "max_tokens": 1, "messages": messages});
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
        assert_eq!(prompt, count(&messages).0);
        // Every full block of turn 1's prompt and reply is hit: only the new turn and the
        // partial block before it are left to prefill.
        let turn1_text = String::from_utf8(render_chat(&json!([question])).unwrap()).unwrap();
        let sent_back = format!("{turn1_text}{}{TURN_END}", completion_text(N));
        let shared = hf.encode(sent_back.as_str(), false).unwrap().len() as u64;
        assert_eq!(cached, shared / 16 * 16, "{prompt} {cached} {shared}");
    }
}

/// `--dp-size 2`: two engines behind one port, each with its own pool. A pinned request
/// reuses only its rank's cache; an unpinned one goes to the rank with fewer in flight.
#[tokio::test]
async fn data_parallel_ranks_keep_their_own_caches() {
    let sim = Sim::with_config(SimConfig {
        dp_size: 2,
        ..SimConfig::for_engine_tests(64_000, 10.0)
    })
    .await;
    let body = chat_body(false);
    let cached = |rank: Option<&'static str>| {
        let (sim, body) = (&sim, &body);
        async move {
            let mut req = sim
                .http
                .post(format!("{}/v1/chat/completions", sim.base))
                .json(body);
            if let Some(r) = rank {
                req = req.header("X-Data-Parallel-Rank", r);
            }
            let v: Value = req.send().await.unwrap().json().await.unwrap();
            v["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap()
        }
    };
    assert_eq!(cached(Some("1")).await, 0);
    assert!(cached(Some("1")).await > 100, "rank 1 holds the prompt");
    assert_eq!(cached(Some("0")).await, 0, "rank 0 has its own pool");
    let state = sim.get_json("/debug/state").await;
    assert_eq!(
        state["engine"]["num_gpu_blocks"],
        2 * 64_000 / 16,
        "the server's blocks are both ranks'"
    );
    // A rank past the last is no pin: the balancer places it, on a rank that holds it.
    assert!(cached(Some("9")).await > 100);
}

/// A server speaking llama.cpp (`--profile cpu-smollm2`) at time scale `k`.
async fn llama_sim(k: f64) -> Sim {
    Sim::with_config(SimConfig::for_llamacpp_tests(k)).await
}

impl Sim {
    async fn status(&self, path: &str) -> u16 {
        let res = self
            .http
            .get(format!("{}{path}", self.base))
            .send()
            .await
            .unwrap();
        res.status().as_u16()
    }
}

/// `/props` and `/slots` as llama-server 0.6.0 answers them (kvroute reads `total_slots` and
/// `default_generation_settings.n_ctx` from `/props`); only a llama.cpp server has them.
#[tokio::test]
async fn llamacpp_props_and_slots() {
    let sim = llama_sim(10.0).await;
    let props = sim.get_json("/props").await;
    assert_eq!(props["total_slots"], 2);
    assert_eq!(props["default_generation_settings"]["n_ctx"], 4096);
    // Every field the simulator sends has the type the recorded server's has.
    let recorded: Value = serde_json::from_str(include_str!(
        "../../../tests/fixtures/scrapes/llamacpp-0.6.0.props.json"
    ))
    .unwrap();
    let kind = |v: &Value| match v {
        Value::Null => "null",
        Value::Bool(_) => "bool",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    };
    for key in [
        "total_slots",
        "model_path",
        "model_alias",
        "build_info",
        "is_sleeping",
    ] {
        assert!(props.get(key).is_some(), "no {key}: {props}");
    }
    for (key, v) in props.as_object().unwrap() {
        assert_eq!(kind(v), kind(&recorded[key]), "{key}");
    }
    for (key, v) in props["default_generation_settings"]["params"]
        .as_object()
        .unwrap()
    {
        let want = &recorded["default_generation_settings"]["params"][key];
        assert_eq!(kind(v), kind(want), "params.{key}");
    }
    let idle = json!({"n_ctx": 4096, "speculative": false, "is_processing": false});
    let slots = sim.get_json("/slots").await;
    assert_eq!(slots.as_array().unwrap().len(), 2, "{slots}");
    for (id, slot) in slots.as_array().unwrap().iter().enumerate() {
        let mut want = idle.clone();
        want["id"] = json!(id);
        assert_eq!(*slot, want);
    }
    // vLLM has neither.
    let vllm = engine_sim().await;
    assert_eq!(vllm.status("/props").await, 404);
    assert_eq!(vllm.status("/slots").await, 404);
    assert_eq!(sim.status("/props").await, 200);
}

/// Three concurrent streams on two slots: the third is reported deferred and starts only
/// when a slot frees; afterwards llama.cpp's counters describe what ran.
#[tokio::test]
async fn llamacpp_third_concurrent_request_is_deferred_until_a_slot_frees() {
    const N: u64 = 150;
    let sim = Arc::new(llama_sim(10.0).await);
    let mut tasks = Vec::new();
    for i in 0..3 {
        let sim = sim.clone();
        tasks.push(tokio::spawn(async move {
            // ~100-token prompts, distinct so that none hits another's cache.
            let prompt = format!("{i} {}", "Tell me a story about slots. ".repeat(13));
            let body = json!({"model": "smollm2", "prompt": prompt, "max_tokens": N,
                "stream": true});
            let res = sim.post("/v1/completions", &body).await;
            let mut stream = res.bytes_stream();
            let mut first = None;
            let mut text = String::new();
            while let Some(chunk) = stream.next().await {
                first.get_or_insert_with(tokio::time::Instant::now);
                text.push_str(std::str::from_utf8(&chunk.unwrap()).unwrap());
            }
            assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
            (first.unwrap(), tokio::time::Instant::now())
        }));
    }
    // While all three are in flight: two processing, one deferred, both slots busy.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let m = sim.metrics().await;
        let (processing, deferred) = (
            sample(&m, "llamacpp:requests_processing"),
            sample(&m, "llamacpp:requests_deferred"),
        );
        assert!(processing <= 2.0, "{m}");
        if (processing, deferred) == (2.0, 1.0) {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "never 2 + 1\n{m}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let slots = sim.get_json("/slots").await;
    let busy = slots
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["is_processing"] == true)
        .count();
    assert!(busy >= 1, "{slots}");
    let mut times = Vec::new();
    for t in tasks {
        times.push(t.await.unwrap());
    }
    let last_first_token = times.iter().map(|t| t.0).max().unwrap();
    let first_done = times.iter().map(|t| t.1).min().unwrap();
    assert!(
        last_first_token >= first_done,
        "the deferred request started before a slot freed"
    );
    let m = sim.metrics().await;
    assert_eq!(sample(&m, "llamacpp:requests_processing"), 0.0);
    assert_eq!(sample(&m, "llamacpp:requests_deferred"), 0.0);
    assert_eq!(
        sample(&m, "llamacpp:tokens_predicted_total"),
        3.0 * N as f64
    );
    let per_decode = sample(&m, "llamacpp:n_busy_slots_per_decode");
    assert!(per_decode > 1.0 && per_decode < 2.0, "{m}");
    assert!(
        sample(&m, "llamacpp:n_decode_total") >= 2.0 * N as f64,
        "{m}"
    );
    // The longest sequence: a prompt and all but its last output token.
    let longest = sample(&m, "llamacpp:n_tokens_max");
    assert!((N + 90..N + 120).contains(&(longest as u64)), "{m}");
}

/// A prompt that fills a slot's context is refused with llama.cpp's words; one that leaves
/// less room than `max_tokens` gets what fits.
#[tokio::test]
async fn llamacpp_context_refuses_a_full_prompt_and_cuts_the_output() {
    let sim = llama_sim(100.0).await;
    let full = json!({"model": "m", "prompt": "abcd".repeat(4_096), "max_tokens": 1});
    let res = sim.post("/v1/completions", &full).await;
    assert_eq!(res.status(), 400);
    let text = res.text().await.unwrap();
    assert!(
        text.contains("request (4096 tokens) exceeds the available context size (4096 tokens)"),
        "{text}"
    );
    let long = json!({"model": "m", "prompt": "abcd".repeat(4_000), "max_tokens": 500});
    let v: Value = sim
        .post("/v1/completions", &long)
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 96);
    assert_eq!(v["choices"][0]["text"], completion_text(96));
    assert_eq!(v["timings"]["predicted_n"], 96);
}

/// llama.cpp's `timings` beside `usage`, in model milliseconds, streamed and not; the metrics
/// count the same times.
#[tokio::test]
async fn llamacpp_answers_carry_timings() {
    use super::engine::profile::{Profile, ProfileName};
    let p = Profile::get(ProfileName::CpuSmollm2);
    let sim = llama_sim(10.0).await;
    let text = sim
        .post("/v1/chat/completions", &chat_body(true))
        .await
        .text()
        .await
        .unwrap();
    let usage_chunk: Value = text
        .split_terminator("\n\n")
        .filter_map(|e| serde_json::from_str::<Value>(e.strip_prefix("data: ")?).ok())
        .find(|c| c.get("usage").is_some())
        .unwrap();
    let prompt = usage_chunk["usage"]["prompt_tokens"].as_u64().unwrap();
    let t = &usage_chunk["timings"];
    assert_eq!(t["cache_n"], 0, "{t}");
    assert_eq!(t["prompt_n"], prompt);
    let prompt_ms = t["prompt_ms"].as_f64().unwrap();
    let want =
        (p.t0 + p.t_prompt + prompt as f64 / p.prefill_rate + p.context_seconds(prompt, 0)) * 1e3;
    assert!(close(prompt_ms, want), "{prompt_ms} vs {want}");
    assert_eq!(t["predicted_n"], 5);
    // Four decode steps of one stream after the first token.
    let predicted_ms = t["predicted_ms"].as_f64().unwrap();
    let step = |ctx: u64| p.step_seconds(0, 1, ctx) * 1e3;
    let want: f64 = (0..4).map(|k| step(prompt + k)).sum();
    assert!(close(predicted_ms, want), "{predicted_ms} vs {want}");

    let v: Value = sim
        .post("/v1/chat/completions", &chat_body(false))
        .await
        .json()
        .await
        .unwrap();
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached > 0);
    assert_eq!(v["timings"]["cache_n"], cached);
    assert_eq!(v["timings"]["prompt_n"], prompt - cached);
    let second_ms = v["timings"]["predicted_ms"].as_f64().unwrap();
    let m = sim.metrics().await;
    assert_eq!(sample(&m, "llamacpp:tokens_predicted_total"), 10.0);
    let seconds = sample(&m, "llamacpp:tokens_predicted_seconds_total");
    assert!(close(seconds, (predicted_ms + second_ms) / 1e3), "{m}");
    assert_eq!(
        sample(&m, "llamacpp:prompt_tokens_cached_total"),
        cached as f64
    );
    // vLLM's answers have none.
    let vllm = engine_sim().await;
    let v: Value = vllm
        .post("/v1/chat/completions", &chat_body(false))
        .await
        .json()
        .await
        .unwrap();
    assert!(v.get("timings").is_none());
}

// The Responses and Messages APIs: served as chat, answered in their own shapes.

impl Sim {
    async fn request(&self, method: reqwest::Method, path: &str) -> (u16, Value) {
        let res = self
            .http
            .request(method, format!("{}{path}", self.base))
            .send()
            .await
            .unwrap();
        assert_eq!(res.headers()["x-kvbench-server"], "3", "{path}");
        let status = res.status().as_u16();
        (status, res.json().await.unwrap())
    }
}

/// `event: <type>\ndata: <json>` events of a typed-event stream, in order.
async fn typed_events(res: reqwest::Response) -> Vec<(String, Value)> {
    assert_eq!(res.status(), 200);
    assert_eq!(res.headers()["content-type"], "text/event-stream");
    assert_eq!(res.headers()["x-kvbench-server"], "3");
    let text = res.text().await.unwrap();
    assert!(!text.contains("[DONE]"), "{text}");
    text.split_terminator("\n\n")
        .map(|e| {
            let (kind, data) = e.split_once('\n').unwrap();
            let kind = kind.strip_prefix("event: ").unwrap().to_owned();
            let data: Value = serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap();
            assert_eq!(data["type"], kind.as_str());
            (kind, data)
        })
        .collect()
}

const AGENT_REPLY: u64 = 40;

fn responses_turn1(stream: bool) -> Value {
    json!({
        "model": "sim-llama-8b",
        "instructions": "You are a coding agent. ".repeat(20),
        "input": [{"role": "user", "content": "Fix the failing test. ".repeat(10)}],
        "max_output_tokens": AGENT_REPLY,
        "stream": stream,
    })
}

/// Turn 2 sent back with the id of turn 1: it hits all of turn 1's prompt and reply, in
/// both modes, and so does the same turn sent whole (stateless).
#[tokio::test]
async fn responses_second_turn_hits_the_cache_in_both_modes() {
    for sim in [Sim::start().await, engine_sim().await] {
        let res = sim.post("/v1/responses", &responses_turn1(false)).await;
        assert_eq!(res.status(), 200);
        assert_eq!(res.headers()["x-kvbench-server"], "3");
        let first: Value = res.json().await.unwrap();
        let id = first["id"].as_str().unwrap();
        assert!(id.starts_with("resp_") && !id.contains("kvbench"), "{id}");
        assert_eq!(first["object"], "response");
        assert_eq!(first["status"], "completed");
        assert_eq!(first["model"], "sim-llama-8b");
        let reply = &first["output"][0];
        assert_eq!(reply["type"], "message");
        assert_eq!(reply["role"], "assistant");
        assert_eq!(reply["content"][0]["type"], "output_text");
        assert_eq!(reply["content"][0]["text"], completion_text(AGENT_REPLY));
        let usage = &first["usage"];
        assert_eq!(usage["output_tokens"], AGENT_REPLY);
        assert_eq!(
            usage["total_tokens"].as_u64(),
            Some(usage["input_tokens"].as_u64().unwrap() + AGENT_REPLY)
        );
        assert_eq!(usage["input_tokens_details"]["cached_tokens"], 0);

        let next = json!({"role": "user", "content": "More."});
        let mut turn2 = responses_turn1(false);
        turn2["previous_response_id"] = json!(id);
        turn2["input"] = json!([next]);
        let mut stateless = responses_turn1(false);
        stateless["input"] = json!([responses_turn1(false)["input"][0], reply, next]);
        for body in [turn2, stateless] {
            let v: Value = sim.post("/v1/responses", &body).await.json().await.unwrap();
            let input = v["usage"]["input_tokens"].as_u64().unwrap();
            let cached = v["usage"]["input_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap();
            // The new user turn and the generation prompt are 14 tokens.
            assert!(cached > 0 && input - cached < 14 + 16, "{input} {cached}");
        }
        let log = sim.get_json("/debug/requests").await;
        assert!(log
            .as_array()
            .unwrap()
            .iter()
            .all(|e| e["path"] == "/v1/responses" && e["status"] == 200));
    }
}

fn messages_turn1(stream: bool) -> Value {
    json!({
        "model": "sim-llama-8b",
        "system": [{"type": "text", "text": "You are a coding agent. ".repeat(20)}],
        "messages": [{"role": "user", "content": "Fix the failing test. ".repeat(10)}],
        "max_tokens": AGENT_REPLY,
        "stream": stream,
        "metadata": {"user_id": "u1"},
    })
}

#[tokio::test]
async fn messages_second_turn_hits_the_cache_in_both_modes() {
    for sim in [Sim::start().await, engine_sim().await] {
        let res = sim.post("/v1/messages", &messages_turn1(false)).await;
        assert_eq!(res.status(), 200);
        assert_eq!(res.headers()["x-kvbench-server"], "3");
        let first: Value = res.json().await.unwrap();
        assert!(first["id"].as_str().unwrap().starts_with("msg_"));
        assert_eq!(first["type"], "message");
        assert_eq!(first["role"], "assistant");
        assert_eq!(first["stop_reason"], "max_tokens");
        assert!(first["stop_sequence"].is_null());
        let reply = completion_text(AGENT_REPLY);
        assert_eq!(first["content"], json!([{"type": "text", "text": reply}]));
        let usage = &first["usage"];
        assert_eq!(usage["cache_read_input_tokens"], 0);
        assert_eq!(usage["cache_creation_input_tokens"], 0);
        assert_eq!(usage["output_tokens"], AGENT_REPLY);
        let counted: Value = sim
            .post("/v1/messages/count_tokens", &messages_turn1(false))
            .await
            .json()
            .await
            .unwrap();
        assert_eq!(counted["input_tokens"], usage["input_tokens"]);

        let mut turn2 = messages_turn1(false);
        turn2["messages"] = json!([
            messages_turn1(false)["messages"][0],
            {"role": "assistant", "content": first["content"]},
            {"role": "user", "content": "More."},
        ]);
        let v: Value = sim.post("/v1/messages", &turn2).await.json().await.unwrap();
        let uncached = v["usage"]["input_tokens"].as_u64().unwrap();
        let cached = v["usage"]["cache_read_input_tokens"].as_u64().unwrap();
        assert!(cached > 0 && uncached < 14 + 16, "{uncached} {cached}");
        let counted: Value = sim
            .post("/v1/messages/count_tokens", &turn2)
            .await
            .json()
            .await
            .unwrap();
        assert_eq!(counted["input_tokens"], uncached + cached);
        let log = sim.get_json("/debug/requests").await;
        let paths: Vec<&str> = log
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["path"].as_str().unwrap())
            .collect();
        let (m, c) = ("/v1/messages", "/v1/messages/count_tokens");
        assert_eq!(paths, [m, c, m, c]);
    }
}

#[tokio::test]
async fn responses_stream_events_in_order_with_usage() {
    for sim in [Sim::start().await, engine_sim().await] {
        let events = typed_events(sim.post("/v1/responses", &responses_turn1(true)).await).await;
        let kinds: Vec<&str> = events.iter().map(|(k, _)| k.as_str()).collect();
        let opening = [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
        ];
        let closing = [
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed",
        ];
        assert_eq!(kinds[..4], opening);
        assert_eq!(kinds[kinds.len() - 4..], closing);
        let deltas = &events[4..events.len() - 4];
        assert!(deltas
            .iter()
            .all(|(k, _)| k == "response.output_text.delta"));
        for (i, (_, v)) in events.iter().enumerate() {
            assert_eq!(v["sequence_number"], i as u64);
        }
        assert_eq!(events[0].1["response"]["status"], "in_progress");
        let text: String = deltas
            .iter()
            .map(|(_, v)| v["delta"].as_str().unwrap())
            .collect();
        assert_eq!(text, completion_text(AGENT_REPLY));
        let done = &events[events.len() - 1].1["response"];
        assert_eq!(done["status"], "completed");
        assert_eq!(deltas[0].1["item_id"], done["output"][0]["id"]);
        assert_eq!(done["output"][0]["content"][0]["text"], text);
        assert_eq!(done["usage"]["output_tokens"], AGENT_REPLY);
        let input = done["usage"]["input_tokens"].as_u64().unwrap();
        assert_eq!(done["usage"]["total_tokens"], input + AGENT_REPLY);

        // The streamed answer is stored and continued like any other.
        let id = done["id"].as_str().unwrap();
        let (status, got) = sim
            .request(reqwest::Method::GET, &format!("/v1/responses/{id}"))
            .await;
        assert_eq!((status, &got), (200, done));
        let mut turn2 = responses_turn1(true);
        turn2["previous_response_id"] = json!(id);
        turn2["input"] = json!("More.");
        let events = typed_events(sim.post("/v1/responses", &turn2).await).await;
        let usage = &events.last().unwrap().1["response"]["usage"];
        let cached = usage["input_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        assert!(cached > input, "{cached} {input}");
    }
    // One token a step in fixed timing: one delta a token.
    let sim = Sim::start().await;
    let events = typed_events(sim.post("/v1/responses", &responses_turn1(true)).await).await;
    assert_eq!(events.len() as u64, 8 + AGENT_REPLY);
}

#[tokio::test]
async fn messages_stream_events_in_order_with_usage() {
    for sim in [Sim::start().await, engine_sim().await] {
        sim.post("/v1/messages", &messages_turn1(false)).await;
        let events = typed_events(sim.post("/v1/messages", &messages_turn1(true)).await).await;
        let kinds: Vec<&str> = events.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(kinds[..3], ["message_start", "content_block_start", "ping"]);
        assert_eq!(
            kinds[kinds.len() - 3..],
            ["content_block_stop", "message_delta", "message_stop"]
        );
        let deltas = &events[3..events.len() - 3];
        assert!(deltas.iter().all(|(k, _)| k == "content_block_delta"));
        let text: String = deltas
            .iter()
            .map(|(_, v)| v["delta"]["text"].as_str().unwrap())
            .collect();
        assert_eq!(text, completion_text(AGENT_REPLY));
        let start = &events[0].1["message"];
        assert_eq!(start["content"], json!([]));
        assert!(start["stop_reason"].is_null());
        let usage = &start["usage"];
        let counted: Value = sim
            .post("/v1/messages/count_tokens", &messages_turn1(true))
            .await
            .json()
            .await
            .unwrap();
        let (uncached, cached) = (
            usage["input_tokens"].as_u64().unwrap(),
            usage["cache_read_input_tokens"].as_u64().unwrap(),
        );
        // The same prompt again: all cached but its last partial block.
        assert!(cached > 0 && uncached < 16, "{uncached} {cached}");
        assert_eq!(counted["input_tokens"], uncached + cached);
        assert_eq!(usage["output_tokens"], 0);
        let delta = &events[events.len() - 2].1;
        assert_eq!(delta["delta"]["stop_reason"], "max_tokens");
        assert_eq!(delta["usage"], json!({"output_tokens": AGENT_REPLY}));
    }
}

#[tokio::test]
async fn responses_store_previous_get_input_items_and_delete() {
    use reqwest::Method;
    let sim = Sim::start().await;
    let first: Value = sim
        .post(
            "/v1/responses",
            &json!({"model": "m", "input": "Hello", "max_output_tokens": 3}),
        )
        .await
        .json()
        .await
        .unwrap();
    let id1 = first["id"].as_str().unwrap();
    let (status, got) = sim
        .request(Method::GET, &format!("/v1/responses/{id1}"))
        .await;
    assert_eq!((status, &got), (200, &first));
    let (_, items) = sim
        .request(Method::GET, &format!("/v1/responses/{id1}/input_items"))
        .await;
    assert_eq!(items["object"], "list");
    assert_eq!(items["has_more"], false);
    assert_eq!(items["data"].as_array().unwrap().len(), 1);
    assert_eq!(items["data"][0]["role"], "user");
    assert_eq!(
        items["data"][0]["content"],
        json!([{"type": "input_text", "text": "Hello"}])
    );
    assert_eq!(items["first_id"], items["data"][0]["id"]);
    assert_eq!(items["last_id"], items["data"][0]["id"]);

    let turn2 = json!({"model": "m", "previous_response_id": id1, "max_output_tokens": 2,
        "input": [{"type": "function_call_output", "call_id": "c1", "output": "ok"}]});
    let second: Value = sim
        .post("/v1/responses", &turn2)
        .await
        .json()
        .await
        .unwrap();
    let id2 = second["id"].as_str().unwrap();
    let (_, items) = sim
        .request(Method::GET, &format!("/v1/responses/{id2}/input_items"))
        .await;
    let data = items["data"].as_array().unwrap();
    let kinds: Vec<&str> = data.iter().map(|i| i["type"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["message", "message", "function_call_output"]);
    assert_eq!(data[1], first["output"][0]);
    assert!(data.iter().all(|i| i["id"].is_string()));
    assert_eq!(items["last_id"], data[2]["id"]);

    let (status, v) = sim
        .request(Method::POST, &format!("/v1/responses/{id2}/cancel"))
        .await;
    assert_eq!(status, 400);
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .starts_with("Cannot cancel a response that is not in progress"));

    let (status, v) = sim
        .request(Method::DELETE, &format!("/v1/responses/{id1}"))
        .await;
    assert_eq!(status, 200);
    assert_eq!(v, json!({"id": id1, "object": "response", "deleted": true}));
    for (method, path) in [
        (Method::GET, format!("/v1/responses/{id1}")),
        (Method::DELETE, format!("/v1/responses/{id1}")),
        (Method::GET, format!("/v1/responses/{id1}/input_items")),
        (Method::POST, format!("/v1/responses/{id1}/cancel")),
    ] {
        let (status, v) = sim.request(method, &path).await;
        assert_eq!(status, 404, "{path}");
        assert_eq!(
            v,
            json!({"error": {"message": format!("Response with id '{id1}' not found."),
                   "type": "invalid_request_error", "param": null,
                   "code": "response_not_found"}})
        );
    }
    // The continuation keeps its whole conversation after its parent is gone.
    let (status, _) = sim
        .request(Method::GET, &format!("/v1/responses/{id2}/input_items"))
        .await;
    assert_eq!(status, 200);
    let res = sim
        .post(
            "/v1/responses",
            &json!({"model": "m", "previous_response_id": id1, "input": "x"}),
        )
        .await;
    assert_eq!(res.status(), 404);
    assert_eq!(res.headers()["x-kvbench-server"], "3");
    let v: Value = res.json().await.unwrap();
    assert_eq!(v["error"]["param"], "previous_response_id");
    assert_eq!(v["error"]["code"], "response_not_found");

    let unstored: Value = sim
        .post(
            "/v1/responses",
            &json!({"model": "m", "input": "x", "store": false}),
        )
        .await
        .json()
        .await
        .unwrap();
    let id = unstored["id"].as_str().unwrap();
    let (status, _) = sim
        .request(Method::GET, &format!("/v1/responses/{id}"))
        .await;
    assert_eq!(status, 404);
}

#[tokio::test]
async fn messages_errors_have_anthropics_shape() {
    let sim = Sim::start().await;
    let res = sim
        .post(
            "/v1/messages",
            &json!({"model": "m", "messages": [{"role": "user", "content": "x"}]}),
        )
        .await;
    assert_eq!(res.status(), 400);
    assert!(res.headers().contains_key("x-kvbench-body-xxh3"));
    let v: Value = res.json().await.unwrap();
    assert_eq!(v["type"], "error");
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert_eq!(v["error"]["message"], "max_tokens: Field required");

    sim.post("/debug/faults", &json!({"fail_rate": 1.0})).await;
    let res = sim.post("/v1/messages", &messages_turn1(false)).await;
    assert_eq!(res.status(), 500);
    let v: Value = res.json().await.unwrap();
    assert_eq!(v["error"]["type"], "api_error");

    let starting = Sim::with_config(SimConfig {
        slow_start: Duration::from_secs(60),
        ..SimConfig::for_tests()
    })
    .await;
    for path in ["/v1/messages", "/v1/messages/count_tokens"] {
        let res = starting.post(path, &messages_turn1(false)).await;
        assert_eq!(res.status(), 529, "{path}");
        let v: Value = res.json().await.unwrap();
        assert_eq!(v["error"]["type"], "overloaded_error");
    }
    // Responses errors keep OpenAI's shape.
    let res = starting
        .post("/v1/responses", &responses_turn1(false))
        .await;
    assert_eq!(res.status(), 503);
    let v: Value = res.json().await.unwrap();
    assert!(v["error"]["message"].is_string());
}

/// A forced tool call, streamed, in each agent API: the stream carries the call, and the next
/// turn that sends it back with the tool's output hits the cache through the call, as a real
/// engine's cache holds the call it generated.
#[tokio::test]
async fn forced_tool_calls_stream_and_the_next_turn_hits_them() {
    let tools_r = json!([{"type": "function", "name": "run", "description": "Runs a command",
                          "parameters": {"type": "object"}}]);
    let tools_m = json!([{"name": "run", "description": "Runs a command",
                          "input_schema": {"type": "object"}}]);
    let output = "Tests passed. ".repeat(30);
    for sim in [Sim::start().await, engine_sim().await] {
        // Responses: the call is one function_call item, its arguments streamed as deltas.
        let mut turn1 = responses_turn1(true);
        turn1["tools"] = tools_r.clone();
        turn1["tool_choice"] = json!("required");
        let events = typed_events(sim.post("/v1/responses", &turn1).await).await;
        let kinds: Vec<&str> = events.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(
            kinds[..3],
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added"
            ]
        );
        assert_eq!(
            kinds[kinds.len() - 3..],
            [
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.completed"
            ]
        );
        let args: String = events
            .iter()
            .filter(|(k, _)| k == "response.function_call_arguments.delta")
            .map(|(_, v)| v["delta"].as_str().unwrap())
            .collect();
        let call = events.last().unwrap().1["response"]["output"][0].clone();
        assert_eq!(call["type"], "function_call");
        assert_eq!(
            (call["name"].as_str(), call["arguments"].as_str()),
            (Some("run"), Some(args.as_str()))
        );
        let parsed: Value = serde_json::from_str(&args).unwrap();
        assert_eq!(parsed["command"], completion_text(AGENT_REPLY));
        let mut turn2 = turn1.clone();
        turn2["stream"] = json!(false);
        turn2["input"] = json!([turn1["input"][0], call,
            {"type": "function_call_output", "call_id": call["call_id"], "output": output}]);
        let v: Value = sim
            .post("/v1/responses", &turn2)
            .await
            .json()
            .await
            .unwrap();
        let (input, cached) = (
            v["usage"]["input_tokens"].as_u64().unwrap(),
            v["usage"]["input_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap(),
        );
        // The tool's output is ~105 tokens; everything before it, the call included, is cached
        // (to the block boundary).
        assert!(input - cached < 105 + 16 + 16, "{input} {cached}");
        assert_eq!(v["output"][0]["type"], "function_call");

        // Messages: one tool_use block, its input streamed as input_json_delta.
        let mut turn1 = messages_turn1(true);
        turn1["tools"] = tools_m.clone();
        turn1["tool_choice"] = json!({"type": "any"});
        let events = typed_events(sim.post("/v1/messages", &turn1).await).await;
        let start = &events[1].1["content_block"];
        assert_eq!(
            (start["type"].as_str(), start["name"].as_str()),
            (Some("tool_use"), Some("run"))
        );
        let partial: String = events
            .iter()
            .filter(|(k, _)| k == "content_block_delta")
            .map(|(_, v)| v["delta"]["partial_json"].as_str().unwrap())
            .collect();
        let input_json: Value = serde_json::from_str(&partial).unwrap();
        assert_eq!(input_json["command"], completion_text(AGENT_REPLY));
        let delta = events.iter().find(|(k, _)| k == "message_delta").unwrap();
        assert_eq!(delta.1["delta"]["stop_reason"], "tool_use");
        let mut turn2 = turn1.clone();
        turn2["stream"] = json!(false);
        turn2["messages"] = json!([turn1["messages"][0],
            {"role": "assistant", "content": [{"type": "tool_use", "id": start["id"],
                                               "name": "run", "input": input_json}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": start["id"],
                                          "content": output}]}]);
        let v: Value = sim.post("/v1/messages", &turn2).await.json().await.unwrap();
        let uncached = v["usage"]["input_tokens"].as_u64().unwrap();
        assert!(uncached < 105 + 16 + 16, "{uncached}");
        assert_eq!(v["content"][0]["type"], "tool_use");
        assert_eq!(v["stop_reason"], "tool_use");
    }
}
