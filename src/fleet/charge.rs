//! The charge a request holds on its backend while in flight, and when it is expected to end.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::backend::{since_epoch_ms, Live};

/// How long a request is expected to hold its backend: until its first token, then while
/// it decodes. Sets when a request past the engine's slots would get one.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Expected {
    pub ttft_s: f64,
    pub decode_s: f64,
}

/// One request's charge on a backend: in flight until released; its estimated prefill counts
/// as queued until the first response byte, then it counts as a decoding stream. Released once,
/// by whichever comes first: the engine's response complete ([`InflightGuard::releaser`], from
/// the connection reading it), or the guard dropped, however the request ends.
pub struct InflightGuard {
    held: Arc<Held>,
}

struct Held {
    live: Arc<Live>,
    prefill: u64,
    /// The data-parallel rank the request is pinned to, whose queue it is in too.
    rank: Option<usize>,
    /// Its entry in the backend's expected ends.
    id: u64,
    decode_s: f64,
    /// Where the charge is. A lock, not an atomic: the first byte and the release may race
    /// (the connection can read a whole short response before the proxy sees its head), and
    /// each moves several counters that must not go below zero.
    stage: Mutex<Stage>,
}

#[derive(Clone, Copy, PartialEq)]
enum Stage {
    Prefill,
    Decoding,
    Released,
}

/// Milliseconds from `now` to `seconds` later, since [`epoch`].
fn end_ms(now: Instant, seconds: f64) -> u64 {
    let s = if seconds.is_finite() {
        seconds.clamp(0.0, 86_400.0)
    } else {
        0.0
    };
    since_epoch_ms(now) + (s * 1000.0) as u64
}

impl InflightGuard {
    pub(super) fn new(
        live: Arc<Live>,
        prefill: u64,
        rank: Option<u32>,
        expected: Expected,
    ) -> InflightGuard {
        static IDS: AtomicU64 = AtomicU64::new(0);
        live.queued_prefill.fetch_add(prefill, Ordering::Relaxed);
        let rank = rank
            .map(|r| r as usize)
            .filter(|&r| r < live.rank_prefill.len());
        if let Some(q) = rank.and_then(|r| live.rank_prefill.get(r)) {
            q.fetch_add(prefill, Ordering::Relaxed);
        }
        let id = IDS.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut ends) = live.ends.lock() {
            ends.push((
                id,
                end_ms(Instant::now(), expected.ttft_s + expected.decode_s),
            ));
        }
        InflightGuard {
            held: Arc::new(Held {
                live,
                prefill,
                rank,
                id,
                decode_s: expected.decode_s,
                stage: Mutex::new(Stage::Prefill),
            }),
        }
    }

    /// The backend answered: its prefill is done and the request is decoding.
    pub fn first_byte(&self) {
        let h = &self.held;
        let mut stage = h.stage();
        if *stage != Stage::Prefill {
            return;
        }
        *stage = Stage::Decoding;
        h.prefill_done();
        h.live.decoding.fetch_add(1, Ordering::Relaxed);
        // Its prefill is over: what is left is its decode.
        let end = end_ms(Instant::now(), h.decode_s);
        if let Ok(mut ends) = h.live.ends.lock() {
            if let Some(e) = ends.iter_mut().find(|e| e.0 == h.id) {
                e.1 = end;
            }
        }
    }

    /// Releases this charge when called, from anywhere; the guard's drop then releases
    /// nothing more.
    pub fn releaser(&self) -> impl FnOnce() -> bool + Send + 'static {
        let held = Arc::clone(&self.held);
        move || held.release()
    }
}

impl Held {
    fn stage(&self) -> std::sync::MutexGuard<'_, Stage> {
        // Only plain values are behind it: a panic while holding it leaves them consistent.
        self.stage.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn prefill_done(&self) {
        let l = &self.live;
        l.queued_prefill.fetch_sub(self.prefill, Ordering::Relaxed);
        if let Some(q) = self.rank.and_then(|r| l.rank_prefill.get(r)) {
            q.fetch_sub(self.prefill, Ordering::Relaxed);
        }
    }

    /// Whether this call released it (false: it already was).
    fn release(&self) -> bool {
        let mut stage = self.stage();
        let was = std::mem::replace(&mut *stage, Stage::Released);
        if was == Stage::Released {
            return false;
        }
        let l = &self.live;
        if let Ok(mut ends) = l.ends.lock() {
            if let Some(at) = ends.iter().position(|e| e.0 == self.id) {
                ends.swap_remove(at);
            }
        }
        l.inflight.fetch_sub(1, Ordering::Relaxed);
        if was == Stage::Decoding {
            l.decoding.fetch_sub(1, Ordering::Relaxed);
        } else {
            self.prefill_done();
        }
        true
    }
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.held.release();
    }
}
