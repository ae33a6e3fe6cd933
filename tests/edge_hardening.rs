//! What an external probe found at the edge, each fixed: an HTTP/1.1 request without `Host`,
//! an `Upgrade` that turned a pass-through route into a raw tunnel past the path filter, and
//! `x-priority` as the client's own choice; bodies in transit under one memory budget.

mod common;

use common::*;
use serde_json::json;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A raw request to kvroute and the response's status line and head.
fn raw(kv: &Kvroute, request: &str) -> String {
    let addr = kv.url("").trim_start_matches("http://").to_string();
    let mut s = TcpStream::connect(addr.trim_end_matches('/')).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(request.as_bytes()).unwrap();
    let mut buf = vec![0u8; 8192];
    let n = s.read(&mut buf).unwrap_or(0);
    String::from_utf8_lossy(&buf[..n]).to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http11_request_needs_one_host() {
    let sim = Sim::start(&[]);
    let kv = Kvroute::start(&[sim.addr], "");
    let body =
        r#"{"model":"sim-llama-8b","messages":[{"role":"user","content":"hi"}],"max_tokens":1}"#;
    let post = |host: &str| {
        format!(
            "POST /v1/chat/completions HTTP/1.1\r\n{host}Content-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
    };
    let answer = raw(&kv, &post(""));
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(answer.contains("missing_host"), "{answer}");
    // kvroute's own answers tell browsers not to sniff them.
    assert!(
        answer
            .to_ascii_lowercase()
            .contains("\r\nx-content-type-options: nosniff\r\n"),
        "{answer}"
    );
    let answer = raw(&kv, &post("Host: a\r\nHost: b\r\n"));
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    let answer = raw(&kv, &post("Host: kvroute\r\n"));
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    // HTTP/1.0 may leave it out.
    let answer = raw(&kv, &post("").replacen("HTTP/1.1", "HTTP/1.0", 1));
    assert!(
        answer.starts_with("HTTP/1.1 200") || answer.starts_with("HTTP/1.0 200"),
        "{answer}"
    );
}

/// A backend that switches to a tunnel when asked to upgrade, and records every request head
/// and every byte it receives after switching.
fn upgrading_backend() -> (SocketAddr, Arc<Mutex<Vec<String>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = seen.clone();
    std::thread::spawn(move || {
        for mut conn in listener.incoming().flatten() {
            let record = record.clone();
            std::thread::spawn(move || {
                let mut buf = vec![0u8; 8192];
                let n = conn.read(&mut buf).unwrap_or(0);
                let head = String::from_utf8_lossy(&buf[..n]).to_string();
                let upgrade = head.to_ascii_lowercase().contains("\r\nupgrade: websocket");
                record.lock().unwrap().push(head);
                if !upgrade {
                    let _ = conn.write_all(
                        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok",
                    );
                    return;
                }
                let _ = conn.write_all(
                    b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n",
                );
                conn.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
                while let Ok(n) = conn.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    let tunneled = String::from_utf8_lossy(&buf[..n]).to_string();
                    record.lock().unwrap().push(format!("TUNNEL {tunneled}"));
                }
            });
        }
    });
    (addr, seen)
}

const WEBSOCKET: &str = "GET /ws HTTP/1.1\r\nHost: kvroute\r\nUpgrade: websocket\r\n\
    Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\
    Sec-WebSocket-Version: 13\r\n\r\n";

/// What reaches the backend after a WebSocket handshake to `/ws` and a request for `/sleep`
/// written on the same connection.
fn upgrade_then_smuggle(kv: &Kvroute) -> String {
    let addr = kv.url("").trim_start_matches("http://").to_string();
    let mut s = TcpStream::connect(addr.trim_end_matches('/')).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(WEBSOCKET.as_bytes()).unwrap();
    let mut buf = vec![0u8; 4096];
    let n = s.read(&mut buf).unwrap_or(0);
    let answer = String::from_utf8_lossy(&buf[..n]).to_string();
    let _ = s.write_all(b"POST /sleep HTTP/1.1\r\nHost: engine\r\nContent-Length: 0\r\n\r\n");
    std::thread::sleep(Duration::from_millis(500));
    answer
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upgrades_only_where_a_passthrough_rule_allows_them() {
    let (backend, seen) = upgrading_backend();
    let conf = |upgrade: bool| {
        format!(
            "  health_check:\n    path: /ws\n  telemetry:\n    enabled: false\n  passthrough:\n    allow:\n      - path: /ws\n        methods: [GET]\n        upgrade: {upgrade}\n"
        )
    };
    let kv = Kvroute::start(&[backend], &conf(false));
    let answer = upgrade_then_smuggle(&kv);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    {
        let seen = seen.lock().unwrap();
        let to_ws: Vec<_> = seen.iter().filter(|h| h.starts_with("GET /ws")).collect();
        assert!(!to_ws.is_empty());
        assert!(
            to_ws
                .iter()
                .all(|h| !h.to_ascii_lowercase().contains("\r\nupgrade:")),
            "{to_ws:?}"
        );
        assert!(
            !seen.iter().any(|h| h.contains("/sleep")),
            "a request for /sleep reached the backend: {seen:?}"
        );
    }
    drop(kv);
    // Allowed explicitly: the operator's choice, and the tunnel is what they asked for.
    let kv = Kvroute::start(&[backend], &conf(true));
    let answer = upgrade_then_smuggle(&kv);
    assert!(answer.starts_with("HTTP/1.1 101"), "{answer}");
}

/// A key's requests get at most its `max_priority` in the router queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn priority_is_bounded_by_the_key() {
    let sim = Sim::start(&["--ttft-ms", "1", "--itl-ms", "20"]);
    let sha = |k: &str| key_sha256(k.as_bytes());
    let extra = format!(
        "  limits:\n    backend_max_inflight: 1\n  access:\n    keys:\n      - sha256: \"{}\"\n        tenant: anyone\n      - sha256: \"{}\"\n        tenant: ops\n        max_priority: 10\n",
        sha("anyone-key"),
        sha("ops-key")
    );
    let kv = Kvroute::start(&[sim.addr], &extra);
    let url = kv.url("/v1/chat/completions");
    let ask = move |key: &'static str, priority: &'static str| {
        let url = url.clone();
        async move {
            client()
                .post(url)
                .bearer_auth(key)
                .header("x-priority", priority)
                .json(&json!({"model": MODEL, "messages": [{"role": "user", "content": key}], "max_tokens": 20}))
                .send()
                .await
        }
    };
    // One request holds the backend's only place; two wait in the queue behind it.
    let busy = tokio::spawn(ask.clone()("ops-key", "0"));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let order = Arc::new(Mutex::new(Vec::new()));
    let (o1, o2) = (order.clone(), order.clone());
    let (ask1, ask2) = (ask.clone(), ask.clone());
    let greedy = tokio::spawn(async move {
        let r = ask1("anyone-key", "2147483647").await.unwrap();
        assert_eq!(r.status(), 200);
        o1.lock().unwrap().push("anyone");
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let ops = tokio::spawn(async move {
        let r = ask2("ops-key", "5").await.unwrap();
        assert_eq!(r.status(), 200);
        o2.lock().unwrap().push("ops");
    });
    assert_eq!(busy.await.unwrap().unwrap().status(), 200);
    greedy.await.unwrap();
    ops.await.unwrap();
    // The first key's 2147483647 counts as 0; the second's 5 stands, so it goes first.
    assert_eq!(*order.lock().unwrap(), ["ops", "anyone"]);
}

/// Behind access control, the client's key stays at the edge; an engine with its own key gets
/// that one, on requests and on the scrapes of its models and metrics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_clients_key_stays_at_the_edge_and_the_engine_gets_its_own() {
    let (backend, seen) = upgrading_backend();
    let dir = std::env::temp_dir().join(format!("kvroute-engine-key-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let key_file = dir.join("engine.key");
    std::fs::write(&key_file, "engine-secret\n").unwrap();
    let sha = key_sha256(b"client-key");
    let kv = Kvroute::start_with(
        &[(backend, format!("      api_key_file: \"{}\"\n", key_file.display()))],
        &format!(
            "  health_check:\n    path: /ws\n  telemetry:\n    interval_ms: 200\n  access:\n    keys:\n      - sha256: \"{sha}\"\n        tenant: t\n"
        ),
    );
    let r = client()
        .post(kv.url("/v1/embeddings"))
        .bearer_auth("client-key")
        .header("x-api-key", "client-key")
        .json(&json!({"model": MODEL, "input": "hi"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    tokio::time::sleep(Duration::from_millis(600)).await;
    let seen = seen.lock().unwrap();
    let head = |prefix: &str| {
        seen.iter()
            .find(|h| h.starts_with(prefix))
            .unwrap_or_else(|| panic!("no {prefix} in {seen:?}"))
            .to_ascii_lowercase()
    };
    let embeddings = head("POST /v1/embeddings");
    assert!(!embeddings.contains("client-key"), "{embeddings}");
    assert!(
        embeddings.contains("authorization: bearer engine-secret"),
        "{embeddings}"
    );
    assert!(head("GET /v1/models").contains("authorization: bearer engine-secret"));
    assert!(head("GET /metrics").contains("authorization: bearer engine-secret"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A chunked body larger than kvroute can replay is refused with 411 as soon as it passes
/// that size, not after the client sent (or stalled on) the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_chunked_body_is_refused_at_once() {
    let sim = Sim::start(&[]);
    let kv = Kvroute::start(&[sim.addr], "");
    let addr = kv.url("").trim_start_matches("http://").to_string();
    let mut s = TcpStream::connect(addr.trim_end_matches('/')).unwrap();
    s.write_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: kvroute\r\nContent-Type: application/json\r\n\
          Transfer-Encoding: chunked\r\n\r\n",
    )
    .unwrap();
    let piece = vec![b' '; 16 * 1024];
    for _ in 0..5 {
        write!(s, "{:x}\r\n", piece.len()).unwrap();
        s.write_all(&piece).unwrap();
        s.write_all(b"\r\n").unwrap();
    }
    // ... and then nothing: the client stalls mid-body.
    let started = std::time::Instant::now();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut buf = vec![0u8; 4096];
    let n = s.read(&mut buf).unwrap_or(0);
    let answer = String::from_utf8_lossy(&buf[..n]).to_string();
    assert!(answer.starts_with("HTTP/1.1 411"), "{answer}");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "answered after {:?}",
        started.elapsed()
    );
}

/// A client that stops reading is cut at `timeouts.client_write_ms`, and its place on the
/// backend is freed while its connection is still open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_frees_its_backend() {
    let sim = Sim::start(&["--ttft-ms", "1", "--itl-ms", "0"]);
    let kv = Kvroute::start(&[sim.addr], "  timeouts:\n    client_write_ms: 1000\n");
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "flood"}],
                      "stream": true, "max_tokens": 1_000_000})
    .to_string();
    let addr = kv.url("").trim_start_matches("http://").to_string();
    let mut s = TcpStream::connect(addr.trim_end_matches('/')).unwrap();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: kvroute\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    // The client reads nothing from here on, and keeps the connection open.
    let inflight = || kv.metric_sum("kvroute_backend_inflight_requests", &[]);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while inflight() < 1.0 {
        assert!(std::time::Instant::now() < deadline, "never dispatched");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    while inflight() > 0.0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the request still holds its backend while its client reads nothing"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(s);
}

/// `/v1/embeddings` and the other pass-through routes with a body are admitted like routed
/// requests: the key's models and rates, and the body limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passthrough_bodies_are_admitted_like_routed_ones() {
    let sim = Sim::start(&[]);
    let sha = key_sha256(b"small-key");
    let extra = format!(
        "  limits:\n    max_body_bytes: 100000\n  access:\n    keys:\n      - sha256: \"{sha}\"\n        tenant: small\n        models: [\"{MODEL}\"]\n        requests_per_minute: 2\n"
    );
    let kv = Kvroute::start(&[sim.addr], &extra);
    let embed = |model: &str, input: String| {
        client()
            .post(kv.url("/v1/embeddings"))
            .bearer_auth("small-key")
            .json(&json!({"model": model, "input": input}))
            .send()
    };
    // Another model than the key's: refused at the edge, never reaching the engine.
    let r = embed("other-model", "hi".into()).await.unwrap();
    assert_eq!(r.status(), 403);
    // Over the body limit: 413.
    let r = embed(MODEL, "x".repeat(200_000)).await.unwrap();
    assert_eq!(r.status(), 413);
    // Two a minute, then 429.
    for _ in 0..2 {
        assert_eq!(embed(MODEL, "hi".into()).await.unwrap().status(), 200);
    }
    let r = embed(MODEL, "hi".into()).await.unwrap();
    assert_eq!(r.status(), 429);
    let reached = sim
        .requests()
        .iter()
        .filter(|e| e["path"] == "/v1/embeddings")
        .count();
    assert_eq!(reached, 2, "only the admitted requests reach the engine");
}

/// A key's requests in flight are capped by its `max_concurrent`: one client cannot hold every
/// backend's places.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keys_requests_in_flight_are_capped() {
    let sim = Sim::start(&["--ttft-ms", "1", "--itl-ms", "20"]);
    let sha = key_sha256(b"one-at-a-time");
    let extra = format!(
        "  access:\n    keys:\n      - sha256: \"{sha}\"\n        tenant: t\n        max_concurrent: 1\n"
    );
    let kv = Kvroute::start(&[sim.addr], &extra);
    let url = kv.url("/v1/chat/completions");
    let ask = move || {
        let url = url.clone();
        async move {
            client()
                .post(url)
                .bearer_auth("one-at-a-time")
                .json(&json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20}))
                .send()
                .await
                .unwrap()
                .status()
        }
    };
    let first = tokio::spawn(ask.clone()());
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert_eq!(ask.clone()().await, 429);
    assert_eq!(first.await.unwrap(), 200);
    // The place is free again once the first has ended.
    assert_eq!(ask().await, 200);
}

/// A key's `max_concurrent` holds while its bodies are still arriving: a client cannot take
/// more of the body memory than its key's places by sending bodies slowly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keys_bodies_in_transit_count_toward_its_cap() {
    let sim = Sim::start(&["--ttft-ms", "1", "--itl-ms", "0"]);
    let sha = key_sha256(b"slow-sender");
    let extra = format!(
        "  access:\n    keys:\n      - sha256: \"{sha}\"\n        tenant: t\n        max_concurrent: 1\n"
    );
    let kv = Kvroute::start(&[sim.addr], &extra);
    let addr = kv
        .url("")
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_string();
    let body = json!({"model": MODEL, "max_tokens": 1,
                      "messages": [{"role": "user", "content": "slowly"}]})
    .to_string();
    let mut slow = TcpStream::connect(&addr).unwrap();
    slow.write_all(
        format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: kvroute\r\nAuthorization: Bearer slow-sender\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{}",
            body.len(),
            &body[..body.len() - 5]
        )
        .as_bytes(),
    )
    .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let started = std::time::Instant::now();
    let second = client()
        .post(kv.url("/v1/chat/completions"))
        .bearer_auth("slow-sender")
        .body(body.clone())
        .header("content-type", "application/json")
        .send()
        .await
        .unwrap();
    assert_eq!(second.status(), 429, "the body in transit held no place");
    assert!(started.elapsed() < Duration::from_secs(2));
    slow.write_all(&body.as_bytes()[body.len() - 5..]).unwrap();
    slow.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut buf = vec![0u8; 4096];
    let n = slow.read(&mut buf).unwrap_or(0);
    let answer = String::from_utf8_lossy(&buf[..n]).to_string();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
}

/// Bodies being received share `limits.body_memory_bytes`: while one client stalls before the
/// end of a large body, another large body is refused at once (503, before it is sent), and
/// taken again once the first is whole; a body whose parse alone would pass the budget is 413.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_in_transit_share_a_memory_budget() {
    let sim = Sim::start(&["--ttft-ms", "1", "--itl-ms", "0"]);
    let kv = Kvroute::start(
        &[sim.addr],
        "  limits:\n    max_body_bytes: 700000\n    body_memory_bytes: 1000000\n",
    );
    let addr = kv.url("").trim_start_matches("http://").to_string();
    let addr = addr.trim_end_matches('/').to_string();
    let chat = |fill: usize| {
        let body = json!({"model": MODEL, "max_tokens": 1,
                          "messages": [{"role": "user", "content": "x".repeat(fill)}]})
        .to_string();
        let head = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: kvroute\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n",
            body.len()
        );
        (head, body)
    };
    let read_head = |s: &mut TcpStream| {
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut buf = vec![0u8; 8192];
        let n = s.read(&mut buf).unwrap_or(0);
        String::from_utf8_lossy(&buf[..n]).to_string()
    };
    // The first client sends all of a 600 KB body but its last 10 bytes, and stalls.
    let (head, body) = chat(600_000);
    let mut stalled = TcpStream::connect(&addr).unwrap();
    stalled.write_all(head.as_bytes()).unwrap();
    stalled
        .write_all(&body.as_bytes()[..body.len() - 10])
        .unwrap();
    let held = || kv.metric_sum("kvroute_body_memory_bytes", &[]);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while held() < body.len() as f64 {
        assert!(
            std::time::Instant::now() < deadline,
            "the body was never leased"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A second 600 KB body does not fit beside it: refused on its head alone.
    let (head2, body2) = chat(600_000);
    let mut second = TcpStream::connect(&addr).unwrap();
    second.write_all(head2.as_bytes()).unwrap();
    let answer = read_head(&mut second);
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    assert!(answer.contains("body_memory_exhausted"), "{answer}");
    assert!(
        answer.to_ascii_lowercase().contains("retry-after: "),
        "{answer}"
    );
    // A small one still fits.
    let r = client()
        .post(kv.url("/v1/chat/completions"))
        .json(&json!({"model": MODEL, "max_tokens": 1,
                      "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    // The first body completes and is served; its share is returned.
    stalled
        .write_all(&body.as_bytes()[body.len() - 10..])
        .unwrap();
    let answer = read_head(&mut stalled);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let mut again = TcpStream::connect(&addr).unwrap();
    again.write_all(head2.as_bytes()).unwrap();
    again.write_all(body2.as_bytes()).unwrap();
    let answer = read_head(&mut again);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert_eq!(held(), 0.0);
    // 20,000 one-character messages: 600 KB sent, far more once parsed.
    let one = json!({"role": "user", "content": "a"});
    let bomb = json!({"model": MODEL, "max_tokens": 1, "messages": vec![one; 20_000]});
    let r = client()
        .post(kv.url("/v1/chat/completions"))
        .json(&bomb)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 413);
    assert!(kv.metric_sum("kvroute_body_memory_refused_total", &[]) >= 1.0);
}

/// A backend that answers every request 200 with a head naming its software and address.
fn chatty_backend() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for mut conn in listener.incoming().flatten() {
            std::thread::spawn(move || {
                let mut buf = vec![0u8; 8192];
                let _ = conn.read(&mut buf);
                let _ = conn.write_all(
                    b"HTTP/1.1 200 OK\r\nServer: llama.cpp b4500\r\nX-Powered-By: engine\r\n\
                      X-Engine-Addr: 10.0.0.7:8080\r\nContent-Type: text/plain\r\n\
                      Content-Length: 2\r\nConnection: close\r\n\r\nok",
                );
            });
        }
    });
    addr
}

/// What names the engine's software is not shown to clients; `response_headers.strip` says
/// what else stays behind (a prefix with `*`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn response_headers_on_the_strip_list_stay_behind() {
    let backend = chatty_backend();
    let conf = |strip: &str| {
        format!(
            "  telemetry:\n    enabled: false\n  passthrough:\n    allow:\n      - path: /info\n{strip}"
        )
    };
    let head = |kv: &Kvroute| {
        raw(
            kv,
            "GET /info HTTP/1.1\r\nHost: kvroute\r\nConnection: close\r\n\r\n",
        )
        .to_ascii_lowercase()
    };
    let kv = Kvroute::start(&[backend], &conf(""));
    let answer = head(&kv);
    assert!(answer.starts_with("http/1.1 200"), "{answer}");
    assert!(!answer.contains("\r\nserver:"), "{answer}");
    assert!(!answer.contains("\r\nx-powered-by:"), "{answer}");
    assert!(
        answer.contains("\r\nx-engine-addr: 10.0.0.7:8080"),
        "{answer}"
    );
    drop(kv);
    let kv = Kvroute::start(
        &[backend],
        &conf("  response_headers:\n    strip: [\"X-Engine-*\"]\n"),
    );
    let answer = head(&kv);
    assert!(answer.starts_with("http/1.1 200"), "{answer}");
    assert!(!answer.contains("\r\nx-engine-addr:"), "{answer}");
    // The list replaces the default.
    assert!(answer.contains("\r\nserver: llama.cpp"), "{answer}");
}

/// A pass-through request with a body waits for a place like a routed one: with every
/// backend at `backend_max_inflight`, an embeddings call waits in the router queue (429 at its
/// deadline) instead of going to the engine past the cap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passthrough_bodies_wait_for_a_place_like_routed_ones() {
    let sim = Sim::start(&["--ttft-ms", "1", "--itl-ms", "40"]);
    let kv = Kvroute::start(
        &[sim.addr],
        "  limits:\n    backend_max_inflight: 1\n    queue_timeout_ms: 500\n",
    );
    let url = kv.url("/v1/chat/completions");
    let long = tokio::spawn(async move {
        client()
            .post(url)
            .json(&json!({"model": MODEL, "stream": true, "max_tokens": 100,
                          "messages": [{"role": "user", "content": "hold the place"}]}))
            .send()
            .await
            .unwrap()
            .bytes()
            .await
            .unwrap()
    });
    let inflight = || kv.metric_sum("kvroute_backend_inflight_requests", &[]);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while inflight() < 1.0 {
        assert!(std::time::Instant::now() < deadline, "never dispatched");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let embed = || {
        client()
            .post(kv.url("/v1/embeddings"))
            .json(&json!({"model": MODEL, "input": "wait for a place"}))
            .send()
    };
    let r = embed().await.unwrap();
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["x-kvroute-dropped-reason"], "queue_timeout");
    assert!(r.text().await.unwrap().contains("fleet_saturated"));
    let reached = |sim: &Sim| {
        sim.requests()
            .iter()
            .filter(|e| e["path"] == "/v1/embeddings")
            .count()
    };
    assert_eq!(reached(&sim), 0, "the engine got a request past the cap");
    long.await.unwrap();
    let r = embed().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(reached(&sim), 1);
}
