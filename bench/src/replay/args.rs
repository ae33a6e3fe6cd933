//! `kvbench replay` arguments, their checks, and where default workload files live.

use std::path::{Path, PathBuf};

use super::api::Api;
use super::workloads::ladder::LadderConfig;
use super::workloads::noisy_neighbor::NoisyShape;
use super::workloads::tenancy::TenantMix;

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkloadKind {
    /// ShareGPT multi-turn chat, closed loop with full history.
    Sharegpt,
    /// Mooncake trace replay (open loop, time-scaled timestamps).
    Mooncake,
    /// Mooncake-format synthetic/hot_prefix.jsonl.
    #[value(name = "hot_prefix", alias = "hot-prefix")]
    HotPrefix,
    /// Mooncake-format synthetic/heavy_mix.jsonl.
    #[value(name = "heavy_mix", alias = "heavy-mix")]
    HeavyMix,
    /// Shared-prefix rate ladder (llm-d's method).
    Ladder,
    /// Single-turn prompts from `--file` (aiperf's `single_turn` JSONL), closed loop.
    Prompts,
    /// ShareGPT chat over several models (`--models`), Zipf popularity, closed loop.
    #[value(name = "multi_model", alias = "multi-model")]
    MultiModel,
    /// Multi-turn chat about documents, in phases of rising concurrency (`--phases`).
    Documents,
    /// Groups of users sharing a long system prompt, one question each, closed loop.
    #[value(name = "prefix_groups", alias = "prefix-groups")]
    PrefixGroups,
    /// An agent's loop: a shared system prompt, then tool calls and outputs, closed loop.
    Agentic,
    /// Tenant `flood` with ten times the workers of each of four steady tenants, its prompts
    /// 8-30k tokens, theirs ~500; closed loop.
    #[value(name = "noisy_neighbor", alias = "noisy-neighbor")]
    NoisyNeighbor,
}

impl WorkloadKind {
    pub fn name(self) -> &'static str {
        match self {
            Self::Sharegpt => "sharegpt",
            Self::Mooncake => "mooncake",
            Self::HotPrefix => "hot_prefix",
            Self::HeavyMix => "heavy_mix",
            Self::Ladder => "ladder",
            Self::Prompts => "prompts",
            Self::MultiModel => "multi_model",
            Self::Documents => "documents",
            Self::PrefixGroups => "prefix_groups",
            Self::Agentic => "agentic",
            Self::NoisyNeighbor => "noisy_neighbor",
        }
    }

    /// Default data file, relative to this crate's directory (`bench/`). Found plain or with
    /// `.gz` appended; the repository ships the gzipped form.
    fn default_file(self) -> Option<&'static str> {
        match self {
            Self::Sharegpt | Self::MultiModel => {
                Some("data/traces/sharegpt/sharegpt_v3_first2000_aiperf_multiturn.jsonl")
            }
            Self::Mooncake => Some("data/traces/mooncake/synthetic_trace.jsonl"),
            Self::HotPrefix => Some("data/traces/synthetic/hot_prefix.jsonl"),
            Self::HeavyMix => Some("data/traces/synthetic/heavy_mix.jsonl"),
            Self::Ladder
            | Self::Prompts
            | Self::Documents
            | Self::PrefixGroups
            | Self::Agentic
            | Self::NoisyNeighbor => None,
        }
    }
}

#[derive(clap::Args, Debug, Clone)]
pub struct ReplayArgs {
    /// Base URL of the OpenAI-compatible server to drive (loopback only).
    #[arg(long)]
    pub target: String,
    /// Another replica of the router (repeatable): turn k of a conversation goes to replica
    /// k mod N (`--target` is replica 0), and an open-loop request #k to replica k mod N.
    #[arg(long = "replica-target")]
    pub replica_targets: Vec<String>,
    #[arg(long, value_enum)]
    pub workload: WorkloadKind,
    /// Workload file, overriding the workload's default.
    #[arg(long)]
    pub file: Option<PathBuf>,
    /// Directory for report.json, report.md and the SVG charts.
    #[arg(long)]
    pub out: PathBuf,
    /// The simulator's `--time-scale`: trace timestamps and ladder rates are compressed K
    /// times, and every reported time is converted back to model time (wall x K), so figures
    /// read as on real GPUs. `--duration-s` stays wall time.
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// mooncake, hot_prefix, heavy_mix: replay the trace K times faster than recorded (arrival
    /// times / K), to find the rate where a policy breaks down. Reported times stay model time.
    #[arg(long, default_value_t = 1.0)]
    pub trace_speedup: f64,
    /// Stop sending after this many seconds (default 60; the ladder's length for `ladder`).
    #[arg(long)]
    pub duration_s: Option<f64>,
    /// Stop after sending this many requests.
    #[arg(long)]
    pub max_requests: Option<u64>,
    /// Requests still running this long after the stop are counted as "timeout" errors.
    #[arg(long, default_value_t = 30.0)]
    pub grace_s: f64,
    #[arg(long, default_value_t = 2000.0)]
    pub slo_ttft_ms: f64,
    /// Model seconds at the start of the run left out of the summary (a learning router's
    /// warm-up); those requests are still sent, and kept in the records.
    #[arg(long, default_value_t = 0.0)]
    pub warmup_s: f64,
    #[arg(long, default_value = "sim-llama-8b")]
    pub model: String,
    /// multi_model: the models conversations are for, hottest first (base models and LoRA
    /// adapters alike).
    #[arg(long, value_delimiter = ',')]
    pub models: Vec<String>,
    /// multi_model: Zipf exponent of the models' popularity (0 is uniform).
    #[arg(long, default_value_t = 1.0)]
    pub model_zipf: f64,
    /// Send the workload's session id as `x-session-id`.
    #[arg(long)]
    pub session_header: bool,
    /// A header sent with every request, `NAME:VALUE` (repeatable), e.g. a tenant's
    /// `x-tenant-id:flood` or a priority.
    #[arg(long = "header")]
    pub headers: Vec<String>,
    /// Check each reply's text against the simulator's (token i is " tok{i}"): a text reply
    /// that is not exactly its first `completion_tokens` tokens, in order, counts as an error.
    /// A stream a router continued on another server must read as one unbroken stream.
    #[arg(long)]
    pub check_text: bool,
    /// The API requests speak: chat, or an agent API (`responses`, `messages`, or `mixed`:
    /// each session through one of the two).
    #[arg(long, value_enum, default_value_t = Api::Chat)]
    pub api: Api,
    /// sharegpt, prompts: conversations (closed-loop workers) in flight at once.
    #[arg(long, default_value_t = 16)]
    pub conversations: u32,
    /// sharegpt: cap on max_tokens per turn; prompts: max_tokens of a line without
    /// output_length.
    #[arg(long, default_value_t = 512)]
    pub max_output_tokens: u32,
    /// ladder: arrival times and question text.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Prometheus endpoint of a backend to poll every 500 ms (repeatable).
    #[arg(long = "metrics-url")]
    pub metrics_urls: Vec<String>,
    /// Name of this run in tables and charts (default: the workload).
    #[arg(long)]
    pub label: Option<String>,
    /// ladder, prefix_groups: groups sharing one system prompt each [default: ladder 8,
    /// prefix_groups 4].
    #[arg(long)]
    pub groups: Option<u32>,
    /// ladder, prefix_groups: users per group [default: ladder 8, prefix_groups 6].
    #[arg(long)]
    pub users: Option<u32>,
    /// ladder, prefix_groups, agentic: tokens of each system prompt [default: ladder 6000,
    /// prefix_groups 600, agentic 400].
    #[arg(long)]
    pub system_tokens: Option<u64>,
    /// ladder, prefix_groups: tokens of a question; agentic: of a tool's output [default:
    /// ladder 200, prefix_groups 30, agentic 120].
    #[arg(long)]
    pub question_tokens: Option<u64>,
    /// documents: conversations, each about its own document.
    #[arg(long, default_value_t = 10)]
    pub documents: u32,
    /// documents: tokens of each document.
    #[arg(long, default_value_t = 800)]
    pub document_tokens: u64,
    /// documents: turns of each conversation; agentic: steps of each task [default:
    /// documents 3, agentic 6].
    #[arg(long)]
    pub turns: Option<u32>,
    /// documents: the conversations in phases, one after the other, with this many at once
    /// in each (the documents shared out evenly).
    #[arg(long, value_delimiter = ',', default_value = "1,3")]
    pub phases: Vec<u32>,
    /// agentic: tasks (conversations); `--conversations` of them at once.
    #[arg(long, default_value_t = 4)]
    pub tasks: u32,
    /// agentic: a tool's output is `--question-tokens` to this many tokens, log-uniform
    /// (default: always `--question-tokens`).
    #[arg(long)]
    pub tool_tokens_max: Option<u64>,
    /// agentic: mean think time before each step after the first, in milliseconds of wall
    /// time (each step's is uniform in 0.5-1.5x the mean).
    #[arg(long, default_value_t = 0)]
    pub think_ms: u64,
    /// agentic: send the agent's tools and ask for a tool call every turn (`tool_choice`);
    /// the calls go back as Responses `function_call` / Messages `tool_use` items and the
    /// tools' outputs as their results. Chat sends the tools but gets text.
    #[arg(long)]
    pub tool_calls: bool,
    /// agentic: Responses sessions store every answer (`store: true`) and send each next turn
    /// as `previous_response_id` plus the new items only.
    #[arg(long)]
    pub store: bool,
    #[arg(long, default_value_t = 100)]
    pub output_tokens: u32,
    /// ladder: request rates (req/s of wall time), one step each.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16,32")]
    pub rates: Vec<f64>,
    /// ladder: seconds per rate step.
    #[arg(long, default_value_t = 20.0)]
    pub step_s: f64,
    /// Shares the conversations (requests, for single-turn and open-loop workloads) among
    /// tenants: `NAME[/weight=W][/priority=P][/slo=MS],...`, sent as `x-tenant-id`,
    /// `x-kvroute-priority` and `x-slo-ttft-ms`. A workload file's own fields win.
    #[arg(long, value_parser = TenantMix::parse)]
    pub tenants: Option<TenantMix>,
    /// noisy_neighbor: the steady tenants' priority (e.g. 1: a band above the flood's 0).
    #[arg(long, allow_hyphen_values = true)]
    pub steady_priority: Option<i32>,
    /// noisy_neighbor: the steady tenants' TTFT deadline, model milliseconds (`x-slo-ttft-ms`).
    #[arg(long)]
    pub steady_slo_ms: Option<u64>,
    /// noisy_neighbor: the share of the flood's requests sent sheddable (priority -1), 0 to 1.
    #[arg(long, default_value_t = 0.0)]
    pub sheddable: f64,
    /// noisy_neighbor: the steady tenants alone, without the flood: the baseline the flood's
    /// effect on them is judged against.
    #[arg(long)]
    pub solo: bool,
    /// noisy_neighbor: every tenant sends the flood's long prompts, each with its own worker
    /// count: all want more than their share, the case fairness (Jain's index) is judged on.
    #[arg(long)]
    pub all_flood: bool,
}

impl ReplayArgs {
    /// `--header`s, checked.
    pub fn extra_headers(&self) -> Result<Vec<(String, String)>, String> {
        self.headers
            .iter()
            .map(|h| {
                let (name, value) = h
                    .split_once(':')
                    .ok_or_else(|| format!("--header {h:?}: expected NAME:VALUE"))?;
                let (name, value) = (name.trim(), value.trim());
                reqwest::header::HeaderName::from_bytes(name.as_bytes())
                    .map_err(|_| format!("--header {h:?}: {name:?} is not a header name"))?;
                reqwest::header::HeaderValue::from_str(value)
                    .map_err(|_| format!("--header {h:?}: not a header value"))?;
                Ok((name.to_owned(), value.to_owned()))
            })
            .collect()
    }

    pub fn check(&self) -> Result<(), String> {
        let positive = |name: &str, v: f64| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(format!("{name} must be a positive number, got {v}"))
            }
        };
        self.extra_headers()?;
        positive("--time-scale", self.time_scale)?;
        positive("--trace-speedup", self.trace_speedup)?;
        positive("--slo-ttft-ms", self.slo_ttft_ms)?;
        if !(self.warmup_s.is_finite() && self.warmup_s >= 0.0) {
            return Err("--warmup-s must be a number of seconds >= 0".to_string());
        }
        if let Some(d) = self.duration_s {
            positive("--duration-s", d)?;
        }
        if !(self.grace_s.is_finite() && self.grace_s >= 0.0) {
            return Err(format!("--grace-s must be >= 0, got {}", self.grace_s));
        }
        if self.max_requests == Some(0) {
            return Err("--max-requests must be at least 1".into());
        }
        if self.conversations == 0 || self.max_output_tokens == 0 {
            return Err("--conversations and --max-output-tokens must be at least 1".into());
        }
        if self.model.is_empty() {
            return Err("--model must not be empty".into());
        }
        if self.workload == WorkloadKind::MultiModel && self.models.is_empty() {
            return Err("--workload multi_model needs --models".into());
        }
        if self.workload == WorkloadKind::Prompts && self.file.is_none() {
            return Err("--workload prompts needs --file".into());
        }
        if self.groups == Some(0) || self.users == Some(0) || self.turns == Some(0) {
            return Err("--groups, --users and --turns must be at least 1".into());
        }
        if self.workload == WorkloadKind::Documents
            && (self.documents == 0 || self.phases.is_empty() || self.phases.contains(&0))
        {
            return Err("--documents and each of --phases must be at least 1".into());
        }
        if self.workload == WorkloadKind::NoisyNeighbor && self.tenants.is_some() {
            return Err("--workload noisy_neighbor names its own tenants: no --tenants".into());
        }
        if !(0.0..=1.0).contains(&self.sheddable) {
            return Err(format!(
                "--sheddable must be 0 to 1, got {}",
                self.sheddable
            ));
        }
        if self.steady_slo_ms == Some(0) {
            return Err("--steady-slo-ms must be at least 1".into());
        }
        if self.workload == WorkloadKind::Agentic && self.tasks == 0 {
            return Err("--tasks must be at least 1".into());
        }
        if let (Some(max), Some(min)) = (self.tool_tokens_max, self.question_tokens) {
            if max < min {
                return Err(format!(
                    "--tool-tokens-max ({max}) must be at least --question-tokens ({min})"
                ));
            }
        }
        if self.workload == WorkloadKind::Ladder {
            positive("--step-s", self.step_s)?;
            if self.rates.is_empty() {
                return Err("--rates must be non-empty".into());
            }
            for &r in &self.rates {
                positive("each of --rates", r)?;
            }
        }
        Ok(())
    }

    pub fn ladder(&self) -> LadderConfig {
        LadderConfig {
            groups: self.groups.unwrap_or(8),
            users: self.users.unwrap_or(8),
            system_tokens: self.system_tokens.unwrap_or(6000),
            question_tokens: self.question_tokens.unwrap_or(200),
            output_tokens: self.output_tokens,
            // Rates and steps are model time; the schedule runs in wall time.
            rates: self.rates.iter().map(|r| r * self.time_scale).collect(),
            step_s: self.step_s / self.time_scale,
            seed: self.seed,
        }
    }

    pub fn noisy(&self) -> NoisyShape {
        NoisyShape {
            workers: self.conversations,
            steady_priority: self.steady_priority,
            steady_slo_ms: self.steady_slo_ms,
            sheddable: self.sheddable,
            solo: self.solo,
            all_flood: self.all_flood,
            seed: self.seed,
        }
    }

    pub fn duration_s(&self) -> f64 {
        match (self.duration_s, self.workload) {
            (Some(d), _) => d,
            (None, WorkloadKind::Ladder) => self.ladder().total_s(),
            (None, _) => 60.0,
        }
    }

    /// The data file: `--file` as given, else the default, plain or gzipped, under `bench/`
    /// of the current directory or any parent (so a binary run from another checkout reads
    /// that checkout's data), else under this crate's own source tree.
    pub fn workload_file(&self) -> Result<Option<PathBuf>, String> {
        if let Some(f) = &self.file {
            if !f.is_file() {
                return Err(format!("--file {}: no such file", f.display()));
            }
            return Ok(Some(f.clone()));
        }
        let Some(rel) = self.workload.default_file() else {
            return Ok(None);
        };
        let cwd = std::env::current_dir().unwrap_or_default();
        let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
        find_default(&cwd, crate_dir, rel).map(Some).ok_or_else(|| {
            format!(
                "cannot find bench/{rel}[.gz] from {} or its parents, nor under {}; pass --file",
                cwd.display(),
                crate_dir.display()
            )
        })
    }
}

/// `rel` (relative to the crate directory, `bench/`) or `rel.gz`, first under `cwd`'s
/// ancestors' `bench/`, then under `crate_dir`.
fn find_default(cwd: &Path, crate_dir: &Path, rel: &str) -> Option<PathBuf> {
    let gz = format!("{rel}.gz");
    cwd.ancestors()
        .map(|a| a.join("bench"))
        .chain(std::iter::once(crate_dir.to_path_buf()))
        .flat_map(|dir| [dir.join(rel), dir.join(&gz)])
        .find(|p| p.is_file())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_default_workload_file_ships_with_the_repository() {
        let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
        for w in [
            WorkloadKind::Sharegpt,
            WorkloadKind::Mooncake,
            WorkloadKind::HotPrefix,
            WorkloadKind::HeavyMix,
        ] {
            let rel = w.default_file().unwrap();
            // From a directory outside any checkout, only the crate's own copy is found.
            let found = find_default(Path::new("/"), crate_dir, rel).unwrap();
            assert!(found.starts_with(crate_dir), "{found:?}");
            // From inside the repository, the same file through the cwd walk.
            let from_repo = find_default(&crate_dir.join("src"), crate_dir, rel).unwrap();
            assert_eq!(
                from_repo.canonicalize().unwrap(),
                found.canonicalize().unwrap()
            );
        }
    }

    #[test]
    fn plain_file_is_preferred_to_gz_and_gz_is_found_alone() {
        let dir = std::env::temp_dir().join(format!("kvbench-find-{}", std::process::id()));
        let bench = dir.join("bench/data");
        std::fs::create_dir_all(&bench).unwrap();
        std::fs::write(bench.join("t.jsonl.gz"), b"x").unwrap();
        let nowhere = dir.join("no-crate");
        let found = find_default(&dir, &nowhere, "data/t.jsonl").unwrap();
        assert_eq!(found, bench.join("t.jsonl.gz"));
        std::fs::write(bench.join("t.jsonl"), b"x").unwrap();
        let found = find_default(&dir.join("bench"), &nowhere, "data/t.jsonl").unwrap();
        assert_eq!(found, bench.join("t.jsonl"));
        assert!(find_default(&dir, &nowhere, "data/none.jsonl").is_none());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn extra_headers_are_name_value_pairs_or_a_clear_error() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            replay: ReplayArgs,
        }
        let parse = |headers: &[&str]| {
            let mut argv = vec![
                "kvbench",
                "--target",
                "http://127.0.0.1:1",
                "--workload",
                "mooncake",
                "--out",
                "x",
            ];
            for h in headers {
                argv.extend(["--header", h]);
            }
            Cli::parse_from(argv).replay.extra_headers()
        };
        assert_eq!(
            parse(&["x-tenant-id: flood", "x-kvroute-priority:bulk"]).unwrap(),
            vec![
                ("x-tenant-id".to_string(), "flood".to_string()),
                ("x-kvroute-priority".to_string(), "bulk".to_string())
            ]
        );
        assert!(parse(&["no-colon"]).unwrap_err().contains("NAME:VALUE"));
        assert!(parse(&["bad name:v"])
            .unwrap_err()
            .contains("not a header name"));
    }
}
