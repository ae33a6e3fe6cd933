//! `kvbench demo`: the README's first command. A 4-server simulated fleet, a short multi-turn
//! chat workload (shipped in `bench/data/`), replayed through round robin and through kvroute's
//! default policy; prints the side-by-side table and where the charts are.

use std::path::PathBuf;

use crate::compare::{self, CompareArgs, PolicyRun};
use crate::replay::args::WorkloadKind;

#[derive(clap::Args, Debug, Clone)]
pub struct DemoArgs {
    /// Wall seconds of sending per policy.
    #[arg(long, default_value_t = 30.0)]
    pub duration_s: f64,
    #[arg(long, default_value = "bench/runs")]
    pub results_dir: PathBuf,
}

pub async fn run(a: DemoArgs) -> Result<(), String> {
    let default_policy = kvroute::config::RoutingConfig::default().policy.as_str();
    let args = CompareArgs {
        name: "demo".into(),
        results_dir: a.results_dir,
        policies: vec![
            PolicyRun::parse("round_robin")?,
            PolicyRun::parse(default_policy)?,
        ],
        replicas: vec![1],
        workloads: vec![WorkloadKind::Sharegpt],
        servers: Some(4),
        time_scale: Some(2.0),
        trace_speedup: 1.0,
        duration_s: Some(a.duration_s),
        max_requests: None,
        slo_ttft_ms: 2000.0,
        warmup_s: 0.0,
        profile: None,
        profiles: None,
        models: None,
        pd: None,
        kv_transfer_gbps: 25.0,
        kv_transfer_base_ms: 2.0,
        pd_abort_timeout_s: None,
        max_loras: 2,
        lora_load_ms: 200.0,
        model_zipf: 1.0,
        kv_tokens: None,
        conversations: Some(150),
        documents: None,
        document_tokens: None,
        turns: None,
        tasks: None,
        agent_system_tokens: None,
        tool_tokens: None,
        tool_tokens_max: None,
        think_ms: None,
        tool_calls: false,
        store: false,
        phases: None,
        fleet: compare::FleetKind::Sim,
        llama_server: PathBuf::new(),
        llama_model: PathBuf::new(),
        llama_args: String::new(),
        session_header: false,
        api: crate::replay::api::Api::Chat,
        rates: vec![],
        step_s: 20.0,
        keep_records: false,
        groups: 96,
        system_tokens: 8000,
        sharegpt_file: Some(
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data/sharegpt_demo.jsonl"),
        ),
        // The demo runs no peer router.
        peer_venv: PathBuf::new(),
        sim_tokenizer: None,
        sim_cores: None,
        kv_events: false,
        dp_size: 1,
        promote: false,
        tenants: None,
        steady_priority: None,
        steady_slo_ms: None,
        sheddable: None,
        solo: false,
        all_flood: false,
    };
    compare::run(args).await
}
