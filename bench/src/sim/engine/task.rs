//! The per-server engine task: runs `Scheduler` steps back to back on the simulated clock.
//!
//! Each step's model time is divided by the time scale and slept until an absolute deadline,
//! so the cost of the simulation itself does not make the clock drift; a step that wakes late
//! is counted (`late_steps`, `max_late_ms` in `/debug/state`) and the next ones catch up.
//! An idle engine parks on its submission channel: no timer runs without work.
//!
//! Delivery: each request has a `watch` channel holding its progress (tokens emitted so far),
//! updated after every step in which it emitted. A watch never blocks the engine: if a
//! client reads slowly, the progress it has not yet seen accumulates in the value and the
//! stream sends the pending tokens together in one SSE event (see `engine_answer`).
//! A request whose receiver is gone (client disconnected) is aborted, freeing its blocks.
//!
//! KV events (`--kv-events`): a step that changed the pool's named blocks publishes them as
//! one batch when it ends, before its tokens are delivered, as vLLM's engine core does after
//! each model step; `kvpublish::Publisher::publish` never waits.
//!
//! Data parallelism (`--dp-size N`): a server runs N such engines (ranks), each with its own
//! pool, step clock and publisher, behind its one HTTP port, as vLLM's `--data-parallel-size`
//! with its internal load balancer. A request goes to the rank its `X-Data-Parallel-Rank`
//! header names, else to the rank with the fewest requests in flight (ties rotate).
//!
//! P/D disaggregation: besides requests, the task takes a hold's release and a prefix lookup
//! (`Command`), between steps or while idle. A request finished with a hold is reported to the
//! server's `HoldSink` from the engine task itself, before its last token is delivered: a hold
//! is known even when its client is already gone, as vLLM keeps the blocks of a finished
//! request whose answer nobody reads until they expire.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::{sleep_until, Instant};

use super::cores::SharedCores;
use super::kv_events::kvpublish::{KvEventCounters, Publisher};
use super::profile::Profile;
use super::scheduler::{NewRequest, Scheduler};
use super::stats::{EngineGauges, Stats};

/// What a waiting client sees of its request.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Progress {
    /// Tokens emitted so far.
    pub generated: u64,
    /// Prefix-cache hit at admission; set before the first token is emitted.
    pub cached_tokens: Option<u64>,
    /// Prompt tokens computed and their model seconds (see `scheduler::Prefilled`); set with
    /// the first token.
    pub prompt_computed: u64,
    pub prompt_seconds: f64,
    /// Model seconds from the first token to the last; set with the last token.
    pub decode_seconds: f64,
    /// Prompt blocks held for a remote decode (`KvTransfer::hold`); set with the last token.
    pub held_blocks: usize,
}

pub struct Submission {
    pub req: NewRequest,
    pub progress: watch::Sender<Progress>,
}

/// What an engine task is asked to do.
enum Command {
    Submit(Submission),
    /// Drop a hold's references (`Scheduler::release_held`).
    Release(Vec<u64>),
    /// How many leading blocks of these the pool holds.
    Lookup(Vec<u64>, oneshot::Sender<usize>),
}

/// A finished request's prompt blocks, held on engine rank `rank` under `key`.
#[derive(Debug)]
pub struct HoldReport {
    pub key: String,
    pub rank: usize,
    pub hashes: Vec<u64>,
}

/// Where engine tasks report holds (`HoldReport`), called from the task between steps.
pub type HoldSink = Arc<dyn Fn(HoldReport) + Send + Sync>;

#[derive(Debug, Clone, Serialize)]
pub struct EngineState {
    /// As `--profile` spells it.
    pub profile: &'static str,
    /// The profile's true prefill rate, model time: the truth a router's estimate is
    /// checked against.
    pub prefill_tokens_per_s: f64,
    pub num_gpu_blocks: usize,
    pub used_blocks: u64,
    pub cached_blocks: u64,
    pub preemptions_total: u64,
    pub steps_total: u64,
    pub prefill_tokens_total: u64,
    /// Steps that woke more than `LATE` (wall) after their deadline.
    pub late_steps: u64,
    pub max_late_ms: f64,
    /// Mean wall-clock lateness of a step's wake-up; later steps catch up, so this is jitter,
    /// not accumulated drift.
    pub mean_late_ms: f64,
}

pub struct EngineHandle {
    ranks: Vec<Rank>,
    profile: Profile,
    /// Where the balancer starts looking, so ties rotate over the ranks.
    next: AtomicUsize,
}

/// One data-parallel rank: an engine task.
struct Rank {
    tx: mpsc::UnboundedSender<Command>,
    gauges: Arc<EngineGauges>,
    kv_events: Option<Arc<KvEventCounters>>,
}

/// Wakes later than this are counted as the engine falling behind. tokio's timer has 1 ms
/// resolution, so up to ~1 ms of lateness per step is expected and caught up by the next.
const LATE: Duration = Duration::from_millis(2);

impl EngineHandle {
    /// Spawns one engine task per rank (`stats.engine` holds their gauges) on the current
    /// runtime; rank r publishes its KV events into `kv_events[r]` when given, and every
    /// rank reports its holds to `holds`.
    pub fn spawn(
        profile: Profile,
        time_scale: f64,
        stats: Arc<Stats>,
        mut kv_events: Vec<Publisher>,
        holds: HoldSink,
        cores: Option<Arc<SharedCores>>,
    ) -> Self {
        let mut publishers = kv_events.drain(..).map(Some);
        let ranks = stats
            .engine
            .iter()
            .enumerate()
            .map(|(rank, gauges)| {
                let kv_events = publishers.next().flatten();
                let (tx, rx) = mpsc::unbounded_channel();
                let mut sched = Scheduler::new(profile);
                if kv_events.is_some() {
                    sched.record_kv_events();
                }
                let counters = kv_events.as_ref().map(Publisher::counters);
                let engine = Engine {
                    sched,
                    rx,
                    senders: HashMap::new(),
                    gauges: gauges.clone(),
                    stats: stats.clone(),
                    time_scale,
                    kv_events,
                    rank,
                    holds: holds.clone(),
                    cores: cores.clone(),
                };
                tokio::spawn(engine.run());
                Rank {
                    tx,
                    gauges: gauges.clone(),
                    kv_events: counters,
                }
            })
            .collect();
        Self {
            ranks,
            profile,
            next: AtomicUsize::new(0),
        }
    }

    /// Whether this engine publishes KV events, so its requests must carry their tokens.
    pub fn publishes_kv_events(&self) -> bool {
        self.ranks.iter().any(|r| r.kv_events.is_some())
    }

    /// Each publishing rank's batch counts.
    pub fn kv_event_counters(&self) -> Vec<&KvEventCounters> {
        self.ranks
            .iter()
            .filter_map(|r| r.kv_events.as_deref())
            .collect()
    }

    pub fn num_gpu_blocks(&self) -> usize {
        self.profile.kv_blocks
    }

    /// Whether a request of this size can ever run on this engine.
    pub fn fits(&self, prompt_tokens: u64, max_tokens: u64) -> bool {
        self.profile.fits(prompt_tokens, max_tokens)
    }

    /// Queues a request on rank `rank` (if it has one), else on the least loaded; its
    /// progress arrives on the returned receiver. None if the engine task is gone (only at
    /// shutdown).
    pub fn submit(
        &self,
        req: NewRequest,
        rank: Option<usize>,
    ) -> Option<watch::Receiver<Progress>> {
        let r = self.ranks.get(self.pick_rank(rank))?;
        let (progress, rx) = watch::channel(Progress::default());
        r.gauges.assigned.fetch_add(1, Relaxed);
        if r.tx
            .send(Command::Submit(Submission { req, progress }))
            .is_err()
        {
            r.gauges.assigned.fetch_sub(1, Relaxed);
            return None;
        }
        Some(rx)
    }

    /// The rank a request goes to: `rank` if this engine has it, else the least loaded.
    /// A decode request picks it before its transfer, so the transfer lands where it runs.
    pub fn pick_rank(&self, rank: Option<usize>) -> usize {
        rank.filter(|&r| r < self.ranks.len())
            .unwrap_or_else(|| self.least_loaded())
    }

    /// Drops a hold on rank `rank` (`HoldReport`); its blocks stay cached.
    pub fn release(&self, rank: usize, hashes: Vec<u64>) {
        if let Some(r) = self.ranks.get(rank) {
            // Err only when the task is gone, and its pool with it.
            let _ = r.tx.send(Command::Release(hashes));
        }
    }

    /// Leading blocks of `hashes` rank `rank`'s pool holds, asked between its steps
    /// (0 if the task is gone).
    pub async fn lookup(&self, rank: usize, hashes: Vec<u64>) -> usize {
        let Some(r) = self.ranks.get(rank) else {
            return 0;
        };
        let (tx, rx) = oneshot::channel();
        if r.tx.send(Command::Lookup(hashes, tx)).is_err() {
            return 0;
        }
        rx.await.unwrap_or(0)
    }

    fn least_loaded(&self) -> usize {
        let n = self.ranks.len().max(1);
        let start = self.next.fetch_add(1, Relaxed) % n;
        (0..n)
            .map(|k| (start + k) % n)
            .min_by_key(|&r| {
                self.ranks
                    .get(r)
                    .map_or(u64::MAX, |r| r.gauges.assigned.load(Relaxed))
            })
            .unwrap_or(0)
    }

    /// The server's engines together (one unless `--dp-size`).
    pub fn state(&self) -> EngineState {
        let sum = |f: fn(&EngineGauges) -> &std::sync::atomic::AtomicU64| -> u64 {
            self.ranks.iter().map(|r| f(&r.gauges).load(Relaxed)).sum()
        };
        let steps = sum(|g| &g.steps);
        EngineState {
            profile: self.profile.name.as_str(),
            prefill_tokens_per_s: self.profile.prefill_rate,
            num_gpu_blocks: self.profile.kv_blocks * self.ranks.len(),
            used_blocks: sum(|g| &g.used_blocks),
            cached_blocks: sum(|g| &g.cached_blocks),
            preemptions_total: sum(|g| &g.preemptions),
            steps_total: steps,
            prefill_tokens_total: sum(|g| &g.prefill_tokens),
            late_steps: sum(|g| &g.late_steps),
            max_late_ms: self
                .ranks
                .iter()
                .map(|r| r.gauges.max_late_us.load(Relaxed))
                .max()
                .unwrap_or(0) as f64
                / 1e3,
            mean_late_ms: sum(|g| &g.late_us_total) as f64 / 1e3 / steps.max(1) as f64,
        }
    }
}

struct Engine {
    sched: Scheduler,
    rx: mpsc::UnboundedReceiver<Command>,
    senders: HashMap<u64, watch::Sender<Progress>>,
    gauges: Arc<EngineGauges>,
    stats: Arc<Stats>,
    time_scale: f64,
    kv_events: Option<Publisher>,
    /// This task's data-parallel rank, which its holds name.
    rank: usize,
    holds: HoldSink,
    /// The cores this engine shares with the process's others (`--cores`), if any.
    cores: Option<Arc<SharedCores>>,
}

impl Engine {
    async fn run(mut self) {
        let mut deadline = Instant::now();
        loop {
            while let Ok(cmd) = self.rx.try_recv() {
                self.command(cmd);
            }
            self.drop_disconnected();
            if self.sched.is_idle() {
                self.publish();
                match self.rx.recv().await {
                    Some(cmd) => self.command(cmd),
                    None => return,
                }
                deadline = Instant::now();
                continue;
            }
            let (slowdown, busy) = match &self.cores {
                Some(c) => {
                    let (s, b) = c.enter();
                    (s, Some(b))
                }
                None => (1.0, None),
            };
            let out = self.sched.step_slowed(slowdown);
            self.gauges
                .prefill_tokens
                .fetch_add(out.prefill_tokens, Relaxed);
            self.publish();
            deadline += Duration::from_secs_f64(out.seconds / self.time_scale);
            sleep_until(deadline).await;
            drop(busy);
            self.note_lateness(deadline);
            if let Some(publisher) = &mut self.kv_events {
                publisher.publish(&out.kv_events);
            }
            for a in &out.admitted {
                // Transferred blocks are cached for the request, not prefix-cache hits.
                let hits = a.cached_tokens - a.transferred_tokens;
                self.stats.admitted(a.prompt_tokens, hits);
                if let Some(tx) = self.senders.get(&a.id) {
                    // No wake-up: the client only needs this with its first token.
                    tx.send_if_modified(|p| {
                        p.cached_tokens = Some(a.cached_tokens);
                        false
                    });
                }
            }
            for p in &out.prefilled {
                self.stats.prefilled(p.computed_tokens, p.seconds);
                if let Some(tx) = self.senders.get(&p.id) {
                    // No wake-up: it comes with the first token, below.
                    tx.send_if_modified(|v| {
                        v.prompt_computed = p.computed_tokens;
                        v.prompt_seconds = p.seconds;
                        false
                    });
                }
            }
            for h in out.held {
                if let Some(tx) = self.senders.get(&h.id) {
                    // No wake-up: it comes with the last token, below.
                    tx.send_if_modified(|v| {
                        v.held_blocks = h.hashes.len();
                        false
                    });
                }
                (self.holds)(HoldReport {
                    key: h.key,
                    rank: self.rank,
                    hashes: h.hashes,
                });
            }
            for f in &out.finished {
                self.stats.predicted(f.tokens, f.decode_seconds);
                if let Some(tx) = self.senders.get(&f.id) {
                    tx.send_if_modified(|v| {
                        v.decode_seconds = f.decode_seconds;
                        false
                    });
                }
            }
            let next_tokens = out.emitted.iter().filter(|e| e.generated > 1).count();
            self.stats.decoded(out.seconds, next_tokens as u64);
            let mut tokens = 0;
            for e in &out.emitted {
                tokens += 1;
                if let Some(tx) = self.senders.get(&e.id) {
                    tx.send_modify(|p| p.generated = e.generated);
                }
                if e.finished && self.senders.remove(&e.id).is_some() {
                    self.gauges.assigned.fetch_sub(1, Relaxed);
                }
            }
            self.stats.generated(tokens);
        }
    }

    fn command(&mut self, cmd: Command) {
        match cmd {
            Command::Submit(sub) => {
                let id = self.sched.add(sub.req);
                self.senders.insert(id, sub.progress);
            }
            Command::Release(hashes) => {
                self.sched.release_held(&hashes);
                // No step may follow (an idle engine): the pool's gauges must show it now.
                self.publish();
            }
            Command::Lookup(hashes, reply) => {
                let _ = reply.send(self.sched.lookup(&hashes));
            }
        }
    }

    fn drop_disconnected(&mut self) {
        let (sched, gauges) = (&mut self.sched, &self.gauges);
        self.senders.retain(|&id, tx| {
            let gone = tx.is_closed();
            if gone {
                sched.abort(id);
                gauges.assigned.fetch_sub(1, Relaxed);
            }
            !gone
        });
    }

    fn note_lateness(&self, deadline: Instant) {
        let late = Instant::now().saturating_duration_since(deadline);
        let us = u64::try_from(late.as_micros()).unwrap_or(u64::MAX);
        self.gauges.late_us_total.fetch_add(us, Relaxed);
        self.gauges.max_late_us.fetch_max(us, Relaxed);
        if late > LATE {
            self.gauges.late_steps.fetch_add(1, Relaxed);
        }
    }

    fn publish(&self) {
        let g = &self.gauges;
        let pool = self.sched.pool();
        let c = self.sched.counters();
        g.running.store(self.sched.running() as u64, Relaxed);
        g.waiting.store(self.sched.waiting() as u64, Relaxed);
        g.used_blocks.store(pool.used() as u64, Relaxed);
        g.cached_blocks.store(pool.cached() as u64, Relaxed);
        g.preemptions.store(c.preemptions, Relaxed);
        g.steps.store(c.steps, Relaxed);
        g.busy_seqs.store(c.busy_seqs, Relaxed);
        g.max_seq_tokens.store(c.max_seq_tokens, Relaxed);
    }
}
