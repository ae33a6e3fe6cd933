//! The systemd helper (`systemd/kvroute-ctl`) outside systemd: `exec-reload` (what the unit's
//! ExecReload runs) validates the file and sends SIGHUP, refuses a bad file without touching the
//! process, and, once an upgrade is requested, starts `kvroute -u -d` and SIGQUITs the old
//! process, returning only when the new daemon has written its pid file. `start` (ExecStart)
//! returns once the daemon's pid file names it.

mod common;

use common::*;
use serde_json::json;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn ctl(kv: &Kvroute, args: &[&str]) -> bool {
    let log = std::fs::OpenOptions::new()
        .append(true)
        .open(kv.dir.join("kvroute.log"))
        .unwrap();
    Command::new(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("systemd/kvroute-ctl"))
        .args(args)
        .env("KVROUTE_BIN", env!("CARGO_BIN_EXE_kvroute"))
        .env("KVROUTE_CONF", kv.conf())
        .env("KVROUTE_RUN_DIR", &kv.dir)
        .env("RUST_LOG", "info")
        // The daemon inherits these: never a pipe the test would wait on.
        .stdout(Stdio::null())
        .stderr(log)
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

/// Kills the daemonized process (not a child of the test) however the test ends.
struct Daemon(u32);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .arg("-KILL")
            .arg(self.0.to_string())
            .status();
    }
}

fn wait_reloads(kv: &Kvroute, result: &str, n: f64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while kv.metric_sum("kvroute_config_reloads_total", &[("result", result)]) < n {
        assert!(Instant::now() < deadline, "no reload; log:\n{}", kv.log());
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn chat_ok(kv: &Kvroute) -> bool {
    let body = chat_body(MODEL, json!([{"role": "user", "content": "hi"}]), false, 2);
    let mut s = match std::net::TcpStream::connect(kv.addr) {
        Ok(s) => s,
        Err(_) => return false,
    };
    use std::io::{Read, Write};
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let body = body.to_string();
    let _ = write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    matches!(parse_response(&raw), Some((200, _)))
}

#[test]
fn exec_reload_reloads_refuses_bad_files_and_upgrades() {
    let sims = Sim::start_n(2, &["--ttft-ms", "1", "--itl-ms", "0"]);
    let (a, b) = (sims[0].addr, sims[1].addr);
    let mut kv = Kvroute::launch(&[a], "", "grace_period_seconds: 1\n");
    kv.wait_ready();
    let pid = kv.pid().to_string();

    // Reload: validated, then SIGHUP.
    kv.write_config(&[a, b], "");
    assert!(ctl(&kv, &["exec-reload", &pid]));
    wait_reloads(&kv, "success", 1.0);

    // A bad file fails the reload before the process is signalled.
    let good = std::fs::read_to_string(kv.conf()).unwrap();
    std::fs::write(kv.conf(), good.replace("backends:", "backendz:")).unwrap();
    assert!(
        !ctl(&kv, &["exec-reload", &pid]),
        "a bad file must fail the reload"
    );
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        kv.metric_sum("kvroute_config_reloads_total", &[("result", "failure")]),
        0.0
    );
    std::fs::write(kv.conf(), good).unwrap();
    assert!(chat_ok(&kv));

    // Upgrade: the marker turns the next reload into the hand-over.
    std::fs::write(kv.dir.join("upgrade-requested"), "").unwrap();
    let started = Instant::now();
    assert!(
        ctl(&kv, &["exec-reload", &pid]),
        "upgrade failed; log:\n{}",
        kv.log()
    );
    eprintln!("ctl returned after {:?}", started.elapsed());
    let new_pid: u32 = std::fs::read_to_string(kv.dir.join("kvroute.pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let _daemon = Daemon(new_pid);
    assert_ne!(
        new_pid.to_string(),
        pid,
        "pid file not rewritten by the new daemon"
    );
    assert!(
        !kv.dir.join("upgrade-requested").exists(),
        "marker left behind"
    );

    // The old process drains and exits; the new daemon serves throughout.
    let mut old = kv
        .replace_child(Command::new("true").spawn().unwrap())
        .unwrap();
    let mut served = 0;
    // Every request during the hand-over succeeds.
    loop {
        assert!(
            chat_ok(&kv),
            "request failed during the upgrade; log:\n{}",
            kv.log()
        );
        served += 1;
        if old.try_wait().unwrap().is_some() {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "old process never exited"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(served > 10);
    for _ in 0..10 {
        assert!(
            chat_ok(&kv),
            "the new daemon does not serve; log:\n{}",
            kv.log()
        );
    }
    // The new daemon reloads too.
    kv.write_config(&[b], "");
    assert!(ctl(&kv, &["exec-reload", &new_pid.to_string()]));
    let deadline = Instant::now() + Duration::from_secs(10);
    while kv.metric_sum("kvroute_config_reloads_total", &[("result", "success")]) < 1.0 {
        assert!(
            Instant::now() < deadline,
            "new daemon did not reload; log:\n{}",
            kv.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }

    drop(_daemon);

    // ExecStart: `start` returns once the pid file names a running daemon that serves.
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(kv.addr).is_ok() {
        assert!(Instant::now() < deadline, "killed daemon still listening");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(ctl(&kv, &["start"]), "start failed; log:\n{}", kv.log());
    let pid: u32 = std::fs::read_to_string(kv.dir.join("kvroute.pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let _daemon = Daemon(pid);
    assert_ne!(pid, new_pid);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !chat_ok(&kv) {
        assert!(
            Instant::now() < deadline,
            "started daemon does not serve; log:\n{}",
            kv.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}
