//! Streams that lose their backend after the response started go on on another one, through
//! real processes: a killed engine, a connection dropped mid-stream, an engine's error event.
//! The simulator's text is deterministic (token i is " tok{i}") and it continues a reply's
//! start from where it ends, so "whole" is checkable: the client reads exactly the text of an
//! unbroken stream, under one `id`, with one end.

mod common;

use common::*;
use serde_json::{json, Value};
use std::time::Duration;

/// The text of an unbroken reply of `n` tokens.
fn whole(n: u64) -> String {
    (0..n).map(|i| format!(" tok{i}")).collect()
}

/// A streamed request's events, as JSON (`[DONE]` as the string "[DONE]").
struct Stream {
    events: Vec<Value>,
}

impl Stream {
    fn parse(raw: &str) -> Stream {
        let events = raw
            .split("\n\n")
            .filter(|e| !e.trim().is_empty())
            .map(|e| {
                let data = e.trim().strip_prefix("data: ").unwrap_or(e.trim());
                serde_json::from_str(data).unwrap_or_else(|_| Value::String(data.to_string()))
            })
            .collect();
        Stream { events }
    }

    /// Choice 0's text, chat or completions.
    fn text(&self) -> String {
        self.events
            .iter()
            .filter_map(|e| {
                let c = &e["choices"][0];
                c["delta"]["content"].as_str().or(c["text"].as_str())
            })
            .collect()
    }

    fn chunks(&self) -> impl Iterator<Item = &Value> {
        self.events.iter().filter(|e| e.get("choices").is_some())
    }

    fn dones(&self) -> usize {
        self.events
            .iter()
            .filter(|e| e.as_str() == Some("[DONE]"))
            .count()
    }

    fn error(&self) -> Option<&Value> {
        self.events.iter().find_map(|e| e.get("error"))
    }
}

async fn stream_of(kv: &Kvroute, path: &str, body: Value) -> Stream {
    let r = client()
        .post(kv.url(path))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let raw = tokio::time::timeout(Duration::from_secs(20), r.text())
        .await
        .expect("the stream hung")
        .expect("the stream broke instead of ending");
    Stream::parse(&raw)
}

fn chat(n: u32) -> Value {
    let mut body = chat_body(
        MODEL,
        json!([{"role": "user", "content": "hello"}]),
        true,
        n,
    );
    body["stream_options"] = json!({"include_usage": true});
    body
}

fn migrations(kv: &Kvroute, outcome: &str) -> f64 {
    kv.metric_sum("kvroute_migrations_total", &[("outcome", outcome)])
}

const FAST: [&str; 4] = ["--ttft-ms", "1", "--itl-ms", "5"];

/// A 60-token chat stream through `kv`, read up to its sixth token: the response, the text
/// read so far, and which of `sims` serves it.
async fn stream_under_way(kv: &Kvroute, sims: &[Sim]) -> (reqwest::Response, String, usize) {
    let mut r = client()
        .post(kv.url("/v1/chat/completions"))
        .json(&chat(60))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let served_by = r.headers()["x-kvbench-addr"].to_str().unwrap().to_string();
    let mut raw = String::new();
    while !raw.contains("tok5\"") {
        let chunk = r.chunk().await.unwrap().expect("stream ended early");
        raw.push_str(&String::from_utf8_lossy(&chunk));
    }
    let i = sims.iter().position(|s| s.addr.to_string() == served_by);
    (r, raw, i.expect("served by a sim"))
}

/// The rest of a stream, if it ends within `within`.
async fn rest_of(r: &mut reqwest::Response, within: Duration) -> Option<String> {
    tokio::time::timeout(within, async {
        let mut rest = String::new();
        while let Some(chunk) = r.chunk().await.expect("the stream broke") {
            rest.push_str(&String::from_utf8_lossy(&chunk));
        }
        rest
    })
    .await
    .ok()
}

/// The engine is killed mid-stream: the rest of the text comes from the other backend, spliced
/// into the same stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_engines_stream_goes_on_elsewhere_as_one_stream() {
    let mut sims = Sim::start_n(2, &["--ttft-ms", "1", "--itl-ms", "20"]);
    let kv = Kvroute::start(&[sims[0].addr, sims[1].addr], "");
    let (mut r, raw, dead) = stream_under_way(&kv, &sims).await;
    sims[dead].kill();
    let rest = rest_of(&mut r, Duration::from_secs(20))
        .await
        .expect("the migrated stream hung");
    let s = Stream::parse(&(raw + &rest));
    assert_eq!(s.error(), None, "{:?}", s.events);
    assert_eq!(s.text(), whole(60));
    assert_eq!(s.dones(), 1);
    let first = s.chunks().next().unwrap().clone();
    for c in s.chunks() {
        assert_eq!(
            (&c["id"], &c["created"], &c["model"]),
            (&first["id"], &first["created"], &first["model"])
        );
    }
    let roles = s
        .chunks()
        .filter(|c| c["choices"][0]["delta"].get("role").is_some())
        .count();
    assert_eq!(roles, 1, "one opening chunk");
    let finish: Vec<_> = s
        .chunks()
        .filter_map(|c| c["choices"][0]["finish_reason"].as_str())
        .collect();
    assert_eq!(finish, ["length"]);
    let usage = &s.chunks().last().unwrap()["usage"];
    assert_eq!(usage["completion_tokens"], 60, "{usage}");
    assert_eq!(migrations(&kv, "migrated"), 1.0);
    assert_eq!(kv.metric_sum("kvroute_cut_streams_total", &[]), 0.0);
    assert_eq!(
        kv.metric_sum("kvroute_migration_gap_seconds_count", &[]),
        1.0
    );
}

/// Connections dropped mid-stream and engine error events, on chat and completions: the
/// continuation asks for what is left, and the client reads one whole stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cut_connections_and_engine_errors_are_continued() {
    let sims = Sim::start_n(2, &FAST);
    let kv = Kvroute::start(&[sims[0].addr, sims[1].addr], "");
    // Every stream is cut at its 5th token: the first attempt sends 5, its continuation the
    // other 3.
    for s in &sims {
        set_faults(s.addr, json!({"cut_after_tokens": 5}));
    }
    let s = stream_of(&kv, "/v1/chat/completions", chat(8)).await;
    assert_eq!((s.text(), s.dones(), s.error()), (whole(8), 1, None));
    let usage = &s.chunks().last().unwrap()["usage"];
    assert_eq!(usage["completion_tokens"], 8, "{usage}");
    // The replayed text was the continuation's prompt: both prompts are counted.
    let prompt = usage["prompt_tokens"].as_u64().unwrap();
    assert!(prompt > 2 * 5, "{usage}");
    let completions = json!({"model": MODEL, "prompt": "Once", "max_tokens": 7, "stream": true});
    let s = stream_of(&kv, "/v1/completions", completions).await;
    assert_eq!((s.text(), s.dones(), s.error()), (whole(7), 1, None));
    // An engine's error event mid-stream is not the client's: the stream goes on.
    for s in &sims {
        set_faults(
            s.addr,
            json!({"cut_after_tokens": 0, "error_after_tokens": 4}),
        );
    }
    let s = stream_of(&kv, "/v1/chat/completions", chat(6)).await;
    assert_eq!((s.text(), s.dones(), s.error()), (whole(6), 1, None));
    assert_eq!(migrations(&kv, "migrated"), 3.0);
    // Text that reached its limit before the cut needs only its end.
    for s in &sims {
        set_faults(
            s.addr,
            json!({"cut_after_tokens": 4, "error_after_tokens": 0}),
        );
    }
    let s = stream_of(&kv, "/v1/chat/completions", chat(4)).await;
    assert_eq!((s.text(), s.dones(), s.error()), (whole(4), 1, None));
}

/// At most `limits.max_migrations` continuations; what cannot be continued faithfully ends
/// with an error event, counted by why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrations_are_limited_and_unfit_streams_end_with_an_error() {
    let sims = Sim::start_n(4, &FAST);
    let addrs: Vec<_> = sims.iter().map(|s| s.addr).collect();
    let kv = Kvroute::start(&addrs, "");
    for s in &sims {
        set_faults(s.addr, json!({"cut_after_tokens": 3}));
    }
    // Three attempts of 3 tokens each (the default limit is 2 migrations), then an error.
    let s = stream_of(&kv, "/v1/chat/completions", chat(20)).await;
    assert_eq!(s.text(), whole(9));
    assert_eq!(
        s.error().unwrap()["code"],
        "upstream_failed",
        "{:?}",
        s.events
    );
    assert_eq!(s.dones(), 0);
    assert_eq!(migrations(&kv, "migrated"), 2.0);
    assert_eq!(migrations(&kv, "limit"), 1.0);
    // Each continuation is built from the client's body and the whole text so far: the second
    // replays " tok0 … tok5", 15 bytes more than the first's " tok0 tok1 tok2", not the first
    // continuation's body with the text appended again.
    let mut lengths: Vec<u64> = sims
        .iter()
        .flat_map(|s| s.requests())
        .filter(|e| e["path"] == "/v1/chat/completions")
        .filter_map(|e| e["body_len"].as_u64())
        .collect();
    lengths.sort_unstable();
    assert_eq!(lengths.len(), 3, "{lengths:?}");
    assert_eq!(
        lengths[2] - lengths[1],
        " tok3 tok4 tok5".len() as u64,
        "{lengths:?}"
    );
    assert_eq!(kv.metric_sum("kvroute_cut_streams_total", &[]), 1.0);
    // Token log probabilities another engine did not sample cannot be continued.
    let mut body = chat(20);
    body["logprobs"] = json!(true);
    let s = stream_of(&kv, "/v1/chat/completions", body).await;
    assert_eq!(s.text(), whole(3));
    assert!(s.error().is_some());
    assert_eq!(migrations(&kv, "unfit_logprobs"), 1.0);
    drop(kv);
    // Migration off: the stream ends with an error event, as before.
    let kv = Kvroute::start(&addrs, "  limits:\n    max_migrations: 0\n");
    let s = stream_of(&kv, "/v1/chat/completions", chat(20)).await;
    assert_eq!(s.text(), whole(3));
    assert!(s.error().is_some());
    assert_eq!(migrations(&kv, "disabled"), 1.0);
}

/// An engine that refuses a continuation (it does not know `continue_final_message`) is not
/// asked to continue a stream again; the client's stream is not touched by its answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_refusing_continuations_is_not_asked_again() {
    let sims = Sim::start_n(2, &FAST);
    let kv = Kvroute::start(&[sims[0].addr, sims[1].addr], "");
    for s in &sims {
        set_faults(
            s.addr,
            json!({"cut_after_tokens": 3, "refuse_continuation": true}),
        );
    }
    for _ in 0..4 {
        let s = stream_of(&kv, "/v1/chat/completions", chat(10)).await;
        assert_eq!(s.text(), whole(3));
        assert_eq!(s.error().unwrap()["code"], "upstream_failed");
    }
    let refused = |b: &Sim| {
        kv.metric_sum(
            "kvroute_upstream_failures_total",
            &[
                ("kind", "refused_continuation"),
                ("backend", &b.addr.to_string()),
            ],
        )
    };
    let per_backend: Vec<f64> = sims.iter().map(refused).collect();
    assert!(per_backend.iter().all(|&n| n <= 1.0), "{per_backend:?}");
    assert!(per_backend.iter().sum::<f64>() >= 1.0, "{per_backend:?}");
}

/// A Messages or Responses stream's events (`event:` then `data:`), as (type, JSON) pairs.
async fn typed_events(kv: &Kvroute, path: &str, body: Value) -> Vec<(String, Value)> {
    let r = client()
        .post(kv.url(path))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let raw = tokio::time::timeout(Duration::from_secs(20), r.text())
        .await
        .expect("the stream hung")
        .expect("the stream broke instead of ending");
    raw.split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| {
            let kind = e
                .lines()
                .find_map(|l| l.strip_prefix("event: "))
                .unwrap_or("")
                .to_string();
            let data = e
                .lines()
                .find_map(|l| l.strip_prefix("data: "))
                .unwrap_or("");
            (kind, serde_json::from_str(data).unwrap_or(Value::Null))
        })
        .collect()
}

fn count(events: &[(String, Value)], kind: &str) -> usize {
    events.iter().filter(|(k, _)| k == kind).count()
}

/// Anthropic's Messages streams go on elsewhere too, as one message: one opening, the text of
/// an unbroken reply, one end, and output usage counting both engines' tokens. A message whose
/// tool call was cut cannot be continued and ends with an error event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_messages_stream_goes_on_elsewhere_as_one_message() {
    let sims = Sim::start_n(2, &FAST);
    let kv = Kvroute::start(&[sims[0].addr, sims[1].addr], "");
    for s in &sims {
        set_faults(s.addr, json!({"cut_after_tokens": 5}));
    }
    let body = json!({"model": MODEL, "max_tokens": 8, "stream": true,
                      "messages": [{"role": "user", "content": "hello"}]});
    let events = typed_events(&kv, "/v1/messages", body).await;
    let text: String = events
        .iter()
        .filter(|(k, _)| k == "content_block_delta")
        .filter_map(|(_, v)| v["delta"]["text"].as_str())
        .collect();
    assert_eq!(text, whole(8), "{events:?}");
    for (kind, n) in [
        ("message_start", 1),
        ("content_block_start", 1),
        ("content_block_stop", 1),
        ("message_delta", 1),
        ("message_stop", 1),
        ("error", 0),
    ] {
        assert_eq!(count(&events, kind), n, "{kind}: {events:?}");
    }
    let end = &events.iter().find(|(k, _)| k == "message_delta").unwrap().1;
    assert_eq!(end["usage"]["output_tokens"], 8, "{end}");
    assert_eq!(migrations(&kv, "migrated"), 1.0);

    // A forced tool call, cut inside its arguments.
    let body = json!({"model": MODEL, "max_tokens": 30, "stream": true,
                      "messages": [{"role": "user", "content": "weather?"}],
                      "tools": [{"name": "get_weather", "description": "d",
                                 "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
                      "tool_choice": {"type": "tool", "name": "get_weather"}});
    let events = typed_events(&kv, "/v1/messages", body).await;
    assert_eq!(count(&events, "message_stop"), 0, "{events:?}");
    assert!(
        events
            .iter()
            .any(|(k, v)| k == "error" || v.get("error").is_some()),
        "{events:?}"
    );
    assert_eq!(migrations(&kv, "unfit_tool_call"), 1.0);
}

/// A Responses stream goes on elsewhere as chat (the Responses API cannot ask for the rest of
/// an answer), and its client reads one response: one `response.created`, the text of an
/// unbroken reply, `sequence_number`s without a gap, and `response.completed` with that text and
/// usage counting both engines' tokens. A function call cut mid-arguments is not continued.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_responses_stream_goes_on_elsewhere_as_one_response() {
    let sims = Sim::start_n(2, &FAST);
    let kv = Kvroute::start(&[sims[0].addr, sims[1].addr], "");
    for s in &sims {
        set_faults(s.addr, json!({"cut_after_tokens": 5}));
    }
    let body = json!({"model": MODEL, "input": "hello", "max_output_tokens": 8,
                      "stream": true, "store": false});
    let events = typed_events(&kv, "/v1/responses", body).await;
    let text: String = events
        .iter()
        .filter(|(k, _)| k == "response.output_text.delta")
        .filter_map(|(_, v)| v["delta"].as_str())
        .collect();
    assert_eq!(text, whole(8), "{events:?}");
    // The simulator stops at the output limit, as it always does: the continuation's
    // `finish_reason: "length"` ends the response as OpenAI's API ends one at
    // `max_output_tokens`.
    for (kind, n) in [
        ("response.created", 1),
        ("response.output_text.done", 1),
        ("response.incomplete", 1),
        ("response.completed", 0),
        ("error", 0),
    ] {
        assert_eq!(count(&events, kind), n, "{kind}: {events:?}");
    }
    let numbers: Vec<u64> = events
        .iter()
        .filter_map(|(_, v)| v["sequence_number"].as_u64())
        .collect();
    let expected: Vec<u64> = (0..numbers.len() as u64).collect();
    assert_eq!(numbers, expected);
    let created = &events[0].1["response"];
    let done = &events
        .iter()
        .find(|(k, _)| k == "response.incomplete")
        .unwrap()
        .1["response"];
    assert_eq!(done["id"], created["id"]);
    assert_eq!(done["incomplete_details"]["reason"], "max_output_tokens");
    assert_eq!(done["output"][0]["content"][0]["text"], whole(8));
    assert_eq!(done["usage"]["output_tokens"], 8, "{done}");
    assert_eq!(migrations(&kv, "migrated"), 1.0);
    let paths: Vec<String> = sims
        .iter()
        .flat_map(|s| s.requests())
        .filter_map(|e| e["path"].as_str().map(str::to_owned))
        .collect();
    assert!(
        paths.contains(&"/v1/responses".to_string())
            && paths.contains(&"/v1/chat/completions".to_string()),
        "{paths:?}"
    );

    let body = json!({"model": MODEL, "input": "weather?", "max_output_tokens": 30,
                      "stream": true, "store": false,
                      "tools": [{"type": "function", "name": "get_weather", "description": "d",
                                 "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}],
                      "tool_choice": {"type": "function", "name": "get_weather"}});
    let events = typed_events(&kv, "/v1/responses", body).await;
    assert_eq!(
        count(&events, "response.completed") + count(&events, "response.incomplete"),
        0,
        "{events:?}"
    );
    assert_eq!(migrations(&kv, "unfit_tool_call"), 1.0);
}

/// A hung engine (SIGSTOP: its connections stay open, nothing comes) is found down by the health
/// check, and the requests silent on it are cut then, not at their read deadlines (30 s and
/// more): a stream goes on elsewhere, a whole-body request is sent again elsewhere. On plain
/// engine connections and on read-ahead ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_on_a_hung_engine_go_on_elsewhere_once_it_is_found_down() {
    for read_ahead in [false, true] {
        let sims = Sim::start_n(2, &["--ttft-ms", "1", "--itl-ms", "20"]);
        let kv = Kvroute::start(
            &[sims[0].addr, sims[1].addr],
            &format!(
                "  health_check:\n    interval_ms: 200\n    timeout_ms: 300\n  outlier:\n    enabled: false\n  limits:\n    read_ahead_http1: {read_ahead}\n"
            ),
        );
        // A stream, its engine frozen after a few tokens.
        let (mut r, raw, hung) = stream_under_way(&kv, &sims).await;
        sims[hung].freeze();
        let rest = rest_of(&mut r, Duration::from_secs(10))
            .await
            .unwrap_or_else(|| {
                panic!(
                    "the stream waited for its read deadline (read_ahead_http1: {read_ahead}): {}",
                    kv.log()
                )
            });
        let s = Stream::parse(&(raw + &rest));
        assert_eq!(s.error(), None, "{:?}", s.events);
        assert_eq!(s.text(), whole(60));
        assert_eq!(s.dones(), 1);
        assert_eq!(migrations(&kv, "migrated"), 1.0);
        assert_eq!(
            kv.metric_sum(
                "kvroute_migration_gap_seconds_count",
                &[("cause", "backend_down")]
            ),
            1.0,
            "{}",
            kv.log()
        );
        drop(sims);
    }
}

/// A whole-body request whose engine hangs while generating is sent again, whole, to the other
/// backend as soon as the health check finds its engine down, and its client gets one answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_whole_body_request_on_a_hung_engine_is_sent_again_elsewhere() {
    let sims = Sim::start_n(2, &["--ttft-ms", "1", "--itl-ms", "20"]);
    let kv = Kvroute::start(
        &[sims[0].addr, sims[1].addr],
        "  health_check:\n    interval_ms: 200\n    timeout_ms: 300\n  outlier:\n    enabled: false\n",
    );
    let body = chat_body(
        MODEL,
        json!([{"role": "user", "content": "hello"}]),
        false,
        100,
    );
    let url = kv.url("/v1/chat/completions");
    let sent = tokio::spawn(async move {
        let r = client().post(url).json(&body).send().await.unwrap();
        (r.status(), r.json::<Value>().await.expect("a JSON answer"))
    });
    // 100 tokens take 2 s: freeze whichever engine took it, well before it answers.
    let hung = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            if let Some(i) = sims.iter().position(|s| !s.requests().is_empty()) {
                break i;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("no engine received the request");
    sims[hung].freeze();
    let (status, answer) = tokio::time::timeout(Duration::from_secs(12), sent)
        .await
        .expect("the request waited for its read deadline")
        .unwrap();
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["choices"][0]["message"]["content"], whole(100));
    assert_eq!(answer["usage"]["completion_tokens"], 100);
    assert_eq!(
        kv.metric_sum(
            "kvroute_upstream_failures_total",
            &[("kind", "backend_down")]
        ),
        1.0,
        "{}",
        kv.log()
    );
    assert_eq!(sims[1 - hung].requests().len(), 1);
}
