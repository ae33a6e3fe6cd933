//! Access control through real processes: API keys (configured as SHA-256 digests only), the
//! models each key may use, unknown models, and per-key rate limits with `Retry-After`. The
//! admin listener needs no key.

mod common;

use common::*;
use serde_json::json;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_models_and_quotas() {
    let sims = Sim::start_n(1, &["--ttft-ms", "1", "--itl-ms", "0"]);
    let alpha = key_sha256(b"alpha-secret");
    let beta = key_sha256(b"beta-secret");
    let extra = format!(
        "  models: [\"{MODEL}\", \"other-model\"]\n  access:\n    keys:\n\
         \x20     - sha256: \"{alpha}\"\n        tenant: alpha\n        models: [\"{MODEL}\"]\n        requests_per_minute: 3\n\
         \x20     - sha256: \"{beta}\"\n        tenant: beta\n        models: [\"other-model\"]\n"
    );
    let kv = Kvroute::start(&[sims[0].addr], &extra);
    assert!(
        !std::fs::read_to_string(kv.conf())
            .unwrap()
            .contains("alpha-secret"),
        "the key itself is never in the config"
    );
    let c = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let url = kv.url("/v1/chat/completions");
    let body = |model: &str| chat_body(model, json!([{"role": "user", "content": "hi"}]), false, 2);
    let send = |key: Option<&str>, model: &str| {
        let mut r = c.post(&url).json(&body(model));
        if let Some(k) = key {
            r = r.bearer_auth(k);
        }
        r.send()
    };
    async fn code(r: reqwest::Response) -> (u16, String, Option<String>) {
        let status = r.status().as_u16();
        let retry = r
            .headers()
            .get("retry-after")
            .map(|v| v.to_str().unwrap().to_string());
        let b = r.bytes().await.unwrap();
        let code = if status == 200 {
            String::new()
        } else {
            error_of(&b)["code"].as_str().unwrap().to_string()
        };
        (status, code, retry)
    }

    assert_eq!(
        code(send(None, MODEL).await.unwrap()).await.1,
        "missing_api_key"
    );
    let (s, c1, _) = code(send(Some("guess"), MODEL).await.unwrap()).await;
    assert_eq!((s, c1.as_str()), (401, "invalid_api_key"));
    // Pass-through paths need a key too.
    let r = c.get(kv.url("/v1/models")).send().await.unwrap();
    assert_eq!(r.status(), 401);
    // A key may use only its models; an unknown model is 404 for everyone.
    let (s, c1, _) = code(send(Some("beta-secret"), MODEL).await.unwrap()).await;
    assert_eq!((s, c1.as_str()), (403, "model_not_allowed"));
    let (s, c1, _) = code(send(Some("alpha-secret"), "nope").await.unwrap()).await;
    assert_eq!((s, c1.as_str()), (404, "model_not_found"));
    // Alpha may send 3 requests a minute (the 404 above was not charged).
    for _ in 0..3 {
        assert_eq!(
            code(send(Some("alpha-secret"), MODEL).await.unwrap())
                .await
                .0,
            200
        );
    }
    let (s, c1, retry) = code(send(Some("alpha-secret"), MODEL).await.unwrap()).await;
    assert_eq!((s, c1.as_str()), (429, "rate_limit_exceeded"));
    let secs: u32 = retry.expect("Retry-After on 429").parse().unwrap();
    assert!((1..=20).contains(&secs), "Retry-After {secs}");
    assert_eq!(
        kv.metric_sum(
            "kvroute_rate_limited_requests_total",
            &[("tenant", "alpha")]
        ),
        1.0
    );
    // The admin listener needs no key.
    assert_eq!(http_get(kv.admin, "/readyz").0, 200);
}
