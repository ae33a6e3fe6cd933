//! `kvbench`: the benchmark companion of kvroute.
//!
//! # Layout
//! - `sim`: simulated OpenAI-compatible inference servers (`kvbench sim`), the backend of both
//!   the placement benchmarks and kvroute's integration tests.
//! - `replay`: drives one target with a workload and writes a report (`kvbench replay`).

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod replay;
mod sim;

#[derive(Parser, Debug)]
#[command(name = "kvbench", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Serve simulated vLLM-like inference servers on loopback ports.
    Sim(sim::SimArgs),
    /// Drive one loopback target with a workload, measure every request, write a report.
    Replay(replay::ReplayArgs),
}

#[tokio::main]
async fn main() -> ExitCode {
    // Logs go to stderr: stdout carries the readiness lines that tests parse.
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info"))
        .target(env_logger::Target::Stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Sim(args) => sim::run(args).await,
        Command::Replay(args) => return replay::main(args).await,
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvbench: {e}");
            ExitCode::FAILURE
        }
    }
}
