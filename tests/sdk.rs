//! Conformance: the official `openai` and `anthropic` Python SDKs, unchanged, against kvroute in
//! front of three `kvbench sim` servers (`bench/scripts/sdk_conformance.py`: Responses streamed
//! and not, a `previous_response_id` chain, retrieve, input items and delete; Messages created,
//! streamed and counted; errors as the SDKs' own exception types).
//!
//! The SDKs live in `bench/.venv-sdk` (`bench/scripts/install-sdks.sh`, which `.ci/run` runs).
//! Where they are not installed the test says so and passes, except under CI (`CI=true`).

mod common;

use common::*;
use std::path::PathBuf;
use std::process::Command;

#[test]
fn the_official_sdks_speak_to_kvroute_unchanged() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let python = root.join("bench/.venv-sdk/bin/python");
    if !python.exists() {
        let msg = "the SDKs are not installed (bench/scripts/install-sdks.sh)";
        assert!(std::env::var("CI").as_deref() != Ok("true"), "{msg}");
        eprintln!("SKIPPED: {msg}");
        return;
    }
    // Three backends: a stored response's chain and calls must find the one that stored it.
    let sims = Sim::start_n(3, &["--ttft-ms", "1", "--itl-ms", "0"]);
    let addrs: Vec<_> = sims.iter().map(|s| s.addr).collect();
    let kv = Kvroute::start(&addrs, "");
    let base = kv.url("");
    let out = Command::new(&python)
        .arg(root.join("bench/scripts/sdk_conformance.py"))
        .args([base.trim_end_matches('/'), MODEL])
        .output()
        .expect("run the SDK checks");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("all checks passed"),
        "{stdout}\n{}\nkvroute log:\n{}",
        String::from_utf8_lossy(&out.stderr),
        kv.log()
    );
    // Every check ran: a script that stopped early would not have printed them.
    assert!(
        stdout.lines().filter(|l| l.starts_with("ok ")).count() >= 23,
        "{stdout}"
    );
    eprintln!("{stdout}");
}
