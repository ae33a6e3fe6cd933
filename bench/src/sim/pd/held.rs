//! P's held requests: the prompt blocks each finished prefill keeps referenced for its
//! decode server, until D's notice takes them (`take`) or their deadline passes
//! (`take_expired`). Releasing the blocks themselves is the server's business (its engine's
//! pool or its fixed-mode cache, `api::pd`); this only keeps the books.
//!
//! One id can be held more than once (a router that retries a prefill with the same
//! `X-Request-Id`): a notice for the id frees them all, as nothing tells the copies apart.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::{watch, Notify};
use tokio::time::Instant;

use crate::sim::engine::stats::Gauge;

/// One hold: which engine rank has the blocks, their hashes, and when they expire.
pub struct Held {
    pub rank: usize,
    pub hashes: Vec<u64>,
    pub expires: Instant,
    /// Fixed timing's count of the blocks as in use (the engine's pool counts its own);
    /// dropping it (with the hold) uncounts them.
    pub _usage: Option<Gauge>,
}

pub struct HeldRequests {
    by_id: Mutex<HashMap<String, Vec<Held>>>,
    /// Wall-clock time a hold lasts unread.
    timeout: Duration,
    /// Wakes the expiry task when a hold is added (its deadline may be the nearest).
    added: Notify,
    /// Bumped on every hold, so that any number of waiters (SGLang's decode servers asking
    /// for a room) see one appear.
    version: watch::Sender<u64>,
}

impl HeldRequests {
    pub fn new(timeout: Duration) -> Self {
        Self {
            by_id: Mutex::default(),
            timeout,
            added: Notify::new(),
            version: watch::Sender::new(0),
        }
    }

    fn map(&self) -> MutexGuard<'_, HashMap<String, Vec<Held>>> {
        self.by_id.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Holds `hashes` (on engine rank `rank`) under `id` until read or expired.
    pub fn hold(&self, id: String, rank: usize, hashes: Vec<u64>, usage: Option<Gauge>) {
        self.hold_at(id, rank, hashes, usage, Instant::now());
    }

    /// `hold` at time `now` (tests inject it).
    fn hold_at(
        &self,
        id: String,
        rank: usize,
        hashes: Vec<u64>,
        usage: Option<Gauge>,
        now: Instant,
    ) {
        let held = Held {
            rank,
            hashes,
            expires: now + self.timeout,
            _usage: usage,
        };
        self.map().entry(id).or_default().push(held);
        self.added.notify_one();
        self.version.send_modify(|v| *v += 1);
    }

    /// Changes when a hold is added: subscribe, then look (`peek`), then wait for a change.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.version.subscribe()
    }

    /// The hashes of the first hold under `id`, if any (it stays held).
    pub fn peek(&self, id: &str) -> Option<Vec<u64>> {
        self.map()
            .get(id)
            .and_then(|holds| holds.first())
            .map(|h| h.hashes.clone())
    }

    /// Every hold under `id` (none: P does not know the request).
    pub fn take(&self, id: &str) -> Vec<Held> {
        self.map().remove(id).unwrap_or_default()
    }

    /// Every hold whose deadline is at or before `now`.
    pub fn take_expired(&self, now: Instant) -> Vec<(String, Held)> {
        let mut out = Vec::new();
        self.map().retain(|id, holds| {
            let (gone, kept): (Vec<Held>, Vec<Held>) = std::mem::take(holds)
                .into_iter()
                .partition(|h| h.expires <= now);
            out.extend(gone.into_iter().map(|h| (id.clone(), h)));
            *holds = kept;
            !holds.is_empty()
        });
        out
    }

    /// The nearest deadline, if anything is held.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.map().values().flatten().map(|h| h.expires).min()
    }

    /// Resolves when a hold is added (or was added since the last call).
    pub async fn added(&self) {
        self.added.notified().await;
    }

    /// Requests held and their blocks.
    pub fn counts(&self) -> (usize, usize) {
        let map = self.map();
        let blocks = map.values().flatten().map(|h| h.hashes.len()).sum();
        (map.values().map(Vec::len).sum(), blocks)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_are_taken_by_id_or_by_deadline() {
        let held = HeldRequests::new(Duration::from_secs(10));
        let t0 = Instant::now();
        let s = Duration::from_secs;
        held.hold_at("a".into(), 0, vec![1, 2, 3], None, t0);
        held.hold_at("b".into(), 1, vec![4], None, t0 + s(4));
        held.hold_at("b".into(), 1, vec![5, 6], None, t0 + s(4));
        assert_eq!(held.counts(), (3, 6));
        assert_eq!(held.peek("b"), Some(vec![4]));
        assert_eq!(held.peek("c"), None);
        assert_eq!(held.next_deadline(), Some(t0 + s(10)));
        assert!(held.take_expired(t0 + s(9)).is_empty());
        // The first deadline passes: only "a" goes.
        let expired = held.take_expired(t0 + s(10));
        assert_eq!(expired.len(), 1);
        assert_eq!((expired[0].0.as_str(), expired[0].1.hashes.len()), ("a", 3));
        assert!(held.take("a").is_empty());
        // Both copies of "b" go with one notice.
        let b = held.take("b");
        assert_eq!((b.len(), b[0].rank), (2, 1));
        assert_eq!((held.counts(), held.next_deadline()), ((0, 0), None));
    }
}
