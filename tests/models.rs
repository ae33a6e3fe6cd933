//! A fleet of several models through real processes: simulated engines serving different
//! models (`kvbench sim --model`), kvroute learning who serves what from their `/v1/models`,
//! placing each request only among its model's backends, answering `/v1/models` itself, and
//! keeping one model up while another's backends are all down.

mod common;

use common::*;
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

fn sim(model: &str) -> Sim {
    Sim::start(&["--ttft-ms", "1", "--itl-ms", "0", "--model", model])
}

async fn chat(k: &Kvroute, model: &str, text: &str) -> reqwest::Response {
    client()
        .post(k.url("/v1/chat/completions"))
        .json(&chat_body(
            model,
            serde_json::json!([{"role": "user", "content": text}]),
            false,
            2,
        ))
        .send()
        .await
        .expect("request")
}

/// The model ids kvroute's `/v1/models` lists when kvroute answers it itself (before it knows
/// any engine's models, it passes the request to one).
fn listed(k: &Kvroute) -> BTreeSet<String> {
    let (status, body) = http_get(k.addr, "/v1/models");
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let v: serde_json::Value = serde_json::from_slice(&body).expect("json");
    assert_eq!(v["object"], "list");
    let data = v["data"].as_array().expect("data");
    if !data.iter().all(|m| m["owned_by"] == "kvroute") {
        return BTreeSet::new();
    }
    data.iter()
        .map(|m| m["id"].as_str().expect("id").to_string())
        .collect()
}

fn wait_for_listed(k: &Kvroute, want: &[&str]) {
    let want: BTreeSet<String> = want.iter().map(|s| s.to_string()).collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let got = listed(k);
        if got == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "/v1/models lists {got:?}, want {want:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The models a simulated engine was sent requests for.
fn models_seen(s: &Sim) -> BTreeSet<String> {
    s.requests()
        .iter()
        .filter_map(|r| r["model"].as_str().map(str::to_string))
        .collect()
}

const FAST: &str = "  telemetry:\n    interval_ms: 100\n  health_check:\n    interval_ms: 100\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_model_is_placed_only_among_the_backends_that_serve_it() {
    let mut sims = [
        sim("model-a"),
        sim("model-a"),
        sim("model-b"),
        sim("model-b"),
    ];
    let addrs: Vec<_> = sims.iter().map(|s| s.addr).collect();
    let k = Kvroute::start(&addrs, FAST);
    wait_for_listed(&k, &["model-a", "model-b"]);

    for i in 0..24 {
        for model in ["model-a", "model-b"] {
            let r = chat(&k, model, &format!("conversation {i}")).await;
            assert_eq!(r.status(), 200, "{model} #{i}");
        }
    }
    for (i, s) in sims.iter().enumerate() {
        let want = if i < 2 { "model-a" } else { "model-b" };
        let seen = models_seen(s);
        assert_eq!(
            seen,
            BTreeSet::from([want.to_string()]),
            "sim {i} serves {want} but was sent {seen:?}"
        );
    }

    // Metrics carry the model: each model's 24 decisions under its own label.
    let m = k.metrics_when("kvroute_requests_total", &[("code", "200")], 48.0);
    for model in ["model-a", "model-b"] {
        assert_eq!(
            metric_sum(&m, "kvroute_routing_decisions_total", &[("model", model)]),
            24.0,
            "{model}"
        );
    }

    // The backend view says what each backend serves and where that came from.
    let (status, body) = http_get(k.admin, "/debug/backends");
    assert_eq!(status, 200);
    let view: serde_json::Value = serde_json::from_slice(&body).expect("json");
    let backends = view["backends"].as_array().expect("backends");
    assert_eq!(backends.len(), 4);
    for (i, b) in backends.iter().enumerate() {
        let want = if i < 2 { "model-a" } else { "model-b" };
        assert_eq!(b["models"][0]["id"], want, "{b}");
        assert_eq!(b["models_source"], "engine");
        assert_eq!(b["ejection_left_seconds"], serde_json::Value::Null);
    }
    // (These prompts are shorter than one prefix block: nothing to index.)
    assert!(backends.iter().all(|b| b["prefix_index_blocks"].is_u64()));
    assert!(view["prefix_index"]["bytes"].is_u64(), "{view}");

    // kvroute answers /v1/models itself: the union, one entry each, and a single model by id.
    let (status, body) = http_get(k.addr, "/v1/models/model-b");
    assert_eq!(status, 200);
    let v: serde_json::Value = serde_json::from_slice(&body).expect("json");
    assert_eq!(
        (v["id"].as_str(), v["object"].as_str()),
        (Some("model-b"), Some("model"))
    );
    let (status, body) = http_get(k.addr, "/v1/models/model-z");
    assert_eq!(status, 404);
    assert_eq!(error_of(&body)["code"], "model_not_found");
    assert!(sims.iter().all(|s| s
        .requests()
        .iter()
        .all(|r| r["path"].as_str() != Some("/v1/models/model-z"))));

    // A model no backend serves.
    let r = chat(&k, "model-z", "anyone?").await;
    assert_eq!(r.status(), 404);
    assert_eq!(
        error_of(&r.bytes().await.expect("body"))["code"],
        "model_not_found"
    );

    // Every backend of model-b down: model-b is 503 with Retry-After, model-a carries on.
    sims[2].kill();
    sims[3].kill();
    let deadline = Instant::now() + Duration::from_secs(10);
    let r = loop {
        let r = chat(&k, "model-b", "still there?").await;
        if r.status() == 503 || Instant::now() > deadline {
            break r;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(r.status(), 503);
    assert!(r.headers().contains_key("retry-after"));
    for i in 0..6 {
        assert_eq!(
            chat(&k, "model-a", &format!("after {i}")).await.status(),
            200
        );
    }
    wait_for_listed(&k, &["model-a"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn configured_models_pin_a_backend_and_survive_a_reload() {
    let sims = [sim("model-a"), sim("model-a")];
    // sims[0] is pinned by the config to an adapter name its engine does not list (the list
    // of backends continues from the harness's first entry, sims[1]).
    let yaml = |first: &str| {
        format!(
            "    - addr: \"{}\"\n      models: [{first}]\n{FAST}",
            sims[0].addr
        )
    };
    let k = Kvroute::start(&[sims[1].addr], &yaml("sql-lora"));
    wait_for_listed(&k, &["model-a", "sql-lora"]);
    for i in 0..8 {
        assert_eq!(chat(&k, "sql-lora", &format!("q {i}")).await.status(), 200);
        assert_eq!(chat(&k, "model-a", &format!("q {i}")).await.status(), 200);
    }
    assert_eq!(
        models_seen(&sims[0]),
        BTreeSet::from(["sql-lora".to_string()])
    );
    assert_eq!(
        models_seen(&sims[1]),
        BTreeSet::from(["model-a".to_string()])
    );

    // Moved by a reload: the first backend now serves model-a too, per the config.
    k.write_config(&[sims[1].addr], &yaml("sql-lora, model-a"));
    signal(k.pid(), "HUP");
    k.metrics_when(
        "kvroute_config_reloads_total",
        &[("result", "success")],
        1.0,
    );
    for i in 0..16 {
        assert_eq!(
            chat(&k, "model-a", &format!("after reload {i}"))
                .await
                .status(),
            200
        );
    }
    assert!(models_seen(&sims[0]).contains("model-a"));
}

/// Adapter loads so far on a simulated engine (`kvbench_lora_loads_total`).
fn adapter_loads(s: &Sim) -> f64 {
    let (status, body) = http_get(s.addr, "/metrics");
    assert_eq!(status, 200);
    metric_sum(
        &String::from_utf8_lossy(&body),
        "kvbench_lora_loads_total",
        &[],
    )
}

/// Adapter loads on two engines (3 adapters, 2 slots each) for 24 requests cycling through the
/// adapters, routed by `policy`; with `pinned`, the config lists each backend's models (without
/// saying which are adapters: the engines' lists do).
async fn loads_under(policy: &str, pinned: bool) -> f64 {
    let args = [
        "--ttft-ms",
        "1",
        "--itl-ms",
        "0",
        "--model",
        "base-8b",
        "--lora-adapters",
        "sql,chat,code",
        "--max-loras",
        "2",
        "--lora-load-ms",
        "50",
    ];
    let sims = [Sim::start(&args), Sim::start(&args)];
    let routing = format!("{FAST}  routing:\n    policy: {policy}\n");
    let k = if pinned {
        let listed: String = sims
            .iter()
            .map(|s| {
                format!(
                    "    - addr: \"{}\"\n      models: [base-8b, sql, chat, code]\n",
                    s.addr
                )
            })
            .collect();
        Kvroute::start(&[], &format!("{listed}{routing}"))
    } else {
        Kvroute::start(&[sims[0].addr, sims[1].addr], &routing)
    };
    wait_for_listed(&k, &["base-8b", "chat", "code", "sql"]);
    // ...and until both engines have said how many adapters they hold.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, body) = http_get(k.admin, "/debug/backends");
        let view: serde_json::Value = serde_json::from_slice(&body).expect("json");
        let known = view["backends"]
            .as_array()
            .expect("backends")
            .iter()
            .all(|b| b["lora_max_adapters"] == 2);
        if known {
            break;
        }
        assert!(Instant::now() < deadline, "max_lora never reported: {view}");
        std::thread::sleep(Duration::from_millis(50));
    }
    let (_, body) = http_get(k.addr, "/v1/models/sql");
    let v: serde_json::Value = serde_json::from_slice(&body).expect("json");
    assert_eq!(v["parent"], "base-8b", "{v}");
    for i in 0..24 {
        let adapter = ["sql", "chat", "code"][i % 3];
        let r = chat(&k, adapter, &format!("{policy} request {i}")).await;
        assert_eq!(r.status(), 200);
    }
    adapter_loads(&sims[0]) + adapter_loads(&sims[1])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_adapter_load_time_is_learned_from_the_loads() {
    // The engine takes 600 ms per load; the config says nothing (200 ms by default).
    let args = [
        "--ttft-ms",
        "1",
        "--itl-ms",
        "0",
        "--model",
        "base-8b",
        "--lora-adapters",
        "sql,chat",
        "--max-loras",
        "1",
        "--lora-load-ms",
        "600",
    ];
    let s = Sim::start(&args);
    let k = Kvroute::start(
        &[s.addr],
        &format!("{FAST}  routing:\n    policy: kv_aware\n"),
    );
    wait_for_listed(&k, &["base-8b", "chat", "sql"]);
    // One slot, two adapters taking turns: every request loads.
    for i in 0..6 {
        let model = ["sql", "chat"][i % 2];
        let messages = serde_json::json!([{"role": "user", "content": format!("turn {i}")}]);
        // Streamed: the first byte shows the load.
        let r = client()
            .post(k.url("/v1/chat/completions"))
            .json(&chat_body(model, messages, true, 2))
            .send()
            .await
            .expect("request");
        assert_eq!(r.status(), 200);
        r.bytes().await.expect("body");
    }
    assert_eq!(adapter_loads(&s), 6.0);
    let (_, body) = http_get(k.admin, "/debug/backends");
    let view: serde_json::Value = serde_json::from_slice(&body).expect("json");
    let learned = view["backends"][0]["lora_load_seconds_learned"]
        .as_f64()
        .unwrap_or_else(|| panic!("nothing learned: {view}"));
    assert!(
        (0.55..0.8).contains(&learned),
        "learned {learned} s: {view}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_aware_keeps_each_adapter_where_it_is_loaded() {
    // Round robin sends each engine every adapter in turn: with 3 adapters cycling through 2
    // slots, nearly every request loads one. kv_aware prices a load and keeps each adapter on
    // an engine that has it.
    let rr = loads_under("round_robin", false).await;
    let kv = loads_under("kv_aware", false).await;
    let kv_pinned = loads_under("kv_aware", true).await;
    eprintln!(
        "adapter loads for 24 requests: round_robin {rr}, kv_aware {kv}, pinned models {kv_pinned}"
    );
    assert!(rr >= 18.0, "round robin loaded only {rr} times");
    assert!(kv <= 4.0, "kv_aware loaded {kv} times");
    assert!(
        kv_pinned <= 4.0,
        "kv_aware with pinned models loaded {kv_pinned} times"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_removes_a_model_keeps_the_others_index() {
    let a = sim("model-a");
    let b = sim("model-b");
    let k = Kvroute::start(&[a.addr, b.addr], FAST);
    wait_for_listed(&k, &["model-a", "model-b"]);
    // Prompts long enough to fill prefix blocks.
    let long = "a system prompt that is long enough to fill several prefix blocks. ".repeat(40);
    for i in 0..4 {
        let r = chat(&k, "model-a", &format!("{long} question {i}")).await;
        assert_eq!(r.status(), 200);
    }
    let blocks_of = |k: &Kvroute, addr: std::net::SocketAddr| -> u64 {
        let (_, body) = http_get(k.admin, "/debug/backends");
        let view: serde_json::Value = serde_json::from_slice(&body).expect("json");
        view["backends"]
            .as_array()
            .expect("backends")
            .iter()
            .find(|x| x["backend"] == addr.to_string())
            .map_or(0, |x| x["prefix_index_blocks"].as_u64().expect("blocks"))
    };
    let before = blocks_of(&k, a.addr);
    assert!(before > 0, "nothing indexed for model-a");

    // model-b's backend leaves the fleet; model-a's keeps its index.
    k.write_config(&[a.addr], FAST);
    signal(k.pid(), "HUP");
    k.metrics_when(
        "kvroute_config_reloads_total",
        &[("result", "success")],
        1.0,
    );
    wait_for_listed(&k, &["model-a"]);
    assert_eq!(blocks_of(&k, a.addr), before);
    let r = chat(&k, "model-b", "gone?").await;
    assert_eq!(r.status(), 404);
    // The next turn still finds its prefix: the engine reports it cached.
    let r = chat(&k, "model-a", &format!("{long} question 0")).await;
    let v: serde_json::Value = r.json().await.expect("json");
    assert!(
        v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64() > Some(0),
        "{v}"
    );
}
