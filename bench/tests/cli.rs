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
