//! `kvbench replay`: drives one OpenAI-compatible target with a workload, measures every
//! request and writes a report.
//!
//! # Layout
//! - `args`: the command line and default workload files.
//! - `workloads`: ShareGPT chat (closed loop), Mooncake-format traces and the shared-prefix
//!   ladder (open loop), each with its oracle hit-rate accounting; the generated shapes
//!   (documents, prefix groups, agents, the noisy neighbor) and `--tenants`.
//! - `runner`: schedules requests within the time and request budget.
//! - `client` and `sse`: one streamed request and its measurements.
//! - `stats`, `report`, `charts`: summaries, Markdown/JSON and SVG output, reusable by a
//!   multi-run comparison.
//! - `tenants`: per-tenant rows and Jain's fairness index, for runs of several tenants.
//! - `metrics`, `progress`: backend load polling and the stderr progress line.

use std::process::ExitCode;

mod agent_sse;
pub mod api;
pub mod args;
pub mod charts;
pub mod client;
pub mod metrics;
pub mod percentile;
pub mod progress;
pub mod record;
pub mod report;
pub mod rng;
pub mod runner;
pub mod sse;
pub mod stats;
mod stream_event;
pub mod target;
pub mod tenant_table;
pub mod tenants;
pub mod workloads;

pub use args::ReplayArgs;

/// Entry point from `main`: prints the error itself so the dispatcher stays one line.
pub async fn main(args: ReplayArgs) -> ExitCode {
    match runner::run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvbench replay: {e}");
            ExitCode::FAILURE
        }
    }
}
