//! LoRA adapters on one backend as kvroute believes them: the engine's LRU of loaded adapters
//! (what kvroute sent there, least recently first) and the adapters its own requests hold
//! there now.
//!
//! An engine runs at most `max_loras` adapters at once (vLLM's scheduler leaves a request
//! waiting while its adapter does not fit the running batch), loads one that is missing into a
//! free slot, and evicts the least recently used adapter that no running request holds. So a
//! request for an adapter finds it loaded, a free slot, an idle adapter to evict (whose next
//! request then loads it again somewhere), or every slot held by running requests of other
//! adapters: it waits until all requests of one of those have ended, which under steady
//! traffic for them may be never.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A scrape's sample shows the engine a little before kvroute stores it: a request of ours
/// that ended this close before the sample may still show as running in it.
const SAMPLE_SKEW: Duration = Duration::from_millis(250);

/// Where a request for an adapter stands on one backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdapterSlot {
    Loaded,
    Free,
    EvictsIdle,
    Blocked,
}

/// Seconds a request is priced to wait when every adapter slot is held by other adapters'
/// running requests: long enough that such a backend is chosen only when every other one is
/// blocked too (or over its load bound).
pub const BLOCKED_WAIT_S: f64 = 30.0;

impl AdapterSlot {
    /// What it adds to the request's time to first token, one load taking `load_s`.
    pub fn cost_s(self, load_s: f64) -> f64 {
        match self {
            AdapterSlot::Loaded => 0.0,
            AdapterSlot::Free => load_s,
            AdapterSlot::EvictsIdle => 2.0 * load_s,
            AdapterSlot::Blocked => BLOCKED_WAIT_S + load_s,
        }
    }
}

#[derive(Debug, Default)]
pub(super) struct AdapterBelief {
    /// Adapters believed loaded, least recently used first; at most `cap`.
    lru: VecDeque<String>,
    /// Adapters sent here that found every slot held: they load, in this order, as slots
    /// free.
    waiting: VecDeque<String>,
    /// kvroute's requests in flight per adapter (loaded or waiting).
    inflight: Vec<(String, u32)>,
    /// When kvroute's last request of each adapter here ended.
    ended: Vec<(String, Instant)>,
}

/// The adapters an engine last reported running, and when kvroute took that sample.
pub struct Reported<'a> {
    pub running: &'a [String],
    pub at: Instant,
}

impl AdapterBelief {
    fn running(&self, model: &str) -> bool {
        self.inflight.iter().any(|(a, _)| a == model)
    }

    /// Makes room for one more loaded adapter: true if a slot is free or an idle adapter was
    /// evicted for it.
    fn make_room(&mut self, cap: usize) -> bool {
        if self.lru.len() < cap {
            return true;
        }
        match self.lru.iter().position(|a| !self.running(a)) {
            Some(at) => {
                self.lru.remove(at);
                true
            }
            None => false,
        }
    }

    /// A request for `model` was sent: the engine loads it if missing, evicting the least
    /// recently used idle adapter when its `cap` slots are taken, or holds it until a slot
    /// frees.
    pub(super) fn start(&mut self, model: &str, cap: usize) {
        let cap = cap.max(1);
        match self.inflight.iter().position(|(a, _)| a == model) {
            Some(at) => self.inflight[at].1 += 1,
            None => self.inflight.push((model.to_string(), 1)),
        }
        if let Some(at) = self.lru.iter().position(|a| a == model) {
            let a = self.lru.remove(at).unwrap_or_default();
            self.lru.push_back(a);
        } else if self.waiting.iter().any(|a| a == model) {
        } else if self.waiting.is_empty() && self.make_room(cap) {
            self.lru.push_back(model.to_string());
        } else {
            self.waiting.push_back(model.to_string());
        }
    }

    pub(super) fn end(&mut self, model: &str, cap: usize) {
        let Some(at) = self.inflight.iter().position(|(a, _)| a == model) else {
            return;
        };
        self.inflight[at].1 -= 1;
        if self.inflight[at].1 > 0 {
            return;
        }
        self.inflight.remove(at);
        // A waiting adapter whose requests all ended (cancelled) no longer waits.
        self.waiting.retain(|a| a != model);
        let now = Instant::now();
        match self.ended.iter_mut().find(|(a, _)| a == model) {
            Some(e) => e.1 = now,
            None => self.ended.push((model.to_string(), now)),
        }
        // Its slot may be the one a waiting adapter needed.
        while !self.waiting.is_empty() && self.make_room(cap.max(1)) {
            if let Some(next) = self.waiting.pop_front() {
                self.lru.push_back(next);
            }
        }
    }

    /// Where a request for `model` would stand, given the adapters the engine last reported
    /// running: other routers' requests hold slots too, but an adapter whose last request of
    /// ours ended around or after the sample may show only because of ours.
    pub(super) fn slot(&self, model: &str, cap: usize, reported: Option<Reported>) -> AdapterSlot {
        let cap = cap.max(1);
        let running = reported.as_ref().map_or(&[][..], |r| r.running);
        if self.lru.iter().any(|a| a == model) || running.iter().any(|a| a == model) {
            return AdapterSlot::Loaded;
        }
        if self.waiting.iter().any(|a| a == model) {
            return AdapterSlot::Blocked;
        }
        let mut held: Vec<&str> = self
            .lru
            .iter()
            .filter(|a| self.running(a))
            .map(String::as_str)
            .collect();
        if let Some(r) = &reported {
            let ours_since = |a: &str| {
                self.ended
                    .iter()
                    .any(|(e, t)| e == a && *t + SAMPLE_SKEW >= r.at)
            };
            held.extend(
                r.running
                    .iter()
                    .map(String::as_str)
                    .filter(|a| !ours_since(a)),
            );
        }
        held.sort_unstable();
        held.dedup();
        // Adapters already waiting here take the next free slots.
        if held.len() + self.waiting.len() >= cap {
            AdapterSlot::Blocked
        } else if self.lru.len() >= cap {
            AdapterSlot::EvictsIdle
        } else {
            AdapterSlot::Free
        }
    }

    pub(super) fn loaded(&self) -> Vec<String> {
        self.lru.iter().cloned().collect()
    }
}

/// Adapter load times a backend showed: each request that had to load its adapter, its time
/// to first token beyond what placement predicted without the load. Engines export no load
/// time (vLLM's `vllm:lora_requests_info` names adapters only), so this is kvroute's own.
#[derive(Debug, Default)]
pub(super) struct LoadTimes {
    recent: VecDeque<f64>,
}

/// Loads remembered, and the ones needed before the median replaces the configured time.
const LOAD_SAMPLES: usize = 16;
const LOAD_SAMPLES_TRUSTED: usize = 4;

impl LoadTimes {
    pub(super) fn observe(&mut self, seconds: f64) {
        if !seconds.is_finite() {
            return;
        }
        if self.recent.len() == LOAD_SAMPLES {
            self.recent.pop_front();
        }
        self.recent.push_back(seconds.max(0.0));
    }

    /// The median of the recent loads, once there are enough; a median, because one sample
    /// also carries whatever else the prediction missed (a burst queued ahead of it).
    pub(super) fn estimate(&self) -> Option<f64> {
        if self.recent.len() < LOAD_SAMPLES_TRUSTED {
            return None;
        }
        let mut v: Vec<f64> = self.recent.iter().copied().collect();
        v.sort_by(f64::total_cmp);
        Some(v[v.len() / 2])
    }
}

/// A request's hold on its adapter's slot, released when the request ends (dropped).
pub struct AdapterHold {
    belief: Arc<Mutex<AdapterBelief>>,
    model: String,
    cap: usize,
}

impl AdapterHold {
    pub(super) fn new(belief: Arc<Mutex<AdapterBelief>>, model: &str, cap: usize) -> Self {
        if let Ok(mut b) = belief.lock() {
            b.start(model, cap);
        }
        AdapterHold {
            belief,
            model: model.to_string(),
            cap,
        }
    }
}

impl Drop for AdapterHold {
    fn drop(&mut self) {
        if let Ok(mut b) = self.belief.lock() {
            b.end(&self.model, self.cap);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_follow_the_engines_rules() {
        let mut b = AdapterBelief::default();
        assert_eq!(b.slot("a", 2, None), AdapterSlot::Free);
        b.start("a", 2);
        b.start("b", 2);
        assert_eq!(b.slot("a", 2, None), AdapterSlot::Loaded);
        // Both slots held by running requests: c waits.
        assert_eq!(b.slot("c", 2, None), AdapterSlot::Blocked);
        b.end("b", 2);
        // b is idle now: c evicts it.
        assert_eq!(b.slot("c", 2, None), AdapterSlot::EvictsIdle);
        b.start("c", 2);
        assert_eq!(b.loaded(), ["a", "c"]);
        assert_eq!(b.slot("b", 2, None), AdapterSlot::Blocked);
        b.end("a", 2);
        b.end("c", 2);
        assert_eq!(b.slot("b", 2, None), AdapterSlot::EvictsIdle);
        // Another router's requests hold slots too, as the engine reports them.
        let running = ["x".to_string(), "y".to_string()];
        let sample = |at| {
            Some(Reported {
                running: &running,
                at,
            })
        };
        let now = Instant::now();
        assert_eq!(b.slot("b", 2, sample(now)), AdapterSlot::Blocked);
        assert_eq!(b.slot("x", 2, sample(now)), AdapterSlot::Loaded);
        // Our own request of x ended around the sample: x may show only because of it.
        b.start("x", 2);
        b.end("x", 2);
        assert_eq!(b.slot("b", 2, sample(now)), AdapterSlot::EvictsIdle);
        // A sample taken well after ours ended: someone else runs x.
        let later = Instant::now() + Duration::from_secs(1);
        assert_eq!(b.slot("b", 2, sample(later)), AdapterSlot::Blocked);
    }

    #[test]
    fn a_request_sent_to_full_slots_waits_and_loads_when_one_frees() {
        let mut b = AdapterBelief::default();
        b.start("a", 1);
        // Sent anyway (every backend was blocked): it waits, and is not believed loaded.
        b.start("b", 1);
        assert_eq!(b.loaded(), ["a"]);
        assert_eq!(b.slot("b", 1, None), AdapterSlot::Blocked);
        // A third adapter queues behind it.
        assert_eq!(b.slot("c", 1, None), AdapterSlot::Blocked);
        b.end("a", 1);
        assert_eq!(b.loaded(), ["b"]);
        assert_eq!(b.slot("b", 1, None), AdapterSlot::Loaded);
        // A waiting request that goes away stops waiting.
        b.start("c", 1);
        b.end("c", 1);
        assert_eq!(b.slot("c", 1, None), AdapterSlot::Blocked);
        b.end("b", 1);
        assert_eq!(b.slot("c", 1, None), AdapterSlot::EvictsIdle);
        assert_eq!(b.loaded(), ["b"]);
    }

    #[test]
    fn load_time_is_the_median_of_recent_loads() {
        let mut t = LoadTimes::default();
        for s in [0.21, 0.19, 5.0] {
            t.observe(s);
        }
        assert_eq!(t.estimate(), None);
        t.observe(0.2);
        assert_eq!(t.estimate(), Some(0.21));
        // Old samples age out: a slower store shows within 16 loads.
        for _ in 0..16 {
            t.observe(0.5);
        }
        t.observe(f64::NAN);
        t.observe(-1.0);
        assert_eq!(t.estimate(), Some(0.5));
    }

    #[test]
    fn a_hold_ends_with_its_request() {
        let belief = Arc::new(Mutex::new(AdapterBelief::default()));
        let h1 = AdapterHold::new(belief.clone(), "a", 1);
        let h2 = AdapterHold::new(belief.clone(), "a", 1);
        assert_eq!(
            belief.lock().unwrap().slot("b", 1, None),
            AdapterSlot::Blocked
        );
        drop(h1);
        assert_eq!(
            belief.lock().unwrap().slot("b", 1, None),
            AdapterSlot::Blocked
        );
        drop(h2);
        let b = belief.lock().unwrap();
        assert_eq!(b.slot("b", 1, None), AdapterSlot::EvictsIdle);
        assert_eq!(b.slot("a", 1, None), AdapterSlot::Loaded);
        assert_eq!(
            (
                AdapterSlot::Free.cost_s(0.2),
                AdapterSlot::EvictsIdle.cost_s(0.2)
            ),
            (0.2, 0.4)
        );
    }
}
