//! `kvbench compare`: for each workload and each routing policy, a fresh simulated fleet and a
//! kvroute in front of it, one replay, and one side-by-side table and CDF chart per workload
//! under `bench/results/<name>/`, with the exact command line.
//!
//! Every run starts cold (new simulator processes), so no policy inherits another's cache.

mod procs;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use clap::Parser;

use crate::replay::args::WorkloadKind;
use crate::replay::report::{self, Report};
use crate::replay::stats::Summary;
use crate::replay::{charts, runner, ReplayArgs};
use procs::{Proxy, SimFleet};

#[derive(clap::Args, Debug, Clone)]
pub struct CompareArgs {
    /// Results go to `<results-dir>/<name>/`.
    #[arg(long, default_value = "compare")]
    pub name: String,
    #[arg(long, default_value = "bench/results")]
    pub results_dir: PathBuf,
    /// kvroute routing policies to compare.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "round_robin,least_load,session_hash,bounded_hash"
    )]
    pub policies: Vec<String>,
    #[arg(
        long,
        value_delimiter = ',',
        value_enum,
        default_value = "sharegpt,mooncake,hot_prefix,heavy_mix,ladder"
    )]
    pub workloads: Vec<WorkloadKind>,
    /// Simulated GPU servers.
    #[arg(long, default_value_t = 8)]
    pub servers: u32,
    /// Simulator speed-up; reported times are model time. Wall-clock jitter is multiplied by
    /// this factor in model time, so keep it small when TTFTs of tens of ms matter.
    #[arg(long, default_value_t = 2.0)]
    pub time_scale: f64,
    /// mooncake, hot_prefix, heavy_mix: arrival rate as a multiple of the trace's own.
    #[arg(long, default_value_t = 1.0)]
    pub trace_speedup: f64,
    /// Wall seconds of sending per run.
    #[arg(long, default_value_t = 60.0)]
    pub duration_s: f64,
    #[arg(long)]
    pub max_requests: Option<u64>,
    #[arg(long, default_value_t = 2000.0)]
    pub slo_ttft_ms: f64,
    /// Simulator GPU profile.
    #[arg(long, default_value = "h100-llama8b")]
    pub profile: String,
    /// Simulator KV pool per server, tokens (default: the profile's).
    #[arg(long)]
    pub kv_tokens: Option<u64>,
    /// sharegpt: conversations in flight.
    #[arg(long, default_value_t = 128)]
    pub conversations: u32,
    /// Send the workload's session ids as `x-session-id` (default: content affinity only).
    #[arg(long)]
    pub session_header: bool,
    /// ladder: model-time request rates. The default steps past what 8 servers can prefill
    /// without cache hits.
    #[arg(long, value_delimiter = ',', default_value = "4,8,16,32,48")]
    pub rates: Vec<f64>,
    /// ladder: model seconds per rate step.
    #[arg(long, default_value_t = 20.0)]
    pub step_s: f64,
    /// ladder: groups, each with its own system prompt. The default's prefixes (96 x 8000
    /// tokens) need more KV than one server holds, so a router must partition them.
    #[arg(long, default_value_t = 96)]
    pub groups: u32,
    #[arg(long, default_value_t = 8000)]
    pub system_tokens: u64,
    /// sharegpt: conversation file (default: the workload's).
    #[arg(long)]
    pub sharegpt_file: Option<PathBuf>,
}

/// One workload's runs, one per policy.
struct Section {
    workload: WorkloadKind,
    runs: Vec<(String, Summary)>,
    /// Ladder rate steps, labelled `policy, step`.
    steps: Vec<(String, Summary)>,
}

/// Lets a comparison build `ReplayArgs` from strings, so a run gets exactly the CLI defaults.
#[derive(Parser)]
struct ReplayCli {
    #[command(flatten)]
    args: ReplayArgs,
}

pub async fn run(args: CompareArgs) -> Result<(), String> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot find own binary: {e}"))?;
    let out = args.results_dir.join(&args.name);
    std::fs::create_dir_all(&out).map_err(|e| format!("{}: {e}", out.display()))?;
    let mut sections = Vec::new();
    for &workload in &args.workloads {
        let mut rows: Vec<(String, Summary)> = Vec::new();
        let mut steps: Vec<(String, Summary)> = Vec::new();
        for policy in &args.policies {
            eprintln!("== {} / {policy}", workload.name());
            let report = run_one(&exe, &args, workload, policy, &out).await?;
            steps.extend(
                report
                    .steps
                    .iter()
                    .map(|(s, m)| (format!("{policy}, {s}"), m.clone())),
            );
            rows.push((policy.clone(), report.summary));
        }
        let dir = out.join(workload.name());
        std::fs::write(dir.join("ttft_cdf.svg"), charts::ttft_cdf_svg(&rows))
            .map_err(|e| format!("{}: {e}", dir.display()))?;
        sections.push(Section {
            workload,
            runs: rows,
            steps,
        });
    }
    let md = render(&args, &sections);
    std::fs::write(out.join("README.md"), &md).map_err(|e| format!("{}: {e}", out.display()))?;
    let json: Vec<_> = sections
        .iter()
        .map(|s| serde_json::json!({"workload": s.workload.name(), "runs": s.runs, "steps": s.steps}))
        .collect();
    let json = serde_json::json!({"command_line": command_line(), "settings": settings(&args), "results": json});
    std::fs::write(
        out.join("results.json"),
        serde_json::to_string_pretty(&json).unwrap_or_default(),
    )
    .map_err(|e| format!("{}: {e}", out.display()))?;
    print!("{md}");
    eprintln!("results: {}", out.display());
    Ok(())
}

async fn run_one(
    exe: &Path,
    args: &CompareArgs,
    workload: WorkloadKind,
    policy: &str,
    out: &Path,
) -> Result<Report, String> {
    let dir = out.join(workload.name()).join(policy);
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut sim_args = vec![
        "--time-scale".to_string(),
        args.time_scale.to_string(),
        "--profile".to_string(),
        args.profile.clone(),
    ];
    if let Some(kv) = args.kv_tokens {
        sim_args.extend(["--kv-tokens".to_string(), kv.to_string()]);
    }
    let fleet = SimFleet::start(exe, args.servers, &sim_args, &dir.join("sim.log")).await?;
    let proxy = Proxy::start(exe, &fleet.addrs, policy, &dir).await?;
    let mut cli: Vec<String> = vec!["replay".into()];
    let mut push = |k: &str, v: String| {
        cli.push(k.to_string());
        cli.push(v);
    };
    push("--target", proxy.url.clone());
    push("--workload", workload.name().to_string());
    push("--out", dir.display().to_string());
    push("--time-scale", args.time_scale.to_string());
    push("--duration-s", args.duration_s.to_string());
    push("--slo-ttft-ms", args.slo_ttft_ms.to_string());
    push("--conversations", args.conversations.to_string());
    push("--label", policy.to_string());
    push("--trace-speedup", args.trace_speedup.to_string());
    if let Some(n) = args.max_requests {
        push("--max-requests", n.to_string());
    }
    if workload == WorkloadKind::Ladder {
        let rates = args.rates.iter().map(f64::to_string).collect::<Vec<_>>();
        push("--rates", rates.join(","));
        push("--step-s", args.step_s.to_string());
        push("--groups", args.groups.to_string());
        push("--system-tokens", args.system_tokens.to_string());
    }
    for a in &fleet.addrs {
        push("--metrics-url", format!("http://{a}/metrics"));
    }
    if args.session_header {
        cli.push("--session-header".into());
    }
    if let (WorkloadKind::Sharegpt, Some(f)) = (workload, &args.sharegpt_file) {
        cli.push("--file".into());
        cli.push(f.display().to_string());
    }
    let replay = ReplayCli::try_parse_from(&cli).map_err(|e| format!("replay arguments: {e}"))?;
    runner::run(replay.args).await?;
    drop(proxy);
    drop(fleet);
    // Keep the summary; per-request records of every run would bloat the committed results.
    let path = dir.join("report.json");
    let mut report = Report::load(&path)?;
    report.records_omitted += report.records.len() as u64;
    report.records.clear();
    report.load_samples.clear();
    std::fs::write(
        &path,
        serde_json::to_string_pretty(&report).unwrap_or_default(),
    )
    .map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(report)
}

fn command_line() -> String {
    std::env::args().collect::<Vec<_>>().join(" ")
}

fn settings(args: &CompareArgs) -> String {
    format!(
        "{} simulated `{}` servers, time scale {} (times below are model time), {} s of sending per run, TTFT SLO {} ms, {}",
        args.servers,
        args.profile,
        args.time_scale,
        args.duration_s,
        args.slo_ttft_ms,
        if args.session_header { "session ids sent as x-session-id" } else { "no session header (content affinity only)" }
    )
}

fn render(args: &CompareArgs, sections: &[Section]) -> String {
    let mut md = String::new();
    let _ = writeln!(md, "# kvbench compare: {}\n", args.name);
    let _ = writeln!(md, "Command: `{}`\n", command_line());
    let _ = writeln!(md, "{}.\n", settings(args));
    for Section {
        workload: w,
        runs,
        steps,
    } in sections
    {
        let _ = writeln!(md, "## {}\n", w.name());
        md.push_str(&report::markdown_table(runs));
        if !steps.is_empty() {
            let _ = writeln!(md, "\nPer rate step:\n");
            md.push_str(&report::markdown_table(steps));
        }
        let _ = writeln!(
            md,
            "\n![TTFT CDF]({0}/ttft_cdf.svg) (per-run charts: `{0}/<policy>/`)\n",
            w.name()
        );
    }
    md
}
