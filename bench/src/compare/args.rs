//! `kvbench compare`'s arguments, their checks, and what they make of the fleet: the profile
//! of each server, the simulators' arguments, the policy entries with their replicas.

use std::path::PathBuf;

use super::llama::{self, LlamaSpec};
use super::models::{self, ModelGroup};
use super::pd::{Link, PdSplit};
use super::policy::PolicyRun;
use crate::replay::args::WorkloadKind;
use crate::replay::workloads::noisy_neighbor::NoisyShape;
use crate::replay::workloads::tenancy::TenantMix;
use crate::sim::{fleet_profiles, ProfileName};

/// What serves the requests: simulated engines, or real ones.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FleetKind {
    /// `kvbench sim` servers (`--profile`, `--profiles`, `--models`).
    #[default]
    Sim,
    /// Real `llama-server` processes (`--llama-server`, `--llama-model`, `--llama-args`),
    /// at time scale 1.
    Llamacpp,
}

#[derive(clap::Args, Debug, Clone)]
pub struct CompareArgs {
    /// Results go to `<results-dir>/<name>/`.
    #[arg(long, default_value = "compare")]
    pub name: String,
    #[arg(long, default_value = "bench/runs")]
    pub results_dir: PathBuf,
    /// kvroute routing policies to compare. An entry may carry options, each after a `/`:
    /// `rates=true` (configure every backend's true prefill rate), `rates=PROFILE*F+PROFILE*F`
    /// (true rate times F for those profiles), `learn=on|off` (`routing.learn_prefill_rate`),
    /// e.g. `kv_aware/rates=true/learn=off`. A peer router instead of kvroute:
    /// `sglang-router/cache_aware`, `sglang-router/round_robin`, `vllm-router/cache_aware`,
    /// `vllm-router/round_robin` (see --peer-venv). The whole entry labels the run.
    #[arg(
        long,
        value_delimiter = ',',
        value_parser = PolicyRun::parse,
        default_value = "round_robin,least_load,session_hash,bounded_hash"
    )]
    pub policies: Vec<PolicyRun>,
    /// Run each kvroute entry with each of these replica counts (`ENTRY/replicas=N` for N > 1):
    /// N kvroute processes with one config in front of the one fleet, turn k of every
    /// conversation (request k of an open-loop trace) sent to replica k mod N.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    pub replicas: Vec<usize>,
    #[arg(
        long,
        value_delimiter = ',',
        value_enum,
        default_value = "sharegpt,mooncake,hot_prefix,heavy_mix,ladder"
    )]
    pub workloads: Vec<WorkloadKind>,
    /// What serves the requests: `sim` (simulated engines) or `llamacpp` (real llama-server
    /// processes, one thread each unless --llama-args says otherwise).
    #[arg(long, value_enum, default_value_t = FleetKind::Sim)]
    pub fleet: FleetKind,
    /// --fleet llamacpp: the server binary.
    #[arg(long, default_value = llama::DEFAULT_SERVER)]
    pub llama_server: PathBuf,
    /// --fleet llamacpp: the GGUF model every server loads.
    #[arg(long, default_value = llama::DEFAULT_MODEL)]
    pub llama_model: PathBuf,
    /// --fleet llamacpp: each server's arguments besides the model, address, --metrics.
    #[arg(long, default_value = llama::DEFAULT_ARGS, allow_hyphen_values = true)]
    pub llama_args: String,
    /// Servers [default: 8 simulated, or the servers --profiles lists, which it must then
    /// equal; 2 real ones].
    #[arg(long)]
    pub servers: Option<u32>,
    /// Simulator speed-up; reported times are model time. Wall-clock jitter is multiplied by
    /// this factor in model time, so keep it small when TTFTs of tens of ms matter [default:
    /// 2; a real fleet runs in real time: 1].
    #[arg(long)]
    pub time_scale: Option<f64>,
    /// mooncake, hot_prefix, heavy_mix: arrival rate as a multiple of the trace's own.
    #[arg(long, default_value_t = 1.0)]
    pub trace_speedup: f64,
    /// Wall seconds of sending per run [default: 60; 900 on a real fleet, where the small
    /// workloads end by themselves well before].
    #[arg(long)]
    pub duration_s: Option<f64>,
    #[arg(long)]
    pub max_requests: Option<u64>,
    #[arg(long, default_value_t = 2000.0)]
    pub slo_ttft_ms: f64,
    /// Model seconds at the start of each run left out of its summary (see `replay --warmup-s`).
    #[arg(long, default_value_t = 0.0)]
    pub warmup_s: f64,
    /// Simulator GPU profile of every server [default: h100-llama8b].
    #[arg(long, value_enum)]
    pub profile: Option<ProfileName>,
    /// A mixed fleet, `NAME:COUNT,NAME:COUNT` (as `kvbench sim --profiles`).
    #[arg(long, conflicts_with = "profile")]
    pub profiles: Option<String>,
    /// A fleet of several models, `NAME:SERVERS[:ADAPTER+ADAPTER...],...`: one simulator per
    /// group, each server pinned to its group's base model and LoRA adapters in kvroute's
    /// config. The `multi_model` workload ranks the models' popularity in this order.
    #[arg(long, conflicts_with = "profiles")]
    pub models: Option<String>,
    /// Prefill/decode disaggregation on P + D simulated servers, `P:D` (e.g. 2:6): entries that
    /// disaggregate (`kv_aware/pd=cost`, `kv_aware/pd=always`, `vllm-router/pd`,
    /// `sglang-router/pd`) get P prefill and D decode servers, every other entry the same
    /// P + D servers as one unified fleet. Each run's P/D figures get their own table.
    #[arg(long, value_parser = PdSplit::parse, conflicts_with_all = ["profiles", "models"])]
    pub pd: Option<PdSplit>,
    /// --pd: bandwidth of a KV transfer, GB/s, in the simulators (`sim --kv-transfer-gbps`)
    /// and as kvroute is told (`disaggregation.transfer_gbytes_per_s`).
    #[arg(long, default_value_t = Link::default().gbps, requires = "pd")]
    pub kv_transfer_gbps: f64,
    /// --pd: fixed cost of a KV transfer, model ms (`sim --kv-transfer-base-ms`,
    /// `disaggregation.transfer_base_ms`).
    #[arg(long, default_value_t = Link::default().base_ms, requires = "pd")]
    pub kv_transfer_base_ms: f64,
    /// --pd: model seconds a prefill server holds KV unread (`sim --pd-abort-timeout-s`).
    #[arg(long, requires = "pd")]
    pub pd_abort_timeout_s: Option<f64>,
    /// --models: adapters a server holds at once (`kvbench sim --max-loras`).
    #[arg(long, default_value_t = 2)]
    pub max_loras: usize,
    /// --models: model milliseconds one adapter load takes (`kvbench sim --lora-load-ms`).
    #[arg(long, default_value_t = 200.0)]
    pub lora_load_ms: f64,
    /// multi_model: Zipf exponent of the models' popularity.
    #[arg(long, default_value_t = 1.0)]
    pub model_zipf: f64,
    /// Simulator KV pool per server, tokens (default: the profile's).
    #[arg(long)]
    pub kv_tokens: Option<u64>,
    /// sharegpt, prefix_groups, agentic, noisy_neighbor: conversations in flight (closed-loop
    /// workers) [default: 128; 3 on a real fleet].
    #[arg(long)]
    pub conversations: Option<u32>,
    /// documents: conversations, each about its own document (`replay --documents`).
    #[arg(long)]
    pub documents: Option<u32>,
    /// documents: tokens of each document.
    #[arg(long)]
    pub document_tokens: Option<u64>,
    /// documents: turns; agentic: steps of each task.
    #[arg(long)]
    pub turns: Option<u32>,
    /// agentic: tasks (`replay --tasks`).
    #[arg(long)]
    pub tasks: Option<u32>,
    /// agentic: tokens of the shared system prompt (`replay --system-tokens`).
    #[arg(long)]
    pub agent_system_tokens: Option<u64>,
    /// agentic: tokens of each tool output (`replay --question-tokens`).
    #[arg(long)]
    pub tool_tokens: Option<u64>,
    /// agentic: the most tokens of a tool output, log-uniform from `--tool-tokens`
    /// (`replay --tool-tokens-max`).
    #[arg(long)]
    pub tool_tokens_max: Option<u64>,
    /// agentic: mean think time between steps, ms (`replay --think-ms`).
    #[arg(long)]
    pub think_ms: Option<u64>,
    /// agentic: tool calls every turn (`replay --tool-calls`).
    #[arg(long)]
    pub tool_calls: bool,
    /// agentic: Responses sessions chain stored answers (`replay --store`).
    #[arg(long)]
    pub store: bool,
    /// documents: concurrency of each phase (`replay --phases`).
    #[arg(long)]
    pub phases: Option<String>,
    /// Send the workload's session ids as `x-session-id` (default: content affinity only).
    #[arg(long)]
    pub session_header: bool,
    /// The API the workload speaks (`replay --api`).
    #[arg(long, value_enum, default_value_t = crate::replay::api::Api::Chat)]
    pub api: crate::replay::api::Api,
    /// ladder: model-time request rates. The default steps past what 8 servers can prefill
    /// without cache hits.
    #[arg(long, value_delimiter = ',', default_value = "4,8,16,32,48")]
    pub rates: Vec<f64>,
    /// ladder: model seconds per rate step.
    #[arg(long, default_value_t = 20.0)]
    pub step_s: f64,
    /// Keep every run's per-request records (turn, TTFT, cached tokens, backend) in its
    /// `report.json`, for a diagnosis; by default they are dropped to keep results small.
    #[arg(long)]
    pub keep_records: bool,
    /// ladder: groups, each with its own system prompt. The default's prefixes (96 x 8000
    /// tokens) need more KV than one server holds, so a router must partition them.
    #[arg(long, default_value_t = 96)]
    pub groups: u32,
    #[arg(long, default_value_t = 8000)]
    pub system_tokens: u64,
    /// sharegpt: conversation file (default: the workload's).
    #[arg(long)]
    pub sharegpt_file: Option<PathBuf>,
    /// The venv holding the peer routers (`bench/scripts/install-peers.sh` makes it).
    #[arg(long, default_value = "bench/.venv-peers")]
    pub peer_venv: PathBuf,
    /// The simulated engines count prompt tokens with this Hugging Face tokenizer (`kvbench
    /// sim --tokenizer`), e.g. bench/data/tokenizer/bpe8k-sharegpt, instead of bytes / 4.
    #[arg(long)]
    pub sim_tokenizer: Option<PathBuf>,
    /// The simulated engines share this many CPU cores (`sim --cores`), as the real
    /// llama.cpp fleet's one-thread servers share this machine's.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
    pub sim_cores: Option<u16>,
    /// The simulated engines publish KV events (`sim --kv-events`), which `kv_aware/events=on`
    /// runs follow. They then tokenize with --sim-tokenizer, by default the shipped ChatML
    /// tokenizer (bench/data/tokenizer/chatml-bpe8k), whose chat template kvroute renders.
    #[arg(long)]
    pub kv_events: bool,
    /// Engines behind each simulated server (`sim --dp-size`, vLLM's data parallelism with
    /// its internal balancer): --servers 4 --dp-size 2 is eight GPUs behind four endpoints.
    /// `events=on` runs follow every rank and pin requests to one.
    #[arg(long, default_value_t = 1)]
    pub dp_size: u16,
    /// When the run is done, copy its summary into bench/results/ (`kvbench promote NAME`);
    /// refuses to replace a results folder of the same name.
    #[arg(long)]
    pub promote: bool,
    /// Every workload's conversations shared among tenants (`replay --tenants`):
    /// `NAME[/weight=W][/priority=P][/slo=MS],...`.
    #[arg(long, value_parser = TenantMix::parse)]
    pub tenants: Option<TenantMix>,
    /// noisy_neighbor: the steady tenants' priority (`replay --steady-priority`).
    #[arg(long, allow_hyphen_values = true)]
    pub steady_priority: Option<i32>,
    /// noisy_neighbor: the steady tenants' TTFT deadline, model ms (`replay --steady-slo-ms`).
    #[arg(long)]
    pub steady_slo_ms: Option<u64>,
    /// noisy_neighbor: the share of the flood's requests sent sheddable (`replay --sheddable`).
    #[arg(long)]
    pub sheddable: Option<f64>,
    /// noisy_neighbor: the steady tenants alone (`replay --solo`).
    #[arg(long)]
    pub solo: bool,
    /// noisy_neighbor: every tenant sends the flood's prompts (`replay --all-flood`).
    #[arg(long)]
    pub all_flood: bool,
}

impl CompareArgs {
    pub(super) fn real(&self) -> bool {
        self.fleet == FleetKind::Llamacpp
    }

    pub(super) fn time_scale(&self) -> f64 {
        self.time_scale
            .unwrap_or(if self.real() { 1.0 } else { 2.0 })
    }

    pub(super) fn duration_s(&self) -> f64 {
        self.duration_s
            .unwrap_or(if self.real() { 900.0 } else { 60.0 })
    }

    pub(super) fn conversations(&self) -> u32 {
        self.conversations
            .unwrap_or(if self.real() { 3 } else { 128 })
    }

    pub(super) fn llama(&self) -> LlamaSpec {
        LlamaSpec {
            server: self.llama_server.clone(),
            model: self.llama_model.clone(),
            args: self
                .llama_args
                .split_whitespace()
                .map(str::to_owned)
                .collect(),
        }
    }

    /// The model the engines serve and the replay names: llama.cpp (and its stand-in) serve
    /// the small model under its own name.
    pub(super) fn model_name(&self, fleet: &[ProfileName]) -> &'static str {
        if fleet.first() == Some(&llama::PROFILE) {
            llama::MODEL_NAME
        } else {
            "sim-llama-8b"
        }
    }

    /// The KV link of a `--pd` run.
    pub(super) fn link(&self) -> Link {
        Link {
            gbps: self.kv_transfer_gbps,
            base_ms: self.kv_transfer_base_ms,
            abort_timeout_s: self.pd_abort_timeout_s,
        }
    }

    /// The tenants `workload`'s requests name, for kvroute's `tenants.names`.
    pub(super) fn tenant_names(&self, workload: WorkloadKind) -> Vec<String> {
        match (workload, &self.tenants) {
            (WorkloadKind::NoisyNeighbor, _) => NoisyShape::tenants(),
            (_, Some(mix)) => mix.names(),
            (_, None) => Vec::new(),
        }
    }

    /// The replay flags of the tenant options given, for `workload`.
    pub(super) fn tenant_flags(&self, workload: WorkloadKind) -> Vec<String> {
        let mut out = Vec::new();
        let mut flag = |name: &str, value: Option<String>| {
            if let Some(v) = value {
                out.extend([name.to_owned(), v]);
            }
        };
        if workload == WorkloadKind::NoisyNeighbor {
            flag(
                "--steady-priority",
                self.steady_priority.map(|p| p.to_string()),
            );
            flag(
                "--steady-slo-ms",
                self.steady_slo_ms.map(|ms| ms.to_string()),
            );
            flag("--sheddable", self.sheddable.map(|s| s.to_string()));
            if self.solo {
                out.push("--solo".to_owned());
            }
            if self.all_flood {
                out.push("--all-flood".to_owned());
            }
        } else {
            flag("--tenants", self.tenants.as_ref().map(|m| m.spec.clone()));
        }
        out
    }

    /// A real fleet has what llama.cpp has: no simulator options, real time.
    pub(super) fn check_real(&self) -> Result<(), String> {
        if !self.real() {
            return Ok(());
        }
        let sim_only = [
            ("--profile", self.profile.is_some()),
            ("--profiles", self.profiles.is_some()),
            ("--models", self.models.is_some()),
            ("--kv-tokens", self.kv_tokens.is_some()),
            ("--sim-tokenizer", self.sim_tokenizer.is_some()),
            ("--sim-cores", self.sim_cores.is_some()),
            ("--kv-events", self.kv_events),
            ("--dp-size", self.dp_size != 1),
            ("--pd", self.pd.is_some()),
        ];
        if let Some((flag, _)) = sim_only.iter().find(|(_, given)| *given) {
            return Err(format!(
                "{flag} is for simulated fleets, not --fleet llamacpp"
            ));
        }
        if self.time_scale() != 1.0 {
            return Err("--fleet llamacpp runs in real time: --time-scale must be 1".into());
        }
        self.llama().check()
    }
}

/// The model groups of --models, if given.
pub(super) fn groups(args: &CompareArgs) -> Result<Option<Vec<ModelGroup>>, String> {
    args.models.as_deref().map(models::parse_spec).transpose()
}

/// The profile of each server, in fleet order.
pub(super) fn fleet(args: &CompareArgs) -> Result<Vec<ProfileName>, String> {
    if args.real() {
        let n = args.servers.unwrap_or(2).max(1) as usize;
        return Ok(vec![llama::PROFILE; n]);
    }
    let grouped = groups(args)?.map(|g| g.iter().map(|g| g.servers as usize).sum::<usize>());
    let grouped = grouped.or(args.pd.map(|s| s.servers() as usize));
    if let (Some(total), Some(n)) = (grouped, args.servers) {
        if total != n as usize {
            let by = if args.pd.is_some() {
                "--pd"
            } else {
                "--models"
            };
            return Err(format!("--servers {n}, but {by} lists {total}"));
        }
    }
    let default = args.profiles.is_none().then_some(grouped.unwrap_or(8));
    let servers = args.servers.map(|n| n as usize).or(default);
    fleet_profiles(servers, args.profile, args.profiles.as_deref())
}

/// Every entry once per replica count (a peer only once: replicas are kvroute's).
pub(super) fn with_replicas(
    policies: &[PolicyRun],
    counts: &[usize],
) -> Result<Vec<PolicyRun>, String> {
    let mut out = Vec::new();
    for p in policies {
        for &n in counts {
            match (n, p.peer) {
                (1, _) => out.push(p.clone()),
                (_, Some(_)) => {}
                (n, None) => out.push(PolicyRun::parse(&format!("{}/replicas={n}", p.label))?),
            }
        }
        if p.peer.is_some() && !counts.contains(&1) {
            out.push(p.clone());
        }
    }
    Ok(out)
}

/// Entries that disaggregate need `--pd` (their fleet's split), and `--pd` one kvroute per run
/// and one engine per server (kvroute's P/D counters are read from one process).
pub(super) fn check_pd(args: &CompareArgs, policies: &[PolicyRun]) -> Result<(), String> {
    if args.pd.is_none() {
        return match policies.iter().find(|p| p.pd.is_some()) {
            Some(p) => Err(format!(
                "policy entry {:?} disaggregates: it needs --pd P:D (its prefill and decode servers)",
                p.label
            )),
            None => Ok(()),
        };
    }
    let link = args.link();
    let positive = |v: f64| v.is_finite() && v > 0.0;
    let valid = positive(link.gbps)
        && link.base_ms.is_finite()
        && link.base_ms >= 0.0
        && link.abort_timeout_s.is_none_or(positive);
    if !valid {
        return Err("--kv-transfer-gbps and --pd-abort-timeout-s must be > 0, \
                    --kv-transfer-base-ms >= 0"
            .into());
    }
    if policies.iter().any(|p| p.replicas > 1) || args.dp_size > 1 {
        return Err(
            "--pd runs one kvroute per run and one engine per server: no --replicas \
                    above 1, no --dp-size"
                .into(),
        );
    }
    Ok(())
}

/// Each run writes under its own directory, so two entries must not share one.
pub(super) fn check_policies(policies: &[PolicyRun]) -> Result<(), String> {
    if policies.is_empty() {
        return Err("--policies: at least one policy".into());
    }
    for (i, a) in policies.iter().enumerate() {
        for b in &policies[..i] {
            if a.dir_name() == b.dir_name() {
                return Err(format!(
                    "--policies: {:?} and {:?} would share results directory {:?}",
                    b.label,
                    a.label,
                    a.dir_name()
                ));
            }
        }
    }
    Ok(())
}

/// The simulator's arguments besides `--servers` and `--base-port`.
pub(super) fn sim_args(args: &CompareArgs, fleet: &[ProfileName]) -> Vec<String> {
    let mut sim_args = vec!["--time-scale".to_string(), args.time_scale().to_string()];
    match &args.profiles {
        Some(spec) => sim_args.extend(["--profiles".to_string(), spec.clone()]),
        None => {
            let name = fleet.first().copied().unwrap_or(ProfileName::H100Llama8b);
            sim_args.extend(["--profile".to_string(), name.as_str().to_string()]);
        }
    }
    if let Some(kv) = args.kv_tokens {
        sim_args.extend(["--kv-tokens".to_string(), kv.to_string()]);
    }
    match (&args.sim_tokenizer, args.kv_events) {
        (Some(path), _) => sim_args.extend(["--tokenizer".to_string(), path.display().to_string()]),
        (None, true) => sim_args.extend(["--tokenizer".to_string(), CHATML_TOKENIZER.to_string()]),
        (None, false) => {}
    }
    if args.kv_events {
        sim_args.extend(["--kv-events".to_string(), "0".to_string()]);
    }
    if let Some(cores) = args.sim_cores {
        sim_args.extend(["--cores".to_string(), cores.to_string()]);
    }
    if args.dp_size > 1 {
        sim_args.extend(["--dp-size".to_string(), args.dp_size.to_string()]);
    }
    // llama.cpp's stand-in speaks llama.cpp's metrics under the model's own name.
    if fleet.first() == Some(&llama::PROFILE) {
        sim_args.extend(["--engine".to_string(), "llamacpp".to_string()]);
        sim_args.extend(["--model".to_string(), llama::MODEL_NAME.to_string()]);
    }
    sim_args
}

/// The tokenizer `--kv-events` runs count with unless told: one with a chat template.
pub(super) const CHATML_TOKENIZER: &str = "bench/data/tokenizer/chatml-bpe8k";
