//! Prompt token estimates: counted with BPE tables (o200k_base, or a configured tiktoken rank
//! file) where that is affordable, corrected per model by what the engines report in
//! `usage.prompt_tokens` (their tokenizer is not the router's), and otherwise estimated from
//! the prompt's size at the bytes-per-token ratio the engines showed for that model.
//!
//! Counting costs ~0.1 ms per KB, so it runs inline on the proxy's worker thread only up to
//! `count_tokens_max_bytes`; larger prompts, up to `count_tokens_offthread_max_bytes`, are
//! counted on tokio's blocking pool while the request waits, at most half the cores' worth at
//! a time, so a flood of huge prompts cannot queue unbounded work (the rest are sized).
//!
//! The tables follow the config: loaded at start (o200k_base in a background service, a rank
//! file before the proxy starts, so a bad one stops it), swapped by a reload that names other
//! tables or a rank file changed on disk, and dropped when nothing is counted.

use arc_swap::ArcSwapOption;
use prometheus::{Histogram, IntCounter, IntGauge, Registry};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;
use tiktoken_rs::CoreBPE;
use tokio::sync::Semaphore;

use crate::config::{ConfigError, RoutingConfig};
use crate::metrics::{counter_vec, int_gauge, microseconds};

mod tables;

use tables::{Tables, Tokenizer};

/// Bytes per token assumed for a model no engine has reported on yet.
const PRIOR_BYTES_PER_TOKEN: f64 = 4.0;
/// Weight of one engine report in the per-model ratios: a few dozen requests settle them.
const LEARNING_WEIGHT: f64 = 0.05;
/// Models tracked; past this, new models use the priors (a client cannot grow the map).
const MAX_MODELS: usize = 1024;

/// Off-thread counts running at once: half the cores, so counting can never take all the CPU
/// the proxy's worker threads need.
fn default_slots() -> usize {
    std::thread::available_parallelism().map_or(1, |n| (n.get() / 2).max(1))
}

/// How a prompt's tokens were estimated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// Counted on the proxy's worker thread.
    Counted,
    /// Counted on the blocking pool while the request waited.
    CountedOffthread,
    /// From the prompt's size.
    Sized,
}

impl Method {
    pub fn as_str(self) -> &'static str {
        match self {
            Method::Counted => "counted",
            Method::CountedOffthread => "counted_offthread",
            Method::Sized => "sized",
        }
    }
}

/// How one prompt's tokens were estimated, kept until the engine's `usage` settles it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TokenEstimate {
    /// The estimate placement and quotas use.
    pub tokens: u64,
    /// The BPE count it came from, when the prompt was counted.
    pub counted: Option<u64>,
    /// Canonical prompt bytes.
    pub bytes: usize,
    pub method: Method,
    /// Id of the tables that counted it (0: none).
    tables: u64,
}

/// Which prompts to count, from the config and whether tables are loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CountLimits {
    pub inline: usize,
    pub offthread: usize,
}

impl CountLimits {
    /// The canonical text to keep for counting: none when nothing can count it.
    pub fn text(&self) -> usize {
        self.inline.max(self.offthread)
    }
}

/// Per model: engine tokens per BPE token (for the tables `counted_with` names), and engine
/// tokens per prompt byte (independent of the router's tables).
#[derive(Debug, Clone, Copy)]
struct Ratios {
    per_counted: f64,
    counted_with: u64,
    per_byte: f64,
}

impl Default for Ratios {
    fn default() -> Self {
        Ratios {
            per_counted: 1.0,
            counted_with: 0,
            per_byte: 1.0 / PRIOR_BYTES_PER_TOKEN,
        }
    }
}

impl Ratios {
    /// A ratio learned against other tables says nothing about these.
    fn per_counted(&self, tables: u64) -> f64 {
        if self.counted_with == tables {
            self.per_counted
        } else {
            1.0
        }
    }
}

/// Moves `old` a step toward `sample`, in log space, clamped to `[lo, hi]`.
fn settle(old: f64, sample: f64, lo: f64, hi: f64) -> f64 {
    if !(sample.is_finite() && sample > 0.0) {
        return old;
    }
    (old.ln() * (1.0 - LEARNING_WEIGHT) + sample.ln() * LEARNING_WEIGHT)
        .exp()
        .clamp(lo, hi)
}

/// The prompt is client input: should a crafted one ever trip tiktoken's internal unwraps
/// (a regex backtrack limit), the prompt is sized instead of the worker thread going down.
fn count_text(bpe: &CoreBPE, text: &[u8]) -> Option<u64> {
    let text = String::from_utf8_lossy(text);
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        bpe.count_ordinary(&text) as u64
    }))
    .ok()
}

/// The estimator's families.
pub struct TokenMetrics {
    counted: IntCounter,
    busy: IntCounter,
    failed: IntCounter,
    wait: Histogram,
    loaded: IntGauge,
}

impl TokenMetrics {
    pub fn register(r: &Registry) -> prometheus::Result<TokenMetrics> {
        let offthread = counter_vec(
            r,
            "kvroute_prompt_tokens_offthread_total",
            "Prompts too long to count inline, by result: counted (on the blocking pool), busy \
             (every off-thread slot was taken: sized instead), failed (sized instead).",
            &["result"],
        )?;
        Ok(TokenMetrics {
            counted: offthread.with_label_values(&["counted"]),
            busy: offthread.with_label_values(&["busy"]),
            failed: offthread.with_label_values(&["failed"]),
            wait: microseconds(
                r,
                "kvroute_prompt_tokens_offthread_seconds",
                "How long a request waited for its prompt to be counted off-thread.",
            )?,
            loaded: int_gauge(
                r,
                "kvroute_tokenizer_loaded",
                "1 while BPE tables are loaded (counting is on and the tables are in).",
            )?,
        })
    }
}

/// What the config asks the tables to be (loaded, or loading in the background), and a counter
/// that retires a background load the config has since moved away from.
#[derive(Default)]
struct Wanted {
    tokenizer: Option<Tokenizer>,
    epoch: u64,
}

/// Tables a reload has built (or decided to drop), to install once the reload commits.
#[must_use]
pub struct Prepared(Option<(Option<Tokenizer>, Option<Tables>)>);

pub struct TokenEstimator {
    tables: ArcSwapOption<Tables>,
    wanted: Mutex<Wanted>,
    /// Read on every request, written once per answered one: readers never wait on each other.
    models: RwLock<HashMap<String, Ratios>>,
    offthread: Arc<Semaphore>,
    metrics: Option<TokenMetrics>,
}

impl Default for TokenEstimator {
    fn default() -> Self {
        TokenEstimator::new(default_slots(), None)
    }
}

impl TokenEstimator {
    /// The process's estimator: its off-thread slots sized to the machine.
    pub fn with_metrics(metrics: TokenMetrics) -> TokenEstimator {
        TokenEstimator::new(default_slots(), Some(metrics))
    }

    /// `slots`: off-thread counts at once; beyond them prompts are sized.
    pub fn new(slots: usize, metrics: Option<TokenMetrics>) -> TokenEstimator {
        TokenEstimator {
            tables: ArcSwapOption::empty(),
            wanted: Mutex::new(Wanted::default()),
            models: RwLock::new(HashMap::new()),
            offthread: Arc::new(Semaphore::new(slots)),
            metrics,
        }
    }

    /// At process start: a rank file loads now, so a bad one is an error before anything
    /// runs; o200k_base is only noted, for [`load_pending`](Self::load_pending) to load once
    /// the process runs (a daemon forks after this, and a thread started before the fork would
    /// be lost); nothing loads when no prompt is counted.
    pub fn start(&self, cfg: &RoutingConfig) -> Result<(), ConfigError> {
        match Tokenizer::of(cfg) {
            None => {
                log::info!(
                    "token counting is off (both count_tokens limits are 0): BPE tables not loaded"
                );
                self.install(None, None);
            }
            Some(Tokenizer::O200kBase) => self.install(Some(Tokenizer::O200kBase), None),
            Some(t) => {
                let tables = Tables::load(&t)?;
                self.install(Some(t), Some(tables));
            }
        }
        Ok(())
    }

    /// Load the tables [`start`](Self::start) noted but did not load (blocking: ~120 ms), unless
    /// a reload has asked for others since. Prompts are sized until they are in.
    pub fn load_pending(&self) {
        let (t, epoch) = {
            let w = self.lock_wanted();
            match (&w.tokenizer, self.tables.load().is_none()) {
                (Some(t), true) => (t.clone(), w.epoch),
                _ => return,
            }
        };
        match Tables::load(&t) {
            Ok(tables) => {
                let w = self.lock_wanted();
                if w.epoch == epoch {
                    self.tables.store(Some(Arc::new(tables)));
                    self.set_loaded(true);
                    log::info!("{t} loaded: prompts are counted");
                }
            }
            Err(e) => log::error!("{t} did not load, prompts are estimated by size: {e}"),
        }
    }

    /// Load o200k_base now (tests and benchmarks).
    pub fn warm_now(&self) {
        if let Ok(tables) = Tables::load(&Tokenizer::O200kBase) {
            self.install(Some(Tokenizer::O200kBase), Some(tables));
        }
    }

    /// For a reload: build the tables `cfg` names if they are not the ones in use (or drop
    /// them when it counts nothing), without installing them. On error nothing changes.
    pub async fn prepare(&self, cfg: &RoutingConfig) -> Result<Prepared, ConfigError> {
        let want = Tokenizer::of(cfg);
        if !self.differs(want.as_ref()) {
            return Ok(Prepared(None));
        }
        let Some(t) = want else {
            return Ok(Prepared(Some((None, None))));
        };
        let load = t.clone();
        let tables = tokio::task::spawn_blocking(move || Tables::load(&load))
            .await
            .map_err(|e| ConfigError {
                key: "kvroute.routing.tokenizer".into(),
                reason: format!("the tokenizer loader failed: {e}"),
            })??;
        Ok(Prepared(Some((Some(t), Some(tables)))))
    }

    /// Install what [`prepare`](Self::prepare) built, as the reload publishes its config.
    pub fn apply(&self, p: Prepared) {
        if let Some((t, tables)) = p.0 {
            match &t {
                Some(t) => log::info!("token counting now uses {t}"),
                None => log::info!("token counting is off: BPE tables dropped"),
            }
            self.install(t, tables);
        }
    }

    /// Whether `want` is not what is loaded (or loading), or is a rank file changed on disk.
    fn differs(&self, want: Option<&Tokenizer>) -> bool {
        if self.lock_wanted().tokenizer.as_ref() != want {
            return true;
        }
        match (want, self.tables.load().as_deref()) {
            (Some(t), Some(tables)) => !tables.unchanged_on_disk(t),
            _ => false,
        }
    }

    fn install(&self, t: Option<Tokenizer>, tables: Option<Tables>) {
        let mut w = self.lock_wanted();
        w.epoch += 1;
        w.tokenizer = t;
        self.set_loaded(tables.is_some());
        self.tables.store(tables.map(Arc::new));
    }

    fn lock_wanted(&self) -> std::sync::MutexGuard<'_, Wanted> {
        self.wanted.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn set_loaded(&self, loaded: bool) {
        if let Some(m) = &self.metrics {
            m.loaded.set(i64::from(loaded));
        }
    }

    /// Which prompts `cfg` counts, given the tables in use now.
    pub fn limits(&self, cfg: &RoutingConfig) -> CountLimits {
        if self.tables.load().is_none() {
            return CountLimits {
                inline: 0,
                offthread: 0,
            };
        }
        CountLimits {
            inline: cfg.count_tokens_max_bytes,
            offthread: cfg.count_tokens_offthread_max_bytes,
        }
    }

    /// `text` is the canonical prompt, `bytes` its length; it is counted inline when it is at
    /// most `inline_limit` bytes and tables are loaded, and sized otherwise.
    pub fn estimate(
        &self,
        model: &str,
        text: Option<&[u8]>,
        bytes: usize,
        inline_limit: usize,
    ) -> TokenEstimate {
        let counted = match (text, self.tables.load().as_deref()) {
            (Some(t), Some(tables)) if t.len() <= inline_limit => {
                count_text(&tables.bpe, t).map(|n| (n, tables.id))
            }
            _ => None,
        };
        self.settle_estimate(model, bytes, counted, Method::Counted)
    }

    /// [`estimate`](Self::estimate), and a prompt too long to count inline but within
    /// `limits.offthread` is counted on the blocking pool while the caller waits, when a slot is
    /// free; otherwise it is sized.
    pub async fn count(
        &self,
        model: &str,
        text: Vec<u8>,
        bytes: usize,
        limits: CountLimits,
    ) -> TokenEstimate {
        if text.len() <= limits.inline || text.len() > limits.offthread {
            return self.estimate(model, Some(&text), bytes, limits.inline);
        }
        let counted = match self.tables.load_full() {
            Some(tables) => self.count_offthread(tables, text).await,
            None => None,
        };
        self.settle_estimate(model, bytes, counted, Method::CountedOffthread)
    }

    async fn count_offthread(&self, tables: Arc<Tables>, text: Vec<u8>) -> Option<(u64, u64)> {
        let m = self.metrics.as_ref();
        let Ok(slot) = self.offthread.clone().try_acquire_owned() else {
            log::debug!(
                "all off-thread token count slots are busy: a {} byte prompt is sized",
                text.len()
            );
            if let Some(m) = m {
                m.busy.inc();
            }
            return None;
        };
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return None;
        };
        let started = Instant::now();
        // The slot goes with the work: a request that gives up waiting does not free it
        // before the count it started is done.
        let job = rt.spawn_blocking(move || {
            let _slot = slot;
            count_text(&tables.bpe, &text).map(|n| (n, tables.id))
        });
        let counted = job.await.ok().flatten();
        if let Some(m) = m {
            m.wait.observe(started.elapsed().as_secs_f64());
            match counted {
                Some(_) => m.counted.inc(),
                None => m.failed.inc(),
            }
        }
        counted
    }

    fn settle_estimate(
        &self,
        model: &str,
        bytes: usize,
        counted: Option<(u64, u64)>,
        method: Method,
    ) -> TokenEstimate {
        let ratios = self.ratios(model);
        let (tokens, method, tables) = match counted {
            Some((c, id)) => (
                (c as f64 * ratios.per_counted(id)).round() as u64,
                method,
                id,
            ),
            None => (
                (bytes as f64 * ratios.per_byte).ceil() as u64,
                Method::Sized,
                0,
            ),
        };
        TokenEstimate {
            tokens: tokens.max(u64::from(bytes > 0)),
            counted: counted.map(|c| c.0),
            bytes,
            method,
            tables,
        }
    }

    /// The engine reported `engine_tokens` for a prompt estimated as `est`.
    pub fn learn(&self, model: &str, est: &TokenEstimate, engine_tokens: u64) {
        if engine_tokens == 0 || est.bytes == 0 {
            return;
        }
        let in_use = self.tables.load().as_ref().map_or(0, |t| t.id);
        let Ok(mut models) = self.models.write() else {
            return;
        };
        // Looked up by `&str` first: the owned key is made only for a model's first answer.
        if !models.contains_key(model) {
            if models.len() >= MAX_MODELS {
                return;
            }
            models.insert(model.to_owned(), Ratios::default());
        }
        let Some(r) = models.get_mut(model) else {
            return;
        };
        let engine = engine_tokens as f64;
        // A count from tables a reload has since replaced teaches the new ones nothing.
        if let (Some(c), true) = (est.counted.filter(|&c| c > 0), est.tables == in_use) {
            if r.counted_with != in_use {
                *r = Ratios {
                    counted_with: in_use,
                    per_counted: 1.0,
                    ..*r
                };
            }
            r.per_counted = settle(r.per_counted, engine / c as f64, 0.25, 4.0);
        }
        r.per_byte = settle(r.per_byte, engine / est.bytes as f64, 0.02, 2.0);
    }

    fn ratios(&self, model: &str) -> Ratios {
        self.models
            .read()
            .ok()
            .and_then(|m| m.get(model).copied())
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests;
