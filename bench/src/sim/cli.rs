//! `kvbench sim` arguments and their validation into a `SimConfig` plus listen addresses.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;

use super::config::{scaled, Engine, SimConfig};
use super::engine::cores::SharedCores;
use super::engine::kv_events::kvpublish::KvEventsOptions;
use super::engine::lora::LoraConfig;
use super::engine::profile::{fleet_profiles, Profile, ProfileName};
use super::error::SimError;
use super::faults::{check_rate, Faults};
use super::pd::{PdConfig, PdProtocol, Role};
use super::text::tokenizer::PromptTokenizer;

const DEFAULT_TTFT_MS: f64 = 20.0;
const DEFAULT_ITL_MS: f64 = 5.0;

#[derive(clap::Args, Debug, Clone)]
pub struct SimArgs {
    /// Number of servers to run (required unless --profiles is given, and then equal to the
    /// servers it lists).
    #[arg(long)]
    pub servers: Option<u16>,
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
    /// The GPU/model profile of every server: its KV pool and, in engine mode, its step-time
    /// model and scheduler limits; cpu-smollm2 is a llama.cpp server (two slots), and speaks
    /// llama.cpp unless --engine says otherwise [default: h100-llama8b].
    #[arg(long, value_enum)]
    pub profile: Option<ProfileName>,
    /// A mixed fleet, `NAME:COUNT,NAME:COUNT` (e.g. `h100-llama8b:4,l40s-llama8b:4`): server
    /// i gets the i-th profile of the expanded list.
    #[arg(long, conflicts_with = "profile")]
    pub profiles: Option<String>,
    /// KV pool size in tokens, overriding the profile's (rounded down to 16-token blocks).
    #[arg(long)]
    pub kv_tokens: Option<u64>,
    /// The servers' engines share this many CPU cores, as one-thread llama.cpp servers on
    /// one machine do: while more engines compute than there are cores, each step takes
    /// longer by their ratio. Unset: every engine is its own GPU.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
    pub cores: Option<u16>,
    /// The engine each server speaks for: its /metrics names, and for llamacpp its /props
    /// and /slots [default: the profile's: llamacpp for cpu-smollm2, else vllm].
    #[arg(long, value_enum)]
    pub engine: Option<Engine>,
    /// Fraction of POST requests answered 500.
    #[arg(long, default_value_t = 0.0)]
    pub fail_rate: f64,
    /// Fraction of POST requests never answered.
    #[arg(long, default_value_t = 0.0)]
    pub hang_rate: f64,
    /// Fraction of streams whose connection is dropped once mid-response, after a
    /// pseudo-random number of tokens.
    #[arg(long, default_value_t = 0.0)]
    pub cut_rate: f64,
    /// After start, /health and POSTs answer 503 for this many model milliseconds.
    #[arg(long, default_value_t = 0.0)]
    pub slow_start_ms: f64,
    /// Run K times faster than real time: every wait is divided by K.
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// Count prompt tokens with this Hugging Face tokenizer (its directory or its
    /// tokenizer.json), e.g. bench/data/tokenizer/bpe8k-sharegpt, instead of the stand-in
    /// ceil(bytes / 4): usage, prefill and prefix-cache blocks all follow its count.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// LoRA adapters (comma-separated names) each server can load on top of --model; requests
    /// name one in `model`.
    #[arg(long, value_delimiter = ',')]
    pub lora_adapters: Vec<String>,
    /// Adapters loaded at once (vLLM's --max-loras); one more evicts the least recently used.
    #[arg(long, default_value_t = 1)]
    pub max_loras: usize,
    /// Model milliseconds one adapter load adds to a request's time to first token.
    #[arg(long, default_value_t = 200.0)]
    pub lora_load_ms: f64,
    /// Publish each engine's KV cache events as vLLM does (ZMQ, msgpack): server k binds a PUB
    /// socket at PORT + 2k and a ROUTER replay socket at PORT + 2k + 1 on --host (with
    /// --dp-size N, rank r of server k: PORT + 2kN + r and PORT + 2kN + N + r, so each rank is
    /// at its server's ports + r, as vLLM offsets them). 0 binds ephemeral ports (ranks of one
    /// server still consecutive), printed on stdout. Engine mode only.
    #[arg(long, value_name = "PORT")]
    pub kv_events: Option<u16>,
    /// Topic frame of every KV event message (vLLM's `topic`).
    #[arg(long, default_value = "", requires = "kv_events")]
    pub kv_events_topic: String,
    /// Test knob: skip the PUB send of about P% of KV event batches (chosen by sequence
    /// number); they still take their number and stay available for replay.
    #[arg(long, value_name = "P", default_value_t = 0.0, requires = "kv_events")]
    pub kv_events_drop_percent: f64,
    /// Engines per server (vLLM's --data-parallel-size with its internal load balancer):
    /// each an engine of the server's profile with its own KV pool and clock, behind the
    /// server's one port. A request goes to the rank its `X-Data-Parallel-Rank` header names,
    /// else to the rank with the fewest requests in flight. Engine mode only.
    #[arg(long, default_value_t = 1)]
    pub dp_size: u16,
    /// This server's part in a prefill/decode-disaggregated fleet. With vllm_nixl, for
    /// /debug/state and the logs: as vLLM's kv_both, any server serves any request. With
    /// sglang_bootstrap, SGLang's --disaggregation-mode: a prefill or decode server plays that
    /// leg of a request with bootstrap fields and refuses one without (400); both serves
    /// everything plain.
    #[arg(long, value_enum, default_value_t = Role::Both)]
    pub role: Role,
    /// How P and D hand a request over: vllm_nixl is vLLM's NixlConnector
    /// (`kv_transfer_params` in the request and in the prefill server's answer, legs one after
    /// the other); sglang_bootstrap is SGLang's (the same body to both at once, with
    /// bootstrap_host, bootstrap_port: the prefill server's HTTP port, and bootstrap_room).
    #[arg(long, value_enum, default_value_t = PdProtocol::VllmNixl)]
    pub pd_protocol: PdProtocol,
    /// Bandwidth of one KV transfer from a prefill server, GB/s (10^9 bytes a second, model
    /// time).
    #[arg(long, default_value_t = 25.0)]
    pub kv_transfer_gbps: f64,
    /// Bytes of KV per token a transfer moves [default: the profile's model: 131072 for
    /// Llama-3-8B, 23040 for SmolLM2-135M].
    #[arg(long)]
    pub kv_bytes_per_token: Option<u64>,
    /// Fixed cost of one KV transfer, model milliseconds.
    #[arg(long, default_value_t = 2.0)]
    pub kv_transfer_base_ms: f64,
    /// A prefill server frees the blocks it holds for a decode server after this many model
    /// seconds unread (vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT).
    #[arg(long, default_value_t = 480.0)]
    pub pd_abort_timeout_s: f64,
    /// sglang_bootstrap: a prefill server frees a room's blocks no decode server fetched after
    /// this many model seconds and fails its leg (SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT).
    #[arg(long, default_value_t = 300.0)]
    pub pd_bootstrap_timeout_s: f64,
    /// sglang_bootstrap: a decode server fails a request whose prefill KV has not come after
    /// this many model seconds (SGLANG_DISAGGREGATION_WAITING_TIMEOUT).
    #[arg(long, default_value_t = 300.0)]
    pub pd_waiting_timeout_s: f64,
}

/// Ranks one server may run.
const MAX_DP_SIZE: u16 = 16;

/// `--kv-events`: per server, per rank, the PUB and ROUTER addresses, and the options they
/// share.
pub struct KvEventsPlan {
    pub addrs: Vec<Vec<(SocketAddr, SocketAddr)>>,
    pub options: KvEventsOptions,
}

/// What `run` needs: one config and one address per server. The configs differ only in
/// their profile.
pub struct Plan {
    pub configs: Vec<SimConfig>,
    pub listen: Vec<SocketAddr>,
    pub kv_events: Option<KvEventsPlan>,
}

impl SimArgs {
    pub fn validate(&self) -> Result<Plan, SimError> {
        let host = loopback_host(&self.host)?;
        let fleet = fleet_profiles(
            self.servers.map(usize::from),
            self.profile,
            self.profiles.as_deref(),
        )
        .map_err(SimError::new)?;
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
            ("--lora-load-ms", self.lora_load_ms),
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
        check_rate("--cut-rate", self.cut_rate).map_err(SimError::new)?;
        if self.kv_tokens.is_some_and(|t| t < 16) {
            return Err(SimError::new("--kv-tokens must be at least 16 (one block)"));
        }
        if self.max_loras == 0 {
            return Err(SimError::new("--max-loras must be at least 1"));
        }
        if self
            .lora_adapters
            .iter()
            .any(|a| a.is_empty() || *a == self.model)
        {
            return Err(SimError::new(
                "--lora-adapters: names must be non-empty and differ from --model",
            ));
        }
        if !(1..=MAX_DP_SIZE).contains(&self.dp_size) {
            return Err(SimError::new(format!(
                "--dp-size must be between 1 and {MAX_DP_SIZE}"
            )));
        }
        if fixed && self.dp_size > 1 {
            return Err(SimError::new(
                "--dp-size runs several engines: it cannot go with --ttft-ms or --itl-ms",
            ));
        }
        let pd = self.pd_config()?;
        let listen = self.listen_addrs(host, fleet.len())?;
        let kv_events = self.kv_events_plan(host, fleet.len(), fixed)?;
        let tokenizer = match &self.tokenizer {
            Some(path) => PromptTokenizer::load(path).map_err(SimError::new)?,
            None => PromptTokenizer::default(),
        };
        let base = SimConfig {
            model: self.model.clone(),
            // Each server's own, set below.
            engine: Engine::Vllm,
            ttft: scaled(ttft_ms, self.time_scale),
            itl: scaled(itl_ms, self.time_scale),
            slow_start: scaled(self.slow_start_ms, self.time_scale),
            time_scale: self.time_scale,
            faults: Faults {
                fail_rate: self.fail_rate,
                hang_rate: self.hang_rate,
                cut_rate: self.cut_rate,
                ..Faults::default()
            },
            // Each server's own, set below.
            profile: Profile::get(ProfileName::H100Llama8b),
            fixed_timing: fixed,
            tokenizer: Arc::new(tokenizer),
            lora: LoraConfig {
                adapters: self.lora_adapters.clone(),
                max_loras: self.max_loras,
                load: scaled(self.lora_load_ms, self.time_scale),
            },
            dp_size: usize::from(self.dp_size),
            pd,
            cores: self.cores.map(|c| SharedCores::new(usize::from(c))),
        };
        let configs = fleet
            .iter()
            .map(|&name| SimConfig {
                engine: self.engine.unwrap_or(Engine::of_profile(name)),
                ..base.with_profile(name, self.kv_tokens)
            })
            .collect();
        Ok(Plan {
            configs,
            listen,
            kv_events,
        })
    }

    fn pd_config(&self) -> Result<PdConfig, SimError> {
        let gbps = self.kv_transfer_gbps;
        if !(gbps.is_finite() && gbps > 0.0) {
            return Err(SimError::new(format!(
                "--kv-transfer-gbps must be > 0, got {gbps}"
            )));
        }
        if self.kv_bytes_per_token == Some(0) {
            return Err(SimError::new("--kv-bytes-per-token must be at least 1"));
        }
        let base = self.kv_transfer_base_ms;
        if !(base.is_finite() && base >= 0.0) {
            return Err(SimError::new(format!(
                "--kv-transfer-base-ms must be >= 0, got {base}"
            )));
        }
        let timeouts = [
            ("--pd-abort-timeout-s", self.pd_abort_timeout_s),
            ("--pd-bootstrap-timeout-s", self.pd_bootstrap_timeout_s),
            ("--pd-waiting-timeout-s", self.pd_waiting_timeout_s),
        ];
        for (flag, timeout) in timeouts {
            if !(timeout.is_finite() && timeout > 0.0) {
                return Err(SimError::new(format!("{flag} must be > 0, got {timeout}")));
            }
        }
        Ok(PdConfig {
            role: self.role,
            protocol: self.pd_protocol,
            transfer_gbps: gbps,
            kv_bytes_per_token: self.kv_bytes_per_token,
            transfer_base_s: base / 1e3,
            abort_timeout: scaled(self.pd_abort_timeout_s * 1e3, self.time_scale),
            bootstrap_timeout: scaled(self.pd_bootstrap_timeout_s * 1e3, self.time_scale),
            waiting_timeout: scaled(self.pd_waiting_timeout_s * 1e3, self.time_scale),
        })
    }

    fn kv_events_plan(
        &self,
        host: IpAddr,
        n: usize,
        fixed: bool,
    ) -> Result<Option<KvEventsPlan>, SimError> {
        let Some(port) = self.kv_events else {
            return Ok(None);
        };
        if fixed {
            return Err(SimError::new(
                "--kv-events publishes the engine's KV pool: it cannot go with --ttft-ms or \
                 --itl-ms (fixed timing has no pool)",
            ));
        }
        let p = self.kv_events_drop_percent;
        if !(p.is_finite() && (0.0..=100.0).contains(&p)) {
            return Err(SimError::new(format!(
                "--kv-events-drop-percent must be in 0..=100, got {p}"
            )));
        }
        let ranks = usize::from(self.dp_size);
        // Rank r of server k; `socket` 0 is the PUB, 1 the ROUTER.
        let at = |k: usize, r: usize, socket: usize| -> Option<SocketAddr> {
            if port == 0 {
                return Some(SocketAddr::new(host, 0));
            }
            let p = usize::from(port) + 2 * k * ranks + socket * ranks + r;
            u16::try_from(p).ok().map(|p| SocketAddr::new(host, p))
        };
        let addrs = (0..n)
            .map(|k| {
                (0..ranks)
                    .map(|r| Some((at(k, r, 0)?, at(k, r, 1)?)))
                    .collect::<Option<Vec<_>>>()
            })
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| {
                SimError::new(format!(
                    "--kv-events {port} with {n} servers of {ranks} rank(s) needs ports up to \
                     {}, past 65535",
                    usize::from(port) + 2 * n * ranks - 1
                ))
            })?;
        Ok(Some(KvEventsPlan {
            addrs,
            options: KvEventsOptions {
                topic: self.kv_events_topic.clone(),
                drop_percent: p,
            },
        }))
    }

    fn listen_addrs(&self, host: IpAddr, n: usize) -> Result<Vec<SocketAddr>, SimError> {
        if self.base_port == 0 {
            return Ok((0..n).map(|_| SocketAddr::new(host, 0)).collect());
        }
        let past_end = || {
            SimError::new(format!(
                "--base-port {} with {n} servers runs past port 65535",
                self.base_port
            ))
        };
        let n = u16::try_from(n).map_err(|_| past_end())?;
        if u32::from(self.base_port) + u32::from(n) > u32::from(u16::MAX) + 1 {
            return Err(past_end());
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
        parse_argv(&[&["--servers", "3", "--base-port", "9000"], extra].concat())
    }

    fn parse_argv(args: &[&str]) -> Result<Plan, SimError> {
        let all: Vec<&str> = ["sim"].iter().chain(args).copied().collect();
        Wrap::try_parse_from(all)
            .map_err(|e| SimError::new(e.to_string()))?
            .args
            .validate()
    }

    #[test]
    fn defaults_and_consecutive_ports() {
        let plan = parse(&[]).unwrap();
        assert_eq!(plan.configs.len(), 3);
        let config = &plan.configs[0];
        assert_eq!(config.model, "sim-llama-8b");
        assert_eq!(config.engine, Engine::Vllm);
        assert!(!config.fixed_timing);
        let ports: Vec<u16> = plan.listen.iter().map(|a| a.port()).collect();
        assert_eq!(ports, [9000, 9001, 9002]);
        assert!(plan.listen.iter().all(|a| a.ip().is_loopback()));
        assert_eq!(config.profile.name, ProfileName::H100Llama8b);
        assert_eq!(config.num_gpu_blocks(), 31_250);
    }

    #[test]
    fn mixed_fleet_gives_server_i_the_ith_profile() {
        let spec = [
            "--base-port",
            "9000",
            "--profiles",
            "h100-llama8b:4,l40s-llama8b:4",
        ];
        let plan = parse_argv(&spec).unwrap();
        let names: Vec<ProfileName> = plan.configs.iter().map(|c| c.profile.name).collect();
        let mut want = vec![ProfileName::H100Llama8b; 4];
        want.extend([ProfileName::L40sLlama8b; 4]);
        assert_eq!(names, want);
        assert_eq!(plan.listen.len(), 8);
        assert_eq!(plan.listen[7].port(), 9007);
        assert_eq!(plan.configs[7].profile.prefill_rate, 9_000.0);
        assert_eq!(plan.configs[7].num_gpu_blocks(), 150_000 / 16);
        // --servers may repeat the total; anything else is refused with a reason.
        assert!(parse_argv(&[&spec[..], &["--servers", "8"]].concat()).is_ok());
        let err = parse_argv(&[&spec[..], &["--servers", "3"]].concat())
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("--servers 3") && err.contains("lists 8"),
            "{err}"
        );
        let both = [&spec[..], &["--profile", "a100-llama8b"]].concat();
        let err = parse_argv(&both).err().unwrap().to_string();
        assert!(err.contains("--profile"), "{err}");
        let err = parse_argv(&["--base-port", "0"]).err().unwrap().to_string();
        assert!(err.contains("--servers is required"), "{err}");
        let err = parse_argv(&["--base-port", "0", "--profiles", "h100-llama8b:x"]);
        assert!(err.is_err());
        // --kv-tokens resizes every server's pool; fixed timing keeps the profiles' pools.
        let small = parse_argv(&[&spec[..], &["--kv-tokens", "1600"]].concat()).unwrap();
        assert!(small.configs.iter().all(|c| c.num_gpu_blocks() == 100));
        let fixed = parse_argv(&[&spec[..], &["--ttft-ms", "5"]].concat()).unwrap();
        assert!(fixed.configs.iter().all(|c| c.fixed_timing));
        assert_eq!(fixed.configs[4].profile.name, ProfileName::L40sLlama8b);
        let err = parse_argv(&["--profiles", "h100-llama8b:600", "--base-port", "65000"])
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("past port 65535"), "{err}");
    }

    #[test]
    fn timing_flags_select_fixed_mode() {
        for flags in [
            &["--ttft-ms", "7"][..],
            &["--itl-ms", "2"],
            &["--ttft-ms", "1", "--itl-ms", "1"],
        ] {
            let plan = parse(flags).unwrap();
            assert!(plan.configs.iter().all(|c| c.fixed_timing), "{flags:?}");
        }
        let plan = parse(&["--itl-ms", "2"]).unwrap();
        assert_eq!(plan.configs[0].ttft, scaled(20.0, 1.0));
        let plan = parse(&["--profile", "a100-llama8b", "--kv-tokens", "1600"]).unwrap();
        let config = &plan.configs[2];
        assert_eq!(config.profile.name, ProfileName::A100Llama8b);
        assert_eq!(config.num_gpu_blocks(), 100);
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
    fn cores_are_one_budget_for_every_server() {
        assert!(parse(&[]).unwrap().configs[0].cores.is_none());
        let plan = parse(&["--cores", "2"]).unwrap();
        let (a, b) = (&plan.configs[0].cores, &plan.configs[2].cores);
        assert!(Arc::ptr_eq(a.as_ref().unwrap(), b.as_ref().unwrap()));
        assert!(parse(&["--cores", "0"]).is_err());
    }

    #[test]
    fn tokenizer_flag_loads_once_for_every_server_and_bad_paths_fail() {
        assert!(parse(&[]).unwrap().configs[0].tokenizer.is_stand_in());
        let dir = super::super::text::tokenizer::shipped_path();
        let plan = parse(&["--tokenizer", dir.to_str().unwrap()]).unwrap();
        assert!(!plan.configs[0].tokenizer.is_stand_in());
        assert!(Arc::ptr_eq(
            &plan.configs[0].tokenizer,
            &plan.configs[2].tokenizer
        ));
        let err = parse(&["--tokenizer", "/nonexistent/bpe"])
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("--tokenizer /nonexistent/bpe"), "{err}");
    }

    #[test]
    fn kv_events_give_each_server_two_ports_in_engine_mode_only() {
        assert!(parse(&[]).unwrap().kv_events.is_none());
        let plan = parse(&["--kv-events", "5557", "--kv-events-topic", "kv"]).unwrap();
        let kv = plan.kv_events.unwrap();
        let ports: Vec<(u16, u16)> = kv
            .addrs
            .iter()
            .map(|a| (a[0].0.port(), a[0].1.port()))
            .collect();
        assert_eq!(ports, [(5557, 5558), (5559, 5560), (5561, 5562)]);
        assert!(kv
            .addrs
            .iter()
            .flatten()
            .all(|(p, r)| p.ip().is_loopback() && r.ip().is_loopback()));
        assert_eq!(kv.options.topic, "kv");
        assert_eq!(kv.options.drop_percent, 0.0);
        let ephemeral = parse(&["--kv-events", "0"]).unwrap().kv_events.unwrap();
        assert!(ephemeral
            .addrs
            .iter()
            .flatten()
            .all(|(p, r)| p.port() == 0 && r.port() == 0));
        let lossy = parse(&["--kv-events", "5557", "--kv-events-drop-percent", "12.5"]).unwrap();
        assert_eq!(lossy.kv_events.unwrap().options.drop_percent, 12.5);
        // Three servers take six ports: 65530..=65535 fit, one more does not.
        let last = parse(&["--kv-events", "65530"]).unwrap().kv_events.unwrap();
        assert_eq!(last.addrs[2][0].1.port(), 65535);
        let err = parse(&["--kv-events", "65531"]).err().unwrap().to_string();
        assert!(err.contains("past 65535"), "{err}");
        let fixed = parse(&["--kv-events", "5557", "--ttft-ms", "5"])
            .err()
            .unwrap();
        assert!(fixed.to_string().contains("fixed timing"), "{fixed}");
        for bad in ["-1", "101", "NaN"] {
            let args = ["--kv-events", "5557", "--kv-events-drop-percent", bad];
            assert!(parse(&args).is_err(), "{bad}");
        }
        // The topic and the loss knob mean nothing without the sockets.
        assert!(parse(&["--kv-events-topic", "kv"]).is_err());
        assert!(parse(&["--kv-events-drop-percent", "5"]).is_err());
    }

    #[test]
    fn data_parallel_ranks_publish_at_their_servers_ports_plus_rank() {
        let plan = parse(&["--kv-events", "6000", "--dp-size", "2"]).unwrap();
        assert!(plan.configs.iter().all(|c| c.dp_size == 2));
        let kv = plan.kv_events.unwrap();
        let ports: Vec<Vec<(u16, u16)>> = kv
            .addrs
            .iter()
            .map(|ranks| ranks.iter().map(|(p, r)| (p.port(), r.port())).collect())
            .collect();
        // vLLM's layout: rank r at the server's ports + r.
        assert_eq!(
            ports,
            [
                [(6000, 6002), (6001, 6003)],
                [(6004, 6006), (6005, 6007)],
                [(6008, 6010), (6009, 6011)]
            ]
        );
        assert_eq!(
            plan.configs[0].num_gpu_blocks(),
            2 * plan.configs[0].profile.kv_blocks
        );
        for bad in [
            &["--dp-size", "0"][..],
            &["--dp-size", "17"],
            &["--dp-size", "2", "--ttft-ms", "5"],
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
    }

    /// `--profile cpu-smollm2` speaks llama.cpp unless `--engine` says otherwise; in a mixed
    /// fleet each server speaks its own profile's engine.
    #[test]
    fn the_llamacpp_profile_implies_its_engine() {
        let plan = parse(&["--profile", "cpu-smollm2"]).unwrap();
        assert!(plan.configs.iter().all(|c| c.engine == Engine::Llamacpp));
        let config = &plan.configs[0];
        assert_eq!(config.profile.max_num_seqs, 2);
        assert_eq!(config.num_gpu_blocks(), 19_842 / 16);
        let plan = parse(&["--profile", "cpu-smollm2", "--engine", "vllm"]).unwrap();
        assert!(plan.configs.iter().all(|c| c.engine == Engine::Vllm));
        let plan = parse(&["--engine", "llamacpp"]).unwrap();
        assert_eq!(plan.configs[0].engine, Engine::Llamacpp);
        assert_eq!(plan.configs[0].profile.name, ProfileName::H100Llama8b);
        let mixed = parse_argv(&[
            "--base-port",
            "0",
            "--profiles",
            "h100-llama8b:1,cpu-smollm2:2",
        ])
        .unwrap();
        let engines: Vec<Engine> = mixed.configs.iter().map(|c| c.engine).collect();
        assert_eq!(engines, [Engine::Vllm, Engine::Llamacpp, Engine::Llamacpp]);
        let all = [
            "--profiles",
            "h100-llama8b:1,cpu-smollm2:1",
            "--engine",
            "sglang",
        ];
        let forced = parse_argv(&[&["--base-port", "0"][..], &all].concat()).unwrap();
        assert!(forced.configs.iter().all(|c| c.engine == Engine::Sglang));
    }

    #[test]
    fn pd_flags_default_to_vllms_and_are_checked() {
        let plan = parse(&[]).unwrap();
        let pd = plan.configs[0].pd;
        assert_eq!((pd.role, pd.protocol), (Role::Both, PdProtocol::VllmNixl));
        assert_eq!((pd.transfer_gbps, pd.transfer_base_s), (25.0, 0.002));
        assert_eq!(pd.kv_bytes_per_token, None);
        assert_eq!(pd.abort_timeout, std::time::Duration::from_secs(480));
        assert_eq!(pd.bootstrap_timeout, std::time::Duration::from_secs(300));
        assert_eq!(pd.waiting_timeout, std::time::Duration::from_secs(300));
        let sglang = parse(&[
            "--pd-protocol",
            "sglang_bootstrap",
            "--pd-bootstrap-timeout-s",
            "20",
            "--pd-waiting-timeout-s",
            "5",
            "--time-scale",
            "10",
        ])
        .unwrap();
        let pd = sglang.configs[0].pd;
        assert_eq!(pd.protocol, PdProtocol::SglangBootstrap);
        assert_eq!(pd.bootstrap_timeout, std::time::Duration::from_secs(2));
        assert_eq!(pd.waiting_timeout, std::time::Duration::from_millis(500));
        let plan = parse(&[
            "--role",
            "prefill",
            "--pd-protocol",
            "vllm_nixl",
            "--kv-transfer-gbps",
            "0.5",
            "--kv-bytes-per-token",
            "4096",
            "--kv-transfer-base-ms",
            "0",
            "--pd-abort-timeout-s",
            "30",
            "--time-scale",
            "10",
        ])
        .unwrap();
        let pd = plan.configs[2].pd;
        assert_eq!(pd.role, Role::Prefill);
        assert_eq!(pd.transfer_gbps, 0.5);
        assert_eq!(pd.kv_bytes_per_token, Some(4096));
        assert_eq!(pd.transfer_base_s, 0.0);
        // Model seconds, waited on the wall clock like everything else.
        assert_eq!(pd.abort_timeout, std::time::Duration::from_secs(3));
        assert_eq!(
            parse(&["--role", "decode"]).unwrap().configs[0].pd.role,
            Role::Decode
        );
        for bad in [
            &["--role", "router"][..],
            &["--pd-protocol", "sglang"],
            &["--pd-bootstrap-timeout-s", "0"],
            &["--pd-waiting-timeout-s", "-1"],
            &["--kv-transfer-gbps", "0"],
            &["--kv-transfer-gbps", "inf"],
            &["--kv-bytes-per-token", "0"],
            &["--kv-transfer-base-ms", "-1"],
            &["--pd-abort-timeout-s", "0"],
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn rejects_bad_numbers() {
        assert!(parse(&["--time-scale", "0"]).is_err());
        assert!(parse(&["--fail-rate", "2"]).is_err());
        assert!(parse(&["--ttft-ms", "-1"]).is_err());
        assert!(parse(&["--engine", "tgi"]).is_err());
    }
}
