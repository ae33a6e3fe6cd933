//! `kvbench compare`: for each workload and each routing policy, a fresh simulated fleet and a
//! kvroute in front of it, one replay, and one side-by-side table and CDF chart per workload
//! under `bench/runs/<name>/` (`--results-dir`), with the exact command line.
//!
//! Every run starts cold (new simulator processes), so no policy inherits another's cache.
//! A fleet may mix GPU profiles (`--profiles`), and a policy entry may carry options that
//! change kvroute's config (`kv_aware/rates=true`, see `policy`) or name a peer router to run
//! instead of kvroute (`sglang-router/cache_aware`, see `peer`). With `--pd P:D` the fleet's
//! servers are prefill and decode servers for the entries that disaggregate (see `pd`).

mod args;
mod estimates;
pub mod llama;
mod models;
mod pd;
mod pd_report;
mod peer;
mod policy;
mod ports;
mod procs;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use clap::Parser;

use crate::replay::args::WorkloadKind;
use crate::replay::report::{self, Report};
use crate::replay::stats::Summary;
use crate::replay::{charts, runner, ReplayArgs};
use crate::sim::{ProfileName, PromptTokenizer};
use args::{check_pd, check_policies, fleet, groups, sim_args, with_replicas};
pub use args::{CompareArgs, FleetKind};
use estimates::Estimates;
use models::{Audit, ModelGroup};
use pd::FleetPart;
use pd_report::PdCounts;
use policy::PeerRouter;
pub use policy::PolicyRun;
use procs::Router;

/// One workload's runs, one per policy.
struct Section {
    workload: WorkloadKind,
    runs: Vec<(String, Summary)>,
    /// kvroute's prompt-token estimates against the engines' counts, per kvroute run.
    estimates: Vec<(String, Estimates)>,
    /// Ladder rate steps, labelled `policy, step`.
    steps: Vec<(String, Summary)>,
    /// With --models: what the simulators saw, per run.
    audits: Vec<(String, Audit)>,
    /// With --pd: what disaggregation did, per run.
    pd: Vec<(String, PdCounts)>,
}

/// What one run measured besides its report.
struct Extras {
    estimates: Option<Estimates>,
    audit: Option<Audit>,
    pd: Option<PdCounts>,
}

/// Lets a comparison build `ReplayArgs` from strings, so a run gets exactly the CLI defaults.
#[derive(Parser)]
struct ReplayCli {
    #[command(flatten)]
    args: ReplayArgs,
}

pub async fn run(args: CompareArgs) -> Result<(), String> {
    args.check_real()?;
    let fleet = fleet(&args)?;
    let groups = groups(&args)?;
    if groups.is_none() && args.workloads.contains(&WorkloadKind::MultiModel) {
        return Err("--workloads multi_model needs --models".into());
    }
    let policies = with_replicas(&args.policies, &args.replicas)?;
    check_policies(&policies)?;
    check_pd(&args, &policies)?;
    if !args.kv_events && policies.iter().any(|p| p.events) {
        return Err("events=on needs --kv-events (the simulators then publish them)".into());
    }
    if let Some(path) = &args.sim_tokenizer {
        // Here rather than in every simulator's log.
        PromptTokenizer::load(path).map_err(|e| e.replace("--tokenizer", "--sim-tokenizer"))?;
    }
    let peers = peer_versions(&args).await?;
    let exe = std::env::current_exe().map_err(|e| format!("cannot find own binary: {e}"))?;
    let out = args.results_dir.join(&args.name);
    std::fs::create_dir_all(&out).map_err(|e| format!("{}: {e}", out.display()))?;
    let mut sections = Vec::new();
    for &workload in &args.workloads {
        let mut rows: Vec<(String, Summary)> = Vec::new();
        let mut steps: Vec<(String, Summary)> = Vec::new();
        let mut estimates = Vec::new();
        let mut audits = Vec::new();
        let mut pd = Vec::new();
        for policy in &policies {
            let label = &policy.label;
            eprintln!("== {} / {label}", workload.name());
            let (report, extras) = run_one(
                &exe,
                &args,
                &fleet,
                groups.as_deref(),
                workload,
                policy,
                &out,
            )
            .await?;
            if let Some(est) = extras.estimates {
                estimates.push((label.clone(), est));
            }
            if let Some(a) = extras.audit {
                audits.push((label.clone(), a));
            }
            if let Some(c) = extras.pd {
                pd.push((label.clone(), c));
            }
            steps.extend(
                report
                    .steps
                    .iter()
                    .map(|(s, m)| (format!("{label}, {s}"), m.clone())),
            );
            rows.push((label.clone(), report.summary));
        }
        let dir = out.join(workload.name());
        std::fs::write(dir.join("ttft_cdf.svg"), charts::ttft_cdf_svg(&rows))
            .map_err(|e| format!("{}: {e}", dir.display()))?;
        sections.push(Section {
            workload,
            runs: rows,
            estimates,
            steps,
            audits,
            pd,
        });
    }
    let md = render(&args, &fleet, peers.as_deref(), &sections);
    std::fs::write(out.join("README.md"), &md).map_err(|e| format!("{}: {e}", out.display()))?;
    let json: Vec<_> = sections
        .iter()
        .map(|s| {
            serde_json::json!({
                "workload": s.workload.name(),
                "runs": s.runs,
                "steps": s.steps,
                "prompt_token_estimates": s.estimates,
                "model_audits": s.audits,
                "pd": s.pd,
            })
        })
        .collect();
    let json = serde_json::json!({"command_line": command_line(), "settings": settings(&args, &fleet), "peers": peers, "results": json});
    std::fs::write(
        out.join("results.json"),
        serde_json::to_string_pretty(&json).unwrap_or_default(),
    )
    .map_err(|e| format!("{}: {e}", out.display()))?;
    print!("{md}");
    eprintln!("results: {}", out.display());
    if args.promote {
        crate::promote::run(crate::promote::PromoteArgs {
            name: args.name.clone(),
            from: args.results_dir.clone(),
            to: PathBuf::from("bench/results"),
            force: false,
        })?;
    }
    Ok(())
}

/// The installed versions of the peers the entries name, if any; fails before any run when
/// one is missing.
async fn peer_versions(args: &CompareArgs) -> Result<Option<String>, String> {
    let peers: Vec<PeerRouter> = PeerRouter::ALL
        .into_iter()
        .filter(|p| args.policies.iter().any(|r| r.peer == Some(*p)))
        .collect();
    if peers.is_empty() {
        return Ok(None);
    }
    peer::versions(&args.peer_venv, &peers).await.map(Some)
}

async fn run_one(
    exe: &Path,
    args: &CompareArgs,
    profiles: &[ProfileName],
    groups: Option<&[ModelGroup]>,
    workload: WorkloadKind,
    policy: &PolicyRun,
    out: &Path,
) -> Result<(Report, Extras), String> {
    let dir = out.join(workload.name()).join(policy.dir_name());
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let policy = &PolicyRun {
        tenant_names: args.tenant_names(workload),
        pd: policy.pd.map(|p| pd::PdRun {
            link: args.link(),
            ..p
        }),
        ..policy.clone()
    };
    let base = sim_args(args, profiles);
    let parts: Vec<FleetPart> = match (args.pd, groups) {
        (Some(split), _) => pd::parts(split, policy.pd),
        (None, Some(gs)) => gs
            .iter()
            .enumerate()
            .map(|(i, g)| FleetPart {
                args: models::sim_args(g, args.max_loras, args.lora_load_ms),
                models: g.served(),
                log: format!("sim-{i}.log"),
                ..FleetPart::plain(g.servers)
            })
            .collect(),
        (None, None) => vec![FleetPart::plain(profiles.len() as u32)],
    };
    let (fleets, backends) = if args.real() {
        procs::start_llama(&args.llama(), profiles.len(), &dir).await?
    } else {
        procs::start_fleets(exe, &base, profiles, &parts, &dir).await?
    };
    let router = Router::start(exe, &backends, policy, &dir, &args.peer_venv).await?;
    let mut cli: Vec<String> = vec!["replay".into()];
    let mut push = |k: &str, v: String| {
        cli.push(k.to_string());
        cli.push(v);
    };
    let urls = router.urls();
    push("--target", urls[0].to_string());
    for u in &urls[1..] {
        push("--replica-target", u.to_string());
    }
    push("--workload", workload.name().to_string());
    push("--out", dir.display().to_string());
    push("--time-scale", args.time_scale().to_string());
    push("--duration-s", args.duration_s().to_string());
    push("--slo-ttft-ms", args.slo_ttft_ms.to_string());
    push("--warmup-s", args.warmup_s.to_string());
    push("--conversations", args.conversations().to_string());
    if groups.is_none() {
        push("--model", args.model_name(profiles).to_string());
    }
    let shape = [
        ("--documents", args.documents.map(|v| v.to_string())),
        (
            "--document-tokens",
            args.document_tokens.map(|v| v.to_string()),
        ),
        ("--turns", args.turns.map(|v| v.to_string())),
        ("--phases", args.phases.clone()),
    ];
    let agent = [
        ("--tasks", args.tasks.map(|v| v.to_string())),
        (
            "--system-tokens",
            args.agent_system_tokens.map(|v| v.to_string()),
        ),
        ("--question-tokens", args.tool_tokens.map(|v| v.to_string())),
        (
            "--tool-tokens-max",
            args.tool_tokens_max.map(|v| v.to_string()),
        ),
        ("--think-ms", args.think_ms.map(|v| v.to_string())),
    ];
    let shape = shape.into_iter().chain(
        agent
            .into_iter()
            .filter(|_| workload == WorkloadKind::Agentic),
    );
    for (flag, value) in shape {
        if let Some(v) = value {
            push(flag, v);
        }
    }
    push("--label", policy.label.clone());
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
    for m in &backends {
        push("--metrics-url", format!("http://{}/metrics", m.addr));
    }
    if let Some(gs) = groups {
        push("--model", gs[0].name.clone());
        push("--models", models::popularity(gs).join(","));
        push("--model-zipf", args.model_zipf.to_string());
    }
    if args.session_header {
        cli.push("--session-header".into());
    }
    cli.extend(args.tenant_flags(workload));
    if workload == WorkloadKind::Agentic {
        let flags = [("--tool-calls", args.tool_calls), ("--store", args.store)];
        cli.extend(flags.iter().filter(|f| f.1).map(|f| f.0.to_string()));
    }
    if args.api != crate::replay::api::Api::Chat {
        cli.push("--api".into());
        cli.push(format!("{:?}", args.api).to_lowercase());
    }
    let chat = matches!(workload, WorkloadKind::Sharegpt | WorkloadKind::MultiModel);
    if let (true, Some(f)) = (chat, &args.sharegpt_file) {
        cli.push("--file".into());
        cli.push(f.display().to_string());
    }
    let replay = ReplayCli::try_parse_from(&cli).map_err(|e| format!("replay arguments: {e}"))?;
    // kvroute's token-estimate histogram at the end of the warm-up (from the replay's start,
    // in wall time), to subtract from the one at the end.
    let warm = (router.admin(), args.warmup_s > 0.0);
    let warm = match warm {
        (Some(admin), true) => {
            let wall = std::time::Duration::from_secs_f64(args.warmup_s / args.time_scale());
            Some(tokio::spawn(async move {
                tokio::time::sleep(wall).await;
                estimates::scrape(admin).await
            }))
        }
        _ => None,
    };
    let replayed = runner::run(replay.args).await;
    let est = match router.admin() {
        Some(admin) => token_estimates(admin, warm).await,
        None => None,
    };
    let mut pd = args.pd.map(|_| PdCounts {
        fleet: pd_report::fleet(policy, &backends),
        ..PdCounts::default()
    });
    if let (Some(c), Some(admin), Some(_)) = (&mut pd, router.admin(), policy.pd) {
        match estimates::scrape(admin).await {
            Ok(text) => pd_report::from_kvroute(c, &text),
            Err(e) => eprintln!("compare: kvroute's P/D decisions: {e}"),
        }
    }
    router.stop(&dir).await;
    if let Some(c) = &mut pd {
        pd_report::read_sims(c, &backends).await;
    }
    procs::save_engine_metrics(&backends, &dir).await;
    let audit = match groups {
        Some(_) => {
            let served: Vec<_> = backends
                .iter()
                .map(|m| (m.addr, m.models.clone()))
                .collect();
            Some(models::audit(&served).await?)
        }
        None => None,
    };
    drop(fleets);
    replayed?;
    // Keep the summary; per-request records of every run would bloat the committed results.
    let path = dir.join("report.json");
    let mut report = Report::load(&path)?;
    if !args.keep_records {
        report.records_omitted += report.records.len() as u64;
        report.records.clear();
        report.load_samples.clear();
    }
    if let Some(e) = &est {
        report.token_estimates = serde_json::to_value(e).ok();
        let md = dir.join("report.md");
        let line = format!(
            "\nPrompt-token estimates within 10% of the engine's count (kvroute's \
             `kvroute_prompt_tokens_estimate_ratio` in (0.9, 1.1], requests answered after the \
             warm-up): {}\n",
            estimates::summary_line(e)
        );
        let appended = std::fs::read_to_string(&md).map(|text| text + &line);
        if let Err(e) = appended.and_then(|text| std::fs::write(&md, text)) {
            eprintln!(
                "compare: could not add the estimates to {}: {e}",
                md.display()
            );
        }
    }
    std::fs::write(
        &path,
        serde_json::to_string_pretty(&report).unwrap_or_default(),
    )
    .map_err(|e| format!("{}: {e}", path.display()))?;
    let extras = Extras {
        estimates: est,
        audit,
        pd,
    };
    Ok((report, extras))
}

/// kvroute's prompt-token estimates over the measured window: its histogram now, less the
/// one `warm` scraped at the end of the warm-up. None (with a note) when a scrape failed or
/// the run ended inside the warm-up; the run's other figures stand.
async fn token_estimates(
    admin: std::net::SocketAddr,
    warm: Option<tokio::task::JoinHandle<Result<String, String>>>,
) -> Option<Estimates> {
    let before = match warm {
        None => None,
        Some(task) if !task.is_finished() => {
            task.abort();
            eprintln!("compare: the run ended inside the warm-up; no token estimates");
            return None;
        }
        Some(task) => match task.await {
            Ok(Ok(text)) => Some(text),
            Ok(Err(e)) => {
                eprintln!("compare: token estimates: {e}");
                return None;
            }
            Err(e) => {
                eprintln!("compare: token estimates: {e}");
                return None;
            }
        },
    };
    let after = estimates::scrape(admin).await;
    match after.and_then(|after| estimates::between(before.as_deref(), &after)) {
        Ok(e) => Some(e),
        Err(e) => {
            eprintln!("compare: token estimates: {e}");
            None
        }
    }
}

fn command_line() -> String {
    std::env::args().collect::<Vec<_>>().join(" ")
}

fn settings(args: &CompareArgs, fleet: &[ProfileName]) -> String {
    let servers = if args.real() {
        format!(
            "{} real llama.cpp servers (`{} {}`, model `{}`)",
            fleet.len(),
            args.llama_server.display(),
            args.llama_args,
            args.llama_model.display()
        )
    } else {
        match (&args.profiles, &args.models) {
            (Some(spec), _) => format!("{} simulated servers (`{spec}`)", fleet.len()),
            (None, Some(spec)) => {
                format!(
            "{} simulated `{}` servers serving models `{spec}` (max-loras {}, an adapter load \
             {} ms), model popularity Zipf({})",
            fleet.len(),
            fleet.first().copied().unwrap_or(ProfileName::H100Llama8b).as_str(),
            args.max_loras,
            args.lora_load_ms,
            args.model_zipf
        )
            }
            (None, None) => {
                let name = fleet.first().copied().unwrap_or(ProfileName::H100Llama8b);
                format!("{} simulated `{}` servers", fleet.len(), name.as_str())
            }
        }
    };
    let mut s = format!(
        "{servers}, time scale {} (times below are model time), at most {} s of sending per run, TTFT SLO {} ms, {}",
        args.time_scale(),
        args.duration_s(),
        args.slo_ttft_ms,
        if args.session_header { "session ids sent as x-session-id" } else { "no session header (content affinity only)" }
    );
    if args.warmup_s > 0.0 {
        let _ = write!(
            s,
            ", the first {} model s of each run left out",
            args.warmup_s
        );
    }
    if let Some(path) = &args.sim_tokenizer {
        let _ = write!(s, ", engines count prompt tokens with `{}`", path.display());
    }
    if let Some(cores) = args.sim_cores {
        let _ = write!(s, ", the engines share {cores} CPU cores");
    }
    if let Some(split) = args.pd {
        let _ = write!(
            s,
            "; the servers are {} prefill + {} decode servers for the entries that disaggregate, \
             one unified fleet for the others",
            split.prefill, split.decode
        );
    }
    s
}

fn render(
    args: &CompareArgs,
    fleet: &[ProfileName],
    peers: Option<&str>,
    sections: &[Section],
) -> String {
    let mut md = String::new();
    let _ = writeln!(md, "# kvbench compare: {}\n", args.name);
    let _ = writeln!(md, "Command: `{}`\n", command_line());
    let _ = writeln!(md, "{}.\n", settings(args, fleet));
    if let Some(peers) = peers {
        let _ = writeln!(
            md,
            "Peer routers: {peers} (PyPI), each with its defaults except a private metrics \
             port and a 1 s startup check; exact command in `<workload>/<policy>/router.cmd`.\n"
        );
    }
    for Section {
        workload: w,
        runs,
        estimates,
        steps,
        audits,
        pd,
    } in sections
    {
        let _ = writeln!(md, "## {}\n", w.name());
        md.push_str(&report::markdown_table(runs));
        if let Some(tenants) = crate::replay::tenant_table::markdown(runs) {
            md.push_str(&tenants);
        }
        if let Some(turns) = report::turns_table(runs) {
            let _ = writeln!(
                md,
                "\nFirst turns against follow-ups, the run's wall time, and the polling rounds \
                 (every 500 ms) in which one engine had a request waiting for a slot while \
                 another had none at all (from the engines' own gauges):\n"
            );
            md.push_str(&turns);
        }
        if !audits.is_empty() {
            md.push_str(&models::audit_table(runs, audits));
        }
        if !pd.is_empty() {
            md.push_str(&pd_report::table(runs, pd));
        }
        if !estimates.is_empty() {
            let _ = writeln!(
                md,
                "\nkvroute's prompt-token estimates within 10% of the engines' counts \
                 (`kvroute_prompt_tokens_estimate_ratio` in (0.9, 1.1], before each request's \
                 correction; requests answered after the warm-up), overall (by method):\n"
            );
            for (label, e) in estimates {
                let _ = writeln!(md, "- {label}: {}", estimates::summary_line(e));
            }
        }
        if !steps.is_empty() {
            let _ = writeln!(md, "\nPer rate step:\n");
            md.push_str(&report::markdown_table(steps));
        }
        let _ = writeln!(
            md,
            "\n![TTFT CDF]({0}/ttft_cdf.svg) (per-run charts: `{0}/<policy>/`, with `/` in \
             the policy entry written `__`)\n",
            w.name()
        );
    }
    md
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Parser)]
    struct Wrap {
        #[command(flatten)]
        args: CompareArgs,
    }

    fn parse(argv: &[&str]) -> Result<CompareArgs, String> {
        let all = ["compare"].iter().chain(argv).copied();
        Wrap::try_parse_from(all)
            .map(|w| w.args)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn plain_policies_and_single_profile_fleet_as_before() {
        let args = parse(&["--policies", "round_robin,kv_aware"]).unwrap();
        let labels: Vec<&str> = args.policies.iter().map(|p| p.label.as_str()).collect();
        assert_eq!(labels, ["round_robin", "kv_aware"]);
        assert!(args
            .policies
            .iter()
            .all(|p| p.rate_for(ProfileName::H100Llama8b).is_none()));
        let f = fleet(&args).unwrap();
        assert_eq!(f, [ProfileName::H100Llama8b; 8]);
        let sim = sim_args(&args, &f);
        assert_eq!(sim, ["--time-scale", "2", "--profile", "h100-llama8b"]);
        let tok = "bench/data/tokenizer/bpe8k-sharegpt";
        let with_tok = parse(&["--sim-tokenizer", tok, "--warmup-s", "20"]).unwrap();
        let sim = sim_args(&with_tok, &f);
        assert_eq!(sim[4..], ["--tokenizer", tok]);
        let s = settings(&with_tok, &f);
        assert!(s.ends_with(&format!(
            "left out, engines count prompt tokens with `{tok}`"
        )));
        assert!(settings(&args, &f).starts_with("8 simulated `h100-llama8b` servers"));
        let args = parse(&["--servers", "3", "--profile", "l40s-llama8b"]).unwrap();
        assert_eq!(fleet(&args).unwrap(), [ProfileName::L40sLlama8b; 3]);
    }

    #[test]
    fn profiles_pass_through_to_the_fleet() {
        let spec = "h100-llama8b:4,l40s-llama8b:4";
        let args = parse(&["--profiles", spec, "--kv-tokens", "64000"]).unwrap();
        let f = fleet(&args).unwrap();
        assert_eq!(
            (f.len(), f[3], f[4]),
            (8, ProfileName::H100Llama8b, ProfileName::L40sLlama8b)
        );
        let sim = sim_args(&args, &f);
        assert_eq!(
            sim,
            [
                "--time-scale",
                "2",
                "--profiles",
                spec,
                "--kv-tokens",
                "64000"
            ]
        );
        assert!(settings(&args, &f).starts_with(&format!("8 simulated servers (`{spec}`)")));
        assert!(fleet(&parse(&["--profiles", spec, "--servers", "8"]).unwrap()).is_ok());
        let err = fleet(&parse(&["--profiles", spec, "--servers", "4"]).unwrap()).unwrap_err();
        assert!(err.contains("--servers 4"), "{err}");
        let err = parse(&["--profiles", spec, "--profile", "h100-llama8b"])
            .err()
            .unwrap();
        assert!(err.contains("--profile"), "{err}");
        assert!(fleet(&parse(&["--profiles", "h100-llama8b:0"]).unwrap()).is_err());
    }

    #[test]
    fn policy_variants_are_parsed_and_checked_up_front() {
        let args = parse(&[
            "--policies",
            "kv_aware,kv_aware/rates=true,kv_aware/learn=off,kv_aware/rates=h100-llama8b*0.01+l40s-llama8b*100",
        ])
        .unwrap();
        assert_eq!(args.policies.len(), 4);
        assert_eq!(args.policies[1].label, "kv_aware/rates=true");
        assert_eq!(args.policies[2].learn, Some(false));
        assert_eq!(
            args.policies[3].rate_for(ProfileName::L40sLlama8b),
            Some(900_000.0)
        );
        assert!(check_policies(&args.policies).is_ok());
        let err = parse(&["--policies", "kv_aware/fast=1"]).err().unwrap();
        assert!(err.contains("unknown option"), "{err}");
        let twice = parse(&["--policies", "kv_aware,kv_aware"]).unwrap();
        let err = check_policies(&twice.policies).unwrap_err();
        assert!(err.contains("share results directory"), "{err}");
    }

    #[test]
    fn pd_sizes_the_fleet_and_is_needed_by_entries_that_disaggregate() {
        let args = parse(&[
            "--pd",
            "2:6",
            "--policies",
            "kv_aware,kv_aware/pd=cost,vllm-router/pd",
        ])
        .unwrap();
        assert_eq!(fleet(&args).unwrap(), [ProfileName::H100Llama8b; 8]);
        assert!(check_pd(&args, &args.policies).is_ok());
        assert!(settings(&args, &fleet(&args).unwrap()).ends_with(
            "2 prefill + 6 decode servers for the entries that disaggregate, one unified fleet \
             for the others"
        ));
        let err = fleet(&parse(&["--pd", "1:2", "--servers", "4"]).unwrap()).unwrap_err();
        assert!(err.contains("--servers 4, but --pd lists 3"), "{err}");
        assert!(fleet(&parse(&["--pd", "1:2", "--servers", "3"]).unwrap()).is_ok());
        let no_pd = parse(&["--policies", "kv_aware/pd=always"]).unwrap();
        let err = check_pd(&no_pd, &no_pd.policies).unwrap_err();
        assert!(err.contains("needs --pd P:D"), "{err}");
        let replicas =
            parse(&["--pd", "1:2", "--policies", "kv_aware/pd=cost/replicas=2"]).unwrap();
        assert!(check_pd(&replicas, &replicas.policies).is_err());
        assert!(parse(&["--pd", "1:2", "--models", "a:3"]).is_err());
        assert!(parse(&["--kv-transfer-gbps", "50"]).is_err());
        let slow = parse(&["--pd", "1:2", "--kv-transfer-gbps", "0"]).unwrap();
        assert!(check_pd(&slow, &slow.policies).is_err());
        let link = parse(&[
            "--pd",
            "1:2",
            "--kv-transfer-gbps",
            "50",
            "--pd-abort-timeout-s",
            "30",
        ])
        .unwrap()
        .link();
        assert_eq!(
            (link.gbps, link.base_ms, link.abort_timeout_s),
            (50.0, 2.0, Some(30.0))
        );
        let real = parse(&["--pd", "1:2", "--fleet", "llamacpp", "--time-scale", "1"]).unwrap();
        let err = real.check_real().unwrap_err();
        assert!(err.contains("--pd is for simulated fleets"), "{err}");
    }

    #[test]
    fn replica_counts_multiply_kvroute_entries_only() {
        let args = parse(&[
            "--policies",
            "kv_aware,sglang-router/cache_aware",
            "--replicas",
            "1,3",
        ])
        .unwrap();
        let runs = with_replicas(&args.policies, &args.replicas).unwrap();
        let labels: Vec<(&str, usize)> = runs
            .iter()
            .map(|r| (r.label.as_str(), r.replicas))
            .collect();
        assert_eq!(
            labels,
            [
                ("kv_aware", 1),
                ("kv_aware/replicas=3", 3),
                ("sglang-router/cache_aware", 1)
            ]
        );
        assert!(check_policies(&runs).is_ok());
        let only_two = with_replicas(&args.policies, &[2]).unwrap();
        assert_eq!(only_two.len(), 2);
        assert!(with_replicas(&args.policies, &[9]).is_err());
    }

    #[tokio::test]
    async fn peer_entries_sit_beside_kvroute_ones_and_need_the_venv() {
        let args = parse(&[
            "--policies",
            "kv_aware,sglang-router/cache_aware,vllm-router/round_robin",
        ])
        .unwrap();
        assert_eq!(args.peer_venv, PathBuf::from("bench/.venv-peers"));
        let peers: Vec<_> = args.policies.iter().map(|p| p.peer).collect();
        assert_eq!(
            peers,
            [None, Some(PeerRouter::Sglang), Some(PeerRouter::Vllm)]
        );
        assert!(check_policies(&args.policies).is_ok());
        // No peer entry: the venv is not looked at.
        let plain = parse(&["--policies", "kv_aware", "--peer-venv", "/nonexistent"]).unwrap();
        assert_eq!(peer_versions(&plain).await, Ok(None));
        let args = parse(&[
            "--policies",
            "kv_aware,sglang-router/cache_aware",
            "--peer-venv",
            "/nonexistent",
        ])
        .unwrap();
        let err = peer_versions(&args).await.unwrap_err();
        assert!(
            err.contains("sglang-router is not installed in /nonexistent"),
            "{err}"
        );
    }
}
