//! `kvbench sim` arguments and their validation into a `SimConfig` plus listen addresses.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use super::config::{scaled, Engine, SimConfig};
use super::error::SimError;
use super::faults::{check_rate, Faults};
use super::profile::{Profile, ProfileName};

const DEFAULT_TTFT_MS: f64 = 20.0;
const DEFAULT_ITL_MS: f64 = 5.0;

#[derive(clap::Args, Debug, Clone)]
pub struct SimArgs {
    /// Number of servers to run.
    #[arg(long)]
    pub servers: u16,
    /// Port of server 0; server i listens on base-port + i. 0 binds ephemeral ports.
    #[arg(long)]
    pub base_port: u16,
    /// Listen address; loopback only (127.0.0.0/8 or ::1).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Model name served by /v1/models.
    #[arg(long, default_value = "sim-llama-8b")]
    pub model: String,
    /// Fixed timing: time to first token, in model milliseconds (default 20 when --itl-ms
    /// is given). Giving either this or --itl-ms selects fixed timing instead of the engine.
    #[arg(long)]
    pub ttft_ms: Option<f64>,
    /// Fixed timing: inter-token latency, in model milliseconds (default 5 when --ttft-ms is
    /// given).
    #[arg(long)]
    pub itl_ms: Option<f64>,
    /// Engine mode: the GPU/model profile whose step-time model and KV pool are simulated.
    #[arg(long, value_enum, default_value_t = ProfileName::H100Llama8b)]
    pub profile: ProfileName,
    /// KV pool size in tokens, overriding the profile's (rounded down to 16-token blocks).
    #[arg(long)]
    pub kv_tokens: Option<u64>,
    /// Metric names to expose on /metrics.
    #[arg(long, value_enum, default_value_t = Engine::Vllm)]
    pub engine: Engine,
    /// Fraction of POST requests answered 500.
    #[arg(long, default_value_t = 0.0)]
    pub fail_rate: f64,
    /// Fraction of POST requests never answered.
    #[arg(long, default_value_t = 0.0)]
    pub hang_rate: f64,
    /// After start, /health and POSTs answer 503 for this many model milliseconds.
    #[arg(long, default_value_t = 0.0)]
    pub slow_start_ms: f64,
    /// Run K times faster than real time: every wait is divided by K.
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
}

/// What `run` needs: one shared config and one address per server.
pub struct Plan {
    pub config: SimConfig,
    pub listen: Vec<SocketAddr>,
}

impl SimArgs {
    pub fn validate(&self) -> Result<Plan, SimError> {
        let host = loopback_host(&self.host)?;
        if self.servers == 0 {
            return Err(SimError::new("--servers must be at least 1"));
        }
        if self.model.is_empty() {
            return Err(SimError::new("--model must not be empty"));
        }
        let fixed = self.ttft_ms.is_some() || self.itl_ms.is_some();
        let ttft_ms = self.ttft_ms.unwrap_or(DEFAULT_TTFT_MS);
        let itl_ms = self.itl_ms.unwrap_or(DEFAULT_ITL_MS);
        for (name, ms) in [
            ("--ttft-ms", ttft_ms),
            ("--itl-ms", itl_ms),
            ("--slow-start-ms", self.slow_start_ms),
        ] {
            if !(ms.is_finite() && ms >= 0.0) {
                return Err(SimError::new(format!("{name} must be >= 0, got {ms}")));
            }
        }
        if !(self.time_scale.is_finite() && self.time_scale > 0.0) {
            return Err(SimError::new(format!(
                "--time-scale must be > 0, got {}",
                self.time_scale
            )));
        }
        check_rate("--fail-rate", self.fail_rate).map_err(SimError::new)?;
        check_rate("--hang-rate", self.hang_rate).map_err(SimError::new)?;
        if self.kv_tokens.is_some_and(|t| t < 16) {
            return Err(SimError::new("--kv-tokens must be at least 16 (one block)"));
        }
        let mut profile = Profile::get(self.profile);
        if let Some(tokens) = self.kv_tokens {
            profile = profile.with_kv_tokens(tokens);
        }
        let listen = self.listen_addrs(host)?;
        let config = SimConfig {
            model: self.model.clone(),
            engine: self.engine,
            ttft: scaled(ttft_ms, self.time_scale),
            itl: scaled(itl_ms, self.time_scale),
            slow_start: scaled(self.slow_start_ms, self.time_scale),
            time_scale: self.time_scale,
            faults: Faults {
                fail_rate: self.fail_rate,
                hang_rate: self.hang_rate,
                ..Faults::default()
            },
            num_gpu_blocks: profile.kv_blocks,
            profile: (!fixed).then_some(profile),
        };
        Ok(Plan { config, listen })
    }

    fn listen_addrs(&self, host: IpAddr) -> Result<Vec<SocketAddr>, SimError> {
        let n = self.servers;
        if self.base_port == 0 {
            return Ok((0..n).map(|_| SocketAddr::new(host, 0)).collect());
        }
        let last = u32::from(self.base_port) + u32::from(n) - 1;
        if last > u32::from(u16::MAX) {
            return Err(SimError::new(format!(
                "--base-port {} with --servers {n} runs past port 65535",
                self.base_port
            )));
        }
        Ok((0..n)
            .map(|i| SocketAddr::new(host, self.base_port + i))
            .collect())
    }
}

/// The simulator is a test and benchmark tool: it must never be reachable from the network.
fn loopback_host(host: &str) -> Result<IpAddr, SimError> {
    let ip = if host == "localhost" {
        IpAddr::V4(Ipv4Addr::LOCALHOST)
    } else {
        host.parse::<IpAddr>()
            .map_err(|_| SimError::new(format!("--host {host:?} is not an IP address")))?
    };
    if ip.is_loopback() {
        Ok(ip)
    } else {
        Err(SimError::new(format!(
            "--host {host} is not a loopback address: kvbench sim only listens on 127.0.0.0/8 or ::1"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Wrap {
        #[command(flatten)]
        args: SimArgs,
    }

    fn parse(extra: &[&str]) -> Result<Plan, SimError> {
        let argv = ["sim", "--servers", "3", "--base-port", "9000"];
        let all: Vec<&str> = argv.iter().chain(extra).copied().collect();
        Wrap::try_parse_from(all)
            .map_err(|e| SimError::new(e.to_string()))?
            .args
            .validate()
    }

    #[test]
    fn defaults_and_consecutive_ports() {
        let plan = parse(&[]).unwrap();
        assert_eq!(plan.config.model, "sim-llama-8b");
        assert_eq!(plan.config.engine, Engine::Vllm);
        let ports: Vec<u16> = plan.listen.iter().map(|a| a.port()).collect();
        assert_eq!(ports, [9000, 9001, 9002]);
        assert!(plan.listen.iter().all(|a| a.ip().is_loopback()));
        let profile = plan.config.profile.unwrap();
        assert_eq!(profile.name, ProfileName::H100Llama8b);
        assert_eq!(plan.config.num_gpu_blocks, 31_250);
    }

    #[test]
    fn timing_flags_select_fixed_mode() {
        for flags in [
            &["--ttft-ms", "7"][..],
            &["--itl-ms", "2"],
            &["--ttft-ms", "1", "--itl-ms", "1"],
        ] {
            let plan = parse(flags).unwrap();
            assert!(plan.config.profile.is_none(), "{flags:?}");
        }
        let plan = parse(&["--itl-ms", "2"]).unwrap();
        assert_eq!(plan.config.ttft, scaled(20.0, 1.0));
        let plan = parse(&["--profile", "a100-llama8b", "--kv-tokens", "1600"]).unwrap();
        let profile = plan.config.profile.unwrap();
        assert_eq!(profile.name, ProfileName::A100Llama8b);
        assert_eq!((profile.kv_blocks, plan.config.num_gpu_blocks), (100, 100));
        assert!(parse(&["--kv-tokens", "3"]).is_err());
        assert!(parse(&["--profile", "b200"]).is_err());
    }

    #[test]
    fn rejects_non_loopback_hosts() {
        assert!(parse(&["--host", "0.0.0.0"]).is_err());
        assert!(parse(&["--host", "10.1.2.3"]).is_err());
        assert!(parse(&["--host", "example.com"]).is_err());
        assert!(parse(&["--host", "127.0.0.2"]).is_ok());
        assert!(parse(&["--host", "::1"]).is_ok());
    }

    #[test]
    fn rejects_bad_numbers() {
        assert!(parse(&["--time-scale", "0"]).is_err());
        assert!(parse(&["--fail-rate", "2"]).is_err());
        assert!(parse(&["--ttft-ms", "-1"]).is_err());
        assert!(parse(&["--engine", "tgi"]).is_err());
    }
}
