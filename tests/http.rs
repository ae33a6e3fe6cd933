//! The HTTP contract through real processes: streaming timing, body integrity, Expect:
//! 100-continue, error statuses and shapes, metrics, config checking.

mod common;

use common::*;
use futures_util::StreamExt;
use serde_json::json;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap()
}

/// Chunks reach the client when the backend sends them, also on a reused (keep-alive)
/// connection, where Nagle plus delayed ACK would add ~40 ms per event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_chunks_keep_backend_timing() {
    let sims = Sim::start_n(1, &["--ttft-ms", "150", "--itl-ms", "80"]);
    let kv = Kvroute::start(&[sims[0].addr], "");
    let c = client();
    for round in 0..3 {
        let body = chat_body(
            MODEL,
            json!([{"role": "user", "content": "stream please"}]),
            true,
            6,
        );
        let start = Instant::now();
        let resp = c
            .post(kv.url("/v1/chat/completions"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        assert!(resp.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream"));
        let mut arrivals = Vec::new();
        let mut text = String::new();
        let mut stream = resp.bytes_stream();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.unwrap();
            let s = String::from_utf8_lossy(&chunk);
            for _ in 0..s.matches("data: {").count() {
                arrivals.push(start.elapsed());
            }
            text.push_str(&s);
        }
        assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
        assert!(arrivals.len() >= 6, "round {round}: {arrivals:?}");
        let first = arrivals[0].as_millis();
        assert!(
            (140..400).contains(&first),
            "round {round}: first event at {first} ms"
        );
        // Events arrive spread out as produced, not in one burst at the end.
        let spread = (arrivals[arrivals.len() - 1] - arrivals[0]).as_millis();
        assert!(
            spread >= 300,
            "round {round}: events within {spread} ms: {arrivals:?}"
        );
        // Each event in its own time: none held back (a gap under 300 ms) and none bunched
        // with the ones before it. Counted from the first event, so that an event the test's
        // own scheduling delayed, followed by the next one on time, does not fail it.
        for (k, w) in arrivals.windows(2).take(4).enumerate() {
            let gap = (w[1] - w[0]).as_millis();
            assert!(gap < 300, "round {round}: gap {gap} ms in {arrivals:?}");
            let since_first = (w[1] - arrivals[0]).as_millis();
            assert!(
                since_first >= 40 * (k as u128 + 1),
                "round {round}: event {} at +{since_first} ms in {arrivals:?}",
                k + 1
            );
        }
    }
    let text = kv.metrics_when("kvroute_time_to_first_token_seconds_count", &[], 3.0);
    assert_eq!(
        metric_sum(&text, "kvroute_time_to_first_token_seconds_count", &[]),
        3.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_arrive_byte_identical() {
    let sims = Sim::start_n(2, &["--ttft-ms", "1", "--itl-ms", "0"]);
    let kv = Kvroute::start(&[sims[0].addr, sims[1].addr], "");
    let c = client();
    for size in [1_000usize, 300_000, 5_000_000] {
        // Escapes and multi-byte text exercise more than plain ASCII.
        let unit = "line with \"quotes\", tabs\t and ünïcödé ✓\n";
        let content: String = unit.repeat(size / unit.len() + 1);
        let body = serde_json::to_vec(&chat_body(
            MODEL,
            json!([{"role": "user", "content": content}]),
            false,
            2,
        ))
        .unwrap();
        let resp = c
            .post(kv.url("/v1/chat/completions"))
            .header("content-type", "application/json")
            .body(body.clone())
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200, "size {size}");
        let want = format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&body));
        assert_eq!(
            resp.headers()["x-kvbench-body-len"].to_str().unwrap(),
            body.len().to_string()
        );
        assert_eq!(
            resp.headers()["x-kvbench-body-xxh3"].to_str().unwrap(),
            want,
            "size {size}"
        );
        let v: serde_json::Value = resp.json().await.unwrap();
        assert!(v["usage"]["prompt_tokens"].as_u64().unwrap() > 0);
    }
}

#[test]
fn chunked_body_under_64k_is_forwarded_and_over_is_411() {
    let sims = Sim::start_n(1, &["--ttft-ms", "1", "--itl-ms", "0"]);
    let kv = Kvroute::start(&[sims[0].addr], "");
    let small = chat_body(
        MODEL,
        json!([{"role": "user", "content": "x".repeat(20_000)}]),
        false,
        2,
    )
    .to_string();
    let big = chat_body(
        MODEL,
        json!([{"role": "user", "content": "x".repeat(100_000)}]),
        false,
        2,
    )
    .to_string();
    for (body, want) in [(small, 200u16), (big, 411)] {
        let mut s = TcpStream::connect(kv.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        write!(s, "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n").unwrap();
        for piece in body.as_bytes().chunks(7000) {
            write!(s, "{:x}\r\n", piece.len()).unwrap();
            s.write_all(piece).unwrap();
            s.write_all(b"\r\n").unwrap();
        }
        s.write_all(b"0\r\n\r\n").unwrap();
        let mut raw = Vec::new();
        let _ = s.read_to_end(&mut raw);
        let (status, resp) = parse_response(&raw).expect("response");
        assert_eq!(status, want);
        if want == 200 {
            let v: serde_json::Value = serde_json::from_slice(&resp).unwrap();
            assert_eq!(v["object"], "chat.completion");
        } else {
            assert_eq!(error_of(&resp)["code"], "length_required");
        }
    }
}

/// The client waits for `100 Continue` before sending its body; kvroute must answer it.
#[test]
fn expect_100_continue_does_not_stall() {
    let sims = Sim::start_n(1, &["--ttft-ms", "1", "--itl-ms", "0"]);
    let kv = Kvroute::start(&[sims[0].addr], "");
    let body = chat_body(
        MODEL,
        json!([{"role": "user", "content": "y".repeat(200_000)}]),
        false,
        3,
    )
    .to_string();
    let mut s = TcpStream::connect(kv.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: {}\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .unwrap();
    let mut interim = [0u8; 64];
    let n = s.read(&mut interim).expect("no 100 Continue within 5 s");
    assert!(
        String::from_utf8_lossy(&interim[..n]).starts_with("HTTP/1.1 100"),
        "{}",
        String::from_utf8_lossy(&interim[..n])
    );
    s.write_all(body.as_bytes()).unwrap();
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let (status, resp) = parse_response(&raw).expect("final response");
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&resp));
    let sim_seen = sims[0].requests();
    assert_eq!(
        sim_seen[0]["body_len"].as_u64().unwrap() as usize,
        body.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_status_and_openai_shape() {
    let sims = Sim::start_n(1, &["--ttft-ms", "1", "--itl-ms", "0"]);
    let kv = Kvroute::start(&[sims[0].addr], "  limits:\n    max_body_bytes: 1000000\n");
    let c = client();
    let url = kv.url("/v1/chat/completions");
    let cases: Vec<(&str, Vec<u8>, u16, &str)> = vec![
        (
            "/v1/chat/completions",
            b"{not json".to_vec(),
            400,
            "invalid_json",
        ),
        ("/v1/chat/completions", b"".to_vec(), 400, "empty_body"),
        (
            "/v1/chat/completions",
            br#"{"messages":[{"role":"user","content":"a"}]}"#.to_vec(),
            400,
            "missing_model",
        ),
        (
            "/v1/chat/completions",
            br#"{"model":"m"}"#.to_vec(),
            400,
            "missing_messages",
        ),
        (
            "/v1/chat/completions",
            br#"{"model":"m","messages":"hi"}"#.to_vec(),
            400,
            "invalid_json",
        ),
        (
            "/v1/completions",
            br#"{"model":"m"}"#.to_vec(),
            400,
            "missing_prompt",
        ),
        (
            "/v1/completions",
            br#"{"model":"m","prompt":{"x":1}}"#.to_vec(),
            400,
            "invalid_prompt",
        ),
        (
            "/v1/chat/completions",
            vec![b'a'; 2_000_000],
            413,
            "request_too_large",
        ),
    ];
    for (path, body, status, code) in cases {
        let resp = c.post(kv.url(path)).body(body).send().await.unwrap();
        assert_eq!(resp.status().as_u16(), status, "{path} {code}");
        let e = error_of(&resp.bytes().await.unwrap());
        assert_eq!(e["code"], code);
    }
    let resp = c.get(&url).send().await.unwrap();
    assert_eq!(resp.status(), 405);
    error_of(&resp.bytes().await.unwrap());
    // The backend never saw any of them.
    assert!(sims[0].requests().is_empty());
    let text = kv.metrics_when(
        "kvroute_requests_total",
        &[("backend", "none"), ("code", "400")],
        7.0,
    );
    assert_eq!(
        metric_sum(
            &text,
            "kvroute_requests_total",
            &[("backend", "none"), ("code", "400")]
        ),
        7.0
    );
    // And the proxy still serves.
    let ok = c
        .post(&url)
        .json(&chat_body(
            MODEL,
            json!([{"role":"user","content":"hi"}]),
            false,
            2,
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
}

/// A body over the limit is refused before it is read, and the client still gets the 413 while
/// it is writing the rest: kvroute reads and discards what is left for a moment before it
/// closes (a close with unread bytes sends a reset, which can destroy the response in the
/// client's receive buffer before the client reads it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_body_gets_its_413_while_the_client_still_writes() {
    let sims = Sim::start_n(1, &["--ttft-ms", "1", "--itl-ms", "0"]);
    let kv = Kvroute::start(&[sims[0].addr], "  limits:\n    max_body_bytes: 100000\n");
    let body = vec![b'a'; 4_000_000];
    for round in 0..20 {
        // A fresh connection each time, as a client that gets `Connection: close` makes.
        let c = reqwest::Client::builder()
            .pool_max_idle_per_host(0)
            .build()
            .expect("client");
        let resp = c
            .post(kv.url("/v1/chat/completions"))
            .header("content-type", "application/json")
            .body(body.clone())
            .send()
            .await
            .unwrap_or_else(|e| panic!("round {round}: no response: {e:?}"));
        assert_eq!(resp.status().as_u16(), 413, "round {round}");
        let e = error_of(&resp.bytes().await.expect("body"));
        assert_eq!(e["code"], "request_too_large");
    }
    assert!(sims[0].requests().is_empty());
}

/// Send a request head declaring a 4 MB body (over a 100 KB limit) with `headers` and the first
/// bytes `body` of it, then read until kvroute closes: the raw answer and how long that took.
fn oversized_raw(kv: &Kvroute, headers: &str, body: &str) -> (Vec<u8>, Duration) {
    let mut s = TcpStream::connect(kv.addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let started = Instant::now();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: 4000000\r\n{headers}\r\n{body}"
    )
    .expect("write");
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    (raw, started.elapsed())
}

/// A client that waits for `100 Continue` and is refused first (its declared body is over the
/// limit) will send no body: it gets its 413 and the connection closes at once, not after the
/// lingering close's wait for a body that never comes.
#[test]
fn a_refused_expect_continue_is_not_lingered_on() {
    let sims = Sim::start_n(1, &["--ttft-ms", "1", "--itl-ms", "0"]);
    let kv = Kvroute::start(&[sims[0].addr], "  limits:\n    max_body_bytes: 100000\n");
    let (raw, took) = oversized_raw(&kv, "Expect: 100-continue\r\n", "");
    let (status, body) = parse_response(&raw).expect("a response");
    assert_eq!(status, 413);
    assert_eq!(error_of(&body)["code"], "request_too_large");
    assert!(took < Duration::from_millis(1500), "closed after {took:?}");
}

/// A client that stops sending its refused body still gets its 413 at once; kvroute waits a
/// moment for the rest before it closes, and the request's duration ends at the answer, not
/// after that wait.
#[test]
fn a_refused_body_is_answered_at_once_and_its_duration_ends_there() {
    let sims = Sim::start_n(1, &["--ttft-ms", "1", "--itl-ms", "0"]);
    let kv = Kvroute::start(&[sims[0].addr], "  limits:\n    max_body_bytes: 100000\n");
    let (raw, closed) = oversized_raw(&kv, "", &"a".repeat(1000));
    let (status, _) = parse_response(&raw).expect("a response");
    assert_eq!(status, 413);
    // The rest of the body was waited for, then the connection closed.
    assert!(
        closed >= Duration::from_millis(1500) && closed < Duration::from_secs(5),
        "closed after {closed:?}"
    );
    let text = kv.metrics_when("kvroute_requests_total", &[("code", "413")], 1.0);
    let took = metric_sum(
        &text,
        "kvroute_request_duration_seconds_sum",
        &[("backend", "none")],
    );
    assert!(took < 1.0, "the refused request counted {took} s");
}

/// A backend that answers health checks but hangs up on everything else.
fn hang_up_server(counter: std::sync::Arc<std::sync::atomic::AtomicUsize>) -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            let mut buf = [0u8; 4096];
            let _ = conn.set_read_timeout(Some(Duration::from_millis(200)));
            let n = conn.read(&mut buf).unwrap_or(0);
            if buf[..n].starts_with(b"GET /health") {
                let _ = conn.write_all(
                    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok",
                );
            } else if buf[..n].starts_with(b"POST ") {
                // Requests get nothing; telemetry scrapes (GET /metrics) are not counted.
                counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
        }
    });
    addr
}

/// Backends that accept and hang up before answering: retried, then 502. No backend at all
/// that is healthy: 503 with Retry-After.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_failures_are_502_and_no_backend_is_503() {
    let accepted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let rude: Vec<_> = (0..2).map(|_| hang_up_server(accepted.clone())).collect();
    let kv = Kvroute::start(
        &rude,
        "  limits:\n    max_attempts: 2\n    retry_after_seconds: 3\n",
    );
    let c = client();
    let body = chat_body(
        MODEL,
        json!([{"role": "user", "content": "hello"}]),
        false,
        2,
    );
    let resp = c
        .post(kv.url("/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 502);
    assert_eq!(
        error_of(&resp.bytes().await.unwrap())["code"],
        "upstream_failed"
    );
    assert_eq!(
        accepted.load(std::sync::atomic::Ordering::SeqCst),
        2,
        "one try plus one retry elsewhere"
    );

    // A fleet whose only backend is down: 503 + Retry-After once the health check notices.
    let dead = free_port();
    let kv2 = Kvroute::start_unready(
        &[format!("127.0.0.1:{dead}").parse().unwrap()],
        "  health_check:\n    interval_ms: 100\n  limits:\n    retry_after_seconds: 3\n",
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    let resp = c
        .post(kv2.url("/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 503);
    assert_eq!(resp.headers()["retry-after"], "3");
    assert_eq!(
        error_of(&resp.bytes().await.unwrap())["code"],
        "no_healthy_backend"
    );
    let (status, _) = http_get(kv2.admin, "/readyz");
    assert_eq!(status, 503);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_expose_the_documented_families() {
    let sims = Sim::start_n(2, &["--ttft-ms", "1", "--itl-ms", "0"]);
    let kv = Kvroute::start(&[sims[0].addr, sims[1].addr], "");
    let c = client();
    for stream in [false, true] {
        let body = chat_body(MODEL, json!([{"role": "user", "content": "m"}]), stream, 2);
        let resp = c
            .post(kv.url("/v1/chat/completions"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        // Read to the end: a client that hangs up early never receives a first token.
        assert!(!resp.bytes().await.unwrap().is_empty());
    }
    let text = kv.metrics_when("kvroute_requests_total", &[("code", "200")], 2.0);
    for family in [
        "kvroute_requests_total",
        "kvroute_request_duration_seconds",
        "kvroute_time_to_first_token_seconds",
        "kvroute_backend_inflight_requests",
        "kvroute_backend_healthy",
        "kvroute_routing_decisions_total",
        "kvroute_routing_decision_seconds",
        "kvroute_prompt_tokens_total",
        "kvroute_cached_prompt_tokens_total",
        "kvroute_queue_depth",
        "kvroute_index_blocks",
    ] {
        assert!(
            text.contains(&format!("# TYPE {family} ")),
            "missing {family} in\n{text}"
        );
    }
    assert_eq!(
        metric_sum(&text, "kvroute_requests_total", &[("code", "200")]),
        2.0
    );
    assert_eq!(
        metric_sum(
            &text,
            "kvroute_routing_decisions_total",
            &[("policy", "kv_aware")]
        ),
        2.0
    );
    assert_eq!(metric_sum(&text, "kvroute_backend_healthy", &[]), 2.0);
    // Metrics are never on the client port.
    let resp = c.get(kv.url("/metrics")).send().await.unwrap();
    let client_port_body = resp.bytes().await.unwrap();
    assert!(!String::from_utf8_lossy(&client_port_body).contains("kvroute_requests_total"));
}

#[test]
fn config_check_flag_names_the_bad_key() {
    let dir = std::env::temp_dir().join(format!("kvroute-t-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let good = dir.join("good.yaml");
    std::fs::write(
        &good,
        "kvroute:\n  listen: \"127.0.0.1:18080\"\n  backends:\n    - addr: \"127.0.0.1:18001\"\n",
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .arg("-t")
        .arg("-c")
        .arg(&good)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let bad = dir.join("bad.yaml");
    std::fs::write(&bad, "kvroute:\n  listen: \"127.0.0.1:18080\"\n  backends:\n    - addr: \"127.0.0.1:18001\"\n      weight: 0\n").unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .arg("-t")
        .arg("-c")
        .arg(&bad)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("kvroute.backends[0].weight"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// kvroute asks the engine for usage on every stream (to score its placement), shows the usage
/// chunk only to clients that asked for it, and counts the engine's cached tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_usage_is_counted_and_shown_only_when_asked() {
    let sims = Sim::start_n(1, &["--ttft-ms", "1", "--itl-ms", "1"]);
    let kv = Kvroute::start(&[sims[0].addr], "");
    let c = client();
    let prompt = "A prompt long enough to fill several cache blocks. ".repeat(40);
    for (round, asked) in [(0, false), (1, true), (2, false)] {
        let mut body = chat_body(MODEL, json!([{"role": "user", "content": prompt}]), true, 4);
        if asked {
            body["stream_options"] = json!({"include_usage": true});
        }
        let resp = c
            .post(kv.url("/v1/chat/completions"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let text = String::from_utf8(resp.bytes().await.unwrap().to_vec()).unwrap();
        assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
        assert_eq!(text.contains("\"usage\""), asked, "round {round}: {text}");
        assert_eq!(text.matches("\"content\"").count(), 4, "round {round}");
    }
    // Round 0's body reached the engine with `"stream_options":{"include_usage":true}` added.
    let sent = chat_body(MODEL, json!([{"role": "user", "content": prompt}]), true, 4).to_string();
    let added = r#","stream_options":{"include_usage":true}"#.len();
    let seen = sims[0].requests();
    assert_eq!(
        seen[0]["body_len"].as_u64().unwrap() as usize,
        sent.len() + added
    );
    let text = kv.metrics_when("kvroute_requests_total", &[("code", "200")], 3.0);
    let prompt_tokens = metric_sum(&text, "kvroute_prompt_tokens_total", &[]);
    let cached = metric_sum(&text, "kvroute_cached_prompt_tokens_total", &[]);
    assert!(prompt_tokens > 1000.0, "{prompt_tokens}");
    // Rounds 1 and 2 repeat round 0's prompt: most of it is cached.
    assert!(
        cached > prompt_tokens / 2.0,
        "cached {cached} of {prompt_tokens}"
    );
}

#[test]
fn failure_families_are_exported_at_zero_from_start() {
    // An alert on `increase(...) > 0` sees the first event only if the series exists before.
    let sims = Sim::start_n(1, &["--ttft-ms", "1", "--itl-ms", "0"]);
    let kv = Kvroute::start(&[sims[0].addr], "");
    let text = kv.metrics();
    let backend = sims[0].addr.to_string();
    for (name, labels) in [
        (
            "kvroute_shed_requests_total",
            vec![("reason", "queue_full")],
        ),
        (
            "kvroute_shed_requests_total",
            vec![("reason", "queue_timeout")],
        ),
        (
            "kvroute_retries_total",
            vec![("outcome", "budget_exhausted")],
        ),
        ("kvroute_config_reloads_total", vec![("result", "failure")]),
        (
            "kvroute_queue_wait_seconds_count",
            vec![("outcome", "shed")],
        ),
        (
            "kvroute_upstream_failures_total",
            vec![("backend", backend.as_str()), ("kind", "connect")],
        ),
        (
            "kvroute_outlier_ejections_total",
            vec![("backend", backend.as_str())],
        ),
        (
            "kvroute_cut_streams_total",
            vec![("backend", backend.as_str())],
        ),
        ("kvroute_client_timeouts_total", vec![("phase", "header")]),
    ] {
        let line = text.lines().find(|l| {
            l.starts_with(&format!("{name}{{"))
                && labels
                    .iter()
                    .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        });
        assert_eq!(
            line.and_then(|l| l.rsplit(' ').next()),
            Some("0"),
            "{name} {labels:?} not exported at zero"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_access_log_can_be_json() {
    let sims = Sim::start_n(1, &["--ttft-ms", "1", "--itl-ms", "0"]);
    let kv = Kvroute::start(&[sims[0].addr], "  log:\n    format: json\n");
    let r = client()
        .post(kv.url("/v1/chat/completions"))
        .json(&chat_body(
            MODEL,
            serde_json::json!([{"role": "user", "content": "log me"}]),
            true,
            3,
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let _ = r.bytes().await;
    let (status, _) = http_get(kv.addr, "/reset_prefix_cache");
    assert_eq!(status, 404);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let entries: Vec<serde_json::Value> = loop {
        let entries: Vec<serde_json::Value> = kv
            .log()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v.get("path").is_some())
            .collect();
        if entries.len() >= 2 || std::time::Instant::now() > deadline {
            break entries;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let chat = entries
        .iter()
        .find(|e| e["path"] == "/v1/chat/completions")
        .expect("a JSON line for the chat request");
    assert_eq!(chat["status"], 200);
    assert_eq!(chat["method"], "POST");
    assert_eq!(chat["model"], MODEL);
    assert_eq!(chat["backend"], sims[0].addr.to_string());
    assert!(chat["ttft_ms"].as_f64().is_some_and(|t| t > 0.0), "{chat}");
    assert!(chat["duration_ms"].as_f64().is_some(), "{chat}");
    let refused = entries
        .iter()
        .find(|e| e["path"] == "/reset_prefix_cache")
        .expect("a JSON line for the refused request");
    assert_eq!(refused["status"], 404);
    assert_eq!(refused["backend"], "none");
    assert!(
        !kv.log().contains("kvroute::access"),
        "text access lines too"
    );
    // The writer never holds stderr between lines: another thread's log line (a reload's) is
    // written, and the thread goes on (a writer that kept stderr locked stalled it for good).
    signal(kv.pid(), "HUP");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !kv.log().contains("config reloaded") && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(kv.log().contains("config reloaded"), "{}", kv.log());
}

/// The text access log (the default) goes through the same writer: one line per request, in
/// the logger's format.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_access_lines_are_written_in_the_loggers_format() {
    let sims = Sim::start_n(1, &["--ttft-ms", "1", "--itl-ms", "0"]);
    let kv = Kvroute::start(&[sims[0].addr], "");
    let r = client()
        .post(kv.url("/v1/chat/completions"))
        .json(&chat_body(
            MODEL,
            serde_json::json!([{"role": "user", "content": "log me"}]),
            false,
            3,
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let line = loop {
        let found = kv
            .log()
            .lines()
            .find(|l| l.contains("kvroute::access] "))
            .map(str::to_string);
        if found.is_some() || std::time::Instant::now() > deadline {
            break found;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let line = line.unwrap_or_else(|| panic!("no access line: {}", kv.log()));
    // `[2026-12-01T12:00:00Z INFO  kvroute::access] 127.0.0.1:5 "POST /v1/chat/..." 200 ...`
    assert!(
        line.starts_with('[') && line.contains("Z INFO  kvroute::access] "),
        "{line}"
    );
    assert!(
        line.contains("\"POST /v1/chat/completions\" 200 backend="),
        "{line}"
    );
    assert!(
        line.contains(&format!("backend={}", sims[0].addr)),
        "{line}"
    );
}
