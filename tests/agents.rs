//! The agent APIs through real processes (kvroute in front of `kvbench sim` servers): OpenAI's
//! Responses API and Anthropic's Messages API are placed like chat, keep a conversation on
//! the backend that holds its history, honour the session headers agents send, answer errors
//! in their own shape, and are accounted.

mod common;

use common::*;
use serde_json::{json, Value};
use std::collections::{HashMap, HashSet};

async fn post(c: &reqwest::Client, url: &str, body: &Value, headers: &[(&str, &str)]) -> Answer {
    let mut req = c.post(url).json(body);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    send(req).await
}

/// The JSON of every `data:` line of a stream, by its `event:` name.
fn events(sse: &str) -> Vec<(String, Value)> {
    sse.split("\n\n")
        .filter_map(|e| {
            let name = e.lines().find_map(|l| l.strip_prefix("event: "))?;
            let data = e.lines().find_map(|l| l.strip_prefix("data: "))?;
            Some((name.to_string(), serde_json::from_str(data).ok()?))
        })
        .collect()
}

/// A Messages reply's text and `cache_read_input_tokens`, streamed or not.
fn messages_reply(a: &Answer, stream: bool) -> (String, u64) {
    assert_eq!(a.status, 200, "{}", a.body);
    if !stream {
        let v: Value = serde_json::from_str(&a.body).unwrap();
        let text = v["content"][0]["text"].as_str().unwrap().to_string();
        return (
            text,
            v["usage"]["cache_read_input_tokens"].as_u64().unwrap(),
        );
    }
    let ev = events(&a.body);
    assert_eq!(
        ev.last().map(|e| e.0.as_str()),
        Some("message_stop"),
        "{}",
        a.body
    );
    let text: String = ev
        .iter()
        .filter(|e| e.0 == "content_block_delta")
        .filter_map(|e| e.1["delta"]["text"].as_str())
        .collect();
    let read = ev[0].1["message"]["usage"]["cache_read_input_tokens"]
        .as_u64()
        .unwrap();
    (text, read)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agents_messages_turns_stay_where_their_history_is_cached() {
    let sims = Sim::start_n(3, &["--ttft-ms", "1", "--itl-ms", "0"]);
    let addrs: Vec<_> = sims.iter().map(|s| s.addr).collect();
    let kv = Kvroute::start(&addrs, "");
    let c = client();
    // Claude Code's URL carries `?beta=true`: routed by its path, forwarded as sent.
    let url = kv.url("/v1/messages?beta=true");
    let system = "You are a coding agent with tools. ".repeat(30);
    let tools = json!([{"name":"read_file","input_schema":{"type":"object"}}]);
    let mut per_conv: HashMap<usize, HashSet<String>> = HashMap::new();
    let mut follow_up_reads = Vec::new();
    for conv in 0..8 {
        let mut messages =
            vec![json!({"role":"user","content":format!("Task {conv}: fix the failing test.")})];
        for turn in 0..3 {
            let stream = (conv + turn) % 2 == 0;
            let body = json!({"model":MODEL,"max_tokens":8,"stream":stream,"system":system,
                              "tools":tools,"messages":messages});
            let a = post(&c, &url, &body, &[("anthropic-version", "2023-06-01")]).await;
            let (text, read) = messages_reply(&a, stream);
            per_conv.entry(conv).or_default().insert(a.server);
            if turn > 0 {
                follow_up_reads.push(read);
            }
            // The agent calls a tool and sends its result back, as the next turn.
            messages.push(json!({"role":"assistant","content":[
                {"type":"text","text":text},
                {"type":"tool_use","id":format!("toolu_{turn}"),"name":"read_file",
                 "input":{"path":"src/lib.rs"}}]}));
            messages.push(json!({"role":"user","content":[{"type":"tool_result",
                "tool_use_id":format!("toolu_{turn}"),
                "content":format!("line {turn}: fn main() {{}}\n").repeat(20)}]}));
        }
    }
    for (conv, servers) in &per_conv {
        assert_eq!(servers.len(), 1, "conversation {conv} visited {servers:?}");
    }
    let used: HashSet<_> = per_conv.values().flatten().collect();
    assert!(used.len() >= 2, "8 conversations on one backend: {used:?}");
    // Every follow-up found its history in the engine's cache.
    assert!(
        follow_up_reads.iter().all(|&r| r > 200),
        "{follow_up_reads:?}"
    );

    // Anthropic's token counter reaches an engine as sent.
    let count = post(
        &c,
        &kv.url("/v1/messages/count_tokens?beta=true"),
        &json!({"model":MODEL,"messages":[{"role":"user","content":"count me"}]}),
        &[],
    )
    .await;
    assert_eq!(count.status, 200, "{}", count.body);
    let n: Value = serde_json::from_str(&count.body).unwrap();
    assert!(n["input_tokens"].as_u64().unwrap() > 0, "{n}");

    // The engines' usage is accounted as chat's is: prompt tokens include the cached ones.
    let text = kv.metrics_when("kvroute_requests_total", &[("code", "200")], 24.0);
    let prompt = metric_sum(&text, "kvroute_prompt_tokens_total", &[]);
    let cached = metric_sum(&text, "kvroute_cached_prompt_tokens_total", &[]);
    assert!(
        cached > 200.0 * 16.0 && cached < prompt,
        "{cached} of {prompt}"
    );
    // Labelled by the API that carried them.
    let by_api = |name: &str, api: &str| metric_sum(&text, name, &[("api", api)]);
    assert_eq!(by_api("kvroute_prompt_tokens_total", "messages"), prompt);
    assert_eq!(
        by_api("kvroute_cached_prompt_tokens_total", "messages"),
        cached
    );
    assert_eq!(by_api("kvroute_prompt_tokens_total", "chat"), 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_turns_and_agent_session_headers_pin_a_backend() {
    let sims = Sim::start_n(3, &["--ttft-ms", "1", "--itl-ms", "0"]);
    let addrs: Vec<_> = sims.iter().map(|s| s.addr).collect();
    let kv = Kvroute::start(&addrs, "");
    let c = client();
    let url = kv.url("/v1/responses");
    let instructions = "You are Codex, a coding agent. ".repeat(30);
    let mut per_conv: HashMap<usize, HashSet<String>> = HashMap::new();
    let mut follow_up_cached = Vec::new();
    for conv in 0..8 {
        let mut input = vec![json!({"type":"message","role":"user",
            "content":[{"type":"input_text","text":format!("Job {conv}: make the build pass.")}]})];
        for turn in 0..3 {
            let stream = (conv + turn) % 2 == 1;
            let body = json!({"model":MODEL,"instructions":instructions,"input":input,
                              "stream":stream,"store":false,"max_output_tokens":8});
            let a = post(&c, &url, &body, &[]).await;
            assert_eq!(a.status, 200, "{}", a.body);
            let response = if stream {
                let ev = events(&a.body);
                let done = ev.iter().find(|e| e.0 == "response.completed");
                done.expect("a response.completed event").1["response"].clone()
            } else {
                serde_json::from_str(&a.body).unwrap()
            };
            per_conv.entry(conv).or_default().insert(a.server);
            if turn > 0 {
                follow_up_cached.push(
                    response["usage"]["input_tokens_details"]["cached_tokens"]
                        .as_u64()
                        .unwrap(),
                );
            }
            // The agent sends the model's output items back with its tool's result.
            for item in response["output"].as_array().unwrap() {
                input.push(item.clone());
            }
            input.push(json!({"type":"function_call","call_id":format!("c{turn}"),
                              "name":"shell","arguments":"{\"cmd\":[\"cargo\",\"build\"]}"}));
            input.push(
                json!({"type":"function_call_output","call_id":format!("c{turn}"),
                              "output":"error[E0425]: cannot find value `x`\n".repeat(10)}),
            );
        }
    }
    for (conv, servers) in &per_conv {
        assert_eq!(servers.len(), 1, "conversation {conv} visited {servers:?}");
    }
    assert!(
        follow_up_cached.iter().all(|&c| c > 200),
        "{follow_up_cached:?}"
    );

    // Agents name their session in headers: one id keeps every request, whatever it says,
    // on one backend; in any of the agents' headers; different ids spread.
    let chat_url = kv.url("/v1/messages");
    let ask = |i: usize| {
        json!({"model":MODEL,"max_tokens":4,
               "messages":[{"role":"user","content":format!("unrelated question {i}")}]})
    };
    for header in [
        "x-claude-code-session-id",
        "session_id",
        "x-session-affinity",
    ] {
        let mut servers = HashSet::new();
        for i in 0..6 {
            let a = post(&c, &chat_url, &ask(i), &[(header, "session-42")]).await;
            assert_eq!(a.status, 200, "{}", a.body);
            servers.insert(a.server);
        }
        assert_eq!(servers.len(), 1, "{header}: {servers:?}");
    }
    let mut servers = HashSet::new();
    for i in 0..12 {
        let id = format!("session-{i}");
        let a = post(&c, &chat_url, &ask(0), &[("x-claude-code-session-id", &id)]).await;
        servers.insert(a.server);
    }
    assert!(servers.len() >= 2, "12 sessions on {servers:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_api_answers_errors_in_its_own_shape() {
    let sims = Sim::start_n(1, &["--ttft-ms", "600", "--itl-ms", "0"]);
    let addrs: Vec<_> = sims.iter().map(|s| s.addr).collect();
    let kv = Kvroute::start(
        &addrs,
        "  limits:\n    backend_max_inflight: 1\n    queue_size: 0\n    retry_after_seconds: 3\n",
    );
    let c = client();
    let anthropic = |a: &Answer| -> (String, String) {
        let v: Value = serde_json::from_str(&a.body).expect("JSON error");
        assert_eq!(v["type"], "error", "{v}");
        let msg = v["error"]["message"].as_str().expect("message").to_string();
        (v["error"]["type"].as_str().unwrap().to_string(), msg)
    };
    let msg_url = kv.url("/v1/messages");
    let a = post(
        &c,
        &msg_url,
        &json!({"model":MODEL,"messages":[{"role":"user","content":"hi"}]}),
        &[],
    )
    .await;
    assert_eq!(a.status, 400);
    let (kind, message) = anthropic(&a);
    assert_eq!(kind, "invalid_request_error");
    assert!(message.contains("max_tokens"), "{message}");
    let a = post(&c, &kv.url("/v1/messages/batches"), &json!({}), &[]).await;
    assert_eq!(
        (a.status, anthropic(&a).0.as_str()),
        (404, "not_found_error")
    );
    let a = post(
        &c,
        &msg_url,
        &json!({"model":"no-such-model","max_tokens":4,"messages":[{"role":"user","content":"hi"}]}),
        &[],
    )
    .await;
    assert_eq!(
        (a.status, anthropic(&a).0.as_str()),
        (404, "not_found_error")
    );

    // The Responses API keeps OpenAI's shape.
    let a = post(&c, &kv.url("/v1/responses"), &json!({"model":MODEL}), &[]).await;
    assert_eq!(a.status, 400);
    assert_eq!(error_of(a.body.as_bytes())["code"], "missing_input");

    // Shed where the fleet is full: Anthropic's 529 overloaded_error, with Retry-After.
    let body = json!({"model":MODEL,"max_tokens":4,"messages":[{"role":"user","content":"slow"}]});
    let busy = {
        let (c, url, body) = (c.clone(), msg_url.clone(), body.clone());
        tokio::spawn(async move { post(&c, &url, &body, &[]).await })
    };
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let resp = c.post(&msg_url).json(&body).send().await.unwrap();
    assert_eq!(resp.status().as_u16(), 529);
    assert_eq!(resp.headers().get("retry-after").unwrap(), "3");
    let shed = Answer {
        status: 529,
        server: String::new(),
        body: resp.text().await.unwrap(),
    };
    assert_eq!(anthropic(&shed).0, "overloaded_error");
    assert_eq!(busy.await.unwrap().status, 200);
}
