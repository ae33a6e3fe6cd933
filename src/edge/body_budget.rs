//! The process-wide budget for request bodies being received and parsed
//! (`limits.body_memory_bytes`).
//!
//! A body a client is still sending, or one being parsed, is memory that no admission control
//! has seen yet: the queue and the in-flight caps bound requests only once their bodies are
//! whole. Without a budget, a few connections that each declare 30 MB and stall before the
//! last bytes grow the process without bound. Past the budget a body is refused (503 with
//! `Retry-After`) instead of read.

use prometheus::{IntCounter, IntGauge, Registry};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::error::ApiError;
use crate::metrics::{counter, int_gauge};

pub struct BodyBudget {
    used: AtomicUsize,
    in_use: IntGauge,
    refused: IntCounter,
}

impl BodyBudget {
    pub fn register(r: &Registry) -> prometheus::Result<BodyBudget> {
        Ok(BodyBudget {
            used: AtomicUsize::new(0),
            in_use: int_gauge(
                r,
                "kvroute_body_memory_bytes",
                "Request body bytes being received or parsed, held against \
                 limits.body_memory_bytes.",
            )?,
            refused: counter(
                r,
                "kvroute_body_memory_refused_total",
                "Requests refused because their body would have taken the bodies being \
                 received or parsed past limits.body_memory_bytes.",
            )?,
        })
    }

    /// A lease holding nothing yet; [`BodyLease::grow`] takes from the budget.
    pub fn lease(self: &Arc<Self>) -> BodyLease {
        BodyLease {
            budget: Arc::clone(self),
            bytes: 0,
        }
    }
}

/// The answer to a body refused for the budget: another moment, fewer bodies in transit.
pub fn spent(retry_after: u32) -> ApiError {
    ApiError::unavailable(
        "body_memory_exhausted",
        "the proxy is receiving too many request bodies at once (limits.body_memory_bytes); \
         retry shortly",
        retry_after,
    )
}

/// One request's share of the budget, returned when dropped (however the request ends).
pub struct BodyLease {
    budget: Arc<BodyBudget>,
    bytes: usize,
}

impl BodyLease {
    /// Take `more` bytes, unless that would put the bodies held past `capacity`.
    pub fn grow(&mut self, more: usize, capacity: usize) -> bool {
        let b = &self.budget;
        let taken = b
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(more).filter(|&n| n <= capacity)
            })
            .is_ok();
        if taken {
            self.bytes += more;
            b.in_use.add(more as i64);
        } else {
            b.refused.inc();
        }
        taken
    }
}

impl Drop for BodyLease {
    fn drop(&mut self) {
        self.budget.used.fetch_sub(self.bytes, Ordering::AcqRel);
        self.budget.in_use.sub(self.bytes as i64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget() -> Arc<BodyBudget> {
        Arc::new(BodyBudget::register(&Registry::new()).expect("register"))
    }

    #[test]
    fn leases_share_the_capacity_and_return_it_when_dropped() {
        let b = budget();
        let mut first = b.lease();
        assert!(first.grow(60, 100));
        let mut second = b.lease();
        assert!(!second.grow(41, 100), "60 + 41 is past 100");
        assert!(second.grow(40, 100));
        assert_eq!(b.used.load(Ordering::Relaxed), 100);
        assert_eq!(b.refused.get(), 1);
        drop(first);
        assert_eq!(b.used.load(Ordering::Relaxed), 40);
        assert!(second.grow(60, 100));
        drop(second);
        assert_eq!(b.used.load(Ordering::Relaxed), 0);
        assert_eq!(b.in_use.get(), 0);
    }

    #[test]
    fn a_refused_grow_takes_nothing() {
        let b = budget();
        let mut l = b.lease();
        assert!(!l.grow(usize::MAX, usize::MAX - 1));
        assert_eq!((l.bytes, b.used.load(Ordering::Relaxed)), (0, 0));
    }
}
