//! `kvbench sim` as a process: the readiness lines the proxy's integration tests rely on, and
//! answers on every advertised port. (Also makes `cargo test --workspace` build the binary that
//! kvroute's tests start.)

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Command, Stdio};
use std::time::Duration;

#[test]
fn sim_prints_ready_lines_and_serves_each_port() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvbench"))
        .args([
            "sim",
            "--servers",
            "3",
            "--base-port",
            "0",
            "--ttft-ms",
            "1",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn kvbench");
    let stdout = child.stdout.take().expect("stdout");
    let mut addrs: Vec<SocketAddr> = Vec::new();
    for line in BufReader::new(stdout).lines() {
        let line = line.expect("line");
        if let Some(rest) = line.strip_prefix("kvbench-sim listening ") {
            addrs.push(rest.split_whitespace().next().unwrap().parse().unwrap());
        }
        if line == "kvbench-sim ready" {
            break;
        }
    }
    assert_eq!(addrs.len(), 3);
    for a in &addrs {
        assert!(a.ip().is_loopback());
        let mut s = TcpStream::connect(a).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        write!(
            s,
            "GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    }
    let _ = child.kill();
    let _ = child.wait();
}

#[test]
fn sim_refuses_non_loopback_hosts() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvbench"))
        .args([
            "sim",
            "--servers",
            "1",
            "--base-port",
            "0",
            "--host",
            "0.0.0.0",
        ])
        .output()
        .expect("run kvbench");
    assert!(!out.status.success());
}

#[test]
fn sim_refuses_a_bad_tokenizer_path_with_a_clear_error() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvbench"))
        .args(["sim", "--servers", "1", "--base-port", "0"])
        .args(["--tokenizer", "/nonexistent/bpe8k"])
        .output()
        .expect("run kvbench");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--tokenizer /nonexistent/bpe8k: no such file or directory"),
        "{err}"
    );
}

/// Starts `kvbench sim ARGS` and returns the child and its servers' addresses, once ready.
fn start_sim(args: &[&str]) -> (std::process::Child, Vec<SocketAddr>) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvbench"))
        .arg("sim")
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn kvbench");
    let stdout = child.stdout.take().expect("stdout");
    let mut addrs: Vec<SocketAddr> = Vec::new();
    for line in BufReader::new(stdout).lines() {
        let line = line.expect("line");
        if let Some(rest) = line.strip_prefix("kvbench-sim listening ") {
            addrs.push(rest.split_whitespace().next().unwrap().parse().unwrap());
        }
        if line == "kvbench-sim ready" {
            break;
        }
    }
    (child, addrs)
}

/// GET `path` with a plain HTTP/1.1 request; the body as JSON.
fn get_json(addr: SocketAddr, path: &str) -> serde_json::Value {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    let body = out.split_once("\r\n\r\n").unwrap().1;
    serde_json::from_str(body).unwrap()
}

#[test]
fn mixed_fleet_runs_each_servers_profile() {
    let (mut child, addrs) = start_sim(&[
        "--profiles",
        "h100-llama8b:1,l40s-llama8b:2",
        "--base-port",
        "0",
        "--kv-tokens",
        "16000",
    ]);
    assert_eq!(addrs.len(), 3);
    let want = [
        ("h100-llama8b", 25_000.0),
        ("l40s-llama8b", 9_000.0),
        ("l40s-llama8b", 9_000.0),
    ];
    for (i, (addr, (name, rate))) in addrs.iter().zip(want).enumerate() {
        let state = get_json(*addr, "/debug/state");
        assert_eq!(state["index"], i);
        assert_eq!(state["profile"], name);
        assert_eq!(state["prefill_tokens_per_s"], rate);
        assert_eq!(state["engine"]["num_gpu_blocks"], 1_000);
    }
    let _ = child.kill();
    let _ = child.wait();
}

#[test]
fn fleet_flags_are_checked() {
    for (args, says) in [
        (
            &["--profiles", "h100-llama8b:2", "--servers", "3"][..],
            "--servers 3",
        ),
        (
            &["--profiles", "h100-llama8b:2", "--profile", "l40s-llama8b"],
            "--profile",
        ),
        (&["--profiles", "h100-llama8b:two"], "not a whole number"),
        (&["--profiles", "b200:1"], "unknown profile"),
        (&[], "--servers is required"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_kvbench"))
            .args(["sim", "--base-port", "0"])
            .args(args)
            .output()
            .expect("run kvbench");
        assert!(!out.status.success(), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{args:?}: {err}");
    }
}
