//! Retry budget: requests waiting on a retried attempt may be at most a share of the requests
//! in flight (with a floor), so a failing fleet sees each client request once or twice, never a
//! retry storm. A unit is held from the first retry until the retried attempt is answered.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

#[derive(Debug, Default)]
pub struct RetryBudget {
    active: AtomicU64,
    retrying: AtomicU64,
}

/// A request in flight; counts toward the budget's base until dropped.
pub struct Active(Arc<RetryBudget>);

impl Drop for Active {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A request that is retrying; holds one unit of the budget until dropped (its retry is
/// answered, or the request ends).
pub struct Retrying(Arc<RetryBudget>);

impl Drop for Retrying {
    fn drop(&mut self) {
        self.0.retrying.fetch_sub(1, Ordering::Relaxed);
    }
}

impl RetryBudget {
    /// Requests in flight now (from their first phase until their access-log line).
    pub fn in_flight(&self) -> u64 {
        self.active.load(Ordering::Relaxed)
    }

    pub fn start(self: &Arc<Self>) -> Active {
        self.active.fetch_add(1, Ordering::Relaxed);
        Active(self.clone())
    }

    /// Take a unit for a request's retries, if fewer than `max(min, ratio * active)` requests
    /// are retrying now.
    pub fn try_retry(self: &Arc<Self>, ratio: f64, min: u64) -> Option<Retrying> {
        let active = self.active.load(Ordering::Relaxed);
        let cap = ((active as f64 * ratio).floor() as u64).max(min);
        self.retrying
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |r| {
                (r < cap).then_some(r + 1)
            })
            .ok()?;
        Some(Retrying(self.clone()))
    }

    #[cfg(test)]
    pub fn retrying(&self) -> u64 {
        self.retrying.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retries_are_capped_at_a_share_of_active_requests_with_a_floor() {
        let b = Arc::new(RetryBudget::default());
        let active: Vec<_> = (0..40).map(|_| b.start()).collect();
        let held: Vec<_> = (0..8).map(|_| b.try_retry(0.2, 3).unwrap()).collect();
        assert!(b.try_retry(0.2, 3).is_none(), "20% of 40 is 8");
        drop(held);
        assert_eq!(b.retrying(), 0);
        drop(active);
        let few: Vec<_> = (0..3).map(|_| b.try_retry(0.2, 3).unwrap()).collect();
        assert!(b.try_retry(0.2, 3).is_none(), "the floor is 3");
        assert_eq!(few.len(), 3);
    }
}
