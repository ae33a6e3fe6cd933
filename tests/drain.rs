//! A drain that ends when the work ends: after SIGTERM kvroute exits as soon as its in-flight
//! requests and streams have finished (at once when idle), not after the whole grace period,
//! and a second SIGTERM (or SIGINT) during the drain ends it at once, ending running streams
//! with the SSE error event.

mod common;

use common::*;
use std::time::{Duration, Instant};

/// A grace period long enough that waiting it out would fail every timing below.
const GRACE: &str = "grace_period_seconds: 60\n";

fn wait_exit(k: &mut Kvroute, limit: Duration) -> Duration {
    let started = Instant::now();
    let mut child = k.take_child().expect("child");
    loop {
        if child.try_wait().expect("wait").is_some() {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < limit,
            "kvroute still running after {limit:?}; log:\n{}",
            k.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn stream(
    k: &Kvroute,
    max_tokens: u32,
) -> tokio::task::JoinHandle<(Result<String, String>, Instant)> {
    let url = k.url("/v1/chat/completions");
    tokio::spawn(async move {
        let body = chat_body(
            MODEL,
            serde_json::json!([{"role": "user", "content": "a long answer"}]),
            true,
            max_tokens,
        );
        let r = async {
            let r = client()
                .post(&url)
                .json(&body)
                .send()
                .await
                .map_err(|e| e.to_string())?;
            r.text().await.map_err(|e| e.to_string())
        }
        .await;
        (r, Instant::now())
    })
}

#[test]
fn an_idle_kvroute_stops_at_once() {
    let sims = Sim::start_n(1, &["--ttft-ms", "1", "--itl-ms", "0"]);
    let mut k = Kvroute::launch(&[sims[0].addr], "", GRACE);
    k.wait_ready();
    signal(k.pid(), "TERM");
    let took = wait_exit(&mut k, Duration::from_secs(10));
    assert!(took < Duration::from_secs(3), "stopped after {took:?}");
}

/// Cut, not completed, and told so: the stream ends with the SSE error event.
fn assert_cut(text: &str) {
    assert!(!text.contains("data: [DONE]"), "the stream was not cut");
    assert!(
        text.contains("kvroute is shutting down"),
        "no SSE error event: ...{}",
        &text[text.len().saturating_sub(200)..]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_in_flight_finishes_then_kvroute_exits() {
    // 60 tokens at 50 ms: a 3 s stream.
    let sims = Sim::start_n(1, &["--ttft-ms", "1", "--itl-ms", "50"]);
    let mut k = Kvroute::launch(&[sims[0].addr], "", GRACE);
    k.wait_ready();
    let s = stream(&k, 60);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let pid = k.pid();
    signal(pid, "TERM");
    let exit = tokio::task::spawn_blocking(move || {
        let took = wait_exit(&mut k, Duration::from_secs(20));
        (took, Instant::now(), k)
    });
    let (r, ended) = s.await.expect("join");
    let text = r.expect("the stream completed");
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    let (took, exited, _k) = exit.await.expect("join");
    assert!(
        exited + Duration::from_millis(300) >= ended,
        "exited before the stream ended"
    );
    assert!(
        exited <= ended + Duration::from_millis(1500),
        "exited {:?} after the stream ended ({took:?} after SIGTERM)",
        exited - ended
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_sigterm_ends_the_drain_at_once() {
    // A 10 s stream, cut by the second signal.
    let sims = Sim::start_n(1, &["--ttft-ms", "1", "--itl-ms", "50"]);
    let mut k = Kvroute::launch(&[sims[0].addr], "", GRACE);
    k.wait_ready();
    let s = stream(&k, 200);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let pid = k.pid();
    signal(pid, "TERM");
    tokio::time::sleep(Duration::from_millis(700)).await;
    signal(pid, "TERM");
    let took = tokio::task::spawn_blocking(move || wait_exit(&mut k, Duration::from_secs(5)))
        .await
        .expect("join");
    assert!(
        took < Duration::from_secs(2),
        "exited {took:?} after the second signal"
    );
    let (r, _) = s.await.expect("join");
    assert_cut(&r.expect("the cut stream still ended cleanly"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_still_running_at_the_grace_periods_end_is_cut_and_logged() {
    // A 10 s stream against a 3 s grace period: kvroute cuts it a second before the end, so it
    // gets the SSE error event and its access line, which Pingora's own cut at the end (the
    // runtime dropped) would give it neither of.
    let sims = Sim::start_n(1, &["--ttft-ms", "1", "--itl-ms", "50"]);
    let mut k = Kvroute::launch(&[sims[0].addr], "", "grace_period_seconds: 3\n");
    k.wait_ready();
    let s = stream(&k, 200);
    tokio::time::sleep(Duration::from_millis(500)).await;
    signal(k.pid(), "TERM");
    let (took, k) = tokio::task::spawn_blocking(move || {
        let took = wait_exit(&mut k, Duration::from_secs(10));
        (took, k)
    })
    .await
    .expect("join");
    assert!(
        took >= Duration::from_millis(1500) && took < Duration::from_millis(3000),
        "exited {took:?} after SIGTERM, with a 3 s grace period"
    );
    let (r, _) = s.await.expect("join");
    assert_cut(&r.expect("the cut stream still ended cleanly"));
    let log = k.log();
    assert!(
        log.lines()
            .any(|l| l.contains("kvroute::access] ")
                && l.contains("\"POST /v1/chat/completions\" 200")),
        "no access line for the cut stream:\n{log}"
    );
}
