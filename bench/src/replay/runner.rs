//! Runs one replay: loads the workload, sends within the time and request budget, waits out
//! the grace period, then summarises and writes the report.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::task::JoinSet;
use tokio::time::Instant as TokioInstant;

use super::args::{ReplayArgs, WorkloadKind};
use super::client::{self, Ctx};
use super::metrics::{self, LoadSample};
use super::progress::{self, Counters};
use super::record::{ChatRequest, RequestRecord};
use super::report::{self, Report};
use super::stats::{summarize, Summary};
use super::target::loopback_url;
use super::workloads::ladder::LadderSchedule;
use super::workloads::mooncake::{self, MooncakeSchedule};
use super::workloads::multi_model;
use super::workloads::prompts;
use super::workloads::shapes;
use super::workloads::sharegpt::{self, Chat};
use super::workloads::tenancy::{MixedConversations, MixedSchedule};
use super::workloads::{OpenLoop, Pool};
use super::{record::Tenancy, tenants};

enum Plan {
    /// Conversations in phases, one phase after the other; in each, pools of workers that
    /// run at once (one per tenant for `noisy_neighbor`).
    Closed(Vec<Vec<Pool>>),
    /// Independent requests, closed loop.
    Queue(Vec<ChatRequest>),
    Open(Box<dyn OpenLoop>),
}

/// What every sending task needs.
struct Shared {
    ctx: Ctx,
    counters: Arc<Counters>,
    records: Mutex<Vec<RequestRecord>>,
    max_requests: Option<u64>,
    /// No request is sent at or after this instant.
    stop_at: TokioInstant,
}

impl Shared {
    fn finish(&self, r: RequestRecord) {
        self.counters.finished(r.ok());
        if let Ok(mut v) = self.records.lock() {
            v.push(r);
        }
    }
}

pub async fn run(args: ReplayArgs) -> Result<(), String> {
    args.check()?;
    loopback_url("--target", &args.target)?;
    for t in &args.replica_targets {
        loopback_url("--replica-target", t)?;
    }
    for u in &args.metrics_urls {
        loopback_url("--metrics-url", u)?;
    }
    let file = args.workload_file()?;
    let c = args.conversations;
    let plan = match (args.workload, &file) {
        (WorkloadKind::Ladder, _) => Plan::Open(Box::new(LadderSchedule::new(args.ladder()))),
        (WorkloadKind::Documents, _) => Plan::Closed(
            shapes::documents(
                args.documents,
                args.document_tokens,
                args.turns.unwrap_or(3),
                &args.phases,
                args.seed,
            )
            .into_iter()
            .map(|(convs, workers)| vec![Pool::new(convs, workers)])
            .collect(),
        ),
        (WorkloadKind::NoisyNeighbor, _) => Plan::Closed(vec![args.noisy().pools()]),
        (WorkloadKind::PrefixGroups, _) => Plan::Queue(shapes::prefix_groups(
            args.groups.unwrap_or(4),
            args.users.unwrap_or(6),
            args.system_tokens.unwrap_or(600),
            args.question_tokens.unwrap_or(30),
            args.seed,
        )),
        (WorkloadKind::Agentic, _) => {
            let tool_tokens = args.question_tokens.unwrap_or(120);
            let shape = shapes::AgentShape {
                tasks: args.tasks,
                steps: args.turns.unwrap_or(6),
                system_tokens: args.system_tokens.unwrap_or(400),
                tool_tokens: (tool_tokens, args.tool_tokens_max.unwrap_or(tool_tokens)),
                think_ms: args.think_ms,
                tool_calls: args.tool_calls,
                store: args.store,
                seed: args.seed,
            };
            Plan::Closed(vec![vec![Pool::new(shapes::agentic(&shape), c)]])
        }
        (WorkloadKind::Sharegpt, Some(f)) => {
            Plan::Closed(vec![vec![Pool::new(sharegpt::load(f)?, c)]])
        }
        (WorkloadKind::MultiModel, Some(f)) => Plan::Closed(vec![vec![Pool::new(
            multi_model::assign(sharegpt::load(f)?, &args.models, args.model_zipf, args.seed)?,
            c,
        )]]),
        (WorkloadKind::Prompts, Some(f)) => {
            Plan::Queue(prompts::requests(prompts::load(f)?, args.max_output_tokens))
        }
        (_, Some(f)) => Plan::Open(Box::new(MooncakeSchedule::new(
            mooncake::load(f)?,
            args.time_scale * args.trace_speedup,
        ))),
        (_, None) => return Err("no workload file".into()),
    };
    let plan = match &args.tenants {
        Some(mix) => with_tenants(plan, mix),
        None => plan,
    };
    let label = args
        .label
        .clone()
        .unwrap_or_else(|| args.workload.name().to_owned());
    let duration = Duration::from_secs_f64(args.duration_s());
    let (tenancy, headers) = Tenancy::from_headers(args.extra_headers()?);
    let client = reqwest::Client::builder()
        .tcp_nodelay(true)
        .pool_max_idle_per_host(4096)
        .build()
        .map_err(|e| format!("cannot build HTTP client: {e}"))?;

    let start = Instant::now();
    let t_start = TokioInstant::now();
    let stop_at = t_start + duration;
    let shared = Arc::new(Shared {
        ctx: Ctx {
            client: client.clone(),
            targets: std::iter::once(&args.target)
                .chain(&args.replica_targets)
                .map(|t| t.trim_end_matches('/').to_owned())
                .collect(),
            api: args.api,
            model: args.model.clone(),
            session_header: args.session_header,
            headers,
            tenancy,
            time_scale: args.time_scale,
            check_text: args.check_text,
            start,
            hard_deadline: stop_at + Duration::from_secs_f64(args.grace_s),
        },
        counters: Arc::new(Counters::default()),
        records: Mutex::new(Vec::new()),
        max_requests: args.max_requests,
        stop_at,
    });

    let done = Arc::new(AtomicBool::new(false));
    let samples = Arc::new(Mutex::new(Vec::<LoadSample>::new()));
    let mut background = JoinSet::new();
    background.spawn(progress::show(
        shared.counters.clone(),
        label.clone(),
        start,
        duration.as_secs_f64(),
        done.clone(),
    ));
    for url in &args.metrics_urls {
        background.spawn(metrics::poll(
            client.clone(),
            url.clone(),
            start,
            done.clone(),
            samples.clone(),
        ));
    }

    match plan {
        Plan::Closed(phases) => {
            for pools in phases {
                let runs = pools
                    .into_iter()
                    .map(|pool| run_closed(&shared, pool, args.max_output_tokens));
                futures_util::future::join_all(runs).await;
            }
        }
        Plan::Queue(reqs) => run_queue(&shared, reqs, args.conversations).await,
        Plan::Open(sched) => run_open(&shared, sched, t_start, duration).await,
    }
    done.store(true, Ordering::Relaxed);
    while background.join_next().await.is_some() {}

    let mut records = shared
        .records
        .lock()
        .map(|mut v| std::mem::take(&mut *v))
        .unwrap_or_default();
    records.sort_by_key(|r| r.id);
    to_model_time(&mut records, args.time_scale);
    // Records are in model time now, as is the warm-up.
    let warmup_ms = args.warmup_s * 1000.0;
    let after_warmup: Vec<RequestRecord>;
    let measured: &[RequestRecord] = if warmup_ms > 0.0 {
        after_warmup = records
            .iter()
            .filter(|r| r.send_ms >= warmup_ms)
            .cloned()
            .collect();
        &after_warmup
    } else {
        &records
    };
    let mut summary = summarize(measured, args.slo_ttft_ms);
    // Backlogs need every request, those sent in the warm-up too: they may be outstanding
    // after it.
    if let Some((rows, fairness)) = tenants::measure_tenants(
        measured,
        &records,
        warmup_ms,
        summary.slo_ttft_ms,
        summary.duration_s,
    ) {
        summary.tenants = rows;
        summary.fairness = Some(fairness);
    }
    let steps = if args.workload == WorkloadKind::Ladder {
        ladder_steps(&records, &args.rates, args.slo_ttft_ms)
    } else {
        Vec::new()
    };
    let load_samples = samples
        .lock()
        .map(|mut v| std::mem::take(&mut *v))
        .unwrap_or_default();
    if !load_samples.is_empty() {
        summary.queued_while_idle = Some(metrics::queued_while_idle(&load_samples));
    }
    let config = serde_json::json!({
        "label": label,
        "workload": args.workload.name(),
        "file": file.as_ref().map(|f| f.display().to_string()),
        "target": args.target,
        "replica_targets": args.replica_targets,
        "time_scale": args.time_scale,
        "trace_speedup": args.trace_speedup,
        "duration_s": duration.as_secs_f64(),
        "max_requests": args.max_requests,
        "grace_s": args.grace_s,
        "slo_ttft_ms": args.slo_ttft_ms,
        "model": args.model,
        "models": (args.workload == WorkloadKind::MultiModel).then_some((&args.models, args.model_zipf)),
        "session_header": args.session_header,
        "headers": args.headers,
        "api": args.api,
        "conversations": matches!(args.workload, WorkloadKind::Sharegpt | WorkloadKind::MultiModel | WorkloadKind::Prompts | WorkloadKind::PrefixGroups | WorkloadKind::Agentic | WorkloadKind::NoisyNeighbor)
            .then_some(args.conversations),
        "tenants": args.tenants.as_ref().map(|m| &m.spec),
        "noisy_neighbor": (args.workload == WorkloadKind::NoisyNeighbor).then(|| {
            let n = args.noisy();
            serde_json::json!({"shape": n, "steady_workers": n.steady_workers(),
                               "flood_workers": n.flood_workers()})
        }),
        "documents": (args.workload == WorkloadKind::Documents).then(|| serde_json::json!({
            "documents": args.documents, "document_tokens": args.document_tokens,
            "turns": args.turns.unwrap_or(3), "phases": args.phases})),
        "shape": matches!(args.workload, WorkloadKind::PrefixGroups | WorkloadKind::Agentic).then(|| serde_json::json!({
            "groups": args.groups, "users": args.users, "tasks": args.tasks, "turns": args.turns,
            "system_tokens": args.system_tokens, "question_tokens": args.question_tokens})),
        "ladder": (args.workload == WorkloadKind::Ladder).then(|| args.ladder()),
        "metrics_urls": args.metrics_urls,
        "requests_sent": records.len(),
        "wall_s": start.elapsed().as_secs_f64(),
        "command_line": std::env::args().collect::<Vec<_>>().join(" "),
    });
    let rows = [(label.clone(), summary.clone())];
    let table =
        report::markdown_table(&rows) + &super::tenant_table::markdown(&rows).unwrap_or_default();
    let report = Report {
        label,
        config,
        summary,
        steps,
        records,
        records_omitted: 0,
        load_samples,
        token_estimates: None,
    };
    report::write(&args.out, report)?;
    print!("{table}");
    println!("report written to {}", args.out.display());
    Ok(())
}

/// The pool's workers, each with one conversation at a time; each sends its turns in order
/// and takes the pool's next conversation when it ends. A failed turn ends its conversation:
/// the history would lack the reply.
async fn run_closed(shared: &Arc<Shared>, pool: Pool, cap: u32) {
    let convs = pool.convs;
    let next = Arc::new(AtomicUsize::new(0));
    let mut tasks = JoinSet::new();
    for _ in 0..pool.workers {
        let (shared, convs, next) = (shared.clone(), convs.clone(), next.clone());
        tasks.spawn(async move {
            while TokioInstant::now() < shared.stop_at {
                let Some(conv) = convs.get(next.fetch_add(1, Ordering::Relaxed)) else {
                    return;
                };
                let mut chat = Chat::new(conv.clone(), cap);
                // Turn k of a conversation goes to replica k (mod the replicas).
                let mut turn = 0;
                while let Some(req) = chat.next_request() {
                    if TokioInstant::now() >= shared.stop_at {
                        return;
                    }
                    let Some(id) = shared.counters.try_send(shared.max_requests) else {
                        return;
                    };
                    let out = client::send(&shared.ctx, id, req, turn).await;
                    turn += 1;
                    let ok = out.record.ok();
                    shared.finish(out.record);
                    if !ok {
                        back_off(&shared, out.retry_after).await;
                        break;
                    }
                    chat.record_answer(out.text, out.call, out.response_id);
                }
            }
        });
    }
    while tasks.join_next().await.is_some() {}
}

/// C workers; each sends the next request in order once its previous one has finished.
async fn run_queue(shared: &Arc<Shared>, reqs: Vec<ChatRequest>, workers: u32) {
    let reqs = Arc::new(reqs);
    let next = Arc::new(AtomicUsize::new(0));
    let mut tasks = JoinSet::new();
    for _ in 0..workers {
        let (shared, reqs, next) = (shared.clone(), reqs.clone(), next.clone());
        tasks.spawn(async move {
            while TokioInstant::now() < shared.stop_at {
                let Some(req) = reqs.get(next.fetch_add(1, Ordering::Relaxed)) else {
                    return;
                };
                let Some(id) = shared.counters.try_send(shared.max_requests) else {
                    return;
                };
                let out = client::send(&shared.ctx, id, req.clone(), id as usize).await;
                let failed = !out.record.ok();
                shared.finish(out.record);
                if failed {
                    back_off(&shared, out.retry_after).await;
                }
            }
        });
    }
    while tasks.join_next().await.is_some() {}
}

/// A closed-loop worker told to retry later (a shed's `Retry-After`) waits that long, or to
/// the end of sending, before its next request: a polite client does, and one that does not
/// turns a shedding router into a loop of instant 429s that measures nothing.
async fn back_off(shared: &Shared, retry_after: Option<Duration>) {
    if let Some(wait) = retry_after {
        tokio::time::sleep_until(shared.stop_at.min(TokioInstant::now() + wait)).await;
    }
}

/// `plan` with `mix`'s tenants filled in where the workload set none.
fn with_tenants(plan: Plan, mix: &super::workloads::tenancy::TenantMix) -> Plan {
    match plan {
        Plan::Closed(phases) => Plan::Closed(
            phases
                .into_iter()
                .map(|pools| {
                    let mixed = |p: Pool| Pool {
                        convs: Arc::new(MixedConversations {
                            inner: p.convs,
                            mix: mix.clone(),
                        }),
                        workers: p.workers,
                    };
                    pools.into_iter().map(mixed).collect()
                })
                .collect(),
        ),
        Plan::Queue(mut reqs) => {
            mix.assign(&mut reqs);
            Plan::Queue(reqs)
        }
        Plan::Open(inner) => Plan::Open(Box::new(MixedSchedule {
            inner,
            mix: mix.clone(),
            next: 0,
        })),
    }
}

/// Sends each request at its due time without waiting for earlier answers.
async fn run_open(
    shared: &Arc<Shared>,
    mut sched: Box<dyn OpenLoop>,
    t_start: TokioInstant,
    duration: Duration,
) {
    let mut tasks = JoinSet::new();
    while let Some(s) = sched.next_request() {
        if s.at >= duration {
            break;
        }
        tokio::time::sleep_until(t_start + s.at).await;
        let Some(id) = shared.counters.try_send(shared.max_requests) else {
            break;
        };
        let sh = shared.clone();
        tasks.spawn(async move {
            let out = client::send(&sh.ctx, id, s.req, id as usize).await;
            sh.finish(out.record);
        });
        // Reap finished tasks so a long run does not hold every result until the end.
        while tasks.try_join_next().is_some() {}
    }
    while tasks.join_next().await.is_some() {}
}

/// Wall-clock measurements against a simulator running K times faster, in model time.
fn to_model_time(records: &mut [RequestRecord], k: f64) {
    for r in records {
        r.send_ms *= k;
        r.e2e_ms *= k;
        r.ttft_ms = r.ttft_ms.map(|t| t * k);
        r.itl_p50_ms = r.itl_p50_ms.map(|t| t * k);
        r.itl_ms.iter_mut().for_each(|t| *t *= k);
    }
}

fn ladder_steps(records: &[RequestRecord], rates: &[f64], slo: f64) -> Vec<(String, Summary)> {
    let mut by: BTreeMap<usize, Vec<RequestRecord>> = BTreeMap::new();
    for r in records {
        if let Some(s) = r.step {
            by.entry(s).or_default().push(r.clone());
        }
    }
    by.into_iter()
        .map(|(step, rs)| {
            let rate = rates.get(step).copied().unwrap_or(f64::NAN);
            (format!("step {step}: {rate} req/s"), summarize(&rs, slo))
        })
        .collect()
}
