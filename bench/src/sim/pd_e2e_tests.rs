//! End-to-end P/D disaggregation: a prefill server and a decode server on 127.0.0.1:0 in this
//! process, driven over HTTP as a router speaking vLLM's NixlConnector protocol drives them.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use serde_json::{json, Value};
use tokio::time::Instant;

use super::api::server;
use super::config::SimConfig;
use super::pd::{PdConfig, Role};

pub(super) struct Server {
    pub base: String,
    pub port: u16,
    pub http: reqwest::Client,
}

impl Server {
    pub async fn start(mut config: SimConfig, pd: PdConfig) -> Self {
        config.pd = pd;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = server::spawn(listener, 0, Arc::new(config), Vec::new()).unwrap();
        Self {
            base: format!("http://{addr}"),
            port: addr.port(),
            http: reqwest::Client::new(),
        }
    }

    pub async fn post(&self, path: &str, body: &Value, request_id: &str) -> reqwest::Response {
        self.http
            .post(format!("{}{path}", self.base))
            .header("X-Request-Id", request_id)
            .json(body)
            .send()
            .await
            .unwrap()
    }

    pub async fn json(&self, path: &str, body: &Value, request_id: &str) -> Value {
        let res = self.post(path, body, request_id).await;
        assert_eq!(res.status(), 200, "{path}");
        res.json().await.unwrap()
    }

    pub async fn state(&self) -> Value {
        let res = self.http.get(format!("{}/debug/state", self.base));
        res.send().await.unwrap().json().await.unwrap()
    }

    pub async fn metrics(&self) -> String {
        let res = self.http.get(format!("{}/metrics", self.base));
        res.send().await.unwrap().text().await.unwrap()
    }

    /// Polls `/debug/state` until `done` holds of it; panics after 5 s.
    pub async fn until(&self, what: &str, done: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let state = self.state().await;
            if done(&state) {
                return state;
            }
            assert!(Instant::now() < deadline, "{what}: {state}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

pub(super) fn role(role: Role) -> PdConfig {
    PdConfig {
        role,
        ..PdConfig::default()
    }
}

/// The prefill leg as vLLM's toy proxy writes it.
fn prefill_leg(body: &Value) -> Value {
    let mut p = body.clone();
    p["stream"] = json!(false);
    p["max_tokens"] = json!(1);
    if let Some(obj) = p.as_object_mut() {
        obj.remove("stream_options");
    }
    p["kv_transfer_params"] = json!({"do_remote_decode": true, "do_remote_prefill": false,
        "remote_engine_id": null, "remote_block_ids": null, "remote_host": null,
        "remote_port": null});
    p
}

/// The decode leg: the client's body plus P's params.
fn decode_leg(body: &Value, params: &Value) -> Value {
    let mut d = body.clone();
    d["kv_transfer_params"] = params.clone();
    d
}

/// The one sample named `name` (labels ignored).
pub(super) fn sample(text: &str, name: &str) -> f64 {
    let line = text
        .lines()
        .find(|l| {
            l.strip_prefix(name)
                .is_some_and(|r| r.starts_with(' ') || r.starts_with('{'))
        })
        .unwrap_or_else(|| panic!("no {name}\n{text}"));
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

/// A streamed answer's usage (the chunk with `usage`).
pub(super) async fn streamed_usage(res: reqwest::Response) -> Value {
    assert_eq!(res.status(), 200);
    let mut text = String::new();
    let mut body = res.bytes_stream();
    while let Some(chunk) = body.next().await {
        text.push_str(std::str::from_utf8(&chunk.unwrap()).unwrap());
    }
    let usage = text
        .split_terminator("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .find_map(|c| c.get("usage").filter(|u| !u.is_null()).cloned());
    usage.unwrap_or_else(|| panic!("no usage in {text}"))
}

/// Engine mode: P holds the prompt's 281 full blocks under the router's id and names them; D
/// waits the read at the configured bandwidth, reports them cached (but not as its own
/// prefix-cache hits) and frees them on P. A prompt D already holds is not read again, and a
/// request P no longer holds is recomputed and counted as a failed transfer.
#[tokio::test]
async fn engine_prefill_holds_and_decode_reads_then_frees() {
    let p = Server::start(
        SimConfig::for_engine_tests(64_000, 10.0),
        role(Role::Prefill),
    )
    .await;
    // 0.25 GB/s: 4,496 tokens of 128 KiB take 2.36 model s, 236 ms of wall time at 10x.
    let slow = PdConfig {
        transfer_gbps: 0.25,
        ..role(Role::Decode)
    };
    let d = Server::start(SimConfig::for_engine_tests(64_000, 10.0), slow).await;
    let prompt = "The quick brown fox jumps over the lazy dog. ".repeat(400);
    let body = json!({"model": "m", "prompt": prompt, "max_tokens": 4, "stream": true,
        "stream_options": {"include_usage": true}});

    let answer = p
        .json("/v1/completions", &prefill_leg(&body), "req-1")
        .await;
    assert_eq!(answer["usage"]["completion_tokens"], 1);
    let params = &answer["kv_transfer_params"];
    let p_state = p.state().await;
    assert_eq!(params["do_remote_prefill"], true);
    assert_eq!(params["do_remote_decode"], false);
    assert_eq!(params["remote_request_id"], "req-1");
    assert_eq!(params["remote_engine_id"], p_state["pd"]["engine_id"]);
    assert_eq!(params["remote_host"], "127.0.0.1");
    assert_eq!(params["remote_port"], p.port);
    assert_eq!(params["tp_size"], 1);
    let ids = params["remote_block_ids"].as_array().unwrap();
    assert_eq!(ids.len(), 4_500 / 16);
    assert!(ids.iter().all(Value::is_u64));
    assert_eq!(p_state["role"], "prefill");
    assert_eq!(p_state["pd"]["held_requests"], 1);
    assert_eq!(p_state["pd"]["held_blocks"], 281);
    // Pinned blocks count as used, as a request's do.
    assert_eq!(p_state["engine"]["used_blocks"], 281);

    let started = Instant::now();
    let usage = streamed_usage(
        d.post("/v1/completions", &decode_leg(&body, params), "req-1")
            .await,
    )
    .await;
    let took = started.elapsed();
    let model_s = 0.002 + 4_496.0 * 131_072.0 / 0.25e9;
    assert!(
        took >= Duration::from_secs_f64(model_s / 10.0) && took < Duration::from_secs(2),
        "{took:?}"
    );
    // vLLM recomputes the last token: (4,500 - 1) rounded down to 16, all of it read.
    assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 4_496);
    let d_state = d.state().await;
    assert_eq!(d_state["role"], "decode");
    assert_eq!(d_state["pd"]["transfers_total"], 1);
    assert_eq!(d_state["pd"]["transfer_tokens_total"], 4_496);
    assert_eq!(
        d_state["prefix_cache_hits_total"], 0,
        "read, not a local hit"
    );
    let m = d.metrics().await;
    assert_eq!(sample(&m, "vllm:nixl_xfer_time_seconds_count"), 1.0);
    let xfer = sample(&m, "vllm:nixl_xfer_time_seconds_sum");
    // NIXL times the read alone, without the base latency around it.
    assert!(
        (xfer - (model_s - 0.002)).abs() < 1e-9,
        "{xfer} vs {model_s}"
    );
    let bytes = sample(&m, "vllm:nixl_bytes_transferred_sum");
    assert_eq!(bytes, 4_496.0 * 131_072.0);
    assert_eq!(sample(&m, "vllm:nixl_num_failed_transfers_total"), 0.0);
    let p_state = p
        .until("P frees the read blocks", |s| {
            s["engine"]["used_blocks"] == 0
        })
        .await;
    assert_eq!(p_state["pd"]["held_requests"], 0);
    assert_eq!(p_state["pd"]["released_total"], 1);
    assert!(p_state["engine"]["cached_blocks"].as_u64().unwrap() >= 281);

    // Again: D holds the prompt now, so nothing is read, yet P is told at once.
    let again = p
        .json("/v1/completions", &prefill_leg(&body), "req-2")
        .await;
    let started = Instant::now();
    let leg = decode_leg(&body, &again["kv_transfer_params"]);
    let usage = streamed_usage(d.post("/v1/completions", &leg, "req-2").await).await;
    assert!(started.elapsed() < Duration::from_secs_f64(model_s / 10.0));
    assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 4_496);
    assert_eq!(d.state().await["pd"]["transfers_total"], 1);
    p.until("P frees on the notice alone", |s| {
        s["pd"]["held_requests"] == 0 && s["engine"]["used_blocks"] == 0
    })
    .await;

    // A request P no longer holds (another decode server took it): D reads in vain, counts
    // the failure and recomputes the prompt.
    let other = json!({"model": "m", "prompt": "Pack my box with five dozen liquor jugs. "
        .repeat(300), "max_tokens": 2});
    let answer = p
        .json("/v1/completions", &prefill_leg(&other), "req-3")
        .await;
    let notice = json!({"request_id": "req-3"});
    let taken = p.json("/kvbench/nixl/notify", &notice, "x").await;
    assert!(taken["released_blocks"].as_u64().unwrap() > 0);
    let twice = p.post("/kvbench/nixl/notify", &notice, "x").await;
    assert_eq!(twice.status(), 404);
    let leg = decode_leg(&other, &answer["kv_transfer_params"]);
    let v = d.json("/v1/completions", &leg, "req-3").await;
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let d_state = d.state().await;
    assert_eq!(d_state["pd"]["failed_transfers_total"], 1);
    assert_eq!(d_state["pd"]["transfers_total"], 1);
    let m = d.metrics().await;
    assert_eq!(sample(&m, "vllm:nixl_num_failed_transfers_total"), 1.0);
}

/// Fixed timing: the same exchange over chat, a held request that nobody reads expiring at
/// `--pd-abort-timeout-s`, and a decode request for it recomputing its prompt.
#[tokio::test]
async fn fixed_timing_prefill_expires_unread_and_decode_reads_in_time() {
    let hold_600ms = PdConfig {
        abort_timeout: Duration::from_millis(600),
        ..role(Role::Prefill)
    };
    let p = Server::start(SimConfig::for_tests(), hold_600ms).await;
    // 32 KiB a token at 0.25 GB/s: ~150 ms for the prompt's 74 blocks, well within the hold.
    let slow = PdConfig {
        transfer_gbps: 0.25,
        kv_bytes_per_token: Some(32_768),
        ..role(Role::Decode)
    };
    let d = Server::start(SimConfig::for_tests(), slow).await;
    let body = json!({"model": "m", "max_tokens": 3, "messages": [
        {"role": "system", "content": "You are a helpful assistant. ".repeat(160)},
        {"role": "user", "content": "What is disaggregated serving?"}]});

    let answer = p
        .json("/v1/chat/completions", &prefill_leg(&body), "chat-1")
        .await;
    let params = &answer["kv_transfer_params"];
    let blocks = params["remote_block_ids"].as_array().unwrap().len() as u64;
    assert!(blocks > 60, "{blocks}");
    let p_state = p.state().await;
    assert_eq!(p_state["pd"]["held_blocks"], blocks);
    assert_eq!(
        p_state["kv_tokens_used"],
        blocks * 16,
        "held blocks are in use"
    );
    let started = Instant::now();
    let v = d
        .json("/v1/chat/completions", &decode_leg(&body, params), "chat-1")
        .await;
    let took = started.elapsed();
    let model_s = 0.002 + (blocks * 16 * 32_768) as f64 / 0.25e9;
    assert!(
        took >= Duration::from_secs_f64(model_s) && took < Duration::from_secs(2),
        "{took:?} for {model_s} s"
    );
    assert_eq!(
        v["usage"]["prompt_tokens_details"]["cached_tokens"],
        blocks * 16
    );
    assert_eq!(v["choices"][0]["message"]["content"], " tok0 tok1 tok2");
    let p_state = p.state().await;
    assert_eq!(p_state["pd"]["held_requests"], 0);
    assert_eq!(p_state["pd"]["released_total"], 1);
    assert_eq!(p_state["kv_tokens_used"], 0);

    // Unread, a hold lasts the abort timeout and no longer.
    let other = json!({"model": "m", "max_tokens": 3, "messages": [
        {"role": "user", "content": "Sphinx of black quartz, judge my vow. ".repeat(40)}]});
    let answer = p
        .json("/v1/chat/completions", &prefill_leg(&other), "chat-2")
        .await;
    let held_at = Instant::now();
    assert_eq!(p.state().await["pd"]["held_requests"], 1);
    let p_state = p
        .until("the hold expires", |s| s["pd"]["held_requests"] == 0)
        .await;
    assert!(held_at.elapsed() >= Duration::from_millis(550));
    assert_eq!(p_state["pd"]["expired_total"], 1);
    assert_eq!(p_state["kv_tokens_used"], 0);
    let m = p.metrics().await;
    assert_eq!(sample(&m, "vllm:nixl_num_kv_expired_reqs_total"), 1.0);
    // Too late: D recomputes.
    let leg = decode_leg(&other, &answer["kv_transfer_params"]);
    let v = d.json("/v1/chat/completions", &leg, "chat-2").await;
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(d.state().await["pd"]["failed_transfers_total"], 1);
}

/// A decode request whose client goes away during its read still lets P free the blocks at
/// once, long before the read would have ended; the read counts neither way. A prefill server
/// that cannot be reached fails the read.
#[tokio::test]
async fn abandoned_decode_frees_the_prefill_and_an_unreachable_one_fails() {
    let p = Server::start(SimConfig::for_tests(), role(Role::Prefill)).await;
    // 4 KiB a token at 0.0001 GB/s: 18 s for the prompt's 28 blocks.
    let crawl = PdConfig {
        transfer_gbps: 0.0001,
        kv_bytes_per_token: Some(4_096),
        ..role(Role::Decode)
    };
    let d = Arc::new(Server::start(SimConfig::for_tests(), crawl).await);
    let body = json!({"model": "m", "prompt": "lorem ipsum dolor ".repeat(100),
        "max_tokens": 2});
    let answer = p
        .json("/v1/completions", &prefill_leg(&body), "gone-1")
        .await;
    let leg = decode_leg(&body, &answer["kv_transfer_params"]);
    let pending = {
        let (d, leg) = (d.clone(), leg.clone());
        tokio::spawn(async move { d.post("/v1/completions", &leg, "gone-1").await })
    };
    d.until("the read is under way, as a waiting request", |s| {
        s["waiting"] == 1
    })
    .await;
    assert_eq!(p.state().await["pd"]["held_requests"], 1);
    pending.abort();
    let p_state = p
        .until("P told of the abort", |s| s["pd"]["held_requests"] == 0)
        .await;
    assert_eq!(p_state["pd"]["released_total"], 1);
    assert_eq!(p_state["pd"]["expired_total"], 0);
    let d_state = d.until("D lets go", |s| s["waiting"] == 0).await;
    assert_eq!(d_state["pd"]["transfers_total"], 0);
    assert_eq!(d_state["pd"]["failed_transfers_total"], 0);

    // Nothing listens on port 1 of loopback: the read fails and D prefills by itself.
    let mut params = answer["kv_transfer_params"].clone();
    params["remote_port"] = json!(1);
    let fast = Server::start(SimConfig::for_tests(), role(Role::Decode)).await;
    let v = fast
        .json("/v1/completions", &decode_leg(&body, &params), "gone-1")
        .await;
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(fast.state().await["pd"]["failed_transfers_total"], 1);
}
