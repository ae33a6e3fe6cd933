//! The peer routers kvroute is measured against: sglang-router and vllm-router, Python
//! packages wrapping a Rust router, installed from PyPI into one venv by
//! `bench/scripts/install-peers.sh`. A run with a peer entry starts the peer in front of the
//! fresh fleet instead of kvroute, on a free loopback port, with its defaults except where a
//! default would get in the way of a benchmark (see `launch_args`).
//!
//! sglang-router tries to fetch a tokenizer from the internet for a model it learns from a
//! worker, so peers are meant to run in a loopback-only network namespace
//! (`bench/scripts/compare-in-netns.sh`).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use tokio::process::{Child, Command};

use super::pd;
use super::policy::{Member, PeerRouter, PolicyRun};

/// Time a peer gets to register every worker and answer. The routers start in well under a
/// second here; the margin is for a loaded machine.
const READY_TIMEOUT: Duration = Duration::from_secs(60);
/// Time a peer gets to exit after SIGTERM before its process group is killed. Both routers
/// otherwise wait minutes for in-flight requests, and a run that is over has none it needs.
const STOP_TIMEOUT: Duration = Duration::from_secs(5);

impl PeerRouter {
    /// The Python module whose `main` launches the router alone (the form each package's
    /// `--help` documents).
    fn module(self) -> &'static str {
        match self {
            PeerRouter::Sglang => "sglang_router.launch_router",
            PeerRouter::Vllm => "vllm_router.launch_router",
        }
    }

    /// The switch of its P/D mode (`PEER/pd` entries).
    fn pd_switch(self) -> &'static str {
        match self {
            PeerRouter::Sglang => "--pd-disaggregation",
            PeerRouter::Vllm => "--vllm-pd-disaggregation",
        }
    }

    /// Their `--log-level` choices differ: sglang-router takes `warn`, vllm-router `warning`.
    fn warn_level(self) -> &'static str {
        match self {
            PeerRouter::Sglang => "warn",
            PeerRouter::Vllm => "warning",
        }
    }
}

/// The venv's interpreter.
fn python(venv: &Path) -> PathBuf {
    venv.join("bin").join("python")
}

/// The router's arguments after `python -m MODULE`: `run`'s policy over `workers`, or for a
/// `PEER/pd` entry its P/D mode over their prefill and decode servers.
pub fn launch_args(
    peer: PeerRouter,
    run: &PolicyRun,
    listen: SocketAddr,
    prometheus: SocketAddr,
    workers: &[Member],
) -> Vec<String> {
    let mut args: Vec<String> = vec![
        "--host".into(),
        listen.ip().to_string(),
        "--port".into(),
        listen.port().to_string(),
    ];
    if run.pd.is_some() {
        let members: Vec<_> = workers
            .iter()
            .map(|m| (format!("http://{}", m.addr), m.role, m.bootstrap_port))
            .collect();
        args.extend(pd::peer_args(peer.pd_switch(), &members));
    } else {
        args.extend([
            "--policy".into(),
            run.policy.clone(),
            "--worker-urls".into(),
        ]);
        args.extend(workers.iter().map(|w| format!("http://{}", w.addr)));
    }
    args.extend([
        "--log-level".into(),
        peer.warn_level().into(),
        // Both default to port 29000 (sglang-router on every interface): a port of its own
        // on loopback keeps consecutive runs and other tools on this machine apart.
        "--prometheus-host".into(),
        prometheus.ip().to_string(),
        "--prometheus-port".into(),
        prometheus.port().to_string(),
        // The default 30 s between startup health checks would add up to 30 s per run when
        // the first check comes too early; the fleet is already up.
        "--worker-startup-check-interval".into(),
        "1".into(),
    ]);
    args
}

/// Each peer's installed version, `name version` joined by `, `; an error says how to
/// install them. Checked before the first run so a long comparison does not fail midway.
pub async fn versions(venv: &Path, peers: &[PeerRouter]) -> Result<String, String> {
    let mut out = Vec::new();
    for &peer in peers {
        let script = format!(
            "from importlib.metadata import version; import {}; print(version({:?}))",
            peer.module(),
            peer.name()
        );
        let result = Command::new(python(venv))
            .args(["-c", &script])
            .stdin(Stdio::null())
            .output()
            .await;
        let missing = || {
            format!(
                "{} is not installed in {}: run bench/scripts/install-peers.sh or pass --peer-venv",
                peer.name(),
                venv.display()
            )
        };
        let output = result.map_err(|e| format!("{}: {e}", missing()))?;
        if !output.status.success() {
            let err = String::from_utf8_lossy(&output.stderr);
            let last = err.lines().last().unwrap_or_default();
            return Err(format!("{} ({last})", missing()));
        }
        let version = String::from_utf8_lossy(&output.stdout).trim().to_string();
        out.push(format!("{} {version}", peer.name()));
    }
    Ok(out.join(", "))
}

/// A running peer router, in a process group of its own so that stopping it leaves no
/// process behind, whatever the Python launcher started.
pub struct PeerProcess {
    child: Child,
    pgid: Option<Pid>,
    pub url: String,
}

impl PeerProcess {
    /// The peer of `run` in front of `workers`; its command line goes to `dir/router.cmd`, its
    /// output to `dir/router.log`. Returns once every worker is registered and healthy.
    pub async fn start(
        venv: &Path,
        run: &PolicyRun,
        peer: PeerRouter,
        workers: &[Member],
        listen: SocketAddr,
        prometheus: SocketAddr,
        dir: &Path,
    ) -> Result<PeerProcess, String> {
        let python = python(venv);
        let mut argv = vec!["-m".to_string(), peer.module().to_string()];
        argv.extend(launch_args(peer, run, listen, prometheus, workers));
        let cmd_path = dir.join("router.cmd");
        let cmd_line = format!("{} {}\n", python.display(), argv.join(" "));
        std::fs::write(&cmd_path, cmd_line).map_err(|e| format!("{}: {e}", cmd_path.display()))?;
        let log_path = dir.join("router.log");
        let log =
            std::fs::File::create(&log_path).map_err(|e| format!("{}: {e}", log_path.display()))?;
        let child = Command::new(&python)
            .args(&argv)
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(|e| format!("router.log: {e}"))?)
            .stderr(log)
            .process_group(0)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", peer.name()))?;
        // With process_group(0) the child leads a new group whose id is its pid.
        let pgid = child
            .id()
            .and_then(|id| i32::try_from(id).ok())
            .map(Pid::from_raw);
        let mut proc = PeerProcess {
            child,
            pgid,
            url: format!("http://{listen}"),
        };
        if let Err(e) = proc.wait_ready(workers.len()).await {
            proc.stop().await;
            return Err(format!("{} {e}; see {}", run.label, log_path.display()));
        }
        Ok(proc)
    }

    /// Polls `GET /workers` (both routers list their workers there, with health) until all
    /// `n` are registered and healthy: sglang-router serves before its workers are
    /// registered, and a replay started then would meet 503s or a partial fleet.
    async fn wait_ready(&mut self, n: usize) -> Result<(), String> {
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(2))
            .build()
            .map_err(|e| format!("http client: {e}"))?;
        let url = format!("{}/workers", self.url);
        let deadline = Instant::now() + READY_TIMEOUT;
        let mut last = String::from("no answer");
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(format!("exited before it was ready ({status})"));
            }
            match client.get(&url).send().await {
                Ok(r) if r.status().is_success() => {
                    let body: serde_json::Value = r.json().await.unwrap_or_default();
                    let healthy = healthy_workers(&body);
                    if healthy >= n {
                        return Ok(());
                    }
                    last = format!("{healthy} of {n} workers healthy");
                }
                Ok(r) => last = format!("/workers answered {}", r.status()),
                Err(_) => {}
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Err(format!(
            "not ready after {} s ({last})",
            READY_TIMEOUT.as_secs()
        ))
    }

    /// SIGTERM to the group, then SIGKILL to whatever is left of it after STOP_TIMEOUT.
    pub async fn stop(mut self) {
        self.signal(Signal::SIGTERM);
        let _ = tokio::time::timeout(STOP_TIMEOUT, self.child.wait()).await;
        // Also reaches processes the launcher left behind after it exited itself.
        self.signal(Signal::SIGKILL);
        let _ = self.child.wait().await;
        self.pgid = None;
    }

    fn signal(&self, signal: Signal) {
        if let Some(pgid) = self.pgid {
            // ESRCH: the group is already gone, which is the goal.
            let _ = killpg(pgid, signal);
        }
    }
}

impl Drop for PeerProcess {
    /// A run that fails midway drops the peer without `stop`: kill the whole group.
    fn drop(&mut self) {
        self.signal(Signal::SIGKILL);
    }
}

/// Workers in a `/workers` answer (`{"workers": [{"is_healthy": bool, ..}, ..]}`) marked
/// healthy.
fn healthy_workers(body: &serde_json::Value) -> usize {
    body.get("workers")
        .and_then(serde_json::Value::as_array)
        .map(|ws| {
            ws.iter()
                .filter(|w| w.get("is_healthy").and_then(serde_json::Value::as_bool) == Some(true))
                .count()
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(p: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], p))
    }

    fn member(port: u16, role: pd::Role, bootstrap_port: Option<u16>) -> Member {
        Member {
            addr: addr(port),
            profile: crate::sim::ProfileName::H100Llama8b,
            models: Vec::new(),
            kv_events: None,
            role,
            bootstrap_port,
        }
    }

    fn args(entry: &str, workers: &[Member]) -> String {
        let run = PolicyRun::parse(entry).unwrap();
        let peer = run.peer.unwrap();
        launch_args(peer, &run, addr(8080), addr(8081), workers).join(" ")
    }

    #[test]
    fn launch_args_name_listen_policy_workers_and_a_private_metrics_port() {
        let workers = [
            member(9000, pd::Role::Both, None),
            member(9001, pd::Role::Both, None),
        ];
        let line = args("sglang-router/cache_aware", &workers);
        assert!(line.starts_with("--host 127.0.0.1 --port 8080 --policy cache_aware"));
        assert!(line.contains("--worker-urls http://127.0.0.1:9000 http://127.0.0.1:9001 --"));
        assert!(line.contains("--log-level warn "));
        assert!(line.contains("--prometheus-host 127.0.0.1 --prometheus-port 8081"));
        let v = args("vllm-router/round_robin", &workers);
        assert!(v.contains("--policy round_robin"));
        assert!(v.contains("--log-level warning "));
    }

    #[test]
    fn pd_entries_launch_the_peers_pd_mode_over_prefill_and_decode_servers() {
        let workers = [
            member(9000, pd::Role::Prefill, Some(9000)),
            member(9001, pd::Role::Decode, None),
        ];
        let s = args("sglang-router/pd", &workers);
        assert!(
            s.starts_with(
                "--host 127.0.0.1 --port 8080 --pd-disaggregation --prefill \
                 http://127.0.0.1:9000 9000 --decode http://127.0.0.1:9001 --prefill-policy \
                 cache_aware --decode-policy power_of_two --log-level warn "
            ),
            "{s}"
        );
        assert!(
            !s.contains("--worker-urls") && !s.contains("--policy "),
            "{s}"
        );
        let workers = [
            member(9000, pd::Role::Prefill, None),
            member(9001, pd::Role::Decode, None),
        ];
        let v = args("vllm-router/pd", &workers);
        assert!(
            v.contains("--vllm-pd-disaggregation --prefill http://127.0.0.1:9000 --decode"),
            "{v}"
        );
    }

    #[test]
    fn ready_only_when_every_worker_is_healthy() {
        let body = serde_json::json!({"workers": [
            {"url": "http://127.0.0.1:9000", "is_healthy": true},
            {"url": "http://127.0.0.1:9001", "is_healthy": false},
            {"url": "http://127.0.0.1:9002"}
        ], "total": 3});
        assert_eq!(healthy_workers(&body), 1);
        assert_eq!(healthy_workers(&serde_json::json!({"workers": []})), 0);
        assert_eq!(healthy_workers(&serde_json::json!("not ready")), 0);
    }

    #[tokio::test]
    async fn a_missing_venv_says_how_to_install() {
        let err = versions(Path::new("/nonexistent/venv"), &[PeerRouter::Vllm])
            .await
            .unwrap_err();
        assert!(err.contains("vllm-router is not installed"), "{err}");
        assert!(err.contains("install-peers.sh"), "{err}");
    }
}
