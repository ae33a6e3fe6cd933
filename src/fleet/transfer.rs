//! The KV transfer bandwidth between prefill and decode servers, learned from what the engines
//! say of their own transfers, so that the disaggregation decision prices a transfer at what
//! the fleet's links deliver rather than at a configured figure: vLLM's NixlConnector
//! histograms, recorded on the reading (decode) side (`vllm:nixl_xfer_time_seconds`,
//! `vllm:nixl_bytes_transferred`: `NixlPromMetrics`), and SGLang's gauge of its last
//! transfer's speed (`sglang:kv_transfer_speed_gb_s`).
//!
//! The time NIXL reports is the transfer's own (posted to done), so bytes over seconds is the
//! link's rate; the configured base latency (`transfer_base_ms`) still covers what happens
//! around it (the decode server's request for the blocks, the notification back).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// Cumulative transfers an engine reports.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct TransferCounters {
    pub seconds: f64,
    pub bytes: f64,
    pub count: f64,
}

/// Cumulative speeds of an engine's transfers, GB/s each (SGLang's histogram).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct SpeedCounters {
    pub sum: f64,
    pub count: f64,
}

/// A transfer's evidence weighs by the bytes it moved: a scrape interval of many transfers
/// moves the estimate more than one of a few. At this many bytes, a sample counts half.
const HALF_WEIGHT_BYTES: f64 = 1e9;

/// The fleet's learned transfer rate.
#[derive(Default)]
pub struct TransferLearner {
    /// Each backend's last counters, by fleet index.
    last: Mutex<Vec<Option<TransferCounters>>>,
    last_speeds: Mutex<Vec<Option<SpeedCounters>>>,
    /// Bytes a second (`f64` bits), 0 until learned.
    rate: AtomicU64,
}

impl TransferLearner {
    /// Backend `i` reported `now`: the bytes and seconds since its last report teach the rate.
    /// Counters that went back (an engine restart) start over.
    pub fn observe(&self, i: usize, now: TransferCounters) {
        let Some(prev) = swap(&self.last, i, now) else {
            return;
        };
        let (bytes, seconds, count) = (
            now.bytes - prev.bytes,
            now.seconds - prev.seconds,
            now.count - prev.count,
        );
        if count < 1.0 || bytes <= 0.0 || seconds <= 0.0 {
            return;
        }
        self.learn(bytes / seconds, bytes);
    }

    /// Backend `i` reported its transfers' speeds: their mean since its last report teaches
    /// the rate, each a light sample (their sizes are not said).
    pub fn observe_speeds(&self, i: usize, now: SpeedCounters) {
        let Some(prev) = swap(&self.last_speeds, i, now) else {
            return;
        };
        let (sum, count) = (now.sum - prev.sum, now.count - prev.count);
        if count >= 1.0 && sum > 0.0 {
            self.learn(sum / count * 1e9, count * HALF_WEIGHT_BYTES / 4.0);
        }
    }

    /// A reported speed of the last transfer, bytes a second (0: none yet).
    pub fn observe_speed(&self, bytes_per_s: f64) {
        if bytes_per_s.is_finite() && bytes_per_s > 0.0 {
            // One transfer of unknown size: a light sample.
            self.learn(bytes_per_s, HALF_WEIGHT_BYTES / 4.0);
        }
    }

    fn learn(&self, sample: f64, bytes: f64) {
        if !sample.is_finite() || sample <= 0.0 {
            return;
        }
        let w = bytes / (bytes + HALF_WEIGHT_BYTES);
        let _ = self
            .rate
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                let old = f64::from_bits(bits);
                let new = if old > 0.0 {
                    // Averaged in log space: one slow interval halves the rate no more than
                    // one fast one doubles it.
                    (old.ln() + w * (sample.ln() - old.ln())).exp()
                } else {
                    sample
                };
                Some(new.to_bits())
            });
    }

    /// The learned rate, bytes a second.
    pub fn bytes_per_s(&self) -> Option<f64> {
        Some(f64::from_bits(self.rate.load(Ordering::Relaxed))).filter(|&r| r > 0.0)
    }
}

/// Keep backend `i`'s report `now`, giving back its last.
fn swap<T: Copy>(last: &Mutex<Vec<Option<T>>>, i: usize, now: T) -> Option<T> {
    let mut last = last.lock().unwrap_or_else(|p| p.into_inner());
    if last.len() <= i {
        last.resize(i + 1, None);
    }
    last[i].replace(now)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counters(seconds: f64, bytes: f64, count: f64) -> TransferCounters {
        TransferCounters {
            seconds,
            bytes,
            count,
        }
    }

    #[test]
    fn the_rate_is_bytes_over_seconds_between_reports() {
        let l = TransferLearner::default();
        assert_eq!(l.bytes_per_s(), None);
        l.observe(1, counters(1.0, 5e9, 10.0));
        // One report is a start, not a rate.
        assert_eq!(l.bytes_per_s(), None);
        // 20 GB in 2 s since.
        l.observe(1, counters(3.0, 25e9, 40.0));
        assert!((l.bytes_per_s().unwrap() - 10e9).abs() < 1.0);
        // Nothing moved: nothing learned.
        l.observe(1, counters(3.0, 25e9, 40.0));
        assert!((l.bytes_per_s().unwrap() - 10e9).abs() < 1.0);
        // Another backend's first report teaches nothing; its next does, weighted by bytes.
        l.observe(0, counters(0.0, 0.0, 0.0));
        l.observe(0, counters(0.1, 2e9, 4.0));
        let r = l.bytes_per_s().unwrap();
        assert!(r > 10e9 && r < 20e9, "{r}");
    }

    #[test]
    fn sglang_speed_histograms_teach_their_mean() {
        let l = TransferLearner::default();
        let speeds = |sum, count| SpeedCounters { sum, count };
        l.observe_speeds(2, speeds(10.0, 1.0));
        assert_eq!(l.bytes_per_s(), None);
        l.observe_speeds(2, speeds(70.0, 4.0));
        assert!((l.bytes_per_s().unwrap() - 20e9).abs() < 1.0);
    }

    #[test]
    fn a_restart_starts_over_and_speeds_are_light_samples() {
        let l = TransferLearner::default();
        l.observe(0, counters(10.0, 50e9, 100.0));
        l.observe(0, counters(1.0, 1e9, 2.0));
        assert_eq!(l.bytes_per_s(), None);
        l.observe(0, counters(2.0, 26e9, 12.0));
        assert!((l.bytes_per_s().unwrap() - 25e9).abs() < 1.0);
        l.observe_speed(0.0);
        l.observe_speed(f64::NAN);
        assert!((l.bytes_per_s().unwrap() - 25e9).abs() < 1.0);
        l.observe_speed(5e9);
        let r = l.bytes_per_s().unwrap();
        assert!(r < 25e9 && r > 15e9, "{r}");
    }
}
