//! The processes a comparison run needs: a simulated fleet (`kvbench sim`) and a router in
//! front of it, kvroute (`kvbench proxy`, the kvroute library embedded) or a peer router
//! (`peer`). All are killed when dropped, so a failed run leaves nothing behind.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use super::llama::{LlamaFleet, LlamaSpec};
use super::pd::{FleetPart, Role};
use super::peer::PeerProcess;
use super::policy::{kvroute_yaml, KvEndpoints, Member, PolicyRun};
use super::ports::free_addr;
use crate::sim::ProfileName;

/// The engines of one run, simulated or real; dropping it stops them.
pub struct Engines {
    _sim: Vec<SimFleet>,
    _llama: Option<LlamaFleet>,
}

/// `n` real llama.cpp servers as the fleet: every member runs the `cpu-smollm2` stand-in's
/// engine for real.
pub async fn start_llama(
    spec: &LlamaSpec,
    n: usize,
    dir: &Path,
) -> Result<(Engines, Vec<Member>), String> {
    let fleet = LlamaFleet::start(spec, n, dir).await?;
    let members = fleet
        .addrs
        .iter()
        .map(|&addr| Member {
            addr,
            profile: super::llama::PROFILE,
            models: Vec::new(),
            kv_events: None,
            role: Role::Both,
            bootstrap_port: None,
        })
        .collect();
    let engines = Engines {
        _sim: Vec::new(),
        _llama: Some(fleet),
    };
    Ok((engines, members))
}

/// Each engine's `/metrics` at the end of a run, as `engine-<i>.metrics.txt` in `dir`: what
/// the engines counted themselves (their prefill rate, cache hits), to hold kvroute's
/// beliefs against. A failure is reported, not fatal.
pub async fn save_engine_metrics(backends: &[Member], dir: &Path) {
    for (i, m) in backends.iter().enumerate() {
        let url = format!("http://{}/metrics", m.addr);
        let to = dir.join(format!("engine-{i}.metrics.txt"));
        let body = match reqwest::get(&url).await {
            Ok(r) => r.text().await.map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        if let Err(e) = body.and_then(|b| std::fs::write(&to, b).map_err(|e| e.to_string())) {
            eprintln!("compare: could not save {url} to {}: {e}", to.display());
        }
    }
}

/// The simulators of one run (one per model group, or per P/D role, else one) and their
/// servers in fleet order. `base` is every simulator's arguments; each part adds its own.
pub async fn start_fleets(
    exe: &Path,
    base: &[String],
    profiles: &[ProfileName],
    parts: &[FleetPart],
    dir: &Path,
) -> Result<(Engines, Vec<Member>), String> {
    let (mut fleets, mut members) = (Vec::new(), Vec::<Member>::new());
    for part in parts {
        let mut sim_args = base.to_vec();
        sim_args.extend(part.args.iter().cloned());
        let fleet = SimFleet::start(exe, part.servers, &sim_args, &dir.join(&part.log)).await?;
        if fleet.addrs.len() != part.servers as usize {
            return Err(format!(
                "kvbench sim announced {} servers, expected {}",
                fleet.addrs.len(),
                part.servers
            ));
        }
        // The simulator announces servers in index order, and server i has the i-th profile.
        for (k, &addr) in fleet.addrs.iter().enumerate() {
            let profile = profiles
                .get(members.len())
                .copied()
                .ok_or("more servers than profiles")?;
            members.push(Member {
                addr,
                profile,
                models: part.models.clone(),
                kv_events: fleet.kv_events.get(&k).cloned(),
                role: part.role,
                bootstrap_port: part.bootstrap.then_some(addr.port()),
            });
        }
        fleets.push(fleet);
    }
    let engines = Engines {
        _sim: fleets,
        _llama: None,
    };
    Ok((engines, members))
}

pub struct SimFleet {
    _child: Child,
    pub addrs: Vec<SocketAddr>,
    /// Per server index, where it publishes KV events (`sim --kv-events`).
    pub kv_events: std::collections::HashMap<usize, KvEndpoints>,
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
        let mut kv_events = std::collections::HashMap::new();
        // The tokenizer the engines count with: what kvroute must tokenize with to match them.
        let tokenizer = sim_args
            .iter()
            .position(|a| a == "--tokenizer")
            .and_then(|i| sim_args.get(i + 1))
            .and_then(|p| std::fs::canonicalize(p).ok());
        let ranks = sim_args
            .iter()
            .position(|a| a == "--dp-size")
            .and_then(|i| sim_args.get(i + 1))
            .and_then(|n| n.parse().ok())
            .unwrap_or(1);
        let ready = async {
            while let Ok(Some(line)) = lines.next_line().await {
                if let (Some(rest), Some(tok)) = (
                    line.strip_prefix("kvbench-sim kv-events index "),
                    tokenizer.as_ref(),
                ) {
                    let parts: Vec<&str> = rest.split_whitespace().collect();
                    if let [index, "pub", publish, "replay", replay] = parts[..] {
                        let index: usize = index
                            .parse()
                            .map_err(|_| format!("bad kv-events line {line:?}"))?;
                        kv_events.insert(
                            index,
                            KvEndpoints {
                                publish: publish.to_string(),
                                replay: replay.to_string(),
                                tokenizer: tok.clone(),
                                ranks,
                            },
                        );
                    }
                }
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
            kv_events,
        })
    }
}

/// The router a run replays through.
pub enum Router {
    /// One process per replica.
    Kvroute(Vec<Proxy>),
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
            // Replicas share nothing but the config: each has its own directory.
            let mut replicas = Vec::with_capacity(run.replicas);
            for i in 0..run.replicas.max(1) {
                let own = match run.replicas {
                    1 => dir.to_path_buf(),
                    _ => dir.join(format!("replica-{i}")),
                };
                std::fs::create_dir_all(&own).map_err(|e| format!("{}: {e}", own.display()))?;
                replicas.push(Proxy::start(exe, backends, run, &own).await?);
            }
            return Ok(Router::Kvroute(replicas));
        };
        let (listen, prometheus) = (free_addr()?, free_addr()?);
        PeerProcess::start(peer_venv, run, peer, backends, listen, prometheus, dir)
            .await
            .map(Router::Peer)
    }

    /// The first kvroute replica's admin listener (`/metrics`, `/backends`); None for a peer.
    pub fn admin(&self) -> Option<SocketAddr> {
        match self {
            Router::Kvroute(p) => p.first().map(|p| p.admin),
            Router::Peer(_) => None,
        }
    }

    /// The router's URL, one per replica.
    pub fn urls(&self) -> Vec<&str> {
        match self {
            Router::Kvroute(p) => p.iter().map(|p| p.url.as_str()).collect(),
            Router::Peer(p) => vec![&p.url],
        }
    }

    /// Ends the router before the fleet, so it sees no backend vanish under it. kvroute's view
    /// of its backends at the end (learned prefill rates, KV sizes) is kept as
    /// `dir/backends.json` first.
    pub async fn stop(self, dir: &Path) {
        match self {
            Router::Kvroute(replicas) => {
                let n = replicas.len();
                for (i, p) in replicas.into_iter().enumerate() {
                    let name = match n {
                        1 => "backends.json".to_string(),
                        _ => format!("replica-{i}/backends.json"),
                    };
                    p.save_backends(&dir.join(name)).await;
                    drop(p)
                }
            }
            Router::Peer(p) => p.stop().await,
        }
    }
}

pub struct Proxy {
    child: Child,
    pub url: String,
    pub admin: SocketAddr,
}

/// The embedded kvroute's log filter: warnings and the fleet's learning lines, unless
/// `KVBENCH_ROUTER_LOG` names another (e.g. `info,kvroute::proxy::placement=debug` writes
/// every placement decision to each run's `kvroute.log`).
fn router_log_filter() -> String {
    std::env::var("KVBENCH_ROUTER_LOG")
        .ok()
        .filter(|f| !f.trim().is_empty())
        .unwrap_or_else(|| "warn,kvroute::fleet=info".to_owned())
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
            .env("RUST_LOG", router_log_filter())
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot start kvroute: {e}"))?;
        let mut proxy = Proxy {
            child,
            url: format!("http://{listen}"),
            admin,
        };
        proxy.wait_ready(&log_path).await?;
        Ok(proxy)
    }

    /// `GET /backends` of the admin listener into `path`; a failure is reported, not fatal
    /// (the run's figures do not depend on it).
    /// kvroute's `/backends`, and its `/metrics` beside it (`metrics.txt`): what the run's
    /// numbers do not show (exact-index predictions, tokenizing outcomes, event counts).
    async fn save_backends(&self, path: &Path) {
        let metrics = path.with_file_name("metrics.txt");
        for (what, to) in [("backends", path), ("metrics", metrics.as_path())] {
            let url = format!("http://{}/{what}", self.admin);
            let body = match reqwest::get(&url).await {
                Ok(r) if r.status().is_success() => r.bytes().await.map_err(|e| e.to_string()),
                Ok(r) => Err(format!("status {}", r.status())),
                Err(e) => Err(e.to_string()),
            };
            let saved = body.and_then(|b| std::fs::write(to, b).map_err(|e| e.to_string()));
            if let Err(e) = saved {
                eprintln!("compare: could not save {url} to {}: {e}", to.display());
            }
        }
    }

    async fn wait_ready(&mut self, log: &Path) -> Result<(), String> {
        let client = reqwest::Client::new();
        let url = format!("http://{}/readyz", self.admin);
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            // A config kvroute refuses ends it at once: say why rather than wait out the 30 s.
            if let Ok(Some(status)) = self.child.try_wait() {
                let text = std::fs::read_to_string(log).unwrap_or_default();
                let last = text.lines().last().unwrap_or_default();
                return Err(format!("kvroute exited ({status}): {last}"));
            }
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
