//! The shipped dashboard and alert rules only use metrics kvroute exports: every `kvroute_*`
//! name in their PromQL is in a running kvroute's `/metrics` (with TLS on, telemetry scraped,
//! one backend's KV events followed and one request served), and every family that `/metrics`
//! serves has its row in `docs/guide/metrics.md`. `promtool check rules` runs in `.ci/run`.

mod common;

use common::certs::Ca;
use common::*;
use std::collections::BTreeSet;
use std::path::Path;
use std::time::{Duration, Instant};

/// Every `kvroute_*` metric name in `expr`.
fn names(expr: &str, out: &mut BTreeSet<String>) {
    let mut rest = expr;
    while let Some(at) = rest.find("kvroute_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        out.insert(tail[..end].to_string());
        rest = &tail[end..];
    }
}

fn dashboard_exprs(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, x) in m {
                match (k.as_str(), x) {
                    ("expr" | "query", serde_json::Value::String(e)) => out.push(e.clone()),
                    _ => dashboard_exprs(x, out),
                }
            }
        }
        serde_json::Value::Array(a) => a.iter().for_each(|x| dashboard_exprs(x, out)),
        _ => {}
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_the_dashboard_and_rules_use_is_exported() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dash: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root.join("deploy/grafana/kvroute.json")).expect("dashboard"),
    )
    .expect("dashboard json");
    let mut exprs = Vec::new();
    dashboard_exprs(&dash, &mut exprs);
    let rules: serde_yaml::Value = serde_yaml::from_str(
        &std::fs::read_to_string(root.join("deploy/prometheus/kvroute-rules.yaml")).expect("rules"),
    )
    .expect("rules yaml");
    for group in rules["groups"].as_sequence().expect("groups") {
        for rule in group["rules"].as_sequence().expect("rules") {
            exprs.push(rule["expr"].as_str().expect("expr").to_string());
        }
    }
    let mut used = BTreeSet::new();
    for e in &exprs {
        names(e, &mut used);
    }
    assert!(
        used.len() >= 25,
        "only {} names found: {used:?}",
        used.len()
    );

    let ca = Ca::new("kvroute test CA");
    let dir = std::env::temp_dir().join(format!("kvroute-dash-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    ca.write_server(&dir, 1, -60, 86_000);
    let sim = Sim::start(&["--ttft-ms", "1", "--itl-ms", "1"]);
    // A second backend whose KV events are followed, so that their families are exported too
    // (a simulator with fixed timing has no KV pool to publish).
    let tokenizer = root.join("bench/data/tokenizer/chatml-bpe8k");
    let tokenizer_arg = tokenizer.display().to_string();
    let events_sim = Sim::start(&["--kv-events", "0", "--tokenizer", &tokenizer_arg]);
    let (publish, replay) = events_sim
        .kv_events
        .clone()
        .expect("the sim publishes KV events");
    let tls = free_port();
    let k = Kvroute::start_with(
        &[
            (sim.addr, String::new()),
            (
                events_sim.addr,
                format!(
                    "      kv_events:\n        endpoint: \"{publish}\"\n        replay_endpoint: \"{replay}\"\n"
                ),
            ),
        ],
        &format!(
            "  tls:\n    listen: \"127.0.0.1:{tls}\"\n    cert: {d}/cert.pem\n    key: {d}/key.pem\n\
             \x20 telemetry:\n    interval_ms: 100\n\
             \x20 kv_events:\n    tokenizer: \"{t}/tokenizer.json\"\n    tokenizer_config: \"{t}/tokenizer_config.json\"\n",
            d = dir.display(),
            t = tokenizer.display()
        ),
    );
    let r = client()
        .post(k.url("/v1/chat/completions"))
        .json(&chat_body(
            MODEL,
            serde_json::json!([{"role": "user", "content": "dashboards"}]),
            true,
            3,
        ))
        .send()
        .await
        .expect("request");
    assert_eq!(r.status(), 200);
    let _ = r.bytes().await;
    let deadline = Instant::now() + Duration::from_secs(10);
    let exported = loop {
        let text = k.metrics();
        let exported: BTreeSet<String> = text
            .lines()
            .filter(|l| l.starts_with("kvroute_"))
            .filter_map(|l| l.split(['{', ' ']).next())
            .map(str::to_string)
            .collect();
        if used.is_subset(&exported) || Instant::now() > deadline {
            break exported;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let missing: Vec<_> = used.difference(&exported).collect();
    assert!(
        missing.is_empty(),
        "used but not exported: {missing:?}\n{}",
        k.log()
    );
    // Every family the running process exports has its row in the metrics reference (tests/docs.rs
    // checks the reference against the names the code registers; this, against what it serves).
    let reference =
        std::fs::read_to_string(root.join("docs/guide/metrics.md")).expect("metrics page");
    let documented: BTreeSet<&str> = reference
        .lines()
        .filter_map(|l| l.trim().strip_prefix("| `")?.split('`').next())
        .collect();
    let undocumented: Vec<_> = exported
        .iter()
        .map(|n| {
            ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| n.strip_suffix(s).filter(|f| documented.contains(f)))
                .unwrap_or(n)
        })
        .filter(|f| !documented.contains(f))
        .collect();
    assert!(
        undocumented.is_empty(),
        "exported but not in docs/guide/metrics.md: {undocumented:?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
