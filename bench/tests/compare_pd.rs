//! `kvbench compare --pd 1:2` end to end on 127.0.0.1: simulated prefill and decode servers,
//! kvroute (and the peers' P/D modes where they are installed) in front, a few seconds of
//! chat, and the report's P/D rows.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default()
}

/// A fresh results directory for one test.
fn results_dir(name: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("kvbench-compare-pd-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// Runs `compare --pd 1:2` with `policies` on a few seconds of ShareGPT chat; returns the
/// workload's section of results.json and the README.
fn compare(name: &str, policies: &str) -> (Value, String) {
    let dir = results_dir(name);
    let out = Command::new(env!("CARGO_BIN_EXE_kvbench"))
        .current_dir(repo_root())
        .args(["compare", "--name", name, "--results-dir"])
        .arg(&dir)
        .args([
            "--pd",
            "1:2",
            "--policies",
            policies,
            "--workloads",
            "sharegpt",
        ])
        .args(["--sharegpt-file", "bench/data/sharegpt_demo.jsonl"])
        .args(["--duration-s", "3", "--conversations", "8"])
        .output()
        .expect("run kvbench compare");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "compare failed: {stderr}");
    let run = dir.join(name);
    let json = std::fs::read_to_string(run.join("results.json")).expect("results.json");
    let json: Value = serde_json::from_str(&json).expect("results.json parses");
    let readme = std::fs::read_to_string(run.join("README.md")).expect("README.md");
    let _ = std::fs::remove_dir_all(&dir);
    (json["results"][0].clone(), readme)
}

/// The P/D row of `label`, and its run's summary.
fn row<'a>(section: &'a Value, label: &str) -> (&'a Value, &'a Value) {
    let find = |key: &str| {
        section[key]
            .as_array()
            .and_then(|rows| rows.iter().find(|r| r[0] == label))
            .map(|r| &r[1])
            .unwrap_or_else(|| panic!("no {key} row for {label}: {section}"))
    };
    (find("pd"), find("runs"))
}

/// Every request answered and no prefill server left holding KV for a decode server.
fn clean(label: &str, pd: &Value, summary: &Value) {
    assert!(summary["requests"].as_u64() > Some(0), "{label}: {summary}");
    assert_eq!(summary["errors"], 0, "{label}: {summary}");
    assert_eq!(pd["unread"], 0, "{label}: {pd}");
    assert_eq!(pd["sims"]["held_requests"], 0, "{label} stranded KV: {pd}");
    assert_eq!(pd["sims"]["held_blocks"], 0, "{label} stranded KV: {pd}");
    // SGLang's protocol's waits, where the simulator has them.
    for waiting in [
        "waiting_prefill_legs",
        "waiting_decodes",
        "transferring_decodes",
    ] {
        let n = pd["sims"][waiting].as_u64().unwrap_or(0);
        assert_eq!(n, 0, "{label} stranded {waiting}: {pd}");
    }
}

#[test]
fn kvroute_unified_cost_and_always_on_one_prefill_two_decode() {
    let (section, readme) = compare("kvroute", "kv_aware,kv_aware/pd=cost,kv_aware/pd=always");
    let (unified, s) = row(&section, "kv_aware");
    assert_eq!(unified["fleet"], "unified 3");
    clean("kv_aware", unified, s);
    let (cost, s) = row(&section, "kv_aware/pd=cost");
    assert_eq!(cost["fleet"], "1 prefill + 2 decode, vllm_nixl");
    clean("pd=cost", cost, s);
    let decided = |pd: &Value, k: &str| pd["decisions"][k].as_u64().unwrap_or(0);
    assert!(
        decided(cost, "split") + decided(cost, "whole") > 0,
        "{cost}"
    );
    let (always, s) = row(&section, "kv_aware/pd=always");
    clean("pd=always", always, s);
    assert!(decided(always, "split") > 0, "{always}");
    assert_eq!(decided(always, "whole"), 0, "{always}");
    assert!(always["prefill_legs"]["ok"].as_u64() > Some(0), "{always}");
    assert!(
        always["sims"]["transfers_total"].as_u64() > Some(0),
        "{always}"
    );
    for line in [
        "| kv_aware | unified 3 | - |",
        "| kv_aware/pd=cost | 1 prefill + 2 decode, vllm_nixl |",
        "| kv_aware/pd=always | 1 prefill + 2 decode, vllm_nixl |",
    ] {
        assert!(readme.contains(line), "{line:?} not in {readme}");
    }
}

/// The peers' venv, if `bench/scripts/install-peers.sh` made it.
fn peers_installed() -> bool {
    let python = repo_root().join("bench/.venv-peers/bin/python");
    let ok = python.exists()
        && Command::new(&python)
            .args(["-c", "import sglang_router, vllm_router"])
            .output()
            .is_ok_and(|o| o.status.success());
    if !ok {
        eprintln!(
            "SKIPPED: the peer routers are not installed (bench/scripts/install-peers.sh makes \
             bench/.venv-peers)"
        );
    }
    ok
}

#[test]
fn vllm_router_pd_mode_splits_every_request() {
    if !peers_installed() {
        return;
    }
    let (section, readme) = compare("vllm-router", "vllm-router/pd");
    let (pd, s) = row(&section, "vllm-router/pd");
    assert_eq!(pd["fleet"], "1 prefill + 2 decode, vllm_nixl");
    clean("vllm-router/pd", pd, s);
    assert!(pd["sims"]["transfers_total"].as_u64() > Some(0), "{pd}");
    assert!(readme.contains("| vllm-router/pd | 1 prefill + 2 decode, vllm_nixl | all (peer) |"));
}

/// The simulator speaks SGLang's bootstrap protocol (`sim --pd-protocol sglang_bootstrap`).
fn sim_speaks_sglang() -> bool {
    let help = Command::new(env!("CARGO_BIN_EXE_kvbench"))
        .args(["sim", "--help"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    let ok = help.contains("sglang_bootstrap");
    if !ok {
        eprintln!("SKIPPED: this kvbench sim has no --pd-protocol sglang_bootstrap");
    }
    ok
}

#[test]
fn sglang_router_pd_mode_over_the_bootstrap_protocol() {
    if !sim_speaks_sglang() || !peers_installed() {
        return;
    }
    let (section, readme) = compare("sglang-router", "sglang-router/pd");
    let (pd, s) = row(&section, "sglang-router/pd");
    assert_eq!(pd["fleet"], "1 prefill + 2 decode, sglang_bootstrap");
    clean("sglang-router/pd", pd, s);
    assert!(pd["sims"]["transfers_total"].as_u64() > Some(0), "{pd}");
    assert!(readme.contains("| sglang-router/pd | 1 prefill + 2 decode, sglang_bootstrap |"));
}

#[test]
fn kvroute_over_the_bootstrap_protocol() {
    if !sim_speaks_sglang() {
        return;
    }
    let label = "kv_aware/pd=always/pd_protocol=sglang_bootstrap";
    let (section, _) = compare("kvroute-sglang", label);
    let (pd, s) = row(&section, label);
    assert_eq!(pd["fleet"], "1 prefill + 2 decode, sglang_bootstrap");
    clean(label, pd, s);
    assert!(pd["decisions"]["split"].as_u64() > Some(0), "{pd}");
    assert!(pd["sims"]["transfers_total"].as_u64() > Some(0), "{pd}");
}
