//! What P/D moved and lost, for `/metrics` (vLLM's NixlConnector names, rendered by
//! `api::metrics::render_pd`; SGLang's by `render_sglang_pd`) and `/debug/state`. As on vLLM,
//! transfer times and sizes are recorded by the side that reads (D), expiries by the side
//! that holds (P).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Mutex, PoisonError};

use crate::sim::engine::stats::Histogram;

/// `vllm:nixl_xfer_time_seconds`'s buckets (vLLM's `NixlPromMetrics`), seconds.
pub const XFER_TIME_BUCKETS: [f64; 12] = [
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0,
];

/// `vllm:nixl_bytes_transferred`'s buckets: `2 ** (10 + i) for i in range(1, 25, 2)`, 2 KiB
/// to 8 GiB.
pub const BYTES_BUCKETS: [f64; 12] = [
    2048.0,
    8192.0,
    32768.0,
    131072.0,
    524288.0,
    2097152.0,
    8388608.0,
    33554432.0,
    134217728.0,
    536870912.0,
    2147483648.0,
    8589934592.0,
];

pub struct PdStats {
    /// P: holds freed by D's notice.
    released: AtomicU64,
    /// P: holds freed by the timeout (vLLM's `nixl_num_kv_expired_reqs`).
    expired: AtomicU64,
    /// D: reads completed, and their tokens.
    transfers: AtomicU64,
    transfer_tokens: AtomicU64,
    /// D: reads that came to nothing (P unknown or unreachable): the prompt is recomputed.
    failed_transfers: AtomicU64,
    /// D: notices P did not take when nothing was to be read (a full local hit).
    failed_notifications: AtomicU64,
    /// D: per read, model seconds and bytes.
    histograms: Mutex<(Histogram, Histogram)>,
    /// D (SGLang): legs waiting for P's KV to exist, and legs reading it.
    waiting_decodes: AtomicU64,
    transferring_decodes: AtomicU64,
    /// D (SGLang): waits that ran out (`--pd-waiting-timeout-s`); the request failed.
    timed_out_waits: AtomicU64,
    /// D: the last read's speed (GB/s) and time (ms), SGLang's last-value gauges.
    last_transfer: Mutex<(f64, f64)>,
}

/// Counts one leg in a gauge while it lives.
pub struct InGauge<'a>(&'a AtomicU64);

impl Drop for InGauge<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Relaxed);
    }
}

fn enter(gauge: &AtomicU64) -> InGauge<'_> {
    gauge.fetch_add(1, Relaxed);
    InGauge(gauge)
}

impl Default for PdStats {
    fn default() -> Self {
        Self {
            released: AtomicU64::new(0),
            expired: AtomicU64::new(0),
            transfers: AtomicU64::new(0),
            transfer_tokens: AtomicU64::new(0),
            failed_transfers: AtomicU64::new(0),
            failed_notifications: AtomicU64::new(0),
            histograms: Mutex::new((
                Histogram::new(&XFER_TIME_BUCKETS),
                Histogram::new(&BYTES_BUCKETS),
            )),
            waiting_decodes: AtomicU64::new(0),
            transferring_decodes: AtomicU64::new(0),
            timed_out_waits: AtomicU64::new(0),
            last_transfer: Mutex::new((0.0, 0.0)),
        }
    }
}

/// A copy of the counters for one scrape.
#[derive(Debug, Clone)]
pub struct PdSnapshot {
    pub released_total: u64,
    pub expired_total: u64,
    pub transfers_total: u64,
    pub transfer_tokens_total: u64,
    pub failed_transfers_total: u64,
    pub failed_notifications_total: u64,
    pub xfer_time: Histogram,
    pub bytes: Histogram,
    pub waiting_decodes: u64,
    pub transferring_decodes: u64,
    pub timed_out_waits_total: u64,
    pub last_speed_gb_s: f64,
    pub last_latency_ms: f64,
}

impl PdStats {
    pub fn released(&self, holds: usize) {
        self.released.fetch_add(holds as u64, Relaxed);
    }

    pub fn expired(&self) {
        self.expired.fetch_add(1, Relaxed);
    }

    /// A read of `tokens` tokens (`bytes` bytes) took `seconds` of model time.
    pub fn transferred(&self, tokens: u64, bytes: u64, seconds: f64) {
        self.transfers.fetch_add(1, Relaxed);
        self.transfer_tokens.fetch_add(tokens, Relaxed);
        let mut h = self
            .histograms
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        h.0.observe(seconds);
        h.1.observe(bytes as f64);
        drop(h);
        let speed = if seconds > 0.0 {
            bytes as f64 / seconds / 1e9
        } else {
            0.0
        };
        *self
            .last_transfer
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = (speed, seconds * 1e3);
    }

    /// A decode leg waiting for P's KV to exist.
    pub fn waiting_decode(&self) -> InGauge<'_> {
        enter(&self.waiting_decodes)
    }

    /// A decode leg reading P's KV.
    pub fn transferring_decode(&self) -> InGauge<'_> {
        enter(&self.transferring_decodes)
    }

    pub fn timed_out_wait(&self) {
        self.timed_out_waits.fetch_add(1, Relaxed);
    }

    pub fn failed_transfer(&self) {
        self.failed_transfers.fetch_add(1, Relaxed);
    }

    pub fn failed_notification(&self) {
        self.failed_notifications.fetch_add(1, Relaxed);
    }

    pub fn snapshot(&self) -> PdSnapshot {
        let (xfer_time, bytes) = self
            .histograms
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let (last_speed_gb_s, last_latency_ms) = *self
            .last_transfer
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        PdSnapshot {
            released_total: self.released.load(Relaxed),
            expired_total: self.expired.load(Relaxed),
            transfers_total: self.transfers.load(Relaxed),
            transfer_tokens_total: self.transfer_tokens.load(Relaxed),
            failed_transfers_total: self.failed_transfers.load(Relaxed),
            failed_notifications_total: self.failed_notifications.load(Relaxed),
            xfer_time,
            bytes,
            waiting_decodes: self.waiting_decodes.load(Relaxed),
            transferring_decodes: self.transferring_decodes.load(Relaxed),
            timed_out_waits_total: self.timed_out_waits.load(Relaxed),
            last_speed_gb_s,
            last_latency_ms,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_buckets_are_vllms() {
        let want: Vec<f64> = (1..25).step_by(2).map(|i| 2f64.powi(10 + i)).collect();
        assert_eq!(BYTES_BUCKETS.to_vec(), want);
    }
}
