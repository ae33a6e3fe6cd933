//! Zero-downtime binary upgrade under load, three times in a row: start `kvroute -u`, SIGQUIT
//! the old process. No request may fail or be refused, every long stream that was running on
//! the old process completes with `[DONE]`, the old process reports not-ready while draining and
//! exits right after its last stream ends, long before its grace period is over.

mod common;

use common::*;
use serde_json::json;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// Pingora's fixed hand-over window: the old process keeps accepting this long after SIGQUIT.
const CLOSE_TIMEOUT_S: u64 = 5;
const GRACE_S: u64 = 30;

/// One long stream; Ok(()) once it ended with `[DONE]`.
async fn long_stream(url: String, n: usize) -> Result<(), String> {
    let c = reqwest::Client::new();
    let body = chat_body(
        MODEL,
        json!([{"role": "user", "content": format!("a long answer please {n}")}]),
        true,
        280,
    );
    let r = c
        .post(&url)
        .json(&body)
        .send()
        .await
        .map_err(|e| e.to_string())?;
    if r.status() != 200 {
        return Err(format!("status {}", r.status()));
    }
    let text = r.text().await.map_err(|e| format!("cut: {e}"))?;
    if text.trim_end().ends_with("data: [DONE]") {
        Ok(())
    } else {
        Err(format!(
            "no [DONE]: ...{}",
            &text[text.len().saturating_sub(80)..]
        ))
    }
}

fn readyz(admin: SocketAddr) -> Option<u16> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect_timeout(&admin, Duration::from_secs(1)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(
        s,
        "GET /readyz HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).ok()?;
    parse_response(&raw).map(|(status, _)| status)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upgrade_under_load_drops_nothing() {
    // 280 tokens at 25 ms: a 7 s stream, still running when the old process stops accepting.
    let sims = Sim::start_n(2, &["--ttft-ms", "2", "--itl-ms", "25"]);
    let addrs: Vec<_> = sims.iter().map(|s| s.addr).collect();
    let mut kv = Kvroute::launch(&addrs, "", &format!("grace_period_seconds: {GRACE_S}\n"));
    kv.wait_ready();
    let url = kv.url("/v1/chat/completions");

    // One keep-alive client, one opening a connection per request (a refusal would show).
    let load = Load::start(&url, &[false, true], 2);

    let mut streams_done = 0;
    for round in 0..3 {
        let streams: Vec<_> = (0..4)
            .map(|n| {
                let url = url.clone();
                tokio::spawn(async move {
                    let r = long_stream(url, round * 10 + n).await;
                    (r, Instant::now())
                })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(300)).await;

        let _ = std::fs::remove_file(kv.dir.join("upgrade.sock"));
        let new = kv.spawn(&["-u"]);
        let deadline = Instant::now() + Duration::from_secs(10);
        while !kv.dir.join("upgrade.sock").exists() {
            assert!(
                Instant::now() < deadline,
                "new process never listened for the hand-over"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let old_pid = kv.pid();
        let mut old = kv.replace_child(new).expect("old process");
        let quit_at = Instant::now();
        signal(old_pid, "QUIT");

        // While both processes hold the listeners, the old one answers /readyz with 503.
        let mut saw_draining = false;
        while quit_at.elapsed() < Duration::from_secs(CLOSE_TIMEOUT_S - 1) {
            match readyz(kv.admin) {
                Some(503) => saw_draining = true,
                Some(200) => {}
                other => panic!("round {round}: /readyz during hand-over: {other:?}"),
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        assert!(
            saw_draining,
            "round {round}: the draining process never said not-ready"
        );

        let exited = loop {
            if let Some(status) = old.try_wait().unwrap() {
                break (Instant::now(), status);
            }
            assert!(
                quit_at.elapsed() < Duration::from_secs(CLOSE_TIMEOUT_S + GRACE_S + 10),
                "round {round}: the old process did not exit; log:\n{}",
                kv.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let mut last_end = quit_at;
        for s in streams {
            let (r, ended) = s.await.unwrap();
            r.unwrap_or_else(|e| panic!("round {round}: stream failed: {e}"));
            last_end = last_end.max(ended);
            streams_done += 1;
        }
        // The drain ends with the work: right after the last stream, not at the grace period.
        assert!(
            exited.0 + Duration::from_millis(300) >= last_end,
            "round {round}: the old process left {:?} before its last stream ended",
            last_end - exited.0
        );
        assert!(
            exited.0 <= last_end + Duration::from_millis(1500),
            "round {round}: the old process left {:?} after its last stream ended",
            exited.0 - last_end
        );
        // The new process serves on its own.
        assert_eq!(readyz(kv.admin), Some(200), "round {round}");
    }

    let (sent, failures) = load.stop().await;
    eprintln!(
        "upgrade under load: 3 upgrades, {sent} requests sent, {} failed, {streams_done} long streams completed",
        failures.len()
    );
    assert!(
        failures.is_empty(),
        "{} of {sent} failed: {:?}",
        failures.len(),
        &failures[..failures.len().min(5)]
    );
    assert!(sent >= 100, "the load barely ran: {sent}");
}

/// A plain start (no `-u`) on addresses another kvroute holds exits at once, naming the address,
/// instead of Pingora's 30 s of retries and a process left neither serving nor stopping. The
/// running one is undisturbed.
#[test]
fn a_second_kvroute_on_taken_addresses_exits_naming_them() {
    let sim = Sim::start(&[]);
    let k = Kvroute::start(&[sim.addr], "");
    let started = Instant::now();
    let mut second = k.spawn(&[]);
    let status = loop {
        if let Some(s) = second.try_wait().expect("wait") {
            break s;
        }
        if started.elapsed() > Duration::from_secs(20) {
            let _ = second.kill();
            panic!("the second kvroute still runs; log:\n{}", k.log());
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(status.code(), Some(1), "log:\n{}", k.log());
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "{:?}",
        started.elapsed()
    );
    let log = k.log();
    assert!(
        log.contains(&format!(
            "kvroute: kvroute.admin_listen: cannot listen on {}",
            k.admin
        )),
        "{log}"
    );
    assert!(log.contains("another kvroute"), "{log}");
    assert_eq!(readyz(k.admin), Some(200), "the first still serves");
}
