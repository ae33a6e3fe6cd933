//! The edge-safe surface through real processes: kvroute serves the OpenAI inference API and
//! the routes `kvroute.passthrough.allow` lists; an engine's admin endpoints are refused with
//! 404 in the OpenAI error shape, with or without an API key, and never reach a backend.

mod common;

use common::*;
use std::time::Duration;

const ADMIN_PATHS: [&str; 9] = [
    "/reset_prefix_cache",
    "/sleep",
    "/wake_up",
    "/v1/load_lora_adapter",
    "/start_profile",
    "/collective_rpc",
    "/flush_cache",
    "/update_weights_from_disk",
    "/debug/faults",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_admin_paths_are_refused_with_and_without_a_key() {
    let sim = Sim::start(&["--ttft-ms", "1", "--itl-ms", "0"]);
    let key = key_sha256(b"tenant-secret");
    let extra = format!(
        "  access:\n    keys:\n      - sha256: \"{key}\"\n        tenant: t\n\
         \x20 passthrough:\n    allow:\n      - path: /health\n        methods: [GET]\n"
    );
    let kv = Kvroute::start(&[sim.addr], &extra);
    let c = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let faults_before = http_get(sim.addr, "/debug/faults");
    for path in ADMIN_PATHS {
        for key in [None, Some("tenant-secret")] {
            let mut r = c
                .post(kv.url(path))
                .header("content-type", "application/json")
                .body(r#"{"healthy": false}"#);
            if let Some(k) = key {
                r = r.bearer_auth(k);
            }
            let r = r.send().await.unwrap();
            assert_eq!(r.status(), 404, "{path} key={key:?}");
            let v: serde_json::Value = r.json().await.unwrap();
            assert_eq!(v["error"]["code"], "not_found", "{path}: {v}");
            let msg = v["error"]["message"].as_str().unwrap_or_default();
            assert!(
                msg.contains("not served here"),
                "kvroute answered, not the engine: {v}"
            );
        }
    }
    // Nothing reached the backend: its faults are as they were, no request was logged.
    assert_eq!(http_get(sim.addr, "/debug/faults"), faults_before);
    assert!(sim.requests().is_empty(), "{:?}", sim.requests());
    // A wrong method on an inference route is 405, also before the key is looked at.
    let r = c.get(kv.url("/v1/chat/completions")).send().await.unwrap();
    assert_eq!(r.status(), 405);
    // The listed extra route is passed through, behind the key like any other.
    let r = c.get(kv.url("/health")).send().await.unwrap();
    assert_eq!(r.status(), 401);
    let r = c
        .get(kv.url("/health"))
        .bearer_auth("tenant-secret")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = c
        .get(kv.url("/v1/models"))
        .bearer_auth("tenant-secret")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    // A path that a backend would read as another one is refused (sent raw: an HTTP client
    // library would resolve the dots itself).
    for path in [
        "/v1/models/../../sleep",
        "/v1/models/%2e%2e/sleep",
        "//sleep",
    ] {
        let (status, body) = http_get(kv.addr, path);
        assert_eq!(status, 404, "{path}");
        assert_eq!(error_of(&body)["code"], "not_found", "{path}");
    }
    assert!(sim.requests().is_empty());
}
