//! P's legs under SGLang's protocol, waiting for their room's outcome. SGLang's prefill
//! server answers its leg only once the KV it computed has gone to the decode server (its
//! inflight queue) or the transfer has failed, so the router's P leg lasts until D has read
//! the blocks. Whoever ends a hold (D's notice, the bootstrap timeout) resolves the room here;
//! a room nobody waits for (P's leg cut, or vLLM's protocol) resolves to nothing.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::sync::oneshot;

/// What became of a held room.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// D read the blocks (or needed none) and told P.
    Read,
    /// D's leg ended before its read completed (its client gone): P's copy is freed at once.
    Aborted,
    /// Nobody fetched the blocks within the bootstrap timeout.
    Expired,
}

type Waiters = HashMap<String, (u64, oneshot::Sender<Outcome>)>;

#[derive(Default)]
pub struct Rooms {
    waiters: Arc<Mutex<Waiters>>,
    next: Mutex<u64>,
}

fn lock(m: &Mutex<Waiters>) -> MutexGuard<'_, Waiters> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Rooms {
    /// Registers P's leg for room `key`, before the hold exists (it may end quickly). A later
    /// leg with the same room replaces an earlier one, which then learns nothing.
    pub fn expect(&self, key: &str) -> RoomWaiter {
        let ticket = {
            let mut next = self.next.lock().unwrap_or_else(PoisonError::into_inner);
            *next += 1;
            *next
        };
        let (tx, rx) = oneshot::channel();
        lock(&self.waiters).insert(key.to_owned(), (ticket, tx));
        RoomWaiter {
            waiters: self.waiters.clone(),
            key: key.to_owned(),
            ticket,
            rx,
        }
    }

    /// Tells the leg waiting on `key`, if any, what became of its room.
    pub fn resolve(&self, key: &str, outcome: Outcome) {
        if let Some((_, tx)) = lock(&self.waiters).remove(key) {
            // Err: the leg is gone (cut by the router) between its drop and this.
            let _ = tx.send(outcome);
        }
    }

    /// P's legs waiting now.
    pub fn waiting(&self) -> usize {
        lock(&self.waiters).len()
    }
}

/// One P leg's wait; dropping it (the leg cut) unregisters it.
pub struct RoomWaiter {
    waiters: Arc<Mutex<Waiters>>,
    key: String,
    ticket: u64,
    rx: oneshot::Receiver<Outcome>,
}

impl RoomWaiter {
    /// The outcome if it is already known.
    pub fn try_outcome(&mut self) -> Option<Outcome> {
        self.rx.try_recv().ok()
    }

    /// Waits for the outcome; None if the room was taken over by another leg.
    pub async fn outcome(&mut self) -> Option<Outcome> {
        (&mut self.rx).await.ok()
    }
}

impl Drop for RoomWaiter {
    fn drop(&mut self) {
        let mut w = lock(&self.waiters);
        if w.get(&self.key).is_some_and(|(t, _)| *t == self.ticket) {
            w.remove(&self.key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_waiter_learns_its_outcome_and_unregisters() {
        let rooms = Rooms::default();
        let mut a = rooms.expect("room:1");
        assert_eq!((a.try_outcome(), rooms.waiting()), (None, 1));
        rooms.resolve("room:1", Outcome::Read);
        assert_eq!(
            (a.outcome().await, rooms.waiting()),
            (Some(Outcome::Read), 0)
        );
        // Resolving a room nobody waits for is harmless.
        rooms.resolve("room:2", Outcome::Expired);
        // A dropped waiter unregisters; a replaced one does not unregister its successor.
        drop(rooms.expect("room:3"));
        assert_eq!(rooms.waiting(), 0);
        let mut old = rooms.expect("room:4");
        let mut new = rooms.expect("room:4");
        assert_eq!(old.outcome().await, None);
        drop(old);
        assert_eq!(rooms.waiting(), 1);
        rooms.resolve("room:4", Outcome::Expired);
        assert_eq!(new.outcome().await, Some(Outcome::Expired));
    }
}
