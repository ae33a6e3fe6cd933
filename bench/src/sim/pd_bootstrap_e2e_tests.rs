//! End-to-end SGLang bootstrap protocol: a prefill and a decode server on 127.0.0.1:0 in this
//! process, driven over HTTP as SGLang's routers drive them (the same body to both at once).

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use serde_json::{json, Value};
use tokio::time::Instant;

use super::config::{Engine, SimConfig};
use super::pd::{PdConfig, PdProtocol, Role};
use super::pd_e2e_tests::{sample, streamed_usage, Server};

fn sglang(role: Role) -> PdConfig {
    PdConfig {
        role,
        protocol: PdProtocol::SglangBootstrap,
        ..PdConfig::default()
    }
}

fn engine_config() -> SimConfig {
    SimConfig {
        engine: Engine::Sglang,
        ..SimConfig::for_engine_tests(64_000, 10.0)
    }
}

fn fixed_config() -> SimConfig {
    SimConfig {
        engine: Engine::Sglang,
        ..SimConfig::for_tests()
    }
}

/// The body both legs get: the client's, plus what mini_lb adds.
fn with_room(body: &Value, p: &Server, room: u64) -> Value {
    let mut b = body.clone();
    b["bootstrap_host"] = json!("127.0.0.1");
    b["bootstrap_port"] = json!(p.port);
    b["bootstrap_room"] = json!(room);
    b
}

/// A streamed answer's whole text.
async fn sse_text(res: reqwest::Response) -> String {
    let mut text = String::new();
    let mut body = res.bytes_stream();
    while let Some(chunk) = body.next().await {
        text.push_str(std::str::from_utf8(&chunk.unwrap()).unwrap());
    }
    text
}

/// Engine mode, both legs at once: P prefills and holds the room, D reads the 281 blocks at
/// the configured bandwidth and reports them cached, P answers its leg (one token) once they
/// are read and frees them. Again, P finds the prompt cached and D holds it already.
#[tokio::test]
async fn both_legs_at_once_d_reads_and_p_answers_after_the_read() {
    let p = Arc::new(Server::start(engine_config(), sglang(Role::Prefill)).await);
    // 0.25 GB/s: 4,496 tokens of 128 KiB take 2.36 model s, 236 ms of wall time at 10x.
    let slow = PdConfig {
        transfer_gbps: 0.25,
        ..sglang(Role::Decode)
    };
    let d = Arc::new(Server::start(engine_config(), slow).await);
    let prompt = "The quick brown fox jumps over the lazy dog. ".repeat(400);
    let client = json!({"model": "m", "prompt": prompt, "max_tokens": 4, "stream": true,
        "stream_options": {"include_usage": true}});
    let body = with_room(&client, &p, 9_000_000_000_000_000_001);
    let model_s = 0.002 + 4_496.0 * 131_072.0 / 0.25e9;

    let started = Instant::now();
    let (p_res, d_res) = tokio::join!(
        p.post("/v1/completions", &body, "r-1"),
        d.post("/v1/completions", &body, "r-1")
    );
    let d_usage = streamed_usage(d_res).await;
    // vLLM's rule, shared: (4,500 - 1) rounded down to 16, all of it read.
    assert_eq!(d_usage["prompt_tokens_details"]["cached_tokens"], 4_496);
    assert_eq!(d_usage["completion_tokens"], 4);
    // P's leg: streamed as asked, one token, after the read.
    let p_usage = streamed_usage(p_res).await;
    assert!(started.elapsed() >= Duration::from_secs_f64(model_s / 10.0));
    assert_eq!(p_usage["completion_tokens"], 1);
    assert_eq!(p_usage["prompt_tokens_details"]["cached_tokens"], 0);
    let p_state = p
        .until("P frees the read room", |s| s["engine"]["used_blocks"] == 0)
        .await;
    assert_eq!(p_state["pd"]["held_requests"], 0);
    assert_eq!(p_state["pd"]["released_total"], 1);
    assert_eq!(p_state["pd"]["waiting_prefill_legs"], 0);
    let d_state = d.state().await;
    assert_eq!(d_state["pd"]["transfers_total"], 1);
    assert_eq!(d_state["pd"]["transfer_tokens_total"], 4_496);
    assert_eq!(d_state["pd"]["waiting_decodes"], 0);
    let m = d.metrics().await;
    let latency = sample(&m, "sglang:kv_transfer_latency_ms");
    // The read alone, without the base latency around it.
    assert!(
        (latency - (model_s - 0.002) * 1e3).abs() < 1e-6,
        "{latency}"
    );
    assert_eq!(sample(&m, "sglang:num_decode_transfer_queue_reqs"), 0.0);
    assert_eq!(sample(&m, "sglang:num_transfer_failed_reqs_total"), 0.0);
    let m = p.metrics().await;
    assert_eq!(sample(&m, "sglang:num_prefill_inflight_queue_reqs"), 0.0);

    // Again, non-streamed, a new room: P computes nothing it holds, D reads nothing.
    let mut again = with_room(&client, &p, 7);
    again["stream"] = json!(false);
    let (p_res, d_res) = tokio::join!(
        p.json("/v1/completions", &again, "r-2"),
        d.json("/v1/completions", &again, "r-2")
    );
    assert_eq!(
        p_res["usage"]["prompt_tokens_details"]["cached_tokens"],
        4_496
    );
    assert_eq!(p_res["choices"][0]["finish_reason"], "length");
    assert_eq!(
        d_res["usage"]["prompt_tokens_details"]["cached_tokens"],
        4_496
    );
    assert_eq!(d.state().await["pd"]["transfers_total"], 1);
    p.until("P frees on the notice alone", |s| {
        s["pd"]["held_requests"] == 0 && s["engine"]["used_blocks"] == 0
    })
    .await;
}

/// Fixed timing: D's leg arrives first and waits; P's leg comes 300 ms later; D then reads
/// and both answer.
#[tokio::test]
async fn decode_first_waits_for_a_late_prefill() {
    let p = Server::start(fixed_config(), sglang(Role::Prefill)).await;
    let d = Arc::new(Server::start(fixed_config(), sglang(Role::Decode)).await);
    let client = json!({"model": "m", "max_tokens": 3, "messages": [
        {"role": "system", "content": "You are a helpful assistant. ".repeat(160)},
        {"role": "user", "content": "What is disaggregated serving?"}]});
    let body = with_room(&client, &p, 12_345);
    let pending = {
        let (d, body) = (d.clone(), body.clone());
        tokio::spawn(async move { d.json("/v1/chat/completions", &body, "late-1").await })
    };
    d.until("D waits for P's KV", |s| s["pd"]["waiting_decodes"] == 1)
        .await;
    assert_eq!(
        sample(&d.metrics().await, "sglang:num_decode_prealloc_queue_reqs"),
        1.0
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!pending.is_finished());
    let p_answer = p.json("/v1/chat/completions", &body, "late-1").await;
    assert_eq!(p_answer["usage"]["completion_tokens"], 1);
    let v = pending.await.unwrap();
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached > 60 * 16, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], " tok0 tok1 tok2");
    let p_state = p.state().await;
    assert_eq!(p_state["pd"]["held_requests"], 0);
    assert_eq!(p_state["kv_tokens_used"], 0);
    let d_state = d.state().await;
    assert_eq!(d_state["pd"]["waiting_decodes"], 0);
    assert_eq!(d_state["pd"]["transfers_total"], 1);
}

/// P's leg never comes: D fails at its waiting timeout, non-streamed with SGLang's 500,
/// streamed with one error event and [DONE]; nothing hangs.
#[tokio::test]
async fn decode_without_its_prefill_times_out() {
    let p = Server::start(fixed_config(), sglang(Role::Prefill)).await;
    let short = PdConfig {
        waiting_timeout: Duration::from_millis(400),
        ..sglang(Role::Decode)
    };
    let d = Server::start(fixed_config(), short).await;
    let client = json!({"model": "m", "prompt": "lorem ipsum dolor ".repeat(100),
        "max_tokens": 2});

    let started = Instant::now();
    let res = d
        .post("/v1/completions", &with_room(&client, &p, 1), "lost-1")
        .await;
    assert_eq!(res.status(), 500);
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(400) && took < Duration::from_secs(2),
        "{took:?}"
    );
    let err: Value = res.json().await.unwrap();
    let msg = err["error"]["message"].as_str().unwrap();
    assert!(
        msg.starts_with("Decode transfer failed for request rank=0"),
        "{msg}"
    );
    assert!(
        msg.contains("decode_req.req.rid='lost-1' decode_req.req.bootstrap_room=1"),
        "{msg}"
    );
    assert!(
        msg.contains("timed out after 0.4s in KVPoll.WaitingForInput"),
        "{msg}"
    );

    let mut streamed = with_room(&client, &p, 2);
    streamed["stream"] = json!(true);
    let res = d.post("/v1/completions", &streamed, "lost-2").await;
    assert_eq!(res.status(), 200);
    let text = sse_text(res).await;
    let events: Vec<&str> = text
        .split_terminator("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .collect();
    assert_eq!(events.len(), 2, "{text}");
    let error: Value = serde_json::from_str(events[0]).unwrap();
    let msg = error["error"]["message"].as_str().unwrap();
    assert!(msg.contains("bootstrap_room=2") && msg.contains("KVPoll.WaitingForInput"));
    assert_eq!(events[1], "[DONE]");

    let d_state = d.state().await;
    assert_eq!(d_state["pd"]["timed_out_waits_total"], 2);
    assert_eq!(
        (
            d_state["pd"]["waiting_decodes"].as_u64(),
            d_state["waiting"].as_u64()
        ),
        (Some(0), Some(0))
    );
    let m = d.metrics().await;
    assert_eq!(sample(&m, "sglang:num_transfer_failed_reqs_total"), 2.0);
    assert_eq!(sample(&m, "sglang:num_decode_prealloc_queue_reqs"), 0.0);
}

/// A room nobody fetches is freed at the bootstrap timeout and P's leg fails; a decode leg
/// cut during its read frees the room at once and fails P's leg too.
#[tokio::test]
async fn unfetched_rooms_expire_and_an_aborted_read_frees_at_once() {
    let p = Arc::new(
        Server::start(
            fixed_config(),
            PdConfig {
                bootstrap_timeout: Duration::from_millis(500),
                ..sglang(Role::Prefill)
            },
        )
        .await,
    );
    let client = json!({"model": "m", "max_tokens": 3, "messages": [
        {"role": "user", "content": "Sphinx of black quartz, judge my vow. ".repeat(40)}]});
    let body = with_room(&client, &p, 77);
    let started = Instant::now();
    let res = p.post("/v1/chat/completions", &body, "alone-1").await;
    assert_eq!(res.status(), 500);
    assert!(started.elapsed() >= Duration::from_millis(450));
    let err: Value = res.json().await.unwrap();
    let msg = err["error"]["message"].as_str().unwrap();
    assert!(
        msg.starts_with(
            "Prefill bootstrap failed for request rank=0 req.rid='alone-1' req.bootstrap_room=77"
        ),
        "{msg}"
    );
    let p_state = p.state().await;
    assert_eq!(p_state["pd"]["held_requests"], 0);
    assert_eq!(p_state["pd"]["expired_total"], 1);
    assert_eq!(p_state["kv_tokens_used"], 0);
    assert_eq!(
        sample(&p.metrics().await, "sglang:num_bootstrap_failed_reqs_total"),
        1.0
    );

    // 4 KiB a token at 0.0001 GB/s: 18 s for the prompt's blocks; the decode leg is cut.
    let crawl = PdConfig {
        transfer_gbps: 0.0001,
        kv_bytes_per_token: Some(4_096),
        ..sglang(Role::Decode)
    };
    let d = Arc::new(Server::start(fixed_config(), crawl).await);
    let body = with_room(&client, &p, 78);
    let p_leg = {
        let (p, body) = (p.clone(), body.clone());
        tokio::spawn(async move { p.post("/v1/chat/completions", &body, "cut-1").await })
    };
    let d_leg = {
        let (d, body) = (d.clone(), body.clone());
        tokio::spawn(async move { d.post("/v1/chat/completions", &body, "cut-1").await })
    };
    d.until("D reads", |s| s["pd"]["transferring_decodes"] == 1)
        .await;
    d_leg.abort();
    let res = p_leg.await.unwrap();
    assert_eq!(res.status(), 500);
    let err: Value = res.json().await.unwrap();
    let msg = err["error"]["message"].as_str().unwrap();
    assert!(msg.starts_with("Prefill transfer failed"), "{msg}");
    let p_state = p.state().await;
    assert_eq!(p_state["pd"]["held_requests"], 0);
    assert_eq!(p_state["pd"]["expired_total"], 1);
    d.until("D lets go", |s| s["pd"]["transferring_decodes"] == 0)
        .await;
}

/// A P or D server refuses a request without a room, as SGLang's DP controller does; a
/// `both` server serves it, with or without the fields. Batches of more than one are refused.
#[tokio::test]
async fn requests_without_a_room_are_refused_by_p_and_d_only() {
    let p = Server::start(fixed_config(), sglang(Role::Prefill)).await;
    let d = Server::start(fixed_config(), sglang(Role::Decode)).await;
    let both = Server::start(fixed_config(), sglang(Role::Both)).await;
    let plain = json!({"model": "m", "prompt": "hello there", "max_tokens": 2});
    for (server, stream) in [(&p, false), (&d, false), (&p, true), (&d, true)] {
        let mut body = plain.clone();
        body["stream"] = json!(stream);
        let res = server.post("/v1/completions", &body, "x").await;
        assert_eq!(res.status(), 400);
        let err: Value = res.json().await.unwrap();
        assert_eq!(
            err["error"]["message"],
            "req.bootstrap_room should not be None. Do not send requests directly to \
             prefill or decode instances; send to the router instead."
        );
    }
    let v = both.json("/v1/completions", &plain, "x").await;
    assert_eq!(v["usage"]["completion_tokens"], 2);
    let v = both
        .json("/v1/completions", &with_room(&plain, &p, 3), "x")
        .await;
    assert_eq!(v["usage"]["completion_tokens"], 2);
    // A batch of two rooms, and a decode leg that names no prefill server.
    let mut batch = with_room(&plain, &p, 0);
    batch["bootstrap_room"] = json!([1, 2]);
    let res = p.post("/v1/completions", &batch, "x").await;
    assert_eq!(res.status(), 400);
    let mut nowhere = plain.clone();
    nowhere["bootstrap_room"] = json!(5);
    let res = d.post("/v1/completions", &nowhere, "x").await;
    assert_eq!(res.status(), 400);
    // Nothing was held or waited on.
    assert_eq!(p.state().await["pd"]["held_requests"], 0);
    assert_eq!(d.state().await["pd"]["timed_out_waits_total"], 0);
}
