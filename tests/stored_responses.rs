//! Stored responses (`store: true`) live on the engine that made them: kvroute stamps that
//! backend into the response id, sends every `previous_response_id` and every call on the id
//! there (never elsewhere, never to all), keeps doing so across a SIGHUP and in a replica with
//! the same key, refuses forged ids, and answers 404 once the backend is gone.

mod common;

use common::*;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

fn json_of(a: &Answer) -> Value {
    assert_eq!(a.status, 200, "{}", a.body);
    serde_json::from_str(&a.body).expect("JSON")
}

fn reload(kv: &Kvroute, count: f64) {
    signal(kv.pid(), "HUP");
    let deadline = Instant::now() + Duration::from_secs(10);
    while kv.metric_sum("kvroute_config_reloads_total", &[("result", "success")]) < count {
        assert!(Instant::now() < deadline, "no reload; log:\n{}", kv.log());
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_response_chains_reach_the_backend_that_stored_them() {
    let sims = Sim::start_n(4, &["--ttft-ms", "1", "--itl-ms", "0"]);
    let addrs: Vec<_> = sims.iter().map(|s| s.addr).collect();
    let key = std::env::temp_dir().join(format!("kvroute-resp-key-{}", std::process::id()));
    std::fs::write(
        &key,
        "3f1c9a7e5b2d4f6081a3c5e7f9b1d3e5a7c9e1f3b5d7f9a1c3e5\n",
    )
    .unwrap();
    let extra = format!(
        "  routing:\n    response_id_key_file: \"{}\"\n",
        key.display()
    );
    let kv = Kvroute::start(&addrs[..3], &extra);
    let c = client();
    let url = kv.url("/v1/responses");
    let ask = |text: &str| json!({"model":MODEL,"input":text,"store":true,"max_output_tokens":4});

    // Chains, each started where placement puts it, each continued three times with
    // unrelated text under a fresh session id: placement alone would scatter the turns. Six at
    // least, and more until two backends hold chains (the ring may give six short keys one
    // owner).
    let mut firsts: Vec<(String, String)> = Vec::new();
    let spread = |firsts: &[(String, String)]| {
        firsts
            .iter()
            .map(|f| &f.1)
            .collect::<std::collections::HashSet<_>>()
            .len()
    };
    for chain in 0..24 {
        if chain >= 6 && spread(&firsts) >= 2 {
            break;
        }
        let first = send(c.post(&url).json(&ask(&format!("chain {chain} opens")))).await;
        let v = json_of(&first);
        let mut id = v["id"].as_str().unwrap().to_string();
        assert!(id.starts_with("resp_kvr1"), "{id}");
        firsts.push((id.clone(), first.server.clone()));
        for turn in 0..3 {
            let mut body = ask(&format!("unrelated text {chain}-{turn}"));
            body["previous_response_id"] = json!(id);
            let stream = turn == 1;
            body["stream"] = json!(stream);
            let a = send(
                c.post(&url)
                    .header("x-session-id", format!("s-{chain}-{turn}"))
                    .json(&body),
            )
            .await;
            assert_eq!(a.status, 200, "chain {chain} turn {turn}: {}", a.body);
            assert_eq!(a.server, first.server, "chain {chain} turn {turn}");
            id = if stream {
                // Every event that carries the id carries the stamped one.
                let created = a
                    .body
                    .split("\n\n")
                    .find(|e| e.contains("response.created"));
                let data = created.and_then(|e| e.lines().find_map(|l| l.strip_prefix("data: ")));
                let v: Value = serde_json::from_str(data.expect("response.created")).unwrap();
                let id = v["response"]["id"].as_str().unwrap().to_string();
                assert!(a.body.contains(&format!("\"{id}\"")));
                assert_eq!(
                    a.body.matches(&format!("\"id\":\"{id}\"")).count(),
                    3,
                    "{}",
                    a.body
                );
                id
            } else {
                json_of(&a)["id"].as_str().unwrap().to_string()
            };
            assert!(id.starts_with("resp_kvr1"), "{id}");
        }
    }
    assert!(
        spread(&firsts) >= 2,
        "{} chains all started on {}; log:\n{}",
        firsts.len(),
        firsts[0].1,
        kv.log()
    );

    // The calls on an id go to its backend too.
    let (id, server) = firsts[0].clone();
    let got = send(c.get(kv.url(&format!("/v1/responses/{id}")))).await;
    assert_eq!(got.server, server);
    assert_eq!(json_of(&got)["id"], id.as_str());
    let items = send(c.get(kv.url(&format!("/v1/responses/{id}/input_items?limit=5")))).await;
    assert_eq!(json_of(&items)["object"], "list");
    assert_eq!(items.server, server);

    // Forged, altered or unknown ids name no backend: 404 in OpenAI's shape, no backend asked.
    let before: usize = sims.iter().map(|s| s.requests().len()).sum();
    let altered = format!(
        "{}{}",
        &id[..12],
        if &id[12..13] == "0" { "1" } else { "0" }
    ) + &id[13..];
    for bad in [altered.as_str(), "resp_unknown", "resp_kvr1zz_x"] {
        let a = send(c.get(kv.url(&format!("/v1/responses/{bad}")))).await;
        assert_eq!(a.status, 404, "{bad}: {}", a.body);
        assert_eq!(error_of(a.body.as_bytes())["code"], "response_not_found");
        let mut body = ask("go on");
        body["previous_response_id"] = json!(bad);
        let a = send(c.post(&url).json(&body)).await;
        if bad == "resp_unknown" {
            // An id kvroute did not stamp is the engine's to judge (placed as usual).
            assert_ne!(a.status, 200, "{}", a.body);
        } else {
            assert_eq!(a.status, 404, "{bad}: {}", a.body);
        }
    }
    let after: usize = sims.iter().map(|s| s.requests().len()).sum();
    assert_eq!(
        after - before,
        1,
        "only the unstamped continuation reached a backend"
    );

    // A SIGHUP that adds a backend changes nothing for stored chains.
    kv.write_config(&addrs, &extra);
    reload(&kv, 1.0);
    for (id, server) in &firsts {
        let a = send(c.get(kv.url(&format!("/v1/responses/{id}")))).await;
        assert_eq!((a.status, &a.server), (200, server), "{}", a.body);
    }

    // A replica with the same key routes the ids it did not issue; one with another key does
    // not.
    let replica = Kvroute::start(&addrs, &extra);
    let a = send(c.get(replica.url(&format!("/v1/responses/{id}")))).await;
    assert_eq!(
        (a.status, a.server.as_str()),
        (200, server.as_str()),
        "{}",
        a.body
    );
    let stranger = Kvroute::start(&addrs, "");
    let a = send(c.get(stranger.url(&format!("/v1/responses/{id}")))).await;
    assert_eq!(a.status, 404, "{}", a.body);

    // Deleted on its backend: the engine's own 404 comes back.
    let del = send(c.delete(kv.url(&format!("/v1/responses/{id}")))).await;
    assert_eq!(json_of(&del)["deleted"], true);
    let gone = send(c.get(kv.url(&format!("/v1/responses/{id}")))).await;
    assert_eq!((gone.status, gone.server.as_str()), (404, server.as_str()));

    // The backend removed from the fleet: its ids get a clear 404, not another backend.
    let (id1, server1) = firsts
        .iter()
        .find(|f| f.1 != server)
        .cloned()
        .expect("a chain on another backend");
    let kept: Vec<_> = addrs
        .iter()
        .copied()
        .filter(|a| a.to_string() != server1)
        .collect();
    kv.write_config(&kept, &extra);
    reload(&kv, 2.0);
    let mut body = ask("still there?");
    body["previous_response_id"] = json!(id1);
    let a = send(c.post(&url).json(&body)).await;
    assert_eq!(a.status, 404, "{}", a.body);
    let e = error_of(a.body.as_bytes());
    assert_eq!(e["code"], "response_not_found");
    assert!(
        e["message"]
            .as_str()
            .unwrap()
            .contains("no longer in the fleet"),
        "{e}"
    );
    let _ = std::fs::remove_file(&key);
}

/// A continuation sends only its new input while the engine counts the whole stored thread:
/// its count must not teach the token model (nor be scored against its estimate), or every
/// later estimate drifts with the chain's length.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn continuations_do_not_teach_the_token_model() {
    let sims = Sim::start_n(1, &["--ttft-ms", "1", "--itl-ms", "0"]);
    let kv = Kvroute::start(&[sims[0].addr], "");
    let c = client();
    let url = kv.url("/v1/responses");
    let long = "the engine reads every word of this text ".repeat(40);
    let ask = |text: &str| json!({"model":MODEL,"input":text,"store":true,"max_output_tokens":4});
    let mut id = json_of(&send(c.post(&url).json(&ask(&long))).await)["id"]
        .as_str()
        .unwrap()
        .to_string();
    for turn in 0..8 {
        let mut body = ask(&format!("and {turn}?"));
        body["previous_response_id"] = json!(id);
        let v = json_of(&send(c.post(&url).json(&body)).await);
        // The engine counted the whole thread, far more than the new input.
        assert!(v["usage"]["input_tokens"].as_u64().unwrap() > 300, "{v}");
        id = v["id"].as_str().unwrap().to_string();
    }
    let fresh = json_of(&send(c.post(&url).json(&ask(&format!("fresh: {long}")))).await);
    // A request is scored as it is logged, after its answer went out: wait for the fresh one,
    // then a little more for any late one.
    let count = "kvroute_prompt_tokens_estimate_ratio_count";
    kv.metrics_when(count, &[("method", "sized")], 2.0);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let text = kv.metrics();
    // Scored: the opening and the fresh request, not the eight continuations.
    assert_eq!(
        metric_sum(&text, count, &[("method", "sized")]),
        2.0,
        "{text}"
    );
    // And the fresh request's estimate was not dragged up by the chain's counts.
    let sum = metric_sum(
        &text,
        "kvroute_prompt_tokens_estimate_ratio_sum",
        &[("method", "sized")],
    );
    assert!(
        (0.8..1.25).contains(&(sum / 2.0)),
        "mean ratio {}",
        sum / 2.0
    );
    assert!(fresh["usage"]["input_tokens"].as_u64().unwrap() > 300);
}
