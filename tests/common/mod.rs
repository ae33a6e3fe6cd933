//! Test harness: real processes on 127.0.0.1. `Sim::start` runs one simulated GPU server
//! (`kvbench sim`) per process so a test can kill one; `Kvroute::start` runs the proxy binary
//! against them. Readiness is a printed line or a successful HTTP answer, never a fixed sleep.
#![allow(dead_code)]

pub mod certs;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The kvbench binary, built by `cargo test --workspace` next to this test's binary.
fn kvbench_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let dir = exe.parent().and_then(|d| d.parent()).expect("target dir");
    let bin = dir.join("kvbench");
    assert!(
        bin.exists(),
        "{} not found: run the tests with `cargo test --workspace` (or `cargo build -p kvbench` first)",
        bin.display()
    );
    bin
}

pub struct Sim {
    child: Child,
    pub addr: SocketAddr,
    /// With `--kv-events`: the server's PUB and replay endpoints.
    pub kv_events: Option<(String, String)>,
}

impl Sim {
    /// One simulated server; `args` are extra `kvbench sim` flags (e.g. `--ttft-ms 50`).
    pub fn start(args: &[&str]) -> Sim {
        Self::start_at(0, args)
    }

    /// One simulated server on `port` (0: any free one).
    pub fn start_at(port: u16, args: &[&str]) -> Sim {
        Self::try_start_at(port, args).expect("sim printed no address")
    }

    /// Like [`Sim::start_at`], but `None` when the simulator exits before it is ready: a port
    /// another test took in the meantime (fixed ports race with tests running in parallel).
    pub fn try_start_at(port: u16, args: &[&str]) -> Option<Sim> {
        let mut child = Command::new(kvbench_bin())
            .args(["sim", "--servers", "1", "--base-port", &port.to_string()])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn kvbench sim");
        let stdout = child.stdout.take().expect("stdout");
        let mut lines = BufReader::new(stdout).lines();
        let mut addr = None;
        let mut kv_events = None;
        for line in lines.by_ref() {
            let line = line.expect("read sim stdout");
            if let Some(rest) = line.strip_prefix("kvbench-sim kv-events index 0 pub ") {
                if let Some((publish, replay)) = rest.split_once(" replay ") {
                    kv_events = Some((publish.to_string(), replay.to_string()));
                }
            }
            if let Some(rest) = line.strip_prefix("kvbench-sim listening ") {
                let a = rest.split_whitespace().next().expect("addr");
                addr = Some(a.parse().expect("sim addr"));
            }
            if line == "kvbench-sim ready" {
                break;
            }
        }
        // Keep draining stdout so the simulator never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        match addr {
            Some(addr) => Some(Sim {
                child,
                addr,
                kv_events,
            }),
            None => {
                let _ = child.kill();
                let _ = child.wait();
                None
            }
        }
    }

    pub fn start_n(n: usize, args: &[&str]) -> Vec<Sim> {
        (0..n).map(|_| Sim::start(args)).collect()
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Stop the simulator's process (SIGSTOP): a hung engine, its connections open.
    pub fn freeze(&self) {
        signal(self.child.id(), "STOP");
    }

    /// Requests this server has received (`GET /debug/requests`).
    pub fn requests(&self) -> Vec<serde_json::Value> {
        let (status, body) = http_get(self.addr, "/debug/requests");
        assert_eq!(status, 200);
        serde_json::from_slice(&body).expect("debug/requests json")
    }
}

impl Drop for Sim {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The hex SHA-256 of an API key, as `access.keys[].sha256` takes it.
pub fn key_sha256(key: &[u8]) -> String {
    kvroute::digest(key)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Change a simulated server's faults (`POST /debug/faults`).
pub fn set_faults(sim: SocketAddr, update: serde_json::Value) {
    let body = update.to_string();
    let mut s = TcpStream::connect(sim).unwrap();
    write!(
        s,
        "POST /debug/faults HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    assert_eq!(
        parse_response(&raw).map(|r| r.0),
        Some(200),
        "faults update"
    );
}

/// The items of a `backends:` list, each with its own extra lines.
pub fn backends_yaml(backends: &[(SocketAddr, String)]) -> String {
    backends
        .iter()
        .map(|(a, lines)| format!("    - addr: \"{a}\"\n{lines}"))
        .collect()
}

/// A free loopback port (bound, then released for the child to take).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

pub struct Kvroute {
    child: Option<Child>,
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    pub dir: PathBuf,
    server_keys: String,
}

impl Kvroute {
    /// Start kvroute in front of `backends`. `extra` is YAML appended under `kvroute:`
    /// (indented two spaces), e.g. `"  routing:\n    policy: session_hash\n"`.
    pub fn start(backends: &[SocketAddr], extra: &str) -> Kvroute {
        let k = Self::start_unready(backends, extra);
        k.wait_ready();
        k
    }

    /// Start without waiting for a healthy backend: waits only for the listeners.
    pub fn start_unready(backends: &[SocketAddr], extra: &str) -> Kvroute {
        Self::launch(backends, extra, "grace_period_seconds: 0\n")
    }

    /// Start with per-backend YAML: each backend's `(addr, lines)`, the lines under its
    /// `- addr:` item (indented six spaces), e.g. `"      weight: 2\n"`.
    pub fn start_with(backends: &[(SocketAddr, String)], extra: &str) -> Kvroute {
        let mut with = extra.to_string();
        with.insert_str(0, &backends_yaml(backends));
        let k = Self::launch(&[], &with, "grace_period_seconds: 0\n");
        k.wait_ready();
        k
    }

    /// Start with `server_keys` (Pingora's top-level keys, one per line) in the file.
    pub fn launch(backends: &[SocketAddr], extra: &str, server_keys: &str) -> Kvroute {
        // Tests of one binary run in parallel in one process: number their directories.
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "kvroute-test-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        // Two ports taken and released in turn can be the same one.
        let admin_port = loop {
            let p = free_port();
            if p != addr.port() {
                break p;
            }
        };
        let admin: SocketAddr = format!("127.0.0.1:{admin_port}").parse().unwrap();
        let mut k = Kvroute {
            child: None,
            addr,
            admin,
            dir,
            server_keys: server_keys.to_string(),
        };
        k.write_config(backends, extra);
        k.child = Some(k.spawn(&[]));
        k.wait_for(|| {
            TcpStream::connect(k.addr).is_ok() && try_http_get(k.admin, "/healthz").is_some()
        });
        k
    }

    pub fn conf(&self) -> PathBuf {
        self.dir.join("kvroute.yaml")
    }

    /// (Re)write the config file: `backends`, and `extra` appended under `kvroute:`.
    pub fn write_config(&self, backends: &[SocketAddr], extra: &str) {
        let mut yaml = format!(
            "version: 1\nthreads: 2\npid_file: {d}/kvroute.pid\nupgrade_sock: {d}/upgrade.sock\n\
             graceful_shutdown_timeout_seconds: 1\n{keys}\
             kvroute:\n  listen: \"{addr}\"\n  admin_listen: \"{admin}\"\n  backends:\n",
            d = self.dir.display(),
            keys = self.server_keys,
            addr = self.addr,
            admin = self.admin,
        );
        for b in backends {
            yaml.push_str(&format!("    - addr: \"{b}\"\n"));
        }
        yaml.push_str(extra);
        std::fs::write(self.conf(), yaml).expect("write config");
    }

    /// Another kvroute process on this config (e.g. `&["-u"]` for an upgrade), logging to the
    /// same file.
    pub fn spawn(&self, args: &[&str]) -> Child {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("kvroute.log"))
            .expect("log file");
        Command::new(env!("CARGO_BIN_EXE_kvroute"))
            .args(args)
            .arg("-c")
            .arg(self.conf())
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn kvroute")
    }

    /// The process started by `start`/`launch` (until replaced with `replace_child`).
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// Make `child` the process this handle owns and kills on drop; returns the previous one.
    /// Take the process this handle owns (it is no longer killed on drop).
    pub fn take_child(&mut self) -> Option<Child> {
        self.child.take()
    }

    pub fn replace_child(&mut self, child: Child) -> Option<Child> {
        self.child.replace(child)
    }

    pub fn wait_ready(&self) {
        self.wait_for(|| matches!(try_http_get(self.admin, "/readyz"), Some((200, _))));
    }

    fn wait_for(&self, ok: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("kvroute did not start; log:\n{}", self.log());
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("kvroute.log")).unwrap_or_default()
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    pub fn metrics(&self) -> String {
        let (status, body) = http_get(self.admin, "/metrics");
        assert_eq!(status, 200);
        String::from_utf8(body).expect("utf8 metrics")
    }

    /// Metrics text once `name{labels}` sums to at least `min` (the access-log phase that
    /// records a request runs just after its last byte reaches the client).
    pub fn metrics_when(&self, name: &str, labels: &[(&str, &str)], min: f64) -> String {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let text = self.metrics();
            if metric_sum(&text, name, labels) >= min || Instant::now() > deadline {
                return text;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Sum of a metric's samples whose label set contains every `labels` pair.
    pub fn metric_sum(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        metric_sum(&self.metrics(), name, labels)
    }
}

impl Drop for Kvroute {
    fn drop(&mut self) {
        if let Some(child) = self.child.as_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Send `signal` (e.g. "HUP", "QUIT") to `pid`.
pub fn signal(pid: u32, signal: &str) {
    let ok = Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(pid.to_string())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(ok, "kill -{signal} {pid} failed");
}

pub fn metric_sum(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter(|l| {
            labels
                .iter()
                .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn try_http_get(addr: SocketAddr, path: &str) -> Option<(u16, Vec<u8>)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).ok()?;
    parse_response(&raw)
}

pub fn http_get(addr: SocketAddr, path: &str) -> (u16, Vec<u8>) {
    try_http_get(addr, path).unwrap_or_else(|| panic!("GET {path} on {addr} failed"))
}

/// Status and de-chunked body of a raw HTTP/1.1 response read to EOF.
pub fn parse_response(raw: &[u8]) -> Option<(u16, Vec<u8>)> {
    let end = raw.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = std::str::from_utf8(&raw[..end]).ok()?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    let body = &raw[end + 4..];
    let chunked = head.lines().any(|l| {
        l.to_ascii_lowercase().starts_with("transfer-encoding:")
            && l.to_ascii_lowercase().contains("chunked")
    });
    if !chunked {
        return Some((status, body.to_vec()));
    }
    let mut out = Vec::new();
    let mut rest = body;
    loop {
        let nl = rest.windows(2).position(|w| w == b"\r\n")?;
        let size = usize::from_str_radix(std::str::from_utf8(&rest[..nl]).ok()?.trim(), 16).ok()?;
        rest = &rest[nl + 2..];
        if size == 0 {
            return Some((status, out));
        }
        out.extend_from_slice(rest.get(..size)?);
        rest = rest.get(size + 2..)?;
    }
}

pub fn chat_body(
    model: &str,
    messages: serde_json::Value,
    stream: bool,
    max_tokens: u32,
) -> serde_json::Value {
    serde_json::json!({"model": model, "messages": messages, "stream": stream, "max_tokens": max_tokens})
}

pub const MODEL: &str = "sim-llama-8b";

/// The OpenAI error object of a JSON error body, asserting its shape.
pub fn error_of(body: &[u8]) -> serde_json::Value {
    let v: serde_json::Value = serde_json::from_slice(body)
        .unwrap_or_else(|_| panic!("error body is not JSON: {}", String::from_utf8_lossy(body)));
    let e = v["error"].clone();
    assert!(e["message"].is_string(), "no error.message in {v}");
    assert!(e["type"].is_string(), "no error.type in {v}");
    assert!(e.get("code").is_some(), "no error.code in {v}");
    e
}

/// An HTTP client with a 30 s deadline per request.
pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .expect("reqwest client")
}

/// Clients sending chat requests (streamed and not, in turn) continuously until stopped. Every
/// non-200, empty body or transport error is recorded; 200s are counted per answering server.
pub struct Load {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    sent: std::sync::Arc<std::sync::atomic::AtomicU64>,
    failures: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    per_server: std::sync::Arc<std::sync::Mutex<std::collections::HashMap<String, u64>>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    /// One worker per entry of `fresh_connections`: `true` opens a new connection for every
    /// request (so a refused connection would show), `false` keeps connections alive.
    pub fn start(url: &str, fresh_connections: &[bool], max_tokens: u32) -> Load {
        use std::sync::atomic::Ordering;
        let mut load = Load {
            stop: Default::default(),
            sent: Default::default(),
            failures: Default::default(),
            per_server: Default::default(),
            tasks: Vec::new(),
        };
        for (w, &fresh) in fresh_connections.iter().enumerate() {
            let (stop, sent, failures, per_server, url) = (
                load.stop.clone(),
                load.sent.clone(),
                load.failures.clone(),
                load.per_server.clone(),
                url.to_string(),
            );
            load.tasks.push(tokio::spawn(async move {
                let mut b = reqwest::Client::builder().timeout(Duration::from_secs(30));
                if fresh {
                    b = b.pool_max_idle_per_host(0);
                }
                let c = b.build().expect("reqwest client");
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let body = chat_body(
                        MODEL,
                        serde_json::json!([{"role": "user", "content": format!("load {w}/{i}")}]),
                        i % 2 == 0,
                        max_tokens,
                    );
                    sent.fetch_add(1, Ordering::Relaxed);
                    let failure = match c.post(&url).json(&body).send().await {
                        Ok(r) => {
                            let status = r.status().as_u16();
                            let server = r
                                .headers()
                                .get("x-kvbench-addr")
                                .and_then(|v| v.to_str().ok())
                                .unwrap_or_default()
                                .to_string();
                            match (status, r.bytes().await) {
                                (200, Ok(b)) if !b.is_empty() => {
                                    *per_server.lock().unwrap().entry(server).or_default() += 1;
                                    None
                                }
                                (_, Ok(b)) if b.is_empty() => Some(format!("{status}, empty body")),
                                (_, Ok(_)) => Some(format!("status {status}")),
                                (_, Err(e)) => Some(format!("body: {e}")),
                            }
                        }
                        Err(e) => Some(format!("{e:?}")),
                    };
                    if let Some(f) = failure {
                        failures.lock().unwrap().push(f);
                    }
                    i += 1;
                }
            }));
        }
        load
    }

    /// 200s so far, per answering server.
    pub fn per_server(&self) -> std::collections::HashMap<String, u64> {
        self.per_server.lock().unwrap().clone()
    }

    /// Stop and wait for the workers: requests sent, and the failures.
    pub async fn stop(self) -> (u64, Vec<String>) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for t in self.tasks {
            t.await.expect("load worker");
        }
        let failures = self.failures.lock().unwrap().clone();
        (
            self.sent.load(std::sync::atomic::Ordering::Relaxed),
            failures,
        )
    }
}

/// A simulated server's answer: its status, which server gave it (`x-kvbench-addr`), its body.
pub struct Answer {
    pub status: u16,
    pub server: String,
    pub body: String,
}

/// Send `req` and read the whole answer.
pub async fn send(req: reqwest::RequestBuilder) -> Answer {
    let resp = req.send().await.expect("request");
    let status = resp.status().as_u16();
    let server = resp
        .headers()
        .get("x-kvbench-addr")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    Answer {
        status,
        server,
        body: resp.text().await.expect("body"),
    }
}
