//! The processes a comparison run needs: a simulated fleet (`kvbench sim`) and a router in
//! front of it, kvroute (`kvbench proxy`, the kvroute library embedded) or a peer router
//! (`peer`). All are killed when dropped, so a failed run leaves nothing behind.

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use super::peer::PeerProcess;
use super::policy::{kvroute_yaml, Member, PolicyRun};

pub struct SimFleet {
    _child: Child,
    pub addrs: Vec<SocketAddr>,
}

impl SimFleet {
    pub async fn start(
        exe: &Path,
        servers: u32,
        sim_args: &[String],
        log: &Path,
    ) -> Result<SimFleet, String> {
        let log = std::fs::File::create(log).map_err(|e| format!("{}: {e}", log.display()))?;
        let mut child = Command::new(exe)
            .args(["sim", "--servers", &servers.to_string(), "--base-port", "0"])
            .args(sim_args)
            .stdout(Stdio::piped())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot start kvbench sim: {e}"))?;
        let stdout = child.stdout.take().ok_or("sim stdout")?;
        let mut lines = BufReader::new(stdout).lines();
        let mut addrs = Vec::new();
        let ready = async {
            while let Ok(Some(line)) = lines.next_line().await {
                if let Some(rest) = line.strip_prefix("kvbench-sim listening ") {
                    let a = rest.split_whitespace().next().unwrap_or_default();
                    addrs.push(a.parse().map_err(|_| format!("bad sim address {a}"))?);
                }
                if line == "kvbench-sim ready" {
                    return Ok(());
                }
            }
            Err("kvbench sim exited before it was ready".to_string())
        };
        tokio::time::timeout(Duration::from_secs(30), ready)
            .await
            .map_err(|_| "kvbench sim not ready after 30 s".to_string())??;
        // Keep reading so the simulator never blocks on a full stdout pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Ok(SimFleet {
            _child: child,
            addrs,
        })
    }
}

/// The router a run replays through.
pub enum Router {
    Kvroute(Proxy),
    Peer(PeerProcess),
}

impl Router {
    /// kvroute, or the peer the entry names (from the venv at `peer_venv`), in front of
    /// `backends`; config, command and log go to `dir`.
    pub async fn start(
        exe: &Path,
        backends: &[Member],
        run: &PolicyRun,
        dir: &Path,
        peer_venv: &Path,
    ) -> Result<Router, String> {
        let Some(peer) = run.peer else {
            return Proxy::start(exe, backends, run, dir)
                .await
                .map(Router::Kvroute);
        };
        let workers: Vec<SocketAddr> = backends.iter().map(|m| m.addr).collect();
        let (listen, prometheus) = (free_addr()?, free_addr()?);
        PeerProcess::start(peer_venv, run, peer, &workers, listen, prometheus, dir)
            .await
            .map(Router::Peer)
    }

    /// kvroute's admin listener (`/metrics`, `/backends`); None for a peer.
    pub fn admin(&self) -> Option<SocketAddr> {
        match self {
            Router::Kvroute(p) => Some(p.admin),
            Router::Peer(_) => None,
        }
    }

    pub fn url(&self) -> &str {
        match self {
            Router::Kvroute(p) => &p.url,
            Router::Peer(p) => &p.url,
        }
    }

    /// Ends the router before the fleet, so it sees no backend vanish under it. kvroute's view
    /// of its backends at the end (learned prefill rates, KV sizes) is kept as
    /// `dir/backends.json` first.
    pub async fn stop(self, dir: &Path) {
        match self {
            Router::Kvroute(p) => {
                p.save_backends(&dir.join("backends.json")).await;
                drop(p)
            }
            Router::Peer(p) => p.stop().await,
        }
    }
}

pub struct Proxy {
    _child: Child,
    pub url: String,
    pub admin: SocketAddr,
}

fn free_addr() -> Result<SocketAddr, String> {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| format!("no free port: {e}"))
}

impl Proxy {
    /// kvroute configured by `run` in front of `backends` (address and profile, in fleet
    /// order); config and log go to `dir`.
    pub async fn start(
        exe: &Path,
        backends: &[Member],
        run: &PolicyRun,
        dir: &Path,
    ) -> Result<Proxy, String> {
        let (listen, admin) = (free_addr()?, free_addr()?);
        let yaml = kvroute_yaml(dir, listen, admin, run, backends);
        let conf: PathBuf = dir.join("kvroute.yaml");
        std::fs::write(&conf, yaml).map_err(|e| format!("{}: {e}", conf.display()))?;
        let log_path = dir.join("kvroute.log");
        let log =
            std::fs::File::create(&log_path).map_err(|e| format!("{}: {e}", log_path.display()))?;
        let child = Command::new(exe)
            .arg("proxy")
            .arg("-c")
            .arg(&conf)
            .env("RUST_LOG", "warn,kvroute::fleet=info")
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot start kvroute: {e}"))?;
        let proxy = Proxy {
            _child: child,
            url: format!("http://{listen}"),
            admin,
        };
        proxy.wait_ready(&log_path).await?;
        Ok(proxy)
    }

    /// `GET /backends` of the admin listener into `path`; a failure is reported, not fatal
    /// (the run's figures do not depend on it).
    async fn save_backends(&self, path: &Path) {
        let url = format!("http://{}/backends", self.admin);
        let body = match reqwest::get(&url).await {
            Ok(r) if r.status().is_success() => r.bytes().await.map_err(|e| e.to_string()),
            Ok(r) => Err(format!("status {}", r.status())),
            Err(e) => Err(e.to_string()),
        };
        let saved = body.and_then(|b| std::fs::write(path, b).map_err(|e| e.to_string()));
        if let Err(e) = saved {
            eprintln!("compare: could not save {url} to {}: {e}", path.display());
        }
    }

    async fn wait_ready(&self, log: &Path) -> Result<(), String> {
        let client = reqwest::Client::new();
        let url = format!("http://{}/readyz", self.admin);
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Ok(r) = client.get(&url).send().await {
                if r.status().is_success() {
                    return Ok(());
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Err(format!(
            "kvroute not ready after 30 s; see {}",
            log.display()
        ))
    }
}
