//! HTTP/2 with prior knowledge (h2c) on the plaintext listener, and the edge's HTTP/2 defences:
//! the header deadline for a connection that opens no stream, and the rapid-reset limit
//! (CVE-2023-44487), through real processes and a raw h2 client.

mod common;

use bytes::Bytes;
use common::*;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

fn chat(stream: bool, max_tokens: u32, text: &str) -> Bytes {
    let body = chat_body(
        MODEL,
        serde_json::json!([{"role": "user", "content": text}]),
        stream,
        max_tokens,
    );
    Bytes::from(serde_json::to_vec(&body).expect("json"))
}

fn post(addr: std::net::SocketAddr) -> http::Request<()> {
    http::Request::post(format!("http://{addr}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(())
        .expect("request")
}

type H2Client = h2::client::SendRequest<Bytes>;

/// A raw h2c connection; the task driving it reports how the connection ended.
async fn connect(
    addr: std::net::SocketAddr,
) -> (H2Client, tokio::task::JoinHandle<Result<(), h2::Error>>) {
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (client, conn) = h2::client::handshake(tcp).await.expect("h2 handshake");
    (client, tokio::spawn(conn))
}

/// Send a complete request on `client` and read its whole response: (status, body).
async fn exchange(client: &H2Client, addr: std::net::SocketAddr, body: Bytes) -> (u16, Vec<u8>) {
    let mut ready = client.clone().ready().await.expect("ready");
    let (response, mut send) = ready.send_request(post(addr), false).expect("send");
    send.send_data(body, true).expect("data");
    let response = response.await.expect("response");
    let status = response.status().as_u16();
    let mut recv = response.into_body();
    let mut out = Vec::new();
    while let Some(chunk) = recv.data().await {
        let chunk = chunk.expect("data frame");
        let _ = recv.flow_control().release_capacity(chunk.len());
        out.extend_from_slice(&chunk);
    }
    (status, out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2c_serves_routed_streaming_and_refused_requests() {
    let sim = Sim::start(&["--ttft-ms", "10", "--itl-ms", "40"]);
    let k = Kvroute::start(&[sim.addr], "  h2c: true\n");
    let c = reqwest::Client::builder()
        .http2_prior_knowledge()
        .timeout(Duration::from_secs(30))
        .build()
        .expect("client");
    let start = Instant::now();
    let mut r = c
        .post(k.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(chat(true, 10, "h2c stream"))
        .send()
        .await
        .expect("request");
    assert_eq!(r.version(), reqwest::Version::HTTP_2);
    assert_eq!(r.status(), 200);
    let mut arrivals = Vec::new();
    while let Some(_chunk) = r.chunk().await.expect("chunk") {
        arrivals.push(start.elapsed());
    }
    let spread = arrivals[arrivals.len() - 1] - arrivals[0];
    assert!(
        spread >= Duration::from_millis(200),
        "chunks within {spread:?}"
    );

    // The same status contract as HTTP/1.1: bad JSON is a 400 in the OpenAI shape.
    let r = c
        .post(k.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .expect("request");
    assert_eq!(r.status(), 400);
    error_of(&r.bytes().await.expect("body"));
    // HTTP/1.1 still works on the same listener.
    let (status, _) = http_get(k.addr, "/v1/models");
    assert_eq!(status, 200);
    let m = k.metrics();
    assert_eq!(
        metric_sum(
            &m,
            "kvroute_client_connections_accepted_total",
            &[("transport", "http"), ("protocol", "h2")]
        ),
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_h2_connection_that_opens_no_stream_is_closed_at_the_header_deadline() {
    let sim = Sim::start(&["--ttft-ms", "1", "--itl-ms", "0"]);
    let k = Kvroute::start(
        &[sim.addr],
        "  h2c: true\n  timeouts:\n    client_header_ms: 300\n",
    );
    let mut s = TcpStream::connect(k.addr).expect("connect");
    // The preface and an empty SETTINGS frame, then nothing.
    s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        .expect("write");
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let started = Instant::now();
    let mut buf = [0u8; 1024];
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
            Err(e) => panic!("connection still open after {:?}: {e}", started.elapsed()),
        }
    }
    assert!(
        metric_sum(
            &k.metrics_when("kvroute_client_timeouts_total", &[("phase", "header")], 1.0),
            "kvroute_client_timeouts_total",
            &[("phase", "header")]
        ) >= 1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rapid_reset_closes_the_connection_and_others_are_served() {
    // Each request waits 300 ms at the backend, so every reset below lands on a stream the proxy
    // has accepted and placed: the case the h2 crate's own limit does not cover.
    let sim = Sim::start(&["--ttft-ms", "300", "--itl-ms", "5"]);
    let k = Kvroute::start(
        &[sim.addr],
        "  h2c: true\n  limits:\n    h2_max_client_resets: 10\n",
    );
    let addr = k.addr;

    // A client cancelling a few streams is within the limit and keeps its connection.
    let (polite, polite_conn) = connect(addr).await;
    for i in 0..5 {
        let mut ready = polite.clone().ready().await.expect("ready");
        let (_, mut send) = ready.send_request(post(addr), false).expect("send");
        send.send_data(chat(true, 5, &format!("cancel {i}")), true)
            .expect("data");
        tokio::time::sleep(Duration::from_millis(50)).await;
        send.send_reset(h2::Reason::CANCEL);
    }
    let (status, _) = exchange(&polite, addr, chat(false, 2, "after cancelling")).await;
    assert_eq!(status, 200);

    let (attacker, attacker_conn) = connect(addr).await;
    let mut sent = 0;
    'attack: for round in 0..20 {
        let mut streams = Vec::new();
        for i in 0..10 {
            let Ok(mut ready) = attacker.clone().ready().await else {
                break 'attack;
            };
            let Ok((_, mut send)) = ready.send_request(post(addr), false) else {
                break 'attack;
            };
            if send
                .send_data(chat(true, 5, &format!("attack {round}/{i}")), true)
                .is_err()
            {
                break 'attack;
            }
            streams.push(send);
            sent += 1;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        for mut s in streams {
            s.send_reset(h2::Reason::CANCEL);
        }
    }
    let ended = tokio::time::timeout(Duration::from_secs(10), attacker_conn)
        .await
        .expect("the attacking connection was not closed")
        .expect("join");
    let err = ended.expect_err("the connection ended without an error");
    assert_eq!(
        err.reason(),
        Some(h2::Reason::ENHANCE_YOUR_CALM),
        "{err} after {sent} streams"
    );
    assert!(sent < 200, "all {sent} streams were accepted");
    assert_eq!(
        k.metric_sum("kvroute_h2_rapid_reset_closes_total", &[]),
        1.0
    );

    // The polite connection and new ones are still served.
    let (status, body) = exchange(&polite, addr, chat(false, 2, "still here")).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let (fresh, _fresh_conn) = connect(addr).await;
    assert_eq!(exchange(&fresh, addr, chat(false, 2, "new")).await.0, 200);
    assert!(!polite_conn.is_finished());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2_streams_get_the_same_access_control_and_the_stream_cap_is_advertised() {
    let sim = Sim::start(&["--ttft-ms", "1", "--itl-ms", "0"]);
    // A model the fleet serves but the key may not use.
    let other = Sim::start(&[
        "--ttft-ms",
        "1",
        "--itl-ms",
        "0",
        "--model",
        "another-model",
    ]);
    let digest: String = kvroute::digest(b"h2-secret")
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let extra = format!(
        "  h2c: true\n  limits:\n    h2_max_concurrent_streams: 7\n  access:\n    keys:\n      \
         - sha256: \"{digest}\"\n        tenant: t\n        models: [\"{MODEL}\"]\n"
    );
    let k = Kvroute::start(&[sim.addr, other.addr], &extra);
    let c = reqwest::Client::builder()
        .http2_prior_knowledge()
        .timeout(Duration::from_secs(10))
        .build()
        .expect("client");
    let send = |key: Option<&'static str>, model: &'static str| {
        let mut r = c
            .post(k.url("/v1/chat/completions"))
            .header("content-type", "application/json")
            .body(
                serde_json::to_vec(&chat_body(
                    model,
                    serde_json::json!([{"role": "user", "content": "hi"}]),
                    false,
                    2,
                ))
                .expect("json"),
            );
        if let Some(key) = key {
            r = r.bearer_auth(key);
        }
        r.send()
    };
    for (key, model, status, code) in [
        (None, MODEL, 401, Some("missing_api_key")),
        (Some("wrong"), MODEL, 401, Some("invalid_api_key")),
        (
            Some("h2-secret"),
            "another-model",
            403,
            Some("model_not_allowed"),
        ),
        (Some("h2-secret"), MODEL, 200, None),
    ] {
        let r = send(key, model).await.expect("request");
        assert_eq!(r.version(), reqwest::Version::HTTP_2);
        assert_eq!(r.status().as_u16(), status, "key {key:?} model {model}");
        let body = r.bytes().await.expect("body");
        if let Some(code) = code {
            assert_eq!(error_of(&body)["code"], code);
        }
    }

    // The server's SETTINGS carry the configured cap.
    let (client, _conn) = connect(k.addr).await;
    let (status, _) = exchange(&client, k.addr, chat(false, 2, "settings")).await;
    assert_eq!(status, 401);
    assert_eq!(client.current_max_send_streams(), 7);
}

/// Streams whose client reads nothing (a zero window) free their backend's places as soon as
/// the engine has answered them, not at the write timeout: another client is served at once
/// by a backend "full" of them, and the held streams still get their whole text once read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_held_at_a_zero_window_free_their_backend_when_the_engine_is_done() {
    let sim = Sim::start(&["--ttft-ms", "1", "--itl-ms", "1"]);
    let k = Kvroute::start(
        &[sim.addr],
        "  h2c: true\n  limits:\n    backend_max_inflight: 2\n    queue_timeout_ms: 3000\n",
    );
    let tcp = tokio::net::TcpStream::connect(k.addr)
        .await
        .expect("connect");
    let (h2c, mut conn) = h2::client::Builder::new()
        .initial_window_size(0)
        .handshake::<_, Bytes>(tcp)
        .await
        .expect("h2 handshake");
    let (open, opened) = tokio::sync::oneshot::channel::<()>();
    let driver = tokio::spawn(async move {
        tokio::select! {
            r = &mut conn => return r,
            _ = opened => {}
        }
        conn.set_initial_window_size(1 << 20).expect("window");
        conn.await
    });
    let mut held = Vec::new();
    for i in 0..2 {
        let mut ready = h2c.clone().ready().await.expect("ready");
        let (response, mut send) = ready.send_request(post(k.addr), false).expect("send");
        send.send_data(chat(true, 40, &format!("held {i}")), true)
            .expect("data");
        let response = response.await.expect("response head");
        assert_eq!(response.status(), 200);
        held.push(response.into_body());
    }
    // Both streams are open and read nothing; the engine has finished them.
    let inflight = || k.metric_sum("kvroute_backend_inflight_requests", &[]);
    let deadline = Instant::now() + Duration::from_secs(5);
    while inflight() > 0.0 {
        assert!(
            Instant::now() < deadline,
            "{} requests still charged to the backend while their clients read nothing",
            inflight()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let started = Instant::now();
    let r = client()
        .post(k.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(chat(false, 5, "another client"))
        .send()
        .await
        .expect("request");
    assert_eq!(r.status(), 200);
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    // Read at last: every held stream's text is whole.
    let _ = open.send(());
    for mut body in held {
        let mut text = Vec::new();
        while let Some(chunk) = body.data().await {
            let chunk = chunk.expect("data frame");
            let _ = body.flow_control().release_capacity(chunk.len());
            text.extend_from_slice(&chunk);
        }
        let text = String::from_utf8_lossy(&text).to_string();
        assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    }
    drop(h2c);
    let _ = driver.await;
}
