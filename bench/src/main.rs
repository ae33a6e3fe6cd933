//! `kvbench`: the benchmark companion of kvroute.
//!
//! # Layout
//! - `sim`: simulated OpenAI-compatible inference servers (`kvbench sim`), the backend of both
//!   the placement benchmarks and kvroute's integration tests.
//! - `replay`: drives one target with a workload and writes a report (`kvbench replay`).
//! - `compare`: a fleet and a kvroute per policy, one replay each, side-by-side results.
//! - `demo`: the README's first command, a small `compare`.
//! - `promote`: a run's summary from `bench/runs/` into the committed `bench/results/`.
//! - `kvbench proxy -c FILE`: kvroute itself (the library), so comparisons need one binary.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

// kvroute's allocator (its src/main.rs): `kvbench proxy` is kvroute, measured as it ships.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod compare;
mod demo;
mod probe;
mod promote;
mod replay;
mod report;
mod sim;

#[derive(Parser, Debug)]
#[command(name = "kvbench", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

// One value per process, parsed at startup: the variants' sizes cost nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand, Debug)]
enum Command {
    /// Serve simulated vLLM-like inference servers on loopback ports.
    Sim(sim::SimArgs),
    /// Drive one loopback target with a workload, measure every request, write a report.
    Replay(replay::ReplayArgs),
    /// Compare routing policies across workloads on fresh simulated fleets.
    Compare(compare::CompareArgs),
    /// Round robin vs kvroute's default policy on a small fleet, in about two minutes.
    Demo(demo::DemoArgs),
    /// Copy a run's summary (README, results without records, configs, embedded charts) from
    /// bench/runs/ into the committed bench/results/.
    Promote(promote::PromoteArgs),
    /// Attack probes on a proxy's edge (slow readers).
    Probe(probe::ProbeArgs),
    /// Analyse kept records of compare runs: medians, quantiles, tail, turns, burst, concurrency.
    Report(report::ReportArgs),
    /// Run kvroute (same as the `kvroute` binary) with a config file.
    Proxy {
        #[arg(short = 'c', long)]
        conf: String,
    },
}

fn main() -> ExitCode {
    // Logs go to stderr: stdout carries the readiness lines that tests parse.
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info"))
        .target(env_logger::Target::Stderr)
        .init();
    let cli = Cli::parse();
    if let Command::Proxy { conf } = cli.command {
        // Pingora builds its own runtimes: it must not start inside one.
        let opt = pingora::server::configuration::Opt {
            conf: Some(conf),
            ..Default::default()
        };
        kvroute::server::run(opt);
    }
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvbench: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    rt.block_on(async {
        let result = match cli.command {
            Command::Replay(args) => return replay::main(args).await,
            Command::Sim(args) => sim::run(args).await.map_err(|e| e.to_string()),
            Command::Compare(args) => compare::run(args).await,
            Command::Demo(args) => demo::run(args).await,
            Command::Report(args) => report::run(args),
            Command::Probe(args) => probe::run(args).await,
            Command::Promote(args) => promote::run(args),
            Command::Proxy { .. } => Ok(()),
        };
        match result {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("kvbench: {e}");
                ExitCode::FAILURE
            }
        }
    })
}
