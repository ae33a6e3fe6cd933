//! Learning a backend's prefill rate from its engine's own counters.
//!
//! Engines report, cumulatively, the prompt tokens they computed and the seconds requests spent
//! in prefill (vLLM `vllm:request_prefill_time_seconds` `_sum`/`_count` with
//! `vllm:prompt_tokens_total` less `vllm:prefix_cache_hits_total`; llama.cpp
//! `llamacpp:prompt_tokens_total` and `llamacpp:prompt_seconds_total`). Both are in the engine's
//! own (model) time, so what is learned does not depend on kvroute's clock, its network or its
//! queueing.
//!
//! Each scrape adds one interval `(tokens, seconds, requests)` to a rolling window. Per request
//! prefill time is about `a + tokens / rate`: the fixed part `a` (a step's overhead, the share
//! of a step a tiny prompt waits for) dominates small prompts, so a plain `tokens / seconds`
//! ratio would read a fleet of short chats as a slow GPU. Where the engine reports request
//! counts, a least-squares fit of `seconds = a * requests + tokens / rate` over the window
//! separates the two; otherwise, or when the window's intervals cannot tell them apart, the
//! ratio is used. The fit may only raise the ratio, by at most `MAX_FIT_CORRECTION`.
//! Estimates are clamped to a sane range and need a minimum of evidence: for paired counters
//! (below) one whole prefill of `MIN_PAIRED_TOKENS`, for others `MIN_TOKENS` over
//! `MIN_REQUESTS` prefills, since a fit needs intervals that differ.
//!
//! The plain ratio is also a proof: a prefill cannot outrun its engine, so each request's
//! prefill seconds are at least its tokens over the rate, and `tokens / seconds` over any set
//! of requests is at most the rate (batching and per-step overhead only lower it). It is kept
//! as the `floor` beside the `rate`, so a configured rate that the evidence cannot rule out is
//! not replaced by a noisier estimate (see `BackendState::effective_prefill_rate`). The proof
//! needs tokens and seconds of the same requests: vLLM's `request_prefill_kv_computed_tokens`
//! gives that, its `prompt_tokens_total` only over a long window. With such paired counters
//! the proof holds for every interval, and the estimate is the best of them, or where the
//! engine also counts prefills, the marginal rate of the line under all of them (`envelope`,
//! which separates each prefill's share of its step from its tokens). The fit is used
//! only for counters that are not paired: under batching, per-request prefill times measure
//! latency, not throughput (a short prompt sharing a step with a long one waits for all of it),
//! and on the simulated fleet the fit read a 25k engine as 40k on a chat workload.

use std::collections::VecDeque;

/// Intervals kept: at the default 1 s scrape interval, about a minute of traffic.
pub(crate) const WINDOW: usize = 60;
/// Computed prompt tokens the window must hold before it says anything (counters not paired).
pub(crate) const MIN_TOKENS: f64 = 4096.0;
/// Prefills the window must hold, where the engine counts them (counters not paired).
pub(crate) const MIN_REQUESTS: f64 = 4.0;
/// Paired counters: computed tokens of the whole prefills the window must hold. One prefill
/// is a proof of a lower bound, so the first real prompt moves the estimate: on a small fleet
/// with long prompts (two CPU engines, 800-token documents at 118 tokens/s) a 4-prefill,
/// 4,096-token gate left one backend unlearned for the whole run. Below this, a prompt's fixed
/// per-request part dominates and the ratio says more of it than of the rate.
pub(crate) const MIN_PAIRED_TOKENS: f64 = 256.0;
/// The fit may raise the plain ratio by at most this much. Under batching, per-request prefill
/// times are noisy (a short prompt sharing a step with a long one waits for all of it), and an
/// unbounded fit then swings by orders of magnitude (seen on the simulated mixed fleet: 4k to
/// 2.4M tokens/s for a 9k engine). The ratio can only read low, which steers work away from a
/// busy engine; an estimate too high would draw more work to it.
const MAX_FIT_CORRECTION: f64 = 2.0;
const MIN_RATE: f64 = 1.0;
const MAX_RATE: f64 = 1e8;

/// One scrape's cumulative prefill counters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrefillCounters {
    /// Prompt tokens the engine computed (cache hits excluded).
    pub tokens: f64,
    /// Seconds requests spent in prefill, summed over requests, in the engine's time.
    pub seconds: f64,
    /// Requests those seconds cover, when the engine says.
    pub requests: Option<f64>,
    /// Tokens and seconds are counted together, per finished prefill (vLLM's
    /// `request_prefill_kv_computed_tokens`, llama.cpp): every interval then covers whole
    /// prefills, and its own ratio is a proven floor too.
    pub paired: bool,
}

#[derive(Debug, Clone, Copy)]
struct Interval {
    tokens: f64,
    seconds: f64,
    requests: Option<f64>,
    paired: bool,
}

/// What a window of counters says of an engine's prefill rate, tokens per engine second.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrefillEstimate {
    /// The best estimate.
    pub rate: f64,
    /// A lower bound the evidence proves (the plain ratio); `floor <= rate`.
    pub floor: f64,
}

/// The rolling prefill-rate estimate of one backend.
#[derive(Debug, Default)]
pub struct PrefillLearner {
    last: Option<PrefillCounters>,
    window: VecDeque<Interval>,
}

impl PrefillLearner {
    /// Take one scrape's counters; returns the current estimate.
    pub fn observe(&mut self, now: PrefillCounters) -> Option<PrefillEstimate> {
        match self.last.replace(now) {
            // Counters went down: the engine restarted, and what it knew of itself is gone.
            Some(prev) if now.tokens < prev.tokens || now.seconds < prev.seconds => {
                self.window.clear();
            }
            Some(prev) => {
                let (tokens, seconds) = (now.tokens - prev.tokens, now.seconds - prev.seconds);
                if tokens > 0.0 && seconds > 0.0 {
                    let requests = match (now.requests, prev.requests) {
                        (Some(n), Some(p)) if n >= p => Some(n - p),
                        _ => None,
                    };
                    if self.window.len() == WINDOW {
                        self.window.pop_front();
                    }
                    self.window.push_back(Interval {
                        tokens,
                        seconds,
                        requests,
                        paired: now.paired && prev.paired,
                    });
                }
            }
            None => {}
        }
        self.estimate()
    }

    /// How far the estimate may be off, as a factor. With paired counters the estimate is
    /// a proven lower bound (the best interval), so a queue priced at it is priced slow
    /// enough, or the marginal rate, what each queued token adds to the steps that compute
    /// it: 1. Otherwise it is a fit that may read high: `1 + 1/n` over the window's `n`
    /// intervals.
    pub fn spread(&self) -> f64 {
        if self.window.iter().any(|i| i.paired) {
            return 1.0;
        }
        1.0 + 1.0 / self.window.len().max(1) as f64
    }

    /// The window's estimate, or `None` while it holds too little evidence.
    pub fn estimate(&self) -> Option<PrefillEstimate> {
        let (tokens, seconds, requests) =
            self.window
                .iter()
                .fold((0.0, 0.0, Some(0.0)), |(t, s, r), i| {
                    (
                        t + i.tokens,
                        s + i.seconds,
                        r.zip(i.requests).map(|(a, b)| a + b),
                    )
                });
        let mut paired = self.window.iter().filter(|i| i.paired).peekable();
        let (min_tokens, min_requests) = if paired.peek().is_some() {
            (MIN_PAIRED_TOKENS, 1.0)
        } else {
            (MIN_TOKENS, MIN_REQUESTS)
        };
        if tokens < min_tokens || seconds <= 0.0 || requests.is_some_and(|r| r < min_requests) {
            return None;
        }
        let ratio = tokens / seconds;
        let (rate, floor) = if paired.peek().is_some() {
            // Each interval covers whole prefills, so each interval's ratio is a proof, and
            // the best of them is the tightest: one a long prefill had mostly to itself reads
            // close to the engine's rate. It is also the estimate. It reads low where only
            // short prompts came, which sends a backend less work until a long one shows its
            // rate: a correcting loop, where a fit that can read high would feed on itself.
            // Only intervals of a real prompt's size count: a follow-up turn computing 20
            // tokens reads faster than the engine runs long prompts (a real llama.cpp on one
            // CPU thread: 180 tokens/s on short suffixes, 130 on 400-token documents), and it
            // is the long prefills that the estimate must price.
            let best = paired
                .filter(|i| i.tokens >= MIN_PAIRED_TOKENS)
                .map(|i| i.tokens / i.seconds)
                .fold(ratio, f64::max);
            // The best interval still charges each prefill's fixed part (the step it shares
            // with every decoding stream) to its tokens. Where the engine counts prefills, the
            // envelope separates the two: the marginal rate is what a prompt adds to a step,
            // which is what a stall on the streams there and a prompt's own time both cost.
            (self.envelope().map_or(best, |e| e.max(best)), best)
        } else {
            let rate = match self.fit() {
                Some(fit) if fit > ratio => fit.min(ratio * MAX_FIT_CORRECTION),
                _ => ratio,
            };
            (rate, ratio)
        };
        let floor = floor.clamp(MIN_RATE, MAX_RATE);
        Some(PrefillEstimate {
            rate: rate.clamp(MIN_RATE, MAX_RATE).max(floor),
            floor,
        })
    }

    /// The marginal rate under paired counters that count prefills: the highest line
    /// `seconds per prefill = a + b * tokens per prefill` (a >= 0, b > 0) that lies under
    /// every interval, taken where the window's average prefill is, and the rate is `1 / b`.
    ///
    /// Every prefill takes at least its step's fixed part plus its tokens over the rate, and
    /// waiting (a short prompt sharing steps with a long one, a busy batch) only adds to it,
    /// so the true line lies under every interval too; the lowest intervals are those that
    /// waited least, and the line through them is the lower convex hull's edge. With `a = 0`
    /// this is the best-interval ratio above; a fixed part lets a window of short prefills
    /// on a busy engine (a P/D decode server: 2,900-15,800 tokens/s read as ratios for a
    /// 25,000 tokens/s engine) read the rate and not its steps. `None` when the window cannot
    /// separate the two: no two prefill sizes at least `2x` apart, a line that does not rise,
    /// or one that would need a negative fixed part (the ratio is right then).
    fn envelope(&self) -> Option<f64> {
        let mut points: Vec<(f64, f64)> = Vec::new();
        let (mut tokens, mut requests) = (0.0, 0.0);
        for i in &self.window {
            match i.requests {
                Some(r) if i.paired && r >= 1.0 => {
                    points.push((i.tokens / r, i.seconds / r));
                    tokens += i.tokens;
                    requests += r;
                }
                _ => {}
            }
        }
        points.sort_by(|p, q| p.0.total_cmp(&q.0).then(p.1.total_cmp(&q.1)));
        // Andrew's monotone chain, lower half.
        let mut hull: Vec<(f64, f64)> = Vec::with_capacity(points.len());
        for p in points {
            while let [.., o, a] = hull[..] {
                if (a.0 - o.0) * (p.1 - o.1) - (a.1 - o.1) * (p.0 - o.0) <= 0.0 {
                    hull.pop();
                } else {
                    break;
                }
            }
            hull.push(p);
        }
        let mean = tokens / requests;
        let last = hull.len().checked_sub(1).filter(|&l| l > 0)?;
        let mut hi = hull.iter().position(|p| p.0 >= mean)?.max(1).min(last);
        let mut lo = hi - 1;
        // Two intervals of nearly one size say more of their waits than of the rate: widen
        // the edge along the hull, on the side nearer the mean, until its ends are 2x apart.
        // The chord's slope is then an average of the hull's slopes around the mean.
        while hull[hi].0 < 2.0 * hull[lo].0 {
            let left_nearer = hull[lo].0 * hull[hi].0 > mean * mean;
            match (lo > 0, hi < last) {
                (true, true) if left_nearer => lo -= 1,
                (true, false) => lo -= 1,
                (_, true) => hi += 1,
                (false, false) => return None,
            }
        }
        let (p, q) = (hull[lo], hull[hi]);
        let b = (q.1 - p.1) / (q.0 - p.0);
        let a = p.1 - b * p.0;
        (b > 0.0 && a >= 0.0).then(|| 1.0 / b)
    }

    /// Least squares of `seconds = a * requests + b * tokens` (a >= 0, b > 0): the rate is
    /// `1 / b`. `None` when requests are unknown or the intervals are too alike to separate the
    /// two terms.
    fn fit(&self) -> Option<f64> {
        let (mut rr, mut rt, mut tt, mut rs, mut ts) = (0.0, 0.0, 0.0, 0.0, 0.0);
        for i in &self.window {
            let r = i.requests?;
            rr += r * r;
            rt += r * i.tokens;
            tt += i.tokens * i.tokens;
            rs += r * i.seconds;
            ts += i.tokens * i.seconds;
        }
        let det = rr * tt - rt * rt;
        // Near-collinear requests and tokens (every interval the same mix): no separation.
        if det.is_nan() || det <= 1e-6 * rr * tt {
            return None;
        }
        let a = (tt * rs - rt * ts) / det;
        let b = if a >= 0.0 {
            (rr * ts - rt * rs) / det
        } else {
            // The fixed part cannot be negative: fit through the origin instead.
            ts / tt
        };
        (b > 0.0).then(|| 1.0 / b)
    }
}

/// One scrape's cumulative decode counters: seconds between a stream's consecutive tokens,
/// and how many such gaps (vLLM and SGLang `inter_token_latency_seconds` `_sum`/`_count`;
/// llama.cpp `tokens_predicted_seconds_total`/`tokens_predicted_total`), in engine time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecodeCounters {
    pub seconds: f64,
    pub tokens: f64,
}

/// Output tokens the decode window must hold before it says anything.
const MIN_DECODE_TOKENS: f64 = 64.0;

/// The rolling decode step time of one backend: what one engine step costs each stream now,
/// which is also the least a new request waits for its first token there.
#[derive(Debug, Default)]
pub struct DecodeLearner {
    last: Option<DecodeCounters>,
    window: VecDeque<DecodeCounters>,
}

impl DecodeLearner {
    /// Take one scrape's counters; returns seconds per step once the window holds enough.
    pub fn observe(&mut self, now: DecodeCounters) -> Option<f64> {
        match self.last.replace(now) {
            Some(prev) if now.tokens < prev.tokens || now.seconds < prev.seconds => {
                self.window.clear();
            }
            Some(prev) => {
                let d = DecodeCounters {
                    seconds: now.seconds - prev.seconds,
                    tokens: now.tokens - prev.tokens,
                };
                if d.tokens > 0.0 {
                    if self.window.len() == WINDOW {
                        self.window.pop_front();
                    }
                    self.window.push_back(d);
                }
            }
            None => {}
        }
        let (seconds, tokens) = self
            .window
            .iter()
            .fold((0.0, 0.0), |(s, t), d| (s + d.seconds, t + d.tokens));
        (tokens >= MIN_DECODE_TOKENS && seconds > 0.0).then(|| (seconds / tokens).min(60.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An engine at `rate` tokens/s with `overhead` seconds per request, cumulative.
    struct Engine {
        rate: f64,
        overhead: f64,
        c: PrefillCounters,
    }

    impl Engine {
        fn new(rate: f64, overhead: f64) -> Engine {
            Engine {
                rate,
                overhead,
                c: PrefillCounters {
                    tokens: 0.0,
                    seconds: 0.0,
                    requests: Some(0.0),
                    paired: true,
                },
            }
        }

        fn serve(&mut self, prompts: &[f64]) -> PrefillCounters {
            for p in prompts {
                self.c.tokens += p;
                self.c.seconds += self.overhead + p / self.rate;
                self.c.requests = self.c.requests.map(|r| r + 1.0);
            }
            self.c
        }
    }

    #[test]
    fn separates_per_request_overhead_from_the_rate() {
        // Mostly tiny chats with a few documents: tokens / seconds alone reads ~3x too slow.
        // Counters that are not paired: the fit is all there is.
        let mut e = Engine::new(9_000.0, 0.02);
        e.c.paired = false;
        let mut l = PrefillLearner::default();
        let mut est = None;
        for k in 0..40 {
            let mut batch = vec![50.0; 20 + k % 7];
            if k % 3 == 0 {
                batch.push(24_000.0 + 1_000.0 * (k % 5) as f64);
            }
            est = l.observe(e.serve(&batch));
        }
        let est = est.unwrap();
        assert!((est.rate / 9_000.0 - 1.0).abs() < 0.02, "{est:?}");
        let naive = e.c.tokens / e.c.seconds;
        // The floor is the plain ratio (of the window: all but the first batch).
        assert!((est.floor / naive - 1.0).abs() < 0.05, "{est:?} vs {naive}");
        assert!(
            naive < 0.8 * 9_000.0,
            "the test must be one the ratio gets wrong: {naive}"
        );
    }

    #[test]
    fn ratio_when_requests_are_unknown_and_nothing_without_evidence() {
        let mut l = PrefillLearner::default();
        let c = |t: f64, s: f64| PrefillCounters {
            tokens: t,
            seconds: s,
            requests: None,
            paired: false,
        };
        assert_eq!(l.observe(c(0.0, 0.0)), None);
        assert_eq!(l.observe(c(1000.0, 1.0)), None, "below MIN_TOKENS");
        let r = l.observe(c(10_000.0, 4.0)).unwrap();
        assert!((r.rate - 2_500.0).abs() < 1e-9, "{r:?}");
        assert_eq!(r.floor, r.rate);
    }

    #[test]
    fn an_engine_restart_starts_over() {
        let mut e = Engine::new(25_000.0, 0.0);
        let mut l = PrefillLearner::default();
        l.observe(e.serve(&[]));
        assert_eq!(
            l.observe(e.serve(&[100.0])),
            None,
            "a tiny prompt says nothing"
        );
        assert!(l.observe(e.serve(&[8_000.0])).is_some());
        // Restarted: counters back near zero, the old window is dropped.
        let mut fresh = Engine::new(1_000.0, 0.0);
        assert_eq!(l.observe(fresh.serve(&[100.0])), None);
        let r = l.observe(fresh.serve(&[1_000.0])).unwrap().rate;
        assert!((r / 1_000.0 - 1.0).abs() < 0.01, "{r}");
    }

    #[test]
    fn one_long_paired_prefill_is_enough_and_three_are_within_a_quarter() {
        // llama.cpp on 2 CPU cores: 118 tokens/s, a few ms of fixed cost a prompt, documents
        // of ~800 tokens, one prefill a scrape.
        let mut e = Engine::new(118.0, 0.01);
        let mut l = PrefillLearner::default();
        l.observe(e.serve(&[]));
        let first = l.observe(e.serve(&[820.0])).unwrap();
        assert!((first.rate / 118.0 - 1.0).abs() < 0.05, "{first:?}");
        // Follow-up turns compute only their new tokens; the long prefill still shows the rate.
        l.observe(e.serve(&[60.0]));
        let third = l.observe(e.serve(&[790.0])).unwrap();
        assert!((third.rate / 118.0 - 1.0).abs() < 0.25, "{third:?}");
        // Unpaired counters keep the stricter gate: a fit needs intervals that differ.
        let mut u = PrefillLearner::default();
        let mut c = e.c;
        c.paired = false;
        u.observe(c);
        c.tokens += 820.0;
        c.seconds += 820.0 / 118.0;
        c.requests = c.requests.map(|r| r + 1.0);
        assert_eq!(u.observe(c), None);
    }

    #[test]
    fn a_wild_fit_is_bounded_by_the_ratio() {
        // Noisy intervals whose fit would put the rate far above what was observed.
        let mut l = PrefillLearner::default();
        // Not paired (older vLLM): intervals can split a prefill's tokens from its seconds.
        let mut c = PrefillCounters {
            tokens: 0.0,
            seconds: 0.0,
            requests: Some(0.0),
            paired: false,
        };
        l.observe(c);
        let mut r = None;
        for (tokens, seconds, requests) in [
            (10_000.0, 2.0, 2.0),
            (2_000.0, 1.99, 10.0),
            (30_000.0, 2.01, 3.0),
        ] {
            c.tokens += tokens;
            c.seconds += seconds;
            c.requests = c.requests.map(|n| n + requests);
            r = l.observe(c);
        }
        let ratio = 42_000.0 / 6.0;
        let r = r.unwrap();
        assert!(
            r.rate >= ratio && r.rate <= MAX_FIT_CORRECTION * ratio,
            "{r:?}"
        );
        assert!((r.floor - ratio).abs() < 1e-6);
    }

    #[test]
    fn paired_counters_prove_the_best_interval() {
        // Small prompts dominate; one interval is a document that had the engine to itself.
        let mut e = Engine::new(9_000.0, 0.05);
        let mut l = PrefillLearner::default();
        l.observe(e.serve(&[]));
        for _ in 0..10 {
            l.observe(e.serve(&[200.0; 10]));
        }
        let before = l.estimate().unwrap();
        let est = l.observe(e.serve(&[40_000.0])).unwrap();
        let lone = 40_000.0 / (0.05 + 40_000.0 / 9_000.0);
        assert!((est.floor - lone).abs() < 1e-6, "{est:?}");
        assert!(
            est.floor > before.floor * 1.5 && est.rate >= est.floor,
            "{before:?} {est:?}"
        );
        assert!(est.floor <= 9_000.0);
    }

    #[test]
    fn a_busy_engine_reads_its_marginal_rate_not_its_steps() {
        // A P/D decode server: every prefill shares a step with 64 decoding streams (12-20 ms
        // of fixed work), prompts of 40-600 tokens, some waiting behind another's chunk.
        let rate = 25_000.0;
        let mut e = Engine::new(rate, 0.0);
        let mut l = PrefillLearner::default();
        l.observe(e.serve(&[]));
        let mut est = None;
        for k in 0..60u32 {
            let step = 0.012 + 0.008 * f64::from(k % 5) / 4.0;
            let prompts: Vec<f64> = (0..3 + k % 4)
                .map(|j| 40.0 + f64::from((k * 7 + j * 13) % 12) * 50.0)
                .collect();
            for (j, p) in prompts.iter().enumerate() {
                let wait = if j % 3 == 2 { 0.004 } else { 0.0 };
                e.c.tokens += p;
                e.c.seconds += step + wait + p / rate;
                e.c.requests = e.c.requests.map(|r| r + 1.0);
            }
            est = l.observe(e.c);
        }
        let est = est.unwrap();
        assert!(
            est.floor < 0.6 * rate,
            "the ratio must read the steps: {est:?}"
        );
        assert!((est.rate / rate - 1.0).abs() < 0.1, "{est:?}");
    }

    #[test]
    fn the_envelope_stands_back_where_the_window_cannot_separate() {
        let interval = |l: &mut PrefillLearner, c: &mut PrefillCounters, t: f64, s: f64| {
            c.tokens += t;
            c.seconds += s;
            c.requests = c.requests.map(|r| r + 1.0);
            l.observe(*c)
        };
        let zero = PrefillCounters {
            tokens: 0.0,
            seconds: 0.0,
            requests: Some(0.0),
            paired: true,
        };
        // Prompts of one size: a fixed part and a rate cannot be told apart.
        let (mut l, mut c) = (PrefillLearner::default(), zero);
        l.observe(c);
        let mut r = None;
        for s in [0.05, 0.04, 0.06] {
            r = interval(&mut l, &mut c, 500.0, s);
        }
        let r = r.unwrap();
        assert_eq!(r.rate, r.floor);
        assert!((r.rate - 500.0 / 0.04).abs() < 1e-6, "{r:?}");
        // Short prompts that read faster per token than long ones (llama.cpp on a CPU, where
        // attention over a long prompt costs more a token): the line would need a negative
        // fixed part, and the best ratio stands.
        let (mut l, mut c) = (PrefillLearner::default(), zero);
        l.observe(c);
        interval(&mut l, &mut c, 60.0, 60.0 / 180.0);
        let r = interval(&mut l, &mut c, 800.0, 800.0 / 130.0).unwrap();
        assert_eq!(r.rate, r.floor);
        assert!(r.rate < 135.0, "{r:?}");
        // Without prefill counts there is no envelope either.
        let (mut l, mut c) = (PrefillLearner::default(), zero);
        c.requests = None;
        l.observe(c);
        interval(&mut l, &mut c, 50.0, 0.02);
        let r = interval(&mut l, &mut c, 5_000.0, 0.22).unwrap();
        assert_eq!(r.rate, r.floor);
    }

    #[test]
    fn decode_step_is_the_windows_mean_gap() {
        let mut l = DecodeLearner::default();
        let c = |seconds: f64, tokens: f64| DecodeCounters { seconds, tokens };
        assert_eq!(l.observe(c(0.0, 0.0)), None);
        assert_eq!(l.observe(c(0.5, 50.0)), None, "too few tokens");
        let step = l.observe(c(2.5, 150.0)).unwrap();
        assert!((step - 2.5 / 150.0).abs() < 1e-9, "{step}");
        // A restart starts over.
        assert_eq!(l.observe(c(0.1, 10.0)), None);
    }

    #[test]
    fn the_window_forgets_old_intervals() {
        let mut l = PrefillLearner::default();
        let mut slow = Engine::new(1_000.0, 0.0);
        for _ in 0..WINDOW {
            l.observe(slow.serve(&[2_000.0]));
        }
        // The same engine, now fast (counters continue): after a window, only fast remains.
        slow.rate = 50_000.0;
        let mut r = None;
        for _ in 0..WINDOW {
            r = l.observe(slow.serve(&[2_000.0]));
        }
        let r = r.unwrap().rate;
        assert!((r / 50_000.0 - 1.0).abs() < 0.01, "{r}");
    }
}
