//! The counters a server keeps: its own (requests, tokens, prefix hits, TTFT, fixed-mode
//! gauges) and the gauges its engine task publishes. Both live here, below `engine` and
//! `metrics`, so that the engine can publish into them and `metrics` can render them without
//! either module depending on the other.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use serde::Serialize;

use super::profile::BLOCK_TOKENS;

/// vLLM's TTFT buckets, in seconds, up to 10 s.
pub const TTFT_BUCKETS: [f64; 16] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
];

/// vLLM's request latency buckets (prefill, queue, decode and end-to-end times), seconds.
pub const PREFILL_BUCKETS: [f64; 21] = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// vLLM's inter-token latency buckets, seconds.
pub const ITL_BUCKETS: [f64; 19] = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];

/// Prompt-token buckets of vLLM's per-request token histograms.
pub const TOKEN_BUCKETS: [f64; 14] = [
    1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0,
    65536.0,
];

/// Engine counters published after every step, read by `/metrics` and `/debug/state`.
#[derive(Debug, Default)]
pub struct EngineGauges {
    pub running: AtomicU64,
    pub waiting: AtomicU64,
    pub used_blocks: AtomicU64,
    pub cached_blocks: AtomicU64,
    pub preemptions: AtomicU64,
    pub steps: AtomicU64,
    pub late_steps: AtomicU64,
    pub max_late_us: AtomicU64,
    pub late_us_total: AtomicU64,
    pub prefill_tokens: AtomicU64,
    /// Over every step, the requests it ran (llama.cpp's busy slots per `llama_decode`).
    pub busy_seqs: AtomicU64,
    /// The most tokens one request has held in KV.
    pub max_seq_tokens: AtomicU64,
    /// Requests handed to this engine and not yet finished or abandoned (its balancer's
    /// measure of load, current between steps).
    pub assigned: AtomicU64,
}

#[derive(Debug, Default)]
pub struct Stats {
    running: AtomicU64,
    waiting: AtomicU64,
    /// KV blocks held by running requests (prompt plus output), for the usage gauge.
    blocks_in_use: AtomicU64,
    requests_total: AtomicU64,
    prompt_tokens_total: AtomicU64,
    generation_tokens_total: AtomicU64,
    prefix_queries_total: AtomicU64,
    prefix_hits_total: AtomicU64,
    /// One lock for both histograms and the processed-token count, so that a scrape sees
    /// prompt tokens and prompt seconds of the same requests.
    timings: Mutex<Timings>,
    /// Published by the engine tasks in engine mode, one per data-parallel rank; none in
    /// fixed-timing mode, so the snapshot can simply add both sources.
    pub engine: Vec<Arc<EngineGauges>>,
}

#[derive(Debug, Clone)]
pub struct Histogram {
    /// Upper bounds of the finite buckets.
    pub bounds: &'static [f64],
    /// Non-cumulative counts per bucket; the last slot is +Inf.
    pub counts: Vec<u64>,
    pub sum: f64,
    pub count: u64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: vec![0; bounds.len() + 1],
            sum: 0.0,
            count: 0,
        }
    }

    pub fn observe(&mut self, v: f64) {
        self.observe_n(v, 1);
    }

    /// `n` observations of the same value.
    fn observe_n(&mut self, v: f64, n: u64) {
        let slot = self
            .bounds
            .iter()
            .position(|&b| v <= b)
            .unwrap_or(self.bounds.len());
        self.counts[slot] += n;
        self.sum += v * n as f64;
        self.count += n;
    }
}

#[derive(Debug, Clone)]
struct Timings {
    ttft: Histogram,
    /// Per request, model seconds of prefill (see `scheduler`).
    prefill: Histogram,
    /// Per request, prompt tokens computed by its prefill (prefix-cache hits excluded):
    /// vLLM's `request_prefill_kv_computed_tokens`, observed with `prefill`.
    computed: Histogram,
    /// Per output token after the first, model seconds since the request's previous token.
    itl: Histogram,
    /// Finished requests' output tokens and model seconds from their first token to their
    /// last (llama.cpp's `n_decoded` and `t_token_generation`, counted when a request ends).
    predicted: Throughput,
    /// What llama.cpp counts since the previous `/metrics` scrape (its reset "bucket").
    interval: Interval,
}

/// Tokens and the model seconds they took.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Throughput {
    pub tokens: u64,
    pub seconds: f64,
}

impl Throughput {
    fn add(&mut self, tokens: u64, seconds: f64) {
        self.tokens += tokens;
        self.seconds += seconds;
    }

    /// Tokens per second, 0 when nothing was timed.
    pub fn rate(&self) -> f64 {
        if self.tokens > 0 && self.seconds > 0.0 {
            self.tokens as f64 / self.seconds
        } else {
            0.0
        }
    }
}

/// llama.cpp's interval counters, which each `/metrics` request reads and resets: the
/// throughput gauges `prompt_tokens_seconds` and `predicted_tokens_seconds` cover only the
/// prompts and requests finished since the previous scrape.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Interval {
    pub prompt: Throughput,
    pub predicted: Throughput,
}

impl Default for Timings {
    fn default() -> Self {
        Self {
            ttft: Histogram::new(&TTFT_BUCKETS),
            prefill: Histogram::new(&PREFILL_BUCKETS),
            computed: Histogram::new(&TOKEN_BUCKETS),
            itl: Histogram::new(&ITL_BUCKETS),
            predicted: Throughput::default(),
            interval: Interval::default(),
        }
    }
}

/// A consistent-enough copy of the counters for one scrape or `/debug/state`.
#[derive(Debug, Clone, Serialize)]
pub struct Snapshot {
    pub running: u64,
    pub waiting: u64,
    pub kv_cache_usage: f64,
    /// KV tokens held by requests, at block granularity.
    pub kv_tokens_used: u64,
    pub requests_total: u64,
    pub prompt_tokens_total: u64,
    pub generation_tokens_total: u64,
    pub prefix_cache_queries_total: u64,
    pub prefix_cache_hits_total: u64,
    pub preemptions_total: u64,
    /// Prompt tokens computed (not served from the prefix cache) by finished prefills.
    pub prompt_tokens_processed_total: u64,
    /// Model seconds of those prefills.
    pub prompt_seconds_total: f64,
    /// Finished requests' tokens and decode seconds (see `Timings::predicted`).
    pub predicted_total: Throughput,
    /// Since the previous `/metrics` scrape (`Stats::scrape`).
    pub interval: Interval,
    /// Engine steps (llama.cpp's `n_decode_total`).
    pub steps_total: u64,
    /// Over every step, the requests it ran.
    pub busy_seqs_total: u64,
    /// The most tokens one request has held in KV (llama.cpp's `n_tokens_max`).
    pub max_seq_tokens: u64,
    #[serde(skip)]
    pub ttft: Histogram,
    #[serde(skip)]
    pub prefill_time: Histogram,
    #[serde(skip)]
    pub prefill_computed_tokens: Histogram,
    #[serde(skip)]
    pub itl: Histogram,
}

impl Stats {
    /// A server's statistics with `ranks` engines' gauges (0: fixed timing).
    pub fn with_ranks(ranks: usize) -> Stats {
        Stats {
            engine: (0..ranks).map(|_| Arc::default()).collect(),
            ..Stats::default()
        }
    }

    /// The engines' gauge `f`, summed over the ranks.
    fn engines(&self, f: impl Fn(&EngineGauges) -> &AtomicU64) -> u64 {
        self.engine.iter().map(|e| f(e).load(Relaxed)).sum()
    }

    /// Counts an admitted request's prompt against the prefix cache.
    pub fn admitted(&self, prompt_tokens: u64, cached_tokens: u64) {
        self.requests_total.fetch_add(1, Relaxed);
        self.prompt_tokens_total.fetch_add(prompt_tokens, Relaxed);
        self.prefix_queries_total.fetch_add(prompt_tokens, Relaxed);
        self.prefix_hits_total.fetch_add(cached_tokens, Relaxed);
    }

    pub fn generated(&self, tokens: u64) {
        self.generation_tokens_total.fetch_add(tokens, Relaxed);
    }

    pub fn observe_ttft(&self, seconds: f64) {
        self.timings().ttft.observe(seconds);
    }

    /// A request finished its prefill: `processed_tokens` prompt tokens computed in
    /// `seconds` of model time.
    pub fn prefilled(&self, processed_tokens: u64, seconds: f64) {
        let mut t = self.timings();
        t.prefill.observe(seconds);
        t.computed.observe(processed_tokens as f64);
        t.interval.prompt.add(processed_tokens, seconds);
    }

    /// A request ended after `tokens` output tokens, `seconds` of model time from its first
    /// token to its last.
    pub fn predicted(&self, tokens: u64, seconds: f64) {
        let mut t = self.timings();
        t.predicted.add(tokens, seconds);
        t.interval.predicted.add(tokens, seconds);
    }

    /// An engine step of `seconds` gave `tokens` streams their next (not first) token.
    pub fn decoded(&self, seconds: f64, tokens: u64) {
        if tokens > 0 {
            self.timings().itl.observe_n(seconds, tokens);
        }
    }

    fn timings(&self) -> MutexGuard<'_, Timings> {
        self.timings.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Marks a request running until the guard drops (end of answer or client gone).
    pub fn start_running(self: &Arc<Self>, kv_blocks: u64) -> Gauge {
        self.running.fetch_add(1, Relaxed);
        self.blocks_in_use.fetch_add(kv_blocks, Relaxed);
        Gauge {
            stats: self.clone(),
            kind: GaugeKind::Running(kv_blocks),
        }
    }

    /// Counts `kv_blocks` as in use until the guard drops: fixed timing's prompt blocks held
    /// for a remote decode (the engine's pool counts its own).
    pub fn start_holding(self: &Arc<Self>, kv_blocks: u64) -> Gauge {
        self.blocks_in_use.fetch_add(kv_blocks, Relaxed);
        Gauge {
            stats: self.clone(),
            kind: GaugeKind::Holding(kv_blocks),
        }
    }

    /// Marks a request waiting (held by a hang fault, or for its KV transfer) until the
    /// guard drops.
    pub fn start_waiting(self: &Arc<Self>) -> Gauge {
        self.waiting.fetch_add(1, Relaxed);
        Gauge {
            stats: self.clone(),
            kind: GaugeKind::Waiting,
        }
    }

    pub fn snapshot(&self, num_gpu_blocks: usize) -> Snapshot {
        self.snapshot_and(num_gpu_blocks, false)
    }

    /// The snapshot a `/metrics` scrape renders: it also starts a new interval, as a scrape of
    /// llama.cpp's `/metrics` does.
    pub fn scrape(&self, num_gpu_blocks: usize) -> Snapshot {
        self.snapshot_and(num_gpu_blocks, true)
    }

    fn snapshot_and(&self, num_gpu_blocks: usize, reset_interval: bool) -> Snapshot {
        let blocks = self.blocks_in_use.load(Relaxed) + self.engines(|e| &e.used_blocks);
        let used = blocks as f64 / num_gpu_blocks.max(1) as f64;
        let timings = {
            let mut t = self.timings();
            let copy = t.clone();
            if reset_interval {
                t.interval = Interval::default();
            }
            copy
        };
        Snapshot {
            running: self.running.load(Relaxed) + self.engines(|e| &e.running),
            waiting: self.waiting.load(Relaxed) + self.engines(|e| &e.waiting),
            kv_cache_usage: used.min(1.0),
            kv_tokens_used: blocks * BLOCK_TOKENS,
            requests_total: self.requests_total.load(Relaxed),
            prompt_tokens_total: self.prompt_tokens_total.load(Relaxed),
            generation_tokens_total: self.generation_tokens_total.load(Relaxed),
            prefix_cache_queries_total: self.prefix_queries_total.load(Relaxed),
            prefix_cache_hits_total: self.prefix_hits_total.load(Relaxed),
            preemptions_total: self.engines(|e| &e.preemptions),
            prompt_tokens_processed_total: timings.computed.sum as u64,
            prompt_seconds_total: timings.prefill.sum,
            predicted_total: timings.predicted,
            interval: timings.interval,
            steps_total: self.engines(|e| &e.steps),
            busy_seqs_total: self.engines(|e| &e.busy_seqs),
            max_seq_tokens: self
                .engine
                .iter()
                .map(|e| e.max_seq_tokens.load(Relaxed))
                .max()
                .unwrap_or(0),
            ttft: timings.ttft,
            prefill_time: timings.prefill,
            prefill_computed_tokens: timings.computed,
            itl: timings.itl,
        }
    }
}

enum GaugeKind {
    Running(u64),
    Holding(u64),
    Waiting,
}

pub struct Gauge {
    stats: Arc<Stats>,
    kind: GaugeKind,
}

impl Drop for Gauge {
    fn drop(&mut self) {
        match self.kind {
            GaugeKind::Running(blocks) => {
                self.stats.running.fetch_sub(1, Relaxed);
                self.stats.blocks_in_use.fetch_sub(blocks, Relaxed);
            }
            GaugeKind::Holding(blocks) => {
                self.stats.blocks_in_use.fetch_sub(blocks, Relaxed);
            }
            GaugeKind::Waiting => {
                self.stats.waiting.fetch_sub(1, Relaxed);
            }
        }
    }
}
