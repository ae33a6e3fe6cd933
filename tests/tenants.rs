//! Tenants at the edge, through real processes: on a saturated fleet the router queue lets the
//! tenant served least go first inside a priority band, sheds sheddable requests at once, and
//! answers sheds with 429 and the reason; tenant and priority headers are checked.

mod common;

use common::*;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;

async fn ask(kv: &Kvroute, path: &str, headers: &[(&str, &str)], body: Value) -> reqwest::Response {
    let mut r = client().post(kv.url(path)).json(&body);
    for (k, v) in headers {
        r = r.header(*k, *v);
    }
    r.send().await.unwrap()
}

fn chat(text: &str, max_tokens: u32) -> Value {
    json!({"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens})
}

/// Wait until the router queue holds `n` requests.
async fn queued(kv: &Kvroute, n: f64) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while kv.metric_sum("kvroute_queue_depth", &[]) < n {
        assert!(std::time::Instant::now() < deadline, "never queued {n}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// One tenant's flood waits behind another tenant's single request, though it came first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tenant_served_least_goes_first_inside_a_band() {
    let sim = Sim::start(&["--ttft-ms", "1", "--itl-ms", "20"]);
    let kv = Kvroute::start(
        &[sim.addr],
        "  limits:\n    backend_max_inflight: 1\n    queue_timeout_ms: 20000\n  tenants:\n    names: [flooder]\n",
    );
    let kv = Arc::new(kv);
    // Each request names itself in `x-session-id`, which the simulator logs: the order the
    // engine received them in is the order the queue let them go.
    let send = |name: &'static str, tenant: &'static str, tokens: u32| {
        let kv = kv.clone();
        tokio::spawn(async move {
            let r = ask(
                &kv,
                "/v1/chat/completions",
                &[("x-tenant-id", tenant), ("x-session-id", name)],
                chat(name, tokens),
            )
            .await;
            assert_eq!(r.status(), 200);
            r.bytes().await.unwrap();
        })
    };
    // The flooder holds the only place for a second, and queues three more behind it.
    let mut tasks = vec![send("flood1", "flooder", 50)];
    tokio::time::sleep(Duration::from_millis(100)).await;
    for (i, name) in ["flood2", "flood3", "flood4"].into_iter().enumerate() {
        tasks.push(send(name, "flooder", 5));
        queued(&kv, i as f64 + 1.0).await;
    }
    // The quiet tenant arrives last.
    tasks.push(send("quiet", "quiet", 5));
    queued(&kv, 4.0).await;
    let (_, body) = http_get(kv.admin, "/debug/queue");
    let view: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(view["depth"], 4, "{view}");
    assert_eq!(
        view["bands"][0]["waiting"],
        json!({"flooder": 3, "quiet": 1})
    );
    assert!(
        view["attained_service"]["flooder"].as_f64().unwrap() > 0.0,
        "{view}"
    );
    for t in tasks {
        t.await.unwrap();
    }
    let received: Vec<String> = sim
        .requests()
        .iter()
        .filter_map(|e| e["session"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(received, ["flood1", "quiet", "flood2", "flood3", "flood4"]);
    // Waits are counted by tenant: the unnamed one as `other`.
    let text = kv.metrics();
    let waited = |tenant| {
        metric_sum(
            &text,
            "kvroute_tenant_queue_wait_seconds_count",
            &[("tenant", tenant), ("outcome", "admitted")],
        )
    };
    assert_eq!((waited("flooder"), waited("other")), (3.0, 1.0));
    // What each was served: the flooder's four requests, the quiet tenant's one (as `other`).
    let attained = |tenant| {
        metric_sum(
            &text,
            "kvroute_tenant_attained_service_tokens",
            &[("tenant", tenant)],
        )
    };
    assert!(
        attained("flooder") > attained("other") && attained("other") > 0.0,
        "{text}"
    );
}

/// Below priority 0 a request is sheddable: on a saturated fleet it is answered at once, 429
/// with the reason (Anthropic's 529 on the Messages API); a named class stands for its number.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sheddable_requests_are_shed_at_once_when_the_fleet_is_full() {
    let sim = Sim::start(&["--ttft-ms", "1", "--itl-ms", "20"]);
    let kv = Kvroute::start(
        &[sim.addr],
        "  limits:\n    backend_max_inflight: 1\n    queue_timeout_ms: 20000\n    retry_after_seconds: 3\n",
    );
    let kv = Arc::new(kv);
    let k2 = kv.clone();
    let busy = tokio::spawn(async move {
        let r = ask(&k2, "/v1/chat/completions", &[], chat("hold", 50)).await;
        r.bytes().await.unwrap();
    });
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while kv.metric_sum("kvroute_backend_inflight_requests", &[]) < 1.0 {
        assert!(std::time::Instant::now() < deadline, "never dispatched");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let started = std::time::Instant::now();
    let r = ask(
        &kv,
        "/v1/chat/completions",
        &[("x-kvroute-priority", "bulk")],
        chat("later", 5),
    )
    .await;
    assert_eq!(r.status(), 429);
    assert!(
        started.elapsed() < Duration::from_millis(500),
        "waited in the queue"
    );
    assert_eq!(r.headers()["x-kvroute-dropped-reason"], "sheddable");
    assert_eq!(r.headers()["retry-after"], "3");
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "fleet_saturated");
    let r = ask(
        &kv,
        "/v1/messages",
        &[("x-kvroute-priority", "-5")],
        json!({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}),
    )
    .await;
    assert_eq!(r.status(), 529);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["type"], "overloaded_error");
    busy.await.unwrap();
    // With room, a sheddable request is served like any other.
    let r = ask(
        &kv,
        "/v1/chat/completions",
        &[("x-priority", "-1")],
        chat("now", 2),
    )
    .await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        kv.metric_sum(
            "kvroute_tenant_shed_requests_total",
            &[("tenant", "default"), ("reason", "sheddable")]
        ),
        2.0
    );
}

/// A priority that is neither a number nor a configured name, or a tenant id no metric label
/// could carry, is refused with a 400 that says what is accepted; a key's tenant stands
/// against a header unless the key allows it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_and_priority_headers_are_checked() {
    let sim = Sim::start(&["--ttft-ms", "1", "--itl-ms", "0"]);
    let extra = format!(
        "  access:\n    keys:\n      - sha256: \"{}\"\n        tenant: fixed\n      - sha256: \"{}\"\n        tenant: gateway\n        tenant_from_header: true\n",
        key_sha256(b"fixed-key"),
        key_sha256(b"gateway-key")
    );
    let kv = Kvroute::start(&[sim.addr], &extra);
    let post = |key: &'static str, headers: Vec<(&'static str, &'static str)>| {
        let mut r = client()
            .post(kv.url("/v1/chat/completions"))
            .bearer_auth(key)
            .json(&chat("hi", 1));
        for (k, v) in headers {
            r = r.header(k, v);
        }
        r.send()
    };
    let r = post("fixed-key", vec![("x-kvroute-priority", "urgent")])
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "invalid_priority");
    let message = v["error"]["message"].as_str().unwrap();
    assert!(message.contains("interactive"), "{message}");
    let r = post("gateway-key", vec![("x-tenant-id", "no spaces allowed")])
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "invalid_tenant");
    // The fixed key's header is ignored (even a malformed one); the gateway's names its tenant.
    let r = post("fixed-key", vec![("x-tenant-id", "someone else")])
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = post("gateway-key", vec![("x-smg-tenant-id", "team-a")])
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let (_, body) = http_get(kv.admin, "/debug/queue");
    let view: Value = serde_json::from_slice(&body).unwrap();
    let served = view["attained_service"].as_object().unwrap();
    assert!(
        served.contains_key("fixed") && served.contains_key("team-a"),
        "{view}"
    );
    assert!(
        !served.contains_key("someone else") && !served.contains_key("gateway"),
        "{view}"
    );
}

/// A key's daily token budget: charged up front, settled from the engine's usage, shown per
/// tenant, and once spent answered 429 with the wait until a rolling day has given enough back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spent_daily_budget_is_429_until_the_day_gives_it_back() {
    let sim = Sim::start(&["--ttft-ms", "1", "--itl-ms", "0"]);
    let extra = format!(
        "  access:\n    keys:\n      - sha256: \"{}\"\n        tenant: metered\n        tokens_per_day: 250\n",
        key_sha256(b"metered-key")
    );
    let kv = Kvroute::start(&[sim.addr], &extra);
    let post = || {
        client()
            .post(kv.url("/v1/chat/completions"))
            .bearer_auth("metered-key")
            .json(&chat("hi", 100))
            .send()
    };
    let left = || {
        kv.metric_sum(
            "kvroute_tenant_token_budget_remaining",
            &[("tenant", "metered")],
        )
    };
    assert_eq!(left(), 250.0);
    let r = post().await.unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    let used = v["usage"]["total_tokens"].as_f64().unwrap();
    assert!(used >= 100.0, "{v}");
    // What the engine reported, not the estimate, is what is gone (a day refills 250 tokens
    // in 86,400 s: well under one a second).
    assert!(
        (left() - (250.0 - used)).abs() < 2.0,
        "{} after {used}",
        left()
    );
    let mut refused = None;
    for _ in 0..3 {
        let r = post().await.unwrap();
        if r.status() == 429 {
            refused = Some(r);
            break;
        }
        assert_eq!(r.status(), 200);
    }
    let r = refused.expect("the budget was never spent");
    let retry: u64 = r.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    // Most of a 100-token request missing, at 250 tokens a day: hours, not seconds.
    assert!(retry > 3600, "{retry}");
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "rate_limit_exceeded");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("daily token budget"),
        "{v}"
    );
}

/// Where a backend's engine schedules by priority, kvroute sends the request's band as the
/// engine's `priority` field, the right way round, in place of whatever the client sent;
/// elsewhere the body goes as it came.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_band_reaches_engines_that_schedule_by_priority() {
    let sim = Sim::start(&["--ttft-ms", "1", "--itl-ms", "0"]);
    let sent = |kv: &Kvroute, priority: Option<&'static str>, body: Value| {
        let mut r = client().post(kv.url("/v1/chat/completions")).json(&body);
        if let Some(p) = priority {
            r = r.header("x-kvroute-priority", p);
        }
        r.send()
    };
    let last_priority = || sim.requests().last().expect("a request")["priority"].clone();
    let mut claims = chat("jump the engine's queue", 1);
    claims["priority"] = json!(-99);
    for (order, interactive, client_claim) in [
        ("lower_first", json!(-1), json!(0)),
        ("higher_first", json!(1), json!(0)),
        ("none", json!(null), json!(-99)),
    ] {
        let kv = Kvroute::start_with(
            &[(sim.addr, format!("      engine_priority: {order}\n"))],
            "",
        );
        let r = sent(&kv, Some("interactive"), chat("hi", 1)).await.unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(last_priority(), interactive, "{order}");
        let r = sent(&kv, None, claims.clone()).await.unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(last_priority(), client_claim, "{order}");
    }
}

/// A request with a TTFT deadline is judged by its predicted TTFT: served and told `on_track`
/// or `at_risk`, or, sheddable and predicted past it, answered 429 at once; the answered ones
/// are counted by whether their first byte met the deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deadlines_are_judged_by_the_predicted_ttft() {
    let sim = Sim::start(&["--ttft-ms", "1", "--itl-ms", "1"]);
    // Priced at 100 prompt tokens a second: a 2,000-token prompt is predicted to take 20 s.
    // Learning off: a scrape of the fixed-timing simulator's first long prefill would replace
    // the price, and the predictions would depend on when it came.
    let kv = Kvroute::start_with(
        &[(sim.addr, "      prefill_tokens_per_s: 100\n".into())],
        "  routing:\n    learn_prefill_rate: false\n",
    );
    let long = |tag: &str| format!("{tag} {}", "lorem ipsum dolor sit amet ".repeat(300));
    let slo = |ms: &'static str| ("x-slo-ttft-ms", ms);

    let r = ask(&kv, "/v1/chat/completions", &[slo("60000")], chat("hi", 2)).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-kvroute-slo"], "on_track");
    let predicted: u64 = r.headers()["x-kvroute-predicted-ttft-ms"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(predicted < 60_000, "{predicted}");

    // Not sheddable: served, first among its tenant's by slack, and told so.
    let r = ask(
        &kv,
        "/v1/chat/completions",
        &[("x-llm-d-slo-ttft-ms", "500")],
        chat(&long("served"), 2),
    )
    .await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-kvroute-slo"], "at_risk");
    let predicted: u64 = r.headers()["x-kvroute-predicted-ttft-ms"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(predicted > 5_000, "{predicted}");

    // Sheddable: answered at once, without reaching the engine.
    let before = sim.requests().len();
    let started = std::time::Instant::now();
    let r = ask(
        &kv,
        "/v1/chat/completions",
        &[slo("500"), ("x-kvroute-priority", "bulk")],
        chat(&long("shed"), 2),
    )
    .await;
    let took = started.elapsed();
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["x-kvroute-dropped-reason"], "slo_unattainable");
    assert!(r.headers().contains_key("retry-after"));
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "fleet_saturated");
    let message = v["error"]["message"].as_str().unwrap();
    assert!(message.contains("deadline (500 ms)"), "{message}");
    assert!(took < Duration::from_millis(500), "{took:?}");
    assert_eq!(sim.requests().len(), before);
    // Sheddable with a deadline it can meet: served.
    let r = ask(
        &kv,
        "/v1/chat/completions",
        &[slo("60000"), ("x-kvroute-priority", "-1")],
        chat("short", 2),
    )
    .await;
    assert_eq!(r.status(), 200);

    let r = ask(&kv, "/v1/chat/completions", &[slo("soon")], chat("x", 2)).await;
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "invalid_slo");

    let text = kv.metrics();
    let count = |name, labels: &[(&str, &str)]| metric_sum(&text, name, labels);
    assert_eq!(
        count(
            "kvroute_tenant_slo_requests_total",
            &[("tenant", "default"), ("outcome", "met")]
        ),
        3.0,
        "{text}"
    );
    assert_eq!(
        count(
            "kvroute_shed_requests_total",
            &[("reason", "slo_unattainable")]
        ),
        1.0
    );
}

/// A band's limits hold its own requests only: a full band sheds its next request while
/// another band still queues, and the band's TTL bounds its wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_band_sheds_past_its_own_limits() {
    let sim = Sim::start(&["--ttft-ms", "1", "--itl-ms", "20"]);
    let kv = Kvroute::start(
        &[sim.addr],
        "  limits:\n    backend_max_inflight: 1\n    queue_timeout_ms: 20000\n  tenants:\n    bands:\n      - priority: 0\n        max_requests: 1\n        queue_timeout_ms: 5000\n",
    );
    let kv = Arc::new(kv);
    let send = |priority: &'static str, tokens: u32| {
        let kv = kv.clone();
        tokio::spawn(async move {
            let r = ask(
                &kv,
                "/v1/chat/completions",
                &[("x-kvroute-priority", priority)],
                chat("wait", tokens),
            )
            .await;
            let status = r.status().as_u16();
            let reason = r
                .headers()
                .get("x-kvroute-dropped-reason")
                .map(|v| v.to_str().unwrap().to_owned());
            let body = r.text().await.unwrap();
            (status, reason, body)
        })
    };
    // The only place is held for a second; one request of band 0 waits.
    let hold = send("0", 50);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let waiting = send("0", 2);
    queued(&kv, 1.0).await;
    // Band 0 is full: the next is shed, while band 1 still queues.
    let (status, reason, body) = send("0", 2).await.unwrap();
    assert_eq!((status, reason.as_deref()), (429, Some("queue_full")));
    assert!(body.contains("band 0"), "{body}");
    let urgent = send("1", 2);
    queued(&kv, 2.0).await;
    for t in [hold, urgent, waiting] {
        assert_eq!(t.await.unwrap().0, 200);
    }
}
