//! Engine KV events into the exact index, end to end: kvroute subscribes to a real publisher on
//! 127.0.0.1 (vLLM's own encoder and socket library in `bench/scripts/kv_events_reference.py`,
//! and `kvbench sim --kv-events`), and matches requests' tokens against what it was told.

mod common;

use common::{free_port, metric_sum, Kvroute, Sim};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A Python with msgspec and pyzmq: `KVROUTE_TEST_PYTHON`, else the venv `.ci/run` makes.
/// Outside CI a machine without one skips the reference check (and says so).
fn python() -> Option<PathBuf> {
    let candidates = [
        std::env::var_os("KVROUTE_TEST_PYTHON").map(PathBuf::from),
        Some(repo().join("bench/.venv-kv/bin/python")),
    ];
    let found = candidates.into_iter().flatten().find(|p| {
        Command::new(p)
            .args(["-c", "import msgspec, zmq"])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    });
    if found.is_none() {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI must provide a Python with msgspec and pyzmq (bench/.venv-kv)"
        );
        eprintln!("skipped: no Python with msgspec and pyzmq (set KVROUTE_TEST_PYTHON)");
    }
    found
}

struct Publisher(Child);

impl Drop for Publisher {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn kv_events_yaml(publish: u16, replay: u16) -> String {
    format!(
        "      kv_events:\n        endpoint: \"tcp://127.0.0.1:{publish}\"\n        replay_endpoint: \"tcp://127.0.0.1:{replay}\"\n"
    )
}

fn tokenizer_yaml() -> String {
    let dir = repo().join("bench/data/tokenizer/chatml-bpe8k");
    format!(
        "  kv_events:\n    tokenizer: \"{}\"\n    tokenizer_config: \"{}\"\n",
        dir.join("tokenizer.json").display(),
        dir.join("tokenizer_config.json").display()
    )
}

/// The backend's `kv_events` entry in `/debug/backends`.
fn kv_state(k: &Kvroute, backend: SocketAddr) -> serde_json::Value {
    let (status, body) = common::http_get(k.admin, "/debug/backends");
    assert_eq!(status, 200);
    let v: serde_json::Value = serde_json::from_slice(&body).expect("json");
    v["backends"]
        .as_array()
        .and_then(|l| {
            l.iter()
                .find(|b| b["backend"] == backend.to_string())
                .map(|b| b["kv_events"].clone())
        })
        .unwrap_or_default()
}

fn wait_for(what: &str, timeout: Duration, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if ok() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("timed out waiting for {what}");
}

/// vLLM's encoder (maps) and SGLang's layout (arrays): a late subscriber replays from 0, and
/// the blocks resolve into the same chain a token-id prompt hashes to.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reference_publisher_events_reach_the_exact_index() {
    let Some(py) = python() else { return };
    for array_events in [false, true] {
        let sim = Sim::start(&[]);
        let (publish, replay) = (free_port(), free_port());
        let tokens: Vec<u32> = (1000..1048).collect();
        let batches = serde_json::json!([
            [{"type": "BlockStored", "block_hashes": [101, 102], "parent_block_hash": null,
              "token_ids": tokens[..32], "block_size": 16}],
            [{"type": "BlockStored", "block_hashes": [103], "parent_block_hash": 102,
              "token_ids": tokens[32..], "block_size": 16}],
            // Another medium is not the GPU cache a request reuses: skipped.
            [{"type": "BlockStored", "block_hashes": [900], "parent_block_hash": null,
              "token_ids": tokens[..16], "block_size": 16, "medium": "CPU"}],
            [{"type": "BlockRemoved", "block_hashes": [103]}],
            // A hybrid model's sliding-window group names blocks as the full-attention group
            // does: neither its store nor its dropping 101 touches the prompt's blocks.
            [{"type": "BlockStored", "block_hashes": [101], "parent_block_hash": null,
              "token_ids": tokens[..16], "block_size": 16, "group_idx": 1,
              "kv_cache_spec_kind": "sliding_window"}],
            [{"type": "BlockRemoved", "block_hashes": [101], "group_idx": 1}],
            // The same first block under a cache salt: another block, for salted prompts only.
            [{"type": "BlockStored", "block_hashes": [301], "parent_block_hash": null,
              "token_ids": tokens[..16], "block_size": 16, "extra_keys": [["tenant-a"]]}],
        ]);
        let dir = std::env::temp_dir().join(format!("kvroute-kv-events-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let file = dir.join(format!("batches-{array_events}.json"));
        std::fs::write(&file, batches.to_string()).expect("write");
        let mut cmd = Command::new(&py);
        cmd.arg(repo().join("bench/scripts/kv_events_reference.py"))
            .args(["--pub", &format!("tcp://127.0.0.1:{publish}")])
            .args(["--replay", &format!("tcp://127.0.0.1:{replay}")])
            .arg("--events")
            .arg(&file)
            .args(["--interval-ms", "10", "--repeat-seconds", "60"])
            .stderr(Stdio::null());
        if array_events {
            cmd.arg("--array-events");
        }
        let _publisher = Publisher(cmd.spawn().expect("start the reference publisher"));
        // kvroute starts after the batches went out: it must replay them from 0.
        std::thread::sleep(Duration::from_millis(500));
        let k = Kvroute::start_with(
            &[(sim.addr, kv_events_yaml(publish, replay))],
            &tokenizer_yaml(),
        );
        wait_for("the replayed history", Duration::from_secs(10), || {
            kv_state(&k, sim.addr)["state"] == "synced"
        });
        let state = kv_state(&k, sim.addr);
        assert_eq!(
            state["blocks"], 3,
            "103 was removed, 900 is not on the GPU, group 1 is not followed: {state}"
        );
        let m = k.metrics();
        let b = sim.addr.to_string();
        let sum = |name, labels: &[(&str, &str)]| common::metric_sum(&m, name, labels);
        assert_eq!(
            sum(
                "kvroute_kv_event_batches_total",
                &[("backend", &b), ("outcome", "replayed")]
            ),
            7.0
        );
        assert_eq!(
            sum(
                "kvroute_kv_events_total",
                &[("backend", &b), ("outcome", "applied")]
            ),
            4.0
        );
        assert_eq!(
            sum(
                "kvroute_kv_events_total",
                &[("backend", &b), ("outcome", "skipped")]
            ),
            3.0
        );
        assert_eq!(
            sum(
                "kvroute_kv_events_sync",
                &[("backend", &b), ("state", "synced")]
            ),
            1.0
        );

        // A prompt of those tokens: the first two blocks are cached there, exactly; under the
        // salt, only the salted first block.
        let predicted = |m: &str| {
            common::metric_sum(
                m,
                "kvroute_cached_prompt_tokens_by_index_total",
                &[("index", "exact"), ("source", "predicted")],
            )
        };
        let mut seen = 0.0;
        for (salt, cached) in [(None, 32.0), (Some("tenant-a"), 16.0)] {
            let body =
                serde_json::json!({"model": "sim-llama-8b", "prompt": tokens, "max_tokens": 2});
            let _ = post(&k, "/v1/completions", body, salt, None)
                .await
                .bytes()
                .await;
            let m = k.metrics_when(
                "kvroute_cached_prompt_tokens_by_index_total",
                &[("index", "exact"), ("source", "predicted")],
                seen + 1.0,
            );
            assert_eq!(
                predicted(&m) - seen,
                cached,
                "array_events={array_events}, salt {salt:?}"
            );
            seen = predicted(&m);
        }
        drop(k);
    }
}

/// Two free ports in a row (a data-parallel engine's rank 0 and rank 1).
fn free_port_pair() -> u16 {
    (0..50)
        .map(|_| free_port())
        .find(|&p| p < u16::MAX && std::net::TcpListener::bind(("127.0.0.1", p + 1)).is_ok())
        .expect("two free ports in a row")
}

/// vLLM with `--data-parallel-size 2` behind one HTTP endpoint: each rank publishes its own
/// cache on the configured ports + rank. kvroute follows both and pins each request with
/// `X-Data-Parallel-Rank` to the rank holding its prefix (a client's own header is replaced),
/// and a prefix no rank holds to one rank per conversation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn data_parallel_ranks_are_followed_and_requests_pinned() {
    let Some(py) = python() else { return };
    let sim = Sim::start(&[]);
    let (publish, replay) = (free_port_pair(), free_port_pair());
    let on_rank_1: Vec<u32> = (2000..2048).collect();
    let on_rank_0: Vec<u32> = (3000..3032).collect();
    let dir = std::env::temp_dir().join(format!("kvroute-dp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let mut publishers = Vec::new();
    for (rank, tokens) in [(0u16, &on_rank_0), (1, &on_rank_1)] {
        let hashes: Vec<u64> = (0..tokens.len() as u64 / 16)
            .map(|b| 1000 * u64::from(rank) + b)
            .collect();
        let batches = serde_json::json!([[{"type": "BlockStored", "block_hashes": hashes,
            "parent_block_hash": null, "token_ids": tokens, "block_size": 16}]]);
        let file = dir.join(format!("rank-{rank}.json"));
        std::fs::write(&file, batches.to_string()).expect("write");
        let child = Command::new(&py)
            .arg(repo().join("bench/scripts/kv_events_reference.py"))
            .args(["--pub", &format!("tcp://127.0.0.1:{}", publish + rank)])
            .args(["--replay", &format!("tcp://127.0.0.1:{}", replay + rank)])
            .arg("--events")
            .arg(&file)
            .args(["--data-parallel-rank", &rank.to_string()])
            .args(["--repeat-seconds", "60"])
            .stderr(Stdio::null())
            .spawn()
            .expect("start a reference publisher");
        publishers.push(Publisher(child));
    }
    let events = kv_events_yaml(publish, replay) + "        data_parallel_size: 2\n";
    let k = Kvroute::start_with(&[(sim.addr, events)], &tokenizer_yaml());
    wait_for("both ranks' history", Duration::from_secs(10), || {
        let s = kv_state(&k, sim.addr);
        s["state"] == "synced" && s["ranks"][0]["blocks"] == 2 && s["ranks"][1]["blocks"] == 3
    });
    let b = sim.addr.to_string();
    assert_eq!(
        k.metric_sum(
            "kvroute_kv_events_sync",
            &[("backend", &b), ("rank", "1"), ("state", "synced")]
        ),
        1.0
    );
    // The rank the sim saw the request pinned to, and the cached tokens kvroute predicted.
    let sent = std::sync::atomic::AtomicU64::new(0);
    let send = |prompt: serde_json::Value, client_rank: Option<&'static str>| {
        let (k, sim, sent) = (&k, &sim, &sent);
        async move {
            let before = cached_by_index(k, "predicted");
            let n = sent.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
            let body =
                serde_json::json!({"model": "sim-llama-8b", "prompt": prompt, "max_tokens": 2});
            let _ = post(k, "/v1/completions", body, None, client_rank)
                .await
                .bytes()
                .await;
            // Counted after its other metrics: then the prediction is in too.
            let m = k.metrics_when("kvroute_requests_total", &[], n as f64);
            let predicted = common::metric_sum(
                &m,
                "kvroute_cached_prompt_tokens_by_index_total",
                &[("index", "exact"), ("source", "predicted")],
            ) - before;
            let log = sim.requests();
            let rank = log.last().expect("the request reached the sim")["dp_rank"].clone();
            (rank, predicted)
        }
    };
    let (rank, predicted) = send(serde_json::json!(on_rank_1), Some("0")).await;
    assert_eq!(
        rank, "1",
        "pinned to the rank holding the prefix, not the client's"
    );
    assert_eq!(predicted, 48.0, "all three blocks, on rank 1");
    let (rank, predicted) = send(serde_json::json!(on_rank_0), None).await;
    assert_eq!((rank, predicted), ("0".into(), 32.0));
    // A prompt no rank holds: pinned all the same, the same rank each time.
    let unknown = serde_json::json!((5000..5040).collect::<Vec<u32>>());
    let (first, _) = send(unknown.clone(), None).await;
    assert!(first == "0" || first == "1", "pinned: {first}");
    for _ in 0..3 {
        assert_eq!(send(unknown.clone(), Some("7")).await.0, first);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

fn chatml_dir() -> String {
    repo()
        .join("bench/data/tokenizer/chatml-bpe8k")
        .display()
        .to_string()
}

fn endpoints_yaml(sim: &Sim) -> String {
    let (publish, replay) = sim.kv_events.clone().expect("the sim publishes KV events");
    format!("      kv_events:\n        endpoint: \"{publish}\"\n        replay_endpoint: \"{replay}\"\n")
}

/// The sim's count of named (cached) blocks, from `/debug/state`.
fn sim_cached_blocks(sim: &Sim) -> u64 {
    let (status, body) = common::http_get(sim.addr, "/debug/state");
    assert_eq!(status, 200);
    let v: serde_json::Value = serde_json::from_slice(&body).expect("json");
    v["engine"]["cached_blocks"]
        .as_u64()
        .expect("cached_blocks")
}

/// Waits until kvroute's count of the backend's blocks equals the engine's.
fn wait_in_step(k: &Kvroute, sim: &Sim, timeout: Duration) -> (u64, u64) {
    let deadline = Instant::now() + timeout;
    loop {
        let ours = kv_state(k, sim.addr)["blocks"].as_u64().unwrap_or(0);
        let theirs = sim_cached_blocks(sim);
        if ours == theirs || Instant::now() > deadline {
            return (ours, theirs);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// POST `body` to kvroute's `path`, under vLLM's `cache_salt` and with a client's
/// `X-Data-Parallel-Rank`, when given; the request must succeed.
async fn post(
    k: &Kvroute,
    path: &str,
    mut body: serde_json::Value,
    salt: Option<&str>,
    client_rank: Option<&str>,
) -> reqwest::Response {
    if let Some(s) = salt {
        body["cache_salt"] = s.into();
    }
    let mut req = common::client().post(k.url(path)).json(&body);
    if let Some(r) = client_rank {
        req = req.header("X-Data-Parallel-Rank", r);
    }
    let r = req.send().await.expect("request");
    assert_eq!(r.status(), 200, "{path} {body}");
    r
}

async fn chat(k: &Kvroute, messages: &serde_json::Value) -> String {
    chat_salted(k, messages, None).await
}

/// [`chat`] under vLLM's `cache_salt`, if given.
async fn chat_salted(k: &Kvroute, messages: &serde_json::Value, salt: Option<&str>) -> String {
    let body = serde_json::json!({"model": "sim-llama-8b", "messages": messages, "max_tokens": 24});
    let r = post(k, "/v1/chat/completions", body, salt, None).await;
    let v: serde_json::Value = r.json().await.expect("json");
    v["choices"][0]["message"]["content"]
        .as_str()
        .expect("content")
        .to_string()
}

fn cached_by_index(k: &Kvroute, source: &str) -> f64 {
    k.metric_sum(
        "kvroute_cached_prompt_tokens_by_index_total",
        &[("index", "exact"), ("source", source)],
    )
}

/// A simulated engine's own events: a conversation's next turn is predicted exactly as cached
/// as the engine reports it, and a killed engine's blocks are gone at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_events_predict_the_cache_exactly_and_a_killed_engine_forgets() {
    let sim_args = |events: u16| {
        vec![
            "--kv-events".to_string(),
            events.to_string(),
            "--tokenizer".to_string(),
            chatml_dir(),
        ]
    };
    // Fixed ports, so that the restarted engine is where kvroute expects it; a port another
    // test takes first is tried again with others.
    let (http, args, mut sim) = (0..5)
        .find_map(|_| {
            let (http, events) = (free_port(), free_port());
            let args = sim_args(events);
            let argv: Vec<&str> = args.iter().map(String::as_str).collect();
            Sim::try_start_at(http, &argv).map(|sim| (http, args, sim))
        })
        .expect("a simulator on free ports");
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let k = Kvroute::start_with(&[(sim.addr, endpoints_yaml(&sim))], &tokenizer_yaml());
    wait_for(
        "a fresh engine to be synced",
        Duration::from_secs(10),
        || kv_state(&k, sim.addr)["state"] == "synced",
    );
    let system = "You are a careful assistant who answers in full sentences. ".repeat(20);
    let mut messages = serde_json::json!([
        {"role": "system", "content": system},
        {"role": "user", "content": "Tell me about the tides and the moon, at length please."},
    ]);
    for turn in 0..3 {
        let reply = chat(&k, &messages).await;
        let (ours, theirs) = wait_in_step(&k, &sim, Duration::from_secs(5));
        assert_eq!(
            ours, theirs,
            "turn {turn}: the index follows the engine's blocks"
        );
        let list = messages.as_array_mut().expect("array");
        list.push(serde_json::json!({"role": "assistant", "content": reply}));
        list.push(
            serde_json::json!({"role": "user", "content": format!("And then, part {turn}?")}),
        );
    }
    let (predicted, reported) = (
        cached_by_index(&k, "predicted"),
        cached_by_index(&k, "reported"),
    );
    eprintln!("exact index: predicted {predicted} cached tokens, engine reported {reported}");
    // Every turn's decision is counted under the index behind it; a turn whose prompt was not
    // tokenized within the budget (a loaded machine) is placed on the approximate index.
    let decided = |index| {
        k.metric_sum(
            "kvroute_routing_decisions_by_index_total",
            &[("index", index)],
        )
    };
    let (exact, approximate) = (decided("exact"), decided("approximate"));
    assert_eq!(exact + approximate, 3.0, "one decision a turn");
    assert!(exact >= 1.0, "turns placed on the engine's events: {exact}");
    assert!(
        reported > 500.0,
        "later turns hit the engine's cache: {reported}"
    );
    assert_eq!(
        predicted, reported,
        "the exact index predicts the engine's cached tokens"
    );
    // Each answer's reply was tokenized in the background, for its next turn: one request at a
    // time here, so a tokenizing slot was always free by then.
    let text = k.metrics_when(
        "kvroute_exact_replies_tokenized_total",
        &[("outcome", "tokenized")],
        3.0,
    );
    let replies = |o: &str| {
        metric_sum(
            &text,
            "kvroute_exact_replies_tokenized_total",
            &[("outcome", o)],
        )
    };
    assert_eq!(
        (replies("tokenized"), replies("skipped"), replies("failed")),
        (3.0, 0.0, 0.0)
    );

    // kill -9: the stream's connection drops, and the blocks go with it.
    sim.kill();
    let killed = Instant::now();
    wait_for(
        "the killed engine's blocks to go",
        Duration::from_secs(1),
        || kv_state(&k, sim.addr)["blocks"] == 0,
    );
    assert!(killed.elapsed() < Duration::from_secs(1));
    // Restarted on the same ports: followed again from its (empty) start.
    let sim = Sim::start_at(http, &args);
    wait_for(
        "the restarted engine to be followed",
        Duration::from_secs(15),
        || kv_state(&k, sim.addr)["state"] == "synced",
    );
    assert_eq!(kv_state(&k, sim.addr)["blocks"], 0);
}

/// vLLM's `cache_salt`: an engine shares cached blocks only between requests with the same
/// salt. Its events name the salt in the first block's extra keys, and kvroute salts a
/// request's blocks the same way, so equal prompts under other salts are predicted to miss.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cache_salt_keeps_equal_prompts_apart() {
    let sim = Sim::start(&["--kv-events", "0", "--tokenizer", &chatml_dir()]);
    let k = Kvroute::start_with(&[(sim.addr, endpoints_yaml(&sim))], &tokenizer_yaml());
    wait_for("the engine to be synced", Duration::from_secs(10), || {
        kv_state(&k, sim.addr)["state"] == "synced"
    });
    let system = "You answer questions about tenancy law in plain words. ".repeat(20);
    let messages = serde_json::json!([
        {"role": "system", "content": system},
        {"role": "user", "content": "May a landlord enter without notice?"},
    ]);
    // (salt, whether the engine holds the prompt under it by then)
    let turns = [
        (Some("tenant-a"), false),
        (Some("tenant-b"), false),
        (None, false),
        (Some("tenant-a"), true),
        (Some("tenant-b"), true),
    ];
    for (i, (salt, hit)) in turns.into_iter().enumerate() {
        let before = (
            cached_by_index(&k, "predicted"),
            cached_by_index(&k, "reported"),
        );
        chat_salted(&k, &messages, salt).await;
        let (ours, theirs) = wait_in_step(&k, &sim, Duration::from_secs(5));
        assert_eq!(ours, theirs, "request {i}: the index follows the engine");
        let predicted = cached_by_index(&k, "predicted") - before.0;
        let reported = cached_by_index(&k, "reported") - before.1;
        eprintln!("request {i} ({salt:?}): predicted {predicted}, engine reported {reported}");
        assert_eq!(
            reported > 200.0,
            hit,
            "request {i} ({salt:?}): the engine's hit: {reported}"
        );
        assert_eq!(predicted, reported, "request {i} ({salt:?})");
    }
    // A client does not pick the engine's data-parallel rank: its header never reaches it.
    let body = serde_json::json!({"model": "sim-llama-8b", "messages": messages, "max_tokens": 2});
    let _ = post(&k, "/v1/chat/completions", body, None, Some("3"))
        .await
        .bytes()
        .await;
    let log = sim.requests();
    assert_eq!(
        log.last().expect("logged")["dp_rank"],
        serde_json::Value::Null
    );
}

/// 5% of the engine's batches never reach kvroute: every gap is replayed, and the index ends
/// exactly where the engine's cache is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_batches_are_replayed_with_no_lasting_divergence() {
    let dir = chatml_dir();
    let sim = Sim::start(&[
        "--kv-events",
        "0",
        "--kv-events-drop-percent",
        "5",
        "--tokenizer",
        &dir,
        "--kv-tokens",
        "3000",
    ]);
    let k = Kvroute::start_with(&[(sim.addr, endpoints_yaml(&sim))], &tokenizer_yaml());
    wait_for(
        "a fresh engine to be synced",
        Duration::from_secs(10),
        || kv_state(&k, sim.addr)["state"] == "synced",
    );
    // Conversations that share a prefix, overflow the small cache (evictions) and interleave.
    let mut tasks = Vec::new();
    for c in 0..8 {
        let k_url = k.url("/v1/chat/completions");
        tasks.push(tokio::spawn(async move {
            let mut messages = serde_json::json!([
                {"role": "system", "content": "Shared instructions for every conversation. ".repeat(30)},
                {"role": "user", "content": format!("Conversation {c}: {}", "a question ".repeat(40 + c * 7))},
            ]);
            for _ in 0..4 {
                let body = serde_json::json!({"model": "sim-llama-8b", "messages": messages, "max_tokens": 40});
                let r = common::client().post(&k_url).json(&body).send().await.expect("request");
                assert_eq!(r.status(), 200);
                let v: serde_json::Value = r.json().await.expect("json");
                let reply = v["choices"][0]["message"]["content"].as_str().unwrap_or_default().to_string();
                let list = messages.as_array_mut().expect("array");
                list.push(serde_json::json!({"role": "assistant", "content": reply}));
                list.push(serde_json::json!({"role": "user", "content": "More, please."}));
            }
        }));
    }
    for t in tasks {
        t.await.expect("conversation");
    }
    let (ours, theirs) = wait_in_step(&k, &sim, Duration::from_secs(5));
    eprintln!("after the load: kvroute {ours} blocks, engine {theirs}");
    assert_eq!(
        ours, theirs,
        "kvroute's blocks are the engine's once the gaps are replayed"
    );
    let m = k.metrics();
    let b = sim.addr.to_string();
    let sum = |outcome| {
        common::metric_sum(
            &m,
            "kvroute_kv_event_batches_total",
            &[("backend", &b), ("outcome", outcome)],
        )
    };
    let (_, sim_metrics) = common::http_get(sim.addr, "/metrics");
    let dropped = common::metric_sum(
        &String::from_utf8_lossy(&sim_metrics),
        "kvbench_kv_events_dropped_total",
        &[],
    );
    eprintln!(
        "dropped {dropped}, replayed {}, received {}",
        sum("replayed"),
        sum("received")
    );
    assert!(dropped > 0.0, "the engine dropped some batches");
    assert!(
        sum("replayed") >= dropped,
        "every dropped batch was replayed ({} of {dropped})",
        sum("replayed")
    );
    assert_eq!(sum("lost"), 0.0);
    let removed = common::metric_sum(
        &m,
        "kvroute_kv_event_blocks_total",
        &[("backend", &b), ("change", "removed")],
    );
    assert!(
        removed > 0.0,
        "the small cache evicted blocks, and kvroute followed"
    );
    assert_eq!(kv_state(&k, sim.addr)["state"], "synced");
}

/// KV events switched on by a reload (the tokenizer loaded then), and off again: the backend
/// is followed, then forgotten.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_starts_and_stops_following() {
    let dir = chatml_dir();
    let sim = Sim::start(&["--kv-events", "0", "--tokenizer", &dir]);
    let k = Kvroute::start(&[sim.addr], "");
    assert!(
        kv_state(&k, sim.addr).is_null(),
        "not configured: no kv_events entry"
    );
    let reload = |yaml: String, count: f64| {
        k.write_config(&[], &yaml);
        common::signal(k.pid(), "HUP");
        let m = k.metrics_when(
            "kvroute_config_reloads_total",
            &[("result", "success")],
            count,
        );
        assert_eq!(
            common::metric_sum(&m, "kvroute_config_reloads_total", &[("result", "success")]),
            count,
            "reload {count} took effect; log:\n{}",
            k.log()
        );
    };
    let with_events =
        common::backends_yaml(&[(sim.addr, endpoints_yaml(&sim))]) + &tokenizer_yaml();
    reload(with_events, 1.0);
    wait_for(
        "the reloaded config's subscriber",
        Duration::from_secs(10),
        || kv_state(&k, sim.addr)["state"] == "synced",
    );
    // A bad tokenizer path is refused, and the subscriber keeps running.
    let broken = common::backends_yaml(&[(sim.addr, endpoints_yaml(&sim))])
        + "  kv_events:\n    tokenizer: \"/nonexistent/tokenizer.json\"\n    tokenizer_config: \"/nonexistent/tokenizer_config.json\"\n";
    k.write_config(&[], &broken);
    common::signal(k.pid(), "HUP");
    let m = k.metrics_when(
        "kvroute_config_reloads_total",
        &[("result", "failure")],
        1.0,
    );
    assert_eq!(
        common::metric_sum(&m, "kvroute_config_reloads_total", &[("result", "failure")]),
        1.0
    );
    assert_eq!(kv_state(&k, sim.addr)["state"], "synced");
    // Off again: the backend's knowledge is dropped, and so is its sync state (an alert on
    // `off` means configured but not followed).
    reload(common::backends_yaml(&[(sim.addr, String::new())]), 2.0);
    wait_for("the subscriber to stop", Duration::from_secs(10), || {
        !k.metrics().contains("kvroute_kv_events_sync{")
    });
    assert!(
        kv_state(&k, sim.addr).is_null(),
        "/debug/backends no longer shows a kv_events entry"
    );
}

/// `kv_events.tokenizers`: a model named there is tokenized with its own files, not with the
/// catch-all tokenizer. The catch-all here renders another model family's template (one more
/// line before the conversation), so every block it hashes misses the engine's; the model's own
/// entry predicts the engine's cached tokens exactly. A reload that drops the entry sends the
/// model to the catch-all, and the prediction falls away from the engine's report.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_model_is_tokenized_with_its_own_tokenizer() {
    let dir = repo().join("bench/data/tokenizer/chatml-bpe8k");
    let other = std::env::temp_dir().join(format!("kvroute-test-{}-family", std::process::id()));
    std::fs::create_dir_all(&other).expect("temp dir");
    let mut config: serde_json::Value = serde_json::from_slice(
        &std::fs::read(dir.join("tokenizer_config.json")).expect("the shipped config"),
    )
    .expect("json");
    let template = config["chat_template"]
        .as_str()
        .expect("template")
        .to_string();
    config["chat_template"] = format!("Another family's preamble.\n{template}").into();
    let other_config = other.join("tokenizer_config.json");
    std::fs::write(&other_config, config.to_string()).expect("write");

    let sim = Sim::start(&["--kv-events", "0", "--tokenizer", &chatml_dir()]);
    let tokenizer = dir.join("tokenizer.json");
    let catch_all = format!(
        "  kv_events:\n    tokenizer: \"{}\"\n    tokenizer_config: \"{}\"\n",
        tokenizer.display(),
        other_config.display()
    );
    let with_entry = format!(
        "{catch_all}    tokenizers:\n      - models: [sim-llama-8b]\n        tokenizer: \"{}\"\n        tokenizer_config: \"{}\"\n",
        tokenizer.display(),
        dir.join("tokenizer_config.json").display()
    );
    let k = Kvroute::start_with(&[(sim.addr, endpoints_yaml(&sim))], &with_entry);
    wait_for("the engine to be synced", Duration::from_secs(10), || {
        kv_state(&k, sim.addr)["state"] == "synced"
    });
    let system = "You are a patient tutor who explains with small examples. ".repeat(20);
    let messages = serde_json::json!([
        {"role": "system", "content": system},
        {"role": "user", "content": "Explain how a sundial tells the time, step by step."},
    ]);
    let messages = converse(&k, &sim, messages, 3).await;
    let (predicted, reported) = (
        cached_by_index(&k, "predicted"),
        cached_by_index(&k, "reported"),
    );
    assert!(reported > 500.0, "later turns hit the cache: {reported}");
    assert_eq!(
        predicted, reported,
        "the model's own tokenizer predicts the engine exactly"
    );

    // Without its entry, the model falls to the catch-all and its blocks no longer match.
    k.write_config(
        &[],
        &(common::backends_yaml(&[(sim.addr, endpoints_yaml(&sim))]) + &catch_all),
    );
    common::signal(k.pid(), "HUP");
    k.metrics_when(
        "kvroute_config_reloads_total",
        &[("result", "success")],
        1.0,
    );
    wait_for(
        "the engine to be synced again",
        Duration::from_secs(10),
        || kv_state(&k, sim.addr)["state"] == "synced",
    );
    converse(&k, &sim, messages, 2).await;
    let (predicted2, reported2) = (
        cached_by_index(&k, "predicted") - predicted,
        cached_by_index(&k, "reported") - reported,
    );
    assert!(reported2 > 500.0, "the engine still hits: {reported2}");
    assert!(
        predicted2 < reported2 / 2.0,
        "another family's template misses the engine's blocks: predicted {predicted2}, \
         reported {reported2}"
    );
    let _ = std::fs::remove_dir_all(&other);
}

/// `count` more turns of `messages`, each answered and followed by the index.
async fn converse(
    k: &Kvroute,
    sim: &Sim,
    mut messages: serde_json::Value,
    count: usize,
) -> serde_json::Value {
    for turn in 0..count {
        let reply = chat(k, &messages).await;
        wait_in_step(k, sim, Duration::from_secs(5));
        let list = messages.as_array_mut().expect("array");
        list.push(serde_json::json!({"role": "assistant", "content": reply}));
        list.push(serde_json::json!({"role": "user", "content": format!("Go on ({turn}).")}));
    }
    messages
}

/// Exact cached tokens of one API's kv_aware decisions, predicted and as the engine reported.
fn exact_by_api(k: &Kvroute, api: &str) -> (f64, f64) {
    let get = |source| {
        k.metric_sum(
            "kvroute_cached_prompt_tokens_by_index_total",
            &[("index", "exact"), ("source", source), ("api", api)],
        )
    };
    (get("predicted"), get("reported"))
}

/// The agent APIs on the exact index: a coding loop through Responses and one through Messages
/// (tools, every reply a forced tool call sent back with its result) are tokenized as the
/// engine converts them to chat, so each next turn is predicted exactly as cached as the
/// engine reports it, the calls included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_apis_are_predicted_exactly() {
    use serde_json::json;
    let sim = Sim::start(&["--kv-events", "0", "--tokenizer", &chatml_dir()]);
    let k = Kvroute::start_with(&[(sim.addr, endpoints_yaml(&sim))], &tokenizer_yaml());
    wait_for("the engine to be synced", Duration::from_secs(10), || {
        kv_state(&k, sim.addr)["state"] == "synced"
    });
    let system = "You are a coding agent working in a large repository. ".repeat(20);
    let schema = json!({"type": "object", "properties": {"command": {"type": "string"}}});

    let tools = json!([{"type": "function", "name": "run", "description": "Runs a command",
                        "parameters": schema}]);
    let mut input = vec![json!({"role": "user", "content": "Fix the failing test, please."})];
    for turn in 0..3 {
        let body = json!({"model": "sim-llama-8b", "instructions": system, "input": input,
            "tools": tools, "tool_choice": "required", "max_output_tokens": 24, "store": false});
        let v: serde_json::Value = post(&k, "/v1/responses", body, None, None)
            .await
            .json()
            .await
            .expect("json");
        let (ours, theirs) = wait_in_step(&k, &sim, Duration::from_secs(5));
        assert_eq!(
            ours, theirs,
            "responses turn {turn}: the index follows the engine"
        );
        let call = v["output"][0].clone();
        assert_eq!(call["type"], "function_call", "{v}");
        let output = json!({"type": "function_call_output", "call_id": call["call_id"],
                            "output": format!("turn {turn}: 3 passed, 1 failed")});
        input.extend([call, output]);
    }

    let tools = json!([{"name": "run", "description": "Runs a command", "input_schema": schema}]);
    let mut messages = vec![json!({"role": "user", "content": "Fix the lint errors, please."})];
    for turn in 0..3 {
        let body = json!({"model": "sim-llama-8b", "system": system, "messages": messages,
            "tools": tools, "tool_choice": {"type": "any"}, "max_tokens": 24});
        let v: serde_json::Value = post(&k, "/v1/messages", body, None, None)
            .await
            .json()
            .await
            .expect("json");
        let (ours, theirs) = wait_in_step(&k, &sim, Duration::from_secs(5));
        assert_eq!(
            ours, theirs,
            "messages turn {turn}: the index follows the engine"
        );
        let call = v["content"][0].clone();
        assert_eq!(call["type"], "tool_use", "{v}");
        messages.push(json!({"role": "assistant", "content": [call.clone()]}));
        messages.push(json!({"role": "user", "content": [{"type": "tool_result",
            "tool_use_id": call["id"], "content": format!("turn {turn}: 2 warnings")}]}));
    }

    for api in ["responses", "messages"] {
        let (predicted, reported) = exact_by_api(&k, api);
        eprintln!("{api}: exact index predicted {predicted}, engine reported {reported}");
        // The later turns hit the system prompt, the tools and every call sent back.
        assert!(
            reported > 300.0,
            "{api}: later turns hit the cache: {reported}"
        );
        assert_eq!(
            predicted, reported,
            "{api}: the exact index predicts the engine"
        );
    }
}

/// Six single-block batches from the reference publisher with `extra` arguments, kvroute
/// subscribed before they go out (so the later ones arrive live); returns once every block is
/// known, with kvroute and the publisher still running.
async fn live_batches(extra: &[&str]) -> Option<(Kvroute, Sim, Publisher, PathBuf)> {
    live_batches_until(extra, 6).await
}

/// [`live_batches`], returning once the last batch is in and kvroute knows `blocks` blocks.
async fn live_batches_until(
    extra: &[&str],
    blocks: u64,
) -> Option<(Kvroute, Sim, Publisher, PathBuf)> {
    let py = python()?;
    let sim = Sim::start(&[]);
    let (publish, replay) = (free_port(), free_port());
    let batches: Vec<serde_json::Value> = (0..6u32)
        .map(|i| {
            let tokens: Vec<u32> = (i * 16..i * 16 + 16).collect();
            serde_json::json!([{"type": "BlockStored", "block_hashes": [100 + i],
                "parent_block_hash": null, "token_ids": tokens, "block_size": 16}])
        })
        .collect();
    let dir = std::env::temp_dir().join(format!(
        "kvroute-kv-live-{}-{}",
        std::process::id(),
        extra.join("")
    ));
    std::fs::create_dir_all(&dir).expect("dir");
    let file = dir.join("batches.json");
    std::fs::write(&file, serde_json::json!(batches).to_string()).expect("write");
    let k = Kvroute::start_with(
        &[(sim.addr, kv_events_yaml(publish, replay))],
        &tokenizer_yaml(),
    );
    let mut cmd = Command::new(&py);
    cmd.arg(repo().join("bench/scripts/kv_events_reference.py"))
        .args(["--pub", &format!("tcp://127.0.0.1:{publish}")])
        .args(["--replay", &format!("tcp://127.0.0.1:{replay}")])
        .arg("--events")
        .arg(&file)
        // The odd frames go out two seconds in: kvroute has long joined by then.
        .args(["--interval-ms", "400", "--repeat-seconds", "30"])
        .args(extra)
        .stderr(Stdio::null());
    let publisher = Publisher(cmd.spawn().expect("start the reference publisher"));
    let received = |k: &Kvroute| {
        k.metric_sum(
            "kvroute_kv_event_batches_total",
            &[("backend", &sim.addr.to_string()), ("outcome", "received")],
        )
    };
    // Every batch in (live ones counted as received, the first few maybe replayed at the
    // join), and the blocks they leave.
    wait_for("every batch", Duration::from_secs(15), || {
        received(&k) >= 3.0 && kv_state(&k, sim.addr)["blocks"] == blocks
    });
    Some((k, sim, publisher, dir))
}

fn batches_of(k: &Kvroute, sim: &Sim, outcome: &str) -> f64 {
    k.metric_sum(
        "kvroute_kv_event_batches_total",
        &[("backend", &sim.addr.to_string()), ("outcome", outcome)],
    )
}

/// vLLM delivers at least once: a batch sent again with its sequence number is recognised and
/// ignored, not taken for the engine restarting (which forgets the backend's blocks and
/// replays its history).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_delivered_twice_is_not_a_restart() {
    let Some((k, sim, _publisher, dir)) = live_batches(&["--resend", "4"]).await else {
        return;
    };
    wait_for("the batch sent again", Duration::from_secs(5), || {
        batches_of(&k, &sim, "duplicate") == 1.0
    });
    assert_eq!(kv_state(&k, sim.addr)["state"], "synced");
    assert!(!k.log().contains("restarted its sequence"), "{}", k.log());
    // Only the join replayed history: the copy did not start a replay from 0.
    let replayed = batches_of(&k, &sim, "replayed");
    assert!(replayed <= 5.0, "replayed {replayed} batches");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A sequence number far past the engine's own history (a corrupt frame) is skipped as
/// malformed: the backend's blocks are not forgotten, and the batches after it are not taken
/// for a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_far_ahead_sequence_number_does_not_wipe_the_backend() {
    let Some((k, sim, _publisher, dir)) = live_batches(&["--bogus-after", "3"]).await else {
        return;
    };
    assert_eq!(batches_of(&k, &sim, "malformed"), 1.0);
    assert_eq!(batches_of(&k, &sim, "lost"), 0.0);
    assert_eq!(kv_state(&k, sim.addr)["state"], "synced");
    let log = k.log();
    assert!(
        !log.contains("forgotten") && !log.contains("restarted"),
        "{log}"
    );
    assert!(log.contains("past the engine's history"), "{log}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// An event kvroute cannot decode does not drop its batch whole while the backend stays
/// synced: the batch's other events are applied, and since what the unknown one did is not
/// known, the backend's earlier blocks are forgotten and it turns partial.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undecodable_event_applies_the_rest_and_resyncs() {
    let Some((k, sim, _publisher, dir)) = live_batches_until(&["--garbage-in", "3"], 3).await
    else {
        return;
    };
    // Blocks 100-102 forgotten; 103 (the garbage's batch), 104 and 105 applied. (Three blocks
    // are also what the first three batches leave: wait for the state after the last.)
    wait_for(
        "the batches after the garbage",
        Duration::from_secs(10),
        || {
            let state = kv_state(&k, sim.addr);
            state["state"] == "partial" && state["blocks"] == 3
        },
    );
    let undecodable = k.metric_sum(
        "kvroute_kv_events_total",
        &[
            ("backend", &sim.addr.to_string()),
            ("outcome", "undecodable"),
        ],
    );
    assert_eq!(undecodable, 1.0);
    assert!(k.log().contains("undecodable event"), "{}", k.log());
    let _ = std::fs::remove_dir_all(&dir);
}
