//! kv_aware through real processes: a conversation whose first turn spilled off its ring owner
//! is found again, by its cached prefix, on the backend that served it.

mod common;

use common::*;
use serde_json::json;
use std::time::Duration;

async fn post(
    c: &reqwest::Client,
    url: &str,
    body: &serde_json::Value,
) -> (u16, String, serde_json::Value) {
    let resp = c
        .post(url)
        .header("x-session-id", "conv")
        .json(body)
        .send()
        .await
        .expect("request");
    let status = resp.status().as_u16();
    let server = resp.headers()["x-kvbench-addr"]
        .to_str()
        .unwrap()
        .to_string();
    let v = resp.json().await.unwrap_or(serde_json::Value::Null);
    (status, server, v)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cached_prefix_is_found_after_the_owner_spilled() {
    let sims = Sim::start_n(3, &["--ttft-ms", "1500", "--itl-ms", "0"]);
    let addrs: Vec<_> = sims.iter().map(|s| s.addr).collect();
    let kv = Kvroute::start(&addrs, "  routing:\n    policy: kv_aware\n");
    let c = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    let url = kv.url("/v1/chat/completions");
    let hot = |i: usize| {
        chat_body(
            MODEL,
            json!([{"role": "user", "content": format!("hot request {i}")}]),
            false,
            2,
        )
    };

    // An idle fleet sends the session's first request to its ring owner.
    let (status, owner, _) = post(&c, &url, &hot(0)).await;
    assert_eq!(status, 200);

    // Load the owner and send new conversations of the same session meanwhile: once the owner
    // is at its bound, a conversation's first turn spills to another ring position.
    let history = "Here is a long document to discuss. ".repeat(600);
    let mut hot_tasks = Vec::new();
    let mut probes = Vec::new();
    for probe in 0..8 {
        for i in 0..2 {
            let (c, url, b) = (c.clone(), url.clone(), hot(10 * probe + i + 1));
            hot_tasks.push(tokio::spawn(async move { post(&c, &url, &b).await }));
        }
        tokio::time::sleep(Duration::from_millis(40)).await;
        let turn1 =
            json!([{"role": "user", "content": format!("Conversation {probe}. {history}")}]);
        let (c2, url2, b) = (
            c.clone(),
            url.clone(),
            chat_body(MODEL, turn1.clone(), false, 8),
        );
        probes.push((
            turn1,
            tokio::spawn(async move { post(&c2, &url2, &b).await }),
        ));
    }
    for t in hot_tasks {
        assert_eq!(t.await.unwrap().0, 200);
    }
    let mut spilled = None;
    for (turn1, task) in probes {
        let (status, served, reply) = task.await.unwrap();
        assert_eq!(status, 200);
        if served != owner && spilled.is_none() {
            spilled = Some((turn1, served, reply));
        }
    }
    let (turn1, served, reply) =
        spilled.unwrap_or_else(|| panic!("no conversation spilled; log:\n{}", kv.log()));

    // Turn 2, with the owner idle again: kv_aware goes back to where turn 1's prefix lives.
    let mut messages = turn1.as_array().unwrap().clone();
    messages
        .push(json!({"role": "assistant", "content": reply["choices"][0]["message"]["content"]}));
    messages.push(json!({"role": "user", "content": "and a follow-up question"}));
    let (status, served2, reply2) =
        post(&c, &url, &chat_body(MODEL, json!(messages), false, 2)).await;
    assert_eq!(status, 200);
    assert_eq!(
        served2, served,
        "turn 2 went to {served2}, its prefix is on {served}"
    );
    let cached = reply2["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    let prompt = reply2["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(cached * 10 >= prompt * 9, "cached {cached} of {prompt}");
    let text = kv.metrics_when(
        "kvroute_routing_decisions_total",
        &[("reason", "cached_prefix")],
        1.0,
    );
    assert!(
        metric_sum(
            &text,
            "kvroute_routing_decisions_total",
            &[("reason", "cached_prefix")]
        ) >= 1.0
    );
    assert!(metric_sum(&text, "kvroute_predicted_cached_prompt_tokens_total", &[]) > 0.0);
    assert!(metric_sum(&text, "kvroute_index_blocks", &[]) > 0.0);
}

/// Engine metrics are scraped into kvroute_backend_* gauges, and dropped once stale.
#[test]
fn engine_telemetry_is_scraped_and_expires() {
    // Not the default KV size, so the gauge can only show it by scraping.
    let mut sims = Sim::start_n(
        2,
        &["--ttft-ms", "1", "--itl-ms", "0", "--kv-tokens", "160000"],
    );
    let addrs: Vec<_> = sims.iter().map(|s| s.addr).collect();
    let kv = Kvroute::start(
        &addrs,
        "  telemetry:\n    interval_ms: 100\n    stale_after_ms: 400\n  health_check:\n    interval_ms: 100\n",
    );
    let victim = addrs[1].to_string();
    let mut text = kv.metrics();
    for _ in 0..100 {
        if addrs.iter().all(|a| {
            metric_sum(
                &text,
                "kvroute_backend_kv_capacity_tokens",
                &[("backend", &a.to_string())],
            ) == 160_000.0
        }) {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
        text = kv.metrics();
    }
    for a in &addrs {
        let b = a.to_string();
        // The simulator's vllm:cache_config_info: 10,000 blocks of 16 tokens.
        assert_eq!(
            metric_sum(
                &text,
                "kvroute_backend_kv_capacity_tokens",
                &[("backend", &b)]
            ),
            160_000.0
        );
        assert!(text.contains(&format!(
            "kvroute_backend_engine_running_requests{{backend=\"{b}\"}}"
        )));
        assert!(text.contains(&format!(
            "kvroute_backend_kv_cache_usage_ratio{{backend=\"{b}\"}}"
        )));
    }
    sims[1].kill();
    std::thread::sleep(std::time::Duration::from_millis(900));
    let text = kv.metrics();
    assert!(
        !text.contains(&format!(
            "kvroute_backend_kv_cache_usage_ratio{{backend=\"{victim}\"}}"
        )),
        "{text}"
    );
    assert!(
        metric_sum(
            &text,
            "kvroute_backend_telemetry_age_seconds",
            &[("backend", &victim)]
        ) >= 0.4
    );
    let alive = addrs[0].to_string();
    assert!(text.contains(&format!(
        "kvroute_backend_kv_cache_usage_ratio{{backend=\"{alive}\"}}"
    )));
}

async fn burst(kv: &Kvroute, n: usize) -> Vec<(u16, Option<String>, serde_json::Value, Duration)> {
    let c = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    let mut tasks = Vec::new();
    for i in 0..n {
        let (c, url) = (c.clone(), kv.url("/v1/chat/completions"));
        tasks.push(tokio::spawn(async move {
            let start = std::time::Instant::now();
            let body = chat_body(
                MODEL,
                json!([{"role": "user", "content": format!("burst {i}")}]),
                false,
                2,
            );
            let resp = c.post(&url).json(&body).send().await.unwrap();
            let status = resp.status().as_u16();
            let retry = resp
                .headers()
                .get("retry-after")
                .map(|v| v.to_str().unwrap().to_string());
            let v = resp.json().await.unwrap_or(serde_json::Value::Null);
            (status, retry, v, start.elapsed())
        }));
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

/// Every backend at its hard cap: requests wait in the bounded router queue and run when a slot
/// frees; beyond the queue (or its deadline) they get 429 with Retry-After and the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overload_queues_then_sheds_with_retry_after() {
    let sims = Sim::start_n(2, &["--ttft-ms", "800", "--itl-ms", "0"]);
    let addrs: Vec<_> = sims.iter().map(|s| s.addr).collect();
    let kv = Kvroute::start(
        &addrs,
        "  routing:\n    policy: kv_aware\n  limits:\n    backend_max_inflight: 2\n    queue_size: 2\n    queue_timeout_ms: 5000\n    retry_after_seconds: 2\n",
    );
    let results = burst(&kv, 8).await;
    let ok: Vec<_> = results.iter().filter(|r| r.0 == 200).collect();
    let shed: Vec<_> = results.iter().filter(|r| r.0 == 429).collect();
    assert_eq!(ok.len() + shed.len(), 8, "{results:?}");
    assert!(
        ok.len() >= 6,
        "4 running + 2 queued should succeed: {results:?}"
    );
    assert!(!shed.is_empty());
    for (_, retry, v, took) in &shed {
        assert_eq!(retry.as_deref(), Some("2"));
        assert_eq!(v["error"]["code"], "fleet_saturated");
        assert!(
            *took < Duration::from_millis(500),
            "a full queue sheds at once: {took:?}"
        );
    }
    // The requests admitted at once keep their latency (the engine's 800 ms) while others are
    // shed; queued requests ran after the first wave, not failed or stalled.
    let mut took: Vec<_> = ok.iter().map(|r| r.3).collect();
    took.sort();
    assert!(
        took[3] < Duration::from_millis(1300),
        "admitted requests slowed by the overload: {took:?}"
    );
    let slowest = ok.iter().map(|r| r.3).max().unwrap();
    assert!(slowest < Duration::from_millis(3000), "{slowest:?}");
    let text = kv.metrics_when("kvroute_requests_total", &[], 8.0);
    assert_eq!(
        metric_sum(
            &text,
            "kvroute_shed_requests_total",
            &[("reason", "queue_full")]
        ),
        shed.len() as f64
    );
    assert!(
        metric_sum(
            &text,
            "kvroute_queue_wait_seconds_count",
            &[("outcome", "admitted")]
        ) >= 2.0
    );
    assert_eq!(metric_sum(&text, "kvroute_queue_depth", &[]), 0.0);
    drop(kv);

    // A queue that waits too long sheds by deadline.
    let kv = Kvroute::start(
        &addrs,
        "  limits:\n    backend_max_inflight: 1\n    queue_size: 100\n    queue_timeout_ms: 300\n",
    );
    let results = burst(&kv, 4).await;
    let shed = results.iter().filter(|r| r.0 == 429).count();
    assert_eq!(results.iter().filter(|r| r.0 == 200).count() + shed, 4);
    assert!(shed >= 1, "{results:?}");
    let text = kv.metrics_when("kvroute_requests_total", &[], 4.0);
    assert_eq!(
        metric_sum(
            &text,
            "kvroute_shed_requests_total",
            &[("reason", "queue_timeout")]
        ),
        shed as f64
    );
}

/// kvroute learns each backend's prefill rate from its engine's counters (in the engine's model
/// time, whatever the time scale): with no rate configured, the L40S-like backend is found near
/// its true 9,000 tok/s and the H100-like one near 25,000. Their decode gaps give each one's
/// engine step time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_rates_are_learned_from_engine_counters() {
    let l40s = Sim::start(&["--profile", "l40s-llama8b", "--time-scale", "20"]);
    let h100 = Sim::start(&["--profile", "h100-llama8b", "--time-scale", "20"]);
    let kv = Kvroute::start(
        &[l40s.addr, h100.addr],
        "  routing:\n    policy: round_robin\n  telemetry:\n    interval_ms: 100\n",
    );
    let c = client();
    let url = kv.url("/v1/chat/completions");
    for i in 0..24 {
        // About 4,000 tokens each, distinct from the first block on: all computed, none cached.
        let text = format!("document {i}: ") + &"lorem ipsum dolor sit amet ".repeat(600);
        let body = chat_body(MODEL, json!([{"role": "user", "content": text}]), false, 8);
        let r = c.post(&url).json(&body).send().await.unwrap();
        assert_eq!(r.status(), 200);
    }
    let learned = |name: &str| -> Option<(f64, f64)> {
        let (status, body) = http_get(kv.admin, "/backends");
        assert_eq!(status, 200);
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        let b = v.as_array()?.iter().find(|b| b["backend"] == name)?;
        let rate = &b["prefill_tokens_per_second"];
        Some((rate["learned"].as_f64()?, rate["in_use"].as_f64()?))
    };
    // The decode step comes from the engine's counters at a later scrape than the rate can.
    let step_known = |name: &str| {
        let (_, body) = http_get(kv.admin, "/backends");
        serde_json::from_slice::<serde_json::Value>(&body)
            .ok()
            .and_then(|v| {
                v.as_array()?
                    .iter()
                    .find(|b| b["backend"] == name)
                    .map(|b| b["decode_step_seconds"].is_f64())
            })
            .unwrap_or(false)
    };
    let (l40s_name, h100_name) = (l40s.addr.to_string(), h100.addr.to_string());
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while (learned(&l40s_name).is_none()
        || learned(&h100_name).is_none()
        || !step_known(&l40s_name)
        || !step_known(&h100_name))
        && std::time::Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for (name, truth) in [(&l40s_name, 9_000.0), (&h100_name, 25_000.0)] {
        let (rate, in_use) = learned(name).unwrap_or_else(|| {
            panic!(
                "no learned rate for {name}: {}",
                String::from_utf8_lossy(&http_get(kv.admin, "/backends").1)
            )
        });
        assert!(
            (rate / truth - 1.0).abs() <= 0.25,
            "{name}: learned {rate}, true {truth}"
        );
        assert_eq!(rate, in_use, "the learned rate is the one in use");
        let gauge = kv.metric_sum(
            "kvroute_backend_prefill_tokens_per_second",
            &[("backend", name)],
        );
        assert!((gauge / truth - 1.0).abs() <= 0.25, "{name}: gauge {gauge}");
        // One stream at a time: a step is the engine's fixed cost plus one stream's reads,
        // a few model milliseconds.
        let (_, body) = http_get(kv.admin, "/backends");
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        let b = v
            .as_array()
            .and_then(|a| a.iter().find(|b| b["backend"] == name.as_str()));
        let step = b.and_then(|b| b["decode_step_seconds"].as_f64());
        assert!(
            step.is_some_and(|s| (0.001..0.05).contains(&s)),
            "{name}: decode step {step:?}"
        );
        let gauge = kv.metric_sum("kvroute_backend_decode_step_seconds", &[("backend", name)]);
        assert_eq!(Some(gauge), step, "{name}");
    }
}

/// An engine that only ever prefills short prompts spends most of each prefill on its step's
/// fixed cost: tokens over seconds reads it far slower than it runs. vLLM also counts its
/// prefills, and from that kvroute learns the marginal rate (what a prompt token adds), which
/// is what a miss and a stall on the streams there cost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_prompts_teach_the_marginal_prefill_rate_not_the_step() {
    let h100 = Sim::start(&["--profile", "h100-llama8b", "--time-scale", "20"]);
    let kv = Kvroute::start(
        &[h100.addr],
        "  routing:\n    policy: round_robin\n  telemetry:\n    interval_ms: 100\n",
    );
    let c = client();
    let url = kv.url("/v1/chat/completions");
    let mut n = 0;
    // Phases of ~40-token and ~300-token prompts, each spanning scrapes, all distinct.
    for _ in 0..4 {
        for words in [6, 45] {
            for _ in 0..8 {
                n += 1;
                let text = format!("note {n}: ") + &"lorem ipsum dolor sit amet ".repeat(words);
                let body = chat_body(MODEL, json!([{"role": "user", "content": text}]), false, 1);
                let r = c.post(&url).json(&body).send().await.unwrap();
                assert_eq!(r.status(), 200);
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
    let name = h100.addr.to_string();
    let (_, body) = http_get(kv.admin, "/backends");
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let rate = v
        .as_array()
        .and_then(|a| a.iter().find(|b| b["backend"] == name.as_str()))
        .map(|b| b["prefill_tokens_per_second"].clone())
        .unwrap_or_default();
    let (learned, floor) = (rate["learned"].as_f64(), rate["learned_floor"].as_f64());
    let (Some(learned), Some(floor)) = (learned, floor) else {
        panic!("nothing learned: {rate}");
    };
    assert!(
        floor < 0.8 * 25_000.0,
        "the test must be one the ratio gets wrong: {rate}"
    );
    assert!((learned / 25_000.0 - 1.0).abs() < 0.1, "{rate}");
}

/// Small prompts, with counting on, are counted with o200k_base and the count is settled against the engine's
/// `usage.prompt_tokens`; the estimate moves toward what this engine reports.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_tokens_are_counted_and_corrected_by_the_engine() {
    let sim = Sim::start(&["--ttft-ms", "1", "--itl-ms", "0"]);
    let kv = Kvroute::start(
        &[sim.addr],
        "  routing:\n    count_tokens_max_bytes: 8192\n",
    );
    let c = client();
    let url = kv.url("/v1/chat/completions");
    // The tables load in the background: wait until a request is counted.
    let send = |i: usize| {
        let (c, url) = (c.clone(), url.clone());
        async move {
            // Digits: o200k splits them in threes, the simulator's stand-in counts ~4 bytes a
            // token, so the two disagree by about a third and the correction has work to do.
            let text = format!("question {i}: ") + &"1234567890 ".repeat(60);
            let body = chat_body(MODEL, json!([{"role": "user", "content": text}]), false, 1);
            let r = c.post(&url).json(&body).send().await.unwrap();
            assert_eq!(r.status(), 200);
        }
    };
    let counted = || {
        kv.metric_sum(
            "kvroute_prompt_tokens_estimate_ratio_count",
            &[("method", "counted")],
        )
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let mut i = 0;
    while counted() < 1.0 && std::time::Instant::now() < deadline {
        send(i).await;
        i += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(counted() >= 1.0, "no prompt was counted");
    // The first ratios are off by the tokenizers' disagreement, later ones (after the
    // correction has moved) by less.
    let ratio = |text: &str| {
        metric_sum(
            text,
            "kvroute_prompt_tokens_estimate_ratio_sum",
            &[("method", "counted")],
        ) / metric_sum(
            text,
            "kvroute_prompt_tokens_estimate_ratio_count",
            &[("method", "counted")],
        )
    };
    for j in 0..20 {
        send(i + j).await;
    }
    let early = ratio(&kv.metrics());
    for j in 20..120 {
        send(i + j).await;
    }
    let text = kv.metrics();
    let (sum_all, n_all) = (
        metric_sum(
            &text,
            "kvroute_prompt_tokens_estimate_ratio_sum",
            &[("method", "counted")],
        ),
        metric_sum(
            &text,
            "kvroute_prompt_tokens_estimate_ratio_count",
            &[("method", "counted")],
        ),
    );
    let (sum_early, n_early) = (early * (n_all - 100.0), n_all - 100.0);
    let late = (sum_all - sum_early) / (n_all - n_early);
    assert!(
        (late - 1.0).abs() < (early - 1.0).abs(),
        "the correction did not move: early mean ratio {early}, late {late}"
    );
    assert!((late - 1.0).abs() < 0.15, "late mean ratio {late}");
}
