//! The TLS listener and HTTP/2 through real processes: certificates from a CA made in the test,
//! clients negotiating h2 or HTTP/1.1 by ALPN, mTLS, certificate reload on SIGHUP, `-t` checks,
//! and clients that misbehave (plaintext on the TLS port, a stalled handshake).

mod common;

use common::certs::{client_identity, serial_of, Ca};
use common::*;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::time::{Duration, Instant};

/// kvroute with a TLS listener on a port of its own; returns it and the TLS address.
fn start_tls(sim: &Sim, dir: &Path, extra_tls: &str, extra: &str) -> (Kvroute, SocketAddr) {
    let port = loop {
        let p = free_port();
        if p > 0 {
            break p;
        }
    };
    let tls: SocketAddr = format!("127.0.0.1:{port}").parse().expect("addr");
    let yaml = format!(
        "  tls:\n    listen: \"{tls}\"\n    cert: {d}/cert.pem\n    key: {d}/key.pem\n{extra_tls}{extra}",
        d = dir.display()
    );
    (Kvroute::start(&[sim.addr], &yaml), tls)
}

fn tls_client(ca: &Ca) -> reqwest::ClientBuilder {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .add_root_certificate(reqwest::Certificate::from_pem(&ca.pem()).expect("ca"))
        .tls_info(true)
}

fn url(addr: SocketAddr, path: &str) -> String {
    // The certificate names 127.0.0.1 (and localhost).
    format!("https://{addr}{path}")
}

fn temp_dir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("kvroute-tls-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).expect("dir");
    d
}

fn chat(stream: bool, max_tokens: u32, text: &str) -> serde_json::Value {
    chat_body(
        MODEL,
        serde_json::json!([{"role": "user", "content": text}]),
        stream,
        max_tokens,
    )
}

/// The serial of the certificate the server showed on `r`'s connection.
fn served_serial(r: &reqwest::Response) -> u32 {
    let info = r
        .extensions()
        .get::<reqwest::tls::TlsInfo>()
        .expect("tls info");
    serial_of(info.peer_certificate().expect("peer certificate"))
}

/// The serial of the certificate a new connection is shown.
async fn new_connection_serial(ca: &Ca, tls: SocketAddr) -> u32 {
    let r = tls_client(ca)
        .build()
        .expect("client")
        .get(url(tls, "/v1/models"))
        .send()
        .await
        .expect("request");
    served_serial(&r)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2_streams_a_completion_as_it_is_generated_and_http1_works_too() {
    let ca = Ca::new("kvroute test CA");
    let dir = temp_dir("h2");
    ca.write_server(&dir, 1001, -60, 86_000);
    let sim = Sim::start(&["--ttft-ms", "10", "--itl-ms", "60"]);
    let (k, tls) = start_tls(&sim, &dir, "", "");

    let c = tls_client(&ca).build().expect("client");
    let start = Instant::now();
    let mut r = c
        .post(url(tls, "/v1/chat/completions"))
        .json(&chat(true, 12, "stream over h2"))
        .send()
        .await
        .expect("h2 request");
    assert_eq!(r.version(), reqwest::Version::HTTP_2);
    assert_eq!(r.status(), 200);
    assert_eq!(served_serial(&r), 1001);
    let mut arrivals = Vec::new();
    let mut body = Vec::new();
    while let Some(chunk) = r.chunk().await.expect("chunk") {
        arrivals.push(start.elapsed());
        body.extend_from_slice(&chunk);
    }
    let text = String::from_utf8_lossy(&body);
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    // 12 tokens at 60 ms: chunks arrive across ~0.7 s, not all at the end.
    assert!(arrivals.len() >= 6, "{} chunks", arrivals.len());
    let spread = arrivals[arrivals.len() - 1] - arrivals[0];
    assert!(
        spread >= Duration::from_millis(300),
        "chunks arrived within {spread:?}"
    );

    let h1 = tls_client(&ca).http1_only().build().expect("client");
    let r = h1
        .post(url(tls, "/v1/chat/completions"))
        .json(&chat(false, 3, "plain over h1"))
        .send()
        .await
        .expect("h1 request");
    assert_eq!(r.version(), reqwest::Version::HTTP_11);
    assert_eq!(r.status(), 200);
    let v: serde_json::Value = r.json().await.expect("json");
    assert!(v["choices"][0]["message"]["content"].is_string(), "{v}");

    // The edge's status contract holds on h2: an engine admin path is 404 in the OpenAI shape.
    let r = c
        .post(url(tls, "/reset_prefix_cache"))
        .send()
        .await
        .expect("h2 request");
    assert_eq!(r.status(), 404);
    assert_eq!(
        error_of(&r.bytes().await.expect("body"))["code"],
        "not_found"
    );
    let m = k.metrics();
    assert_eq!(
        metric_sum(
            &m,
            "kvroute_client_connections_accepted_total",
            &[("transport", "https"), ("protocol", "h2")]
        ),
        1.0
    );
    assert!(m.contains("kvroute_tls_certificate_expiry_timestamp_seconds"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_concurrent_streams_share_one_h2_connection() {
    let ca = Ca::new("kvroute test CA");
    let dir = temp_dir("streams");
    ca.write_server(&dir, 7, -60, 86_000);
    let sim = Sim::start(&["--ttft-ms", "50", "--itl-ms", "20"]);
    let (k, tls) = start_tls(&sim, &dir, "", "");
    let c = tls_client(&ca).build().expect("client");
    // One connection first, so every request below multiplexes onto it.
    let r = c.get(url(tls, "/v1/models")).send().await.expect("warm-up");
    assert_eq!(r.version(), reqwest::Version::HTTP_2);
    let started = Instant::now();
    let requests = (0..64).map(|i| {
        let c = c.clone();
        async move {
            let r = c
                .post(url(tls, "/v1/chat/completions"))
                .json(&chat(i % 2 == 0, 5, &format!("stream {i}")))
                .send()
                .await
                .expect("request");
            (
                r.status().as_u16(),
                r.bytes().await.map(|b| b.len()).unwrap_or(0),
            )
        }
    });
    let results = futures_util::future::join_all(requests).await;
    assert!(
        results.iter().all(|&(s, n)| s == 200 && n > 0),
        "{results:?}"
    );
    // 64 requests of ~150 ms each, concurrently on one connection: well under one at a time.
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(
        k.metric_sum(
            "kvroute_client_connections_accepted_total",
            &[("transport", "https")]
        ),
        1.0
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mtls_refuses_a_client_without_a_certificate() {
    let ca = Ca::new("kvroute test CA");
    let clients = Ca::new("kvroute client CA");
    let dir = temp_dir("mtls");
    ca.write_server(&dir, 5, -60, 86_000);
    std::fs::write(dir.join("clients.pem"), clients.pem()).expect("write");
    let sim = Sim::start(&["--ttft-ms", "1", "--itl-ms", "0"]);
    let client_ca = format!("    client_ca: {}/clients.pem\n", dir.display());
    let (k, tls) = start_tls(&sim, &dir, &client_ca, "");

    let anonymous = tls_client(&ca).build().expect("client");
    let refused = anonymous.get(url(tls, "/v1/models")).send().await;
    assert!(
        refused.is_err(),
        "a client without a certificate was served"
    );
    // A certificate from another CA is refused too.
    let stranger = tls_client(&ca)
        .identity(client_identity(&ca))
        .build()
        .expect("client");
    assert!(stranger.get(url(tls, "/v1/models")).send().await.is_err());

    let known = tls_client(&ca)
        .identity(client_identity(&clients))
        .build()
        .expect("client");
    let r = known
        .post(url(tls, "/v1/chat/completions"))
        .json(&chat(false, 2, "mtls"))
        .send()
        .await
        .expect("request with a client certificate");
    assert_eq!(r.status(), 200);
    let failed = [("result", "failed")];
    let m = k.metrics_when("kvroute_tls_handshakes_total", &failed, 2.0);
    assert!(metric_sum(&m, "kvroute_tls_handshakes_total", &failed) >= 2.0);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_serves_a_renewed_certificate_while_an_open_stream_completes() {
    let ca = Ca::new("kvroute test CA");
    let dir = temp_dir("reload");
    ca.write_server(&dir, 100, -60, 86_000);
    let sim = Sim::start(&["--ttft-ms", "10", "--itl-ms", "40"]);
    let (k, tls) = start_tls(&sim, &dir, "", "");
    let expiry_before = k.metric_sum("kvroute_tls_certificate_expiry_timestamp_seconds", &[]);

    let old = tls_client(&ca).build().expect("client");
    let mut stream = old
        .post(url(tls, "/v1/chat/completions"))
        .json(&chat(true, 40, "a long stream across the reload"))
        .send()
        .await
        .expect("stream");
    assert_eq!(served_serial(&stream), 100);
    let first = stream.chunk().await.expect("chunk").expect("a first chunk");

    // A bad pair is rejected and the old certificate stays.
    let (other, other_key) = ca.issue(common::certs::Role::Server, 555, -60, 86_000);
    let (_, mismatched) = ca.issue(common::certs::Role::Server, 556, -60, 86_000);
    common::certs::write_pair(&dir, &other.to_pem().expect("pem"), &mismatched);
    signal(k.pid(), "HUP");
    k.metrics_when(
        "kvroute_config_reloads_total",
        &[("result", "failure")],
        1.0,
    );
    assert_eq!(
        new_connection_serial(&ca, tls).await,
        100,
        "a rejected pair replaced the certificate"
    );
    drop(other_key);

    ca.write_server(&dir, 200, -60, 172_000);
    signal(k.pid(), "HUP");
    k.metrics_when(
        "kvroute_config_reloads_total",
        &[("result", "success")],
        1.0,
    );
    assert_eq!(new_connection_serial(&ca, tls).await, 200);
    let expiry_after = k.metric_sum("kvroute_tls_certificate_expiry_timestamp_seconds", &[]);
    assert!(
        expiry_after > expiry_before + 80_000.0,
        "{expiry_before} -> {expiry_after}"
    );

    let mut body = first.to_vec();
    while let Some(chunk) = stream
        .chunk()
        .await
        .expect("the open stream survived the reload")
    {
        body.extend_from_slice(&chunk);
    }
    let text = String::from_utf8_lossy(&body);
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}

// Counters of closed connections are read with `metrics_when`: the client can see the close a
// moment before the proxy counts it.

/// Read until EOF or `limit`; whether the server closed the connection by then.
fn closed_within(s: &mut TcpStream, limit: Duration) -> bool {
    s.set_read_timeout(Some(limit)).expect("timeout");
    let mut buf = [0u8; 4096];
    let start = Instant::now();
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
            Err(_) => return start.elapsed() < limit,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plaintext_and_stalled_handshakes_are_closed_and_others_are_served() {
    let ca = Ca::new("kvroute test CA");
    let dir = temp_dir("bad");
    ca.write_server(&dir, 9, -60, 86_000);
    let sim = Sim::start(&["--ttft-ms", "1", "--itl-ms", "0"]);
    let (k, tls) = start_tls(
        &sim,
        &dir,
        "",
        "  timeouts:\n    tls_handshake_ms: 300\n    client_header_ms: 300\n",
    );

    let mut plain = TcpStream::connect(tls).expect("connect");
    plain
        .write_all(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        .expect("write");
    assert!(closed_within(&mut plain, Duration::from_secs(5)));

    let started = Instant::now();
    let mut stalled = TcpStream::connect(tls).expect("connect");
    let c = tls_client(&ca).build().expect("client");
    // Served while the stalled connection waits out its deadline.
    let r = c.get(url(tls, "/v1/models")).send().await.expect("request");
    assert_eq!(r.status(), 200);
    assert!(closed_within(&mut stalled, Duration::from_secs(5)));
    assert!(started.elapsed() >= Duration::from_millis(250));
    assert!(
        metric_sum(
            &k.metrics_when(
                "kvroute_client_timeouts_total",
                &[("phase", "tls_handshake")],
                1.0
            ),
            "kvroute_client_timeouts_total",
            &[("phase", "tls_handshake")]
        ) >= 1.0
    );
    assert!(
        metric_sum(
            &k.metrics_when("kvroute_tls_handshakes_total", &[("result", "failed")], 1.0),
            "kvroute_tls_handshakes_total",
            &[("result", "failed")]
        ) >= 1.0
    );

    // A completed handshake followed by no request header is cut at the header deadline too.
    let mut connector =
        openssl::ssl::SslConnector::builder(openssl::ssl::SslMethod::tls()).expect("connector");
    connector.set_verify(openssl::ssl::SslVerifyMode::NONE);
    let tcp = TcpStream::connect(tls).expect("connect");
    let mut silent = connector
        .build()
        .connect("localhost", tcp)
        .expect("handshake");
    silent
        .get_ref()
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let started = Instant::now();
    let mut buf = [0u8; 64];
    let n = silent.read(&mut buf).unwrap_or(0);
    assert_eq!(n, 0, "the silent TLS connection got data");
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(250) && waited < Duration::from_secs(4),
        "closed after {waited:?}"
    );
    assert!(
        metric_sum(
            &k.metrics_when("kvroute_client_timeouts_total", &[("phase", "header")], 1.0),
            "kvroute_client_timeouts_total",
            &[("phase", "header")]
        ) >= 1.0
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `kvroute -t` on a config whose TLS files are `cert` and `key`: its exit code and stderr.
fn check(dir: &Path, cert: &Path, key: &Path) -> (i32, String) {
    let conf = dir.join("check.yaml");
    std::fs::write(
        &conf,
        format!(
            "kvroute:\n  tls:\n    listen: \"127.0.0.1:1\"\n    cert: {}\n    key: {}\n  \
             backends:\n    - addr: \"127.0.0.1:2\"\n",
            cert.display(),
            key.display()
        ),
    )
    .expect("write");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(["-t", "-c"])
        .arg(&conf)
        .output()
        .expect("run kvroute -t");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn config_test_names_the_bad_certificate_or_key() {
    let ca = Ca::new("kvroute test CA");
    let dir = temp_dir("check");
    let (cert, key) = ca.write_server(&dir, 1, -60, 86_000);
    assert_eq!(check(&dir, &cert, &key).0, 0);

    let (code, err) = check(&dir, &cert, &dir.join("missing.pem"));
    assert_ne!(code, 0);
    assert!(
        err.contains("missing.pem") && err.contains("cannot read"),
        "{err}"
    );

    // A key of another certificate: the key's path is named.
    let other = temp_dir("check-other");
    let (_, other_key) = ca.write_server(&other, 2, -60, 86_000);
    let (code, err) = check(&dir, &cert, &other_key);
    assert_ne!(code, 0);
    assert!(
        err.contains(&other_key.display().to_string()) && err.contains("does not match"),
        "{err}"
    );

    let expired = temp_dir("check-expired");
    let (cert, key) = ca.write_server(&expired, 3, -7200, -3600);
    let (code, err) = check(&expired, &cert, &key);
    assert_ne!(code, 0);
    assert!(err.contains("expired"), "{err}");

    std::fs::write(dir.join("garbage.pem"), b"not a certificate").expect("write");
    let (code, err) = check(&dir, &dir.join("garbage.pem"), &key);
    assert_ne!(code, 0);
    assert!(err.contains("garbage.pem"), "{err}");
    for d in [dir, other, expired] {
        let _ = std::fs::remove_dir_all(d);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tls_listener_is_handed_over_on_upgrade() {
    let ca = Ca::new("kvroute test CA");
    let dir = temp_dir("upgrade");
    ca.write_server(&dir, 42, -60, 86_000);
    // 100 tokens at 30 ms: a 3 s stream, still running when the old process stops accepting.
    let sim = Sim::start(&["--ttft-ms", "2", "--itl-ms", "30"]);
    let tls: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().expect("addr");
    let yaml = format!(
        "  tls:\n    listen: \"{tls}\"\n    cert: {d}/cert.pem\n    key: {d}/key.pem\n",
        d = dir.display()
    );
    // Pingora drops whatever the old process still runs when the grace period ends: 1 s
    // left a connection it accepted just before it stopped accepting (its handshake slowed by
    // the parallel tests on a 2-core CI host) cut off. The old process exits as soon as its
    // connections are done, so a longer period costs the test nothing when all goes well.
    let mut k = Kvroute::launch(&[sim.addr], &yaml, "grace_period_seconds: 5\n");
    k.wait_ready();

    // A client opening a new TLS connection for every request: a refused one would show.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let fresh = tls_client(&ca)
        .pool_max_idle_per_host(0)
        .build()
        .expect("client");
    let load = {
        let stop = stop.clone();
        tokio::spawn(async move {
            let (mut ok, mut failures) = (0u32, Vec::new());
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                match fresh.get(url(tls, "/v1/models")).send().await {
                    Ok(r) if r.status() == 200 => ok += 1,
                    Ok(r) => failures.push(format!("status {}", r.status())),
                    Err(e) => failures.push(format!("{e:?}")),
                }
            }
            (ok, failures)
        })
    };
    let streaming = tls_client(&ca).build().expect("client");
    let mut stream = streaming
        .post(url(tls, "/v1/chat/completions"))
        .json(&chat(true, 100, "a stream across the upgrade"))
        .send()
        .await
        .expect("stream");
    assert_eq!(stream.version(), reqwest::Version::HTTP_2);

    let _ = std::fs::remove_file(k.dir.join("upgrade.sock"));
    let new = k.spawn(&["-u"]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !k.dir.join("upgrade.sock").exists() {
        assert!(Instant::now() < deadline, "no hand-over socket");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let old_pid = k.pid();
    let mut old = k.replace_child(new).expect("old process");
    signal(old_pid, "QUIT");
    let mut body = Vec::new();
    while let Some(chunk) = stream
        .chunk()
        .await
        .expect("the stream survived the upgrade")
    {
        body.extend_from_slice(&chunk);
    }
    assert!(String::from_utf8_lossy(&body)
        .trim_end()
        .ends_with("data: [DONE]"));
    let quit = Instant::now();
    while old.try_wait().expect("wait").is_none() {
        assert!(
            quit.elapsed() < Duration::from_secs(20),
            "old process stayed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The new process alone serves TLS, with the same certificate.
    assert_eq!(new_connection_serial(&ca, tls).await, 42);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (ok, failures) = load.await.expect("load");
    assert!(
        failures.is_empty(),
        "{} failed: {:?}",
        failures.len(),
        &failures[..failures.len().min(3)]
    );
    assert!(ok >= 20, "the load barely ran: {ok}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_behind_tls_is_verified_against_its_ca() {
    // The "engine behind TLS" is a kvroute terminating TLS in front of a simulated engine.
    let ca = Ca::new("kvroute test CA");
    let dir = temp_dir("upstream");
    ca.write_server(&dir, 3, -60, 86_000);
    std::fs::write(dir.join("ca.pem"), ca.pem()).expect("write");
    let other = Ca::new("some other CA");
    std::fs::write(dir.join("other.pem"), other.pem()).expect("write");
    let sim = Sim::start(&["--ttft-ms", "1", "--itl-ms", "0"]);
    let passthrough = "  passthrough:\n    allow:\n      - path: /health\n";
    let (_engine, engine_tls) = start_tls(&sim, &dir, "", passthrough);

    let edge = |ca_file: &str| {
        format!(
            "      tls:\n        sni: localhost\n        ca: {}/{ca_file}\n  health_check:\n    \
             interval_ms: 100\n",
            dir.display()
        )
    };
    let trusted = Kvroute::start(&[engine_tls], &edge("ca.pem"));
    let r = client()
        .post(trusted.url("/v1/chat/completions"))
        .json(&chat(false, 2, "through two proxies"))
        .send()
        .await
        .expect("request");
    assert_eq!(r.status(), 200);

    // A backend whose certificate does not chain to the configured CA is never trusted: its
    // health check fails and no request reaches it.
    let untrusted = Kvroute::start_unready(&[engine_tls], &edge("other.pem"));
    tokio::time::sleep(Duration::from_millis(800)).await;
    let (status, _) = http_get(untrusted.admin, "/readyz");
    assert_eq!(
        status, 503,
        "a backend with an unverifiable certificate passed"
    );
    let r = client()
        .post(untrusted.url("/v1/chat/completions"))
        .json(&chat(false, 2, "must not pass"))
        .send()
        .await
        .expect("request");
    assert!(r.status().is_server_error(), "{}", r.status());
    let _ = std::fs::remove_dir_all(&dir);
}

/// A TLS handshake with kvroute offering only `groups` (TLS 1.3) or, when given, only the TLS
/// 1.2 suites `tls12_ciphers` (in the client's order): the suite negotiated, if it completes.
fn negotiate(tls: SocketAddr, groups: &str, tls12_ciphers: Option<&str>) -> Option<String> {
    let mut c = openssl::ssl::SslConnector::builder(openssl::ssl::SslMethod::tls()).expect("c");
    c.set_verify(openssl::ssl::SslVerifyMode::NONE);
    c.set_groups_list(groups).expect("groups");
    if let Some(ciphers) = tls12_ciphers {
        c.set_max_proto_version(Some(openssl::ssl::SslVersion::TLS1_2))
            .expect("tls 1.2");
        c.set_cipher_list(ciphers).expect("ciphers");
    }
    let tcp = TcpStream::connect(tls).expect("connect");
    let s = c.build().connect("localhost", tcp).ok()?;
    s.ssl().current_cipher().map(|c| c.name().to_string())
}

fn handshake_with(tls: SocketAddr, groups: &str, tls12_ciphers: Option<&str>) -> bool {
    negotiate(tls, groups, tls12_ciphers).is_some()
}

/// Mozilla's intermediate key exchange groups only (no X448, no secp521r1), no finite-field
/// DHE suites, which OpenSSL's defaults and Mozilla's own list would offer, and the server's
/// order of suites.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_intermediate_groups_and_no_dhe_are_offered() {
    let ca = Ca::new("kvroute test CA");
    let dir = temp_dir("groups");
    ca.write_rsa_server(&dir, 21);
    let sim = Sim::start(&["--ttft-ms", "1", "--itl-ms", "0"]);
    let (_k, tls) = start_tls(&sim, &dir, "", "");
    for ok in ["X25519", "P-256", "P-384"] {
        assert!(handshake_with(tls, ok, None), "{ok} refused");
    }
    for refused in ["X448", "P-521", "ffdhe2048"] {
        assert!(!handshake_with(tls, refused, None), "{refused} accepted");
    }
    assert!(handshake_with(
        tls,
        "X25519",
        Some("ECDHE-RSA-AES128-GCM-SHA256")
    ));
    assert!(
        !handshake_with(tls, "X25519:ffdhe2048", Some("DHE-RSA-AES128-GCM-SHA256")),
        "a DHE suite was negotiated"
    );
    // The server's order, not the client's: AES-128-GCM comes first in kvroute's list.
    let chosen = negotiate(
        tls,
        "X25519",
        Some("ECDHE-RSA-CHACHA20-POLY1305:ECDHE-RSA-AES128-GCM-SHA256"),
    );
    assert_eq!(chosen.as_deref(), Some("ECDHE-RSA-AES128-GCM-SHA256"));
    let _ = std::fs::remove_dir_all(&dir);
}
