//! Prompt token counting end to end: a prompt too long to count inline is counted off the
//! proxy's worker threads, and the BPE tables follow the config through reloads (loaded only
//! when something is counted; a rank file that does not load is a config error).

mod common;

use base64::Engine as _;
use common::*;
use serde_json::json;
use std::path::Path;
use std::time::{Duration, Instant};

/// A tiktoken rank file: the 256 single bytes, then a few merges.
fn write_rank_file(path: &Path) {
    let b64 = |t: &[u8]| base64::engine::general_purpose::STANDARD.encode(t);
    let merges = ["he", "ll", "hell", "hello", " w", "or", " wor"];
    let tokens = (0..=255u8)
        .map(|b| vec![b])
        .chain(merges.iter().map(|m| m.as_bytes().to_vec()));
    let text: String = tokens
        .enumerate()
        .map(|(rank, t)| format!("{} {rank}\n", b64(&t)))
        .collect();
    std::fs::write(path, text).expect("write rank file");
}

fn wait_until(kv: &Kvroute, what: &str, ok: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !ok() {
        assert!(Instant::now() < deadline, "{what}; log:\n{}", kv.log());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// SIGHUP, then wait until `kvroute_config_reloads_total{result}` reaches `count`.
fn reload(kv: &Kvroute, result: &str, count: f64) {
    signal(kv.pid(), "HUP");
    wait_until(kv, "reload not counted", || {
        kv.metric_sum("kvroute_config_reloads_total", &[("result", result)]) >= count
    });
}

async fn ask(kv: &Kvroute, text: &str) {
    let body = chat_body(MODEL, json!([{"role": "user", "content": text}]), false, 1);
    let r = client()
        .post(kv.url("/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .expect("request");
    assert_eq!(r.status(), 200);
}

/// Requests whose estimate the engine's usage has settled, by method.
fn settled(kv: &Kvroute, method: &str, min: f64) -> f64 {
    let text = kv.metrics_when(
        "kvroute_prompt_tokens_estimate_ratio_count",
        &[("method", method)],
        min,
    );
    metric_sum(
        &text,
        "kvroute_prompt_tokens_estimate_ratio_count",
        &[("method", method)],
    )
}

/// Counting on, as an operator turns it on (it is off by default).
const COUNTING: &str =
    "  routing:\n    count_tokens_max_bytes: 8192\n    count_tokens_offthread_max_bytes: 1048576\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn by_default_nothing_is_counted_and_prompts_are_sized() {
    let sim = Sim::start(&["--ttft-ms", "1", "--itl-ms", "0"]);
    let kv = Kvroute::start(&[sim.addr], "");
    ask(&kv, "hello world").await;
    assert_eq!(settled(&kv, "sized", 1.0), 1.0);
    assert_eq!(kv.metric_sum("kvroute_tokenizer_loaded", &[]), 0.0);
    assert!(kv.log().contains("token counting is off"), "{}", kv.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_past_the_inline_limit_is_counted_off_thread() {
    let sim = Sim::start(&["--ttft-ms", "1", "--itl-ms", "0"]);
    let kv = Kvroute::start(&[sim.addr], COUNTING);
    // o200k_base loads in the background at start.
    wait_until(&kv, "the tables never loaded", || {
        kv.metric_sum("kvroute_tokenizer_loaded", &[]) == 1.0
    });
    // ~23 KB: past count_tokens_max_bytes (8 KiB), within the off-thread limit (1 MiB).
    ask(
        &kv,
        &"Summarise the quarterly report for the board. ".repeat(500),
    )
    .await;
    assert_eq!(settled(&kv, "counted_offthread", 1.0), 1.0, "{}", kv.log());
    assert_eq!(
        kv.metric_sum(
            "kvroute_prompt_tokens_offthread_total",
            &[("result", "counted")]
        ),
        1.0
    );
    assert_eq!(
        kv.metric_sum("kvroute_prompt_tokens_offthread_seconds_count", &[]),
        1.0
    );
    // A short one stays on the worker thread.
    ask(&kv, "hello").await;
    assert_eq!(settled(&kv, "counted", 1.0), 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tables_follow_the_config_through_reloads() {
    let sim = Sim::start(&["--ttft-ms", "1", "--itl-ms", "0"]);
    let off =
        "  routing:\n    count_tokens_max_bytes: 0\n    count_tokens_offthread_max_bytes: 0\n";
    let kv = Kvroute::start(&[sim.addr], off);
    assert_eq!(kv.metric_sum("kvroute_tokenizer_loaded", &[]), 0.0);
    ask(&kv, "hello world").await;
    assert_eq!(settled(&kv, "sized", 1.0), 1.0);
    assert!(kv.log().contains("token counting is off"), "{}", kv.log());

    // Counting turned on by a reload, with a rank file: it loads and counts.
    let ranks = kv.dir.join("tiny.tiktoken");
    write_rank_file(&ranks);
    let on = format!(
        "  routing:\n    tokenizer: {}\n    count_tokens_max_bytes: 8192\n",
        ranks.display()
    );
    kv.write_config(&[sim.addr], &on);
    reload(&kv, "success", 1.0);
    assert_eq!(kv.metric_sum("kvroute_tokenizer_loaded", &[]), 1.0);
    ask(&kv, "hello world").await;
    assert_eq!(settled(&kv, "counted", 1.0), 1.0);

    // A rank file that does not parse rejects the reload; the tables in use stay.
    let broken = kv.dir.join("broken.tiktoken");
    std::fs::write(&broken, "AA== 0\nnot-base64! 1\n").unwrap();
    let bad = format!(
        "  routing:\n    tokenizer: {}\n    count_tokens_max_bytes: 8192\n",
        broken.display()
    );
    kv.write_config(&[sim.addr], &bad);
    reload(&kv, "failure", 1.0);
    let log = kv.log();
    assert!(
        log.contains("kvroute.routing.tokenizer") && log.contains("broken.tiktoken: line 2"),
        "{log}"
    );
    assert_eq!(kv.metric_sum("kvroute_tokenizer_loaded", &[]), 1.0);
    ask(&kv, "hello world").await;
    assert_eq!(settled(&kv, "counted", 2.0), 2.0);

    // Counting off again: the tables are dropped.
    kv.write_config(&[sim.addr], off);
    reload(&kv, "success", 2.0);
    assert_eq!(kv.metric_sum("kvroute_tokenizer_loaded", &[]), 0.0);
}

#[test]
fn check_mode_names_the_bad_line_of_a_rank_file() {
    let dir = std::env::temp_dir().join(format!("kvroute-tokens-check-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ranks = dir.join("short.tiktoken");
    std::fs::write(&ranks, "AA== 0\nAQ== zero\n").unwrap();
    let conf = dir.join("kvroute.yaml");
    std::fs::write(
        &conf,
        format!(
            "kvroute:\n  listen: \"127.0.0.1:18080\"\n  backends:\n    - addr: \"127.0.0.1:18001\"\n  \
             routing:\n    tokenizer: {}\n    count_tokens_max_bytes: 8192\n",
            ranks.display()
        ),
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(["-t", "-c"])
        .arg(&conf)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("kvroute.routing.tokenizer")
            && err.contains("short.tiktoken: line 2: rank `zero`"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Kills the daemonized process (not a child of the test) however the test ends.
struct Daemon(u32);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = std::process::Command::new("kill")
            .arg("-KILL")
            .arg(self.0.to_string())
            .status();
    }
}

/// Under `-d`, as systemd runs it, Pingora forks after kvroute has set up: the tables must load
/// in the daemon, not on a thread of the parent that the fork leaves behind.
#[test]
fn the_tables_load_in_a_daemon() {
    let sim = Sim::start(&["--ttft-ms", "1", "--itl-ms", "0"]);
    let dir = std::env::temp_dir().join(format!("kvroute-tokens-daemon-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let listen = free_port();
    // Two ports taken and released in turn can be the same one.
    let admin = loop {
        let p = free_port();
        if p != listen {
            break p;
        }
    };
    let conf = dir.join("kvroute.yaml");
    std::fs::write(
        &conf,
        format!(
            "version: 1\nthreads: 1\npid_file: {d}/kvroute.pid\nupgrade_sock: {d}/upgrade.sock\n\
             error_log: {d}/error.log\ngrace_period_seconds: 0\n\
             graceful_shutdown_timeout_seconds: 1\nkvroute:\n  listen: \"127.0.0.1:{listen}\"\n  \
             admin_listen: \"127.0.0.1:{admin}\"\n  backends:\n    - addr: \"{sim}\"\n  \
             routing:\n    count_tokens_max_bytes: 8192\n",
            d = dir.display(),
            sim = sim.addr,
        ),
    )
    .unwrap();
    let parent = std::process::Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(["-d", "-c"])
        .arg(&conf)
        .env("RUST_LOG", "info")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(parent.success());
    let log = || std::fs::read_to_string(dir.join("error.log")).unwrap_or_default();
    let deadline = Instant::now() + Duration::from_secs(20);
    let pid = loop {
        let pid = std::fs::read_to_string(dir.join("kvroute.pid")).unwrap_or_default();
        if let Ok(pid) = pid.trim().parse::<u32>() {
            break pid;
        }
        assert!(Instant::now() < deadline, "no pid file; log:\n{}", log());
        std::thread::sleep(Duration::from_millis(20));
    };
    let _daemon = Daemon(pid);
    let admin = format!("127.0.0.1:{admin}").parse().unwrap();
    loop {
        let loaded = std::net::TcpStream::connect(admin).is_ok()
            && metric_sum(
                &String::from_utf8_lossy(&http_get(admin, "/metrics").1),
                "kvroute_tokenizer_loaded",
                &[],
            ) == 1.0;
        if loaded {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "tables not loaded; log:\n{}",
            log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = std::fs::remove_dir_all(&dir);
}
