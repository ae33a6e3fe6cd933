//! SIGHUP hot reload under continuous load: a backend added, one removed, the policy changed,
//! and a broken file, each by SIGHUP, while clients keep sending. Nothing may fail, added
//! backends get traffic, removed ones none, and conversations on unchanged backends keep their
//! prefix affinity (the prefix index survives the reload).

mod common;

use common::*;
use serde_json::json;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// Turn `turn` of conversation `conv`: a long private opening (~2k tokens, well past kv_aware's
/// minimum worthwhile prefix) and the turns so far.
fn conversation(conv: usize, turn: usize) -> serde_json::Value {
    let system =
        format!("Conversation {conv} briefing. ") + &"Keep the facts straight. ".repeat(330);
    let mut messages = vec![json!({"role": "system", "content": system})];
    for t in 0..=turn {
        messages.push(json!({"role": "user", "content": format!("turn {t} of {conv}")}));
        if t < turn {
            messages.push(json!({"role": "assistant", "content": format!("answer {t}")}));
        }
    }
    chat_body(MODEL, json!(messages), turn % 2 == 1, 8)
}

/// Status and the simulated server that answered.
async fn send(
    c: &reqwest::Client,
    url: &str,
    body: &serde_json::Value,
) -> Result<(u16, String), String> {
    let resp = c
        .post(url)
        .json(body)
        .send()
        .await
        .map_err(|e| e.to_string())?;
    let status = resp.status().as_u16();
    let server = resp
        .headers()
        .get("x-kvbench-addr")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    let body = resp.bytes().await.map_err(|e| e.to_string())?;
    if body.is_empty() {
        return Err(format!("{status} with an empty body"));
    }
    Ok((status, server))
}

/// SIGHUP, then wait until `kvroute_config_reloads_total{result}` reaches `count`.
fn reload(kv: &Kvroute, result: &str, count: f64) {
    signal(kv.pid(), "HUP");
    let deadline = Instant::now() + Duration::from_secs(10);
    while kv.metric_sum("kvroute_config_reloads_total", &[("result", result)]) < count {
        assert!(
            Instant::now() < deadline,
            "reload not counted; log:\n{}",
            kv.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

const EXTRA: &str = "  health_check:\n    interval_ms: 200\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_under_load_drops_nothing_and_keeps_affinity() {
    let sims = Sim::start_n(4, &["--ttft-ms", "1", "--itl-ms", "1"]);
    let addr: Vec<SocketAddr> = sims.iter().map(|s| s.addr).collect();
    let (a, b, c_, d) = (addr[0], addr[1], addr[2], addr[3]);
    let kv = Kvroute::start(&[a, b, c_], EXTRA);
    let url = kv.url("/v1/chat/completions");
    let c = client();

    // Conversations find their owners; the index now holds their openings.
    let mut owner = HashMap::new();
    for conv in 0..12 {
        let (status, server) = send(&c, &url, &conversation(conv, 0)).await.unwrap();
        assert_eq!(status, 200);
        owner.insert(conv, server);
    }
    let load = Load::start(&url, &[false, false], 4);

    // 1. Add D.
    kv.write_config(&[a, b, c_, d], EXTRA);
    reload(&kv, "success", 1.0);
    for conv in 0..12 {
        let (status, server) = send(&c, &url, &conversation(conv, 1)).await.unwrap();
        assert_eq!(status, 200);
        assert_eq!(
            server, owner[&conv],
            "conversation {conv} lost its backend on reload"
        );
    }
    // New conversations may go to D once it is in the fleet the health checks have seen: under
    // load that can be a moment after the reload.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !String::from_utf8_lossy(&http_get(kv.admin, "/readyz").1).contains("4/4") {
        assert!(
            Instant::now() < deadline,
            "D never became ready; log:\n{}",
            kv.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut on_d = 0;
    for conv in 100..124 {
        let (status, server) = send(&c, &url, &conversation(conv, 0)).await.unwrap();
        assert_eq!(status, 200);
        on_d += usize::from(server == d.to_string());
    }
    assert!(
        on_d > 0,
        "the added backend got none of 24 new conversations"
    );

    // 2. Remove B: its conversations move, the others stay, B sees nothing more.
    kv.write_config(&[a, c_, d], EXTRA);
    reload(&kv, "success", 2.0);
    // Requests placed on B before the reload may still be finishing: wait until its count
    // holds still.
    let mut b_seen = sims[1].requests().len();
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let now = sims[1].requests().len();
        if now == b_seen {
            break;
        }
        b_seen = now;
    }
    // The load generator keeps sending, and B's conversations have just moved onto the others:
    // the load bound may spill one turn off its owner, as it would without a reload. A reload
    // that lost the ring or the index would move most of them.
    let mut moved = Vec::new();
    for conv in 0..12 {
        let (status, server) = send(&c, &url, &conversation(conv, 2)).await.unwrap();
        assert_eq!(status, 200);
        if owner[&conv] == b.to_string() {
            assert_ne!(server, b.to_string());
        } else if server != owner[&conv] {
            moved.push((conv, owner[&conv].clone(), server));
        }
    }
    assert!(
        moved.len() <= 1,
        "conversations moved off unchanged backends (conversation, owner, now): {moved:?}"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        sims[1].requests().len(),
        b_seen,
        "a removed backend still got requests"
    );
    let text = kv.metrics();
    assert!(
        !text.contains(&format!("kvroute_backend_healthy{{backend=\"{b}\"}}")),
        "removed backend still has gauges"
    );

    // 3. Change the policy (and a health-check setting, which needs an upgrade).
    kv.write_config(
        &[a, c_, d],
        "  routing:\n    policy: round_robin\n  health_check:\n    interval_ms: 300\n",
    );
    reload(&kv, "success", 3.0);
    assert_eq!(kv.metric_sum("kvroute_config_pending_upgrade", &[]), 1.0);
    let rr_before = kv.metric_sum(
        "kvroute_routing_decisions_total",
        &[("policy", "round_robin")],
    );
    for conv in 0..6 {
        assert_eq!(send(&c, &url, &conversation(conv, 3)).await.unwrap().0, 200);
    }
    let rr_after = kv.metric_sum(
        "kvroute_routing_decisions_total",
        &[("policy", "round_robin")],
    );
    assert!(rr_after >= rr_before + 6.0, "policy change not applied");

    // 4. A broken file is rejected and the process keeps running the previous config.
    std::fs::write(
        kv.conf(),
        std::fs::read_to_string(kv.conf())
            .unwrap()
            .replace("policy: round_robin", "policy: fastest"),
    )
    .unwrap();
    reload(&kv, "failure", 1.0);
    assert!(
        kv.log().contains("kvroute.routing.policy"),
        "the rejected key is not logged:\n{}",
        kv.log()
    );
    for conv in 0..6 {
        assert_eq!(send(&c, &url, &conversation(conv, 4)).await.unwrap().0, 200);
    }
    let rr_last = kv.metric_sum(
        "kvroute_routing_decisions_total",
        &[("policy", "round_robin")],
    );
    assert!(
        rr_last >= rr_after + 6.0,
        "the old config stopped being used"
    );
    assert_eq!(
        kv.metric_sum("kvroute_config_reloads_total", &[("result", "success")]),
        3.0
    );

    let per_server = load.per_server();
    let (sent, failures) = load.stop().await;
    eprintln!(
        "reload under load: {sent} requests sent, {} failed; per backend {per_server:?}",
        failures.len()
    );
    assert!(
        failures.is_empty(),
        "{} of {sent} failed: {:?}",
        failures.len(),
        &failures[..failures.len().min(5)]
    );
    assert!(sent >= 50, "the load barely ran: {sent}");
    assert!(
        per_server.get(&d.to_string()).copied().unwrap_or(0) > 0,
        "D never got load traffic"
    );
    assert!(kv.metric_sum("kvroute_config_last_reload_success_timestamp_seconds", &[]) > 1.7e9);
}
