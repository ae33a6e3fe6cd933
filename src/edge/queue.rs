//! The router queue: when every eligible backend is at its hard cap
//! (`limits.backend_max_inflight`), a request waits here, highest `x-priority` first and first
//! come first served within a priority, until a request finishes somewhere or its deadline
//! passes. A full queue or a passed deadline sheds the request (503 with `Retry-After`).
//!
//! Waiting here instead of in an engine's queue keeps placement late: the request is placed
//! when it can start, on whichever backend is best then.

use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::sync::Mutex;
use std::time::Duration;
use tokio::sync::oneshot;
use tokio::time::Instant;

use prometheus::{HistogramVec, IntCounterVec, IntGauge, Registry};

use crate::config::LimitsConfig;
use crate::error::ApiError;
use crate::metrics::{counter_vec, int_gauge, seconds_vec};

/// A waiter re-checks the fleet this often even without a wake-up (none is ever lost for
/// longer than this).
const QUEUE_RECHECK: Duration = Duration::from_millis(200);

/// Why a request was shed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shed {
    QueueFull,
    Deadline,
}

impl Shed {
    pub fn as_str(self) -> &'static str {
        match self {
            Shed::QueueFull => "queue_full",
            Shed::Deadline => "queue_timeout",
        }
    }
}

struct Waiter {
    priority: i32,
    seq: u64,
    wake: oneshot::Sender<()>,
}

impl PartialEq for Waiter {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Waiter {}
impl PartialOrd for Waiter {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Waiter {
    /// The heap's maximum is served first: higher priority, then earlier arrival.
    fn cmp(&self, other: &Self) -> Ordering {
        self.priority
            .cmp(&other.priority)
            .then_with(|| other.seq.cmp(&self.seq))
    }
}

#[derive(Default)]
struct Queue {
    heap: BinaryHeap<Waiter>,
    seq: u64,
}

/// The router queue's own families.
struct QueueMetrics {
    depth: IntGauge,
    wait: HistogramVec,
    shed: IntCounterVec,
}

pub struct Admission {
    queue: Mutex<Queue>,
    metrics: QueueMetrics,
}

impl Admission {
    pub fn register(r: &Registry) -> prometheus::Result<Admission> {
        let a = Admission {
            queue: Mutex::default(),
            metrics: QueueMetrics {
                depth: int_gauge(r, "kvroute_queue_depth", "Requests waiting in the router queue.")?,
                wait: seconds_vec(
                    r,
                    "kvroute_queue_wait_seconds",
                    "Time requests spent in the router queue, by outcome (admitted, shed).",
                    &["outcome"],
                )?,
                shed: counter_vec(
                    r,
                    "kvroute_shed_requests_total",
                    "Requests answered 503 because the fleet was saturated, by reason (queue_full, queue_timeout).",
                    &["reason"],
                )?,
            },
        };
        // Exported from start at zero, so an alert on their increase sees the first event.
        for reason in ["queue_full", "queue_timeout"] {
            a.metrics.shed.with_label_values(&[reason]);
        }
        for outcome in ["admitted", "shed"] {
            a.metrics.wait.with_label_values(&[outcome]);
        }
        Ok(a)
    }

    /// An arrival number, fixed once per request so re-queueing keeps its place.
    pub fn ticket(&self) -> u64 {
        self.queue
            .lock()
            .map(|mut q| {
                q.seq += 1;
                q.seq
            })
            .unwrap_or(0)
    }

    /// Wait until woken by [`Admission::wake_one`] or `deadline`; `capacity` bounds the
    /// waiters.
    pub async fn wait(
        &self,
        priority: i32,
        ticket: u64,
        deadline: Instant,
        capacity: usize,
    ) -> Result<(), Shed> {
        let rx = {
            let Ok(mut q) = self.queue.lock() else {
                return Err(Shed::QueueFull);
            };
            // Waiters that gave up leave closed senders behind: drop them before counting.
            q.heap.retain(|w| !w.wake.is_closed());
            if q.heap.len() >= capacity {
                return Err(Shed::QueueFull);
            }
            let (tx, rx) = oneshot::channel();
            let seq = ticket;
            q.heap.push(Waiter {
                priority,
                seq,
                wake: tx,
            });
            rx
        };
        match tokio::time::timeout_at(deadline, rx).await {
            Ok(Ok(())) => Ok(()),
            // The sender was dropped without a wake-up (cannot happen while queued) or the
            // deadline passed.
            Ok(Err(_)) | Err(_) => Err(Shed::Deadline),
        }
    }

    /// A request finished or failed somewhere: let the best live waiter try again.
    pub fn wake_one(&self) {
        let Ok(mut q) = self.queue.lock() else {
            return;
        };
        while let Some(w) = q.heap.pop() {
            if w.wake.send(()).is_ok() {
                return;
            }
        }
    }

    /// Live waiters.
    /// Wait while `saturated()` (every eligible backend at its hard cap), in priority order,
    /// until `limits.queue_timeout_ms` after `start`; 503 `fleet_saturated` when the queue is full
    /// or the deadline passes.
    pub async fn wait_for_capacity(
        &self,
        limits: &LimitsConfig,
        priority: i32,
        start: std::time::Instant,
        saturated: impl Fn() -> bool,
    ) -> Result<(), ApiError> {
        let metrics = &self.metrics;
        if !saturated() {
            return Ok(());
        }
        let entered = Instant::now();
        let deadline = Instant::from_std(start) + Duration::from_millis(limits.queue_timeout_ms);
        let ticket = self.ticket();
        loop {
            let until = deadline.min(Instant::now() + QUEUE_RECHECK);
            let shed = match self.wait(priority, ticket, until, limits.queue_size).await {
                Err(Shed::Deadline) if Instant::now() < deadline => None,
                Err(e) => Some(e),
                Ok(()) => None,
            };
            if let Some(reason) = shed {
                metrics
                    .wait
                    .with_label_values(&["shed"])
                    .observe(entered.elapsed().as_secs_f64());
                metrics.shed.with_label_values(&[reason.as_str()]).inc();
                return Err(ApiError::unavailable(
                    "fleet_saturated",
                    match reason {
                        Shed::QueueFull => {
                            "every backend is at capacity and the router queue is full".to_string()
                        }
                        Shed::Deadline => format!(
                            "every backend stayed at capacity for {} ms",
                            limits.queue_timeout_ms
                        ),
                    },
                    limits.retry_after_seconds,
                ));
            }
            if !saturated() {
                metrics
                    .wait
                    .with_label_values(&["admitted"])
                    .observe(entered.elapsed().as_secs_f64());
                return Ok(());
            }
        }
    }

    /// Set the depth gauge, just before a scrape renders it.
    pub fn publish_depth(&self) {
        self.metrics.depth.set(self.depth() as i64);
    }

    pub fn depth(&self) -> usize {
        self.queue
            .lock()
            .map(|q| q.heap.iter().filter(|w| !w.wake.is_closed()).count())
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn priority_then_arrival_order() {
        let a = Arc::new(Admission::register(&Registry::new()).unwrap());
        let far = Instant::now() + Duration::from_secs(60);
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for (name, prio) in [("low1", 0), ("high", 5), ("low2", 0), ("mid", 1)] {
            let (a, order) = (a.clone(), order.clone());
            let t = a.ticket();
            tasks.push(tokio::spawn(async move {
                a.wait(prio, t, far, 10).await.unwrap();
                order.lock().unwrap().push(name);
            }));
            tokio::task::yield_now().await;
        }
        assert_eq!(a.depth(), 4);
        for _ in 0..4 {
            a.wake_one();
            tokio::task::yield_now().await;
            tokio::task::yield_now().await;
        }
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(*order.lock().unwrap(), vec!["high", "mid", "low1", "low2"]);
    }

    #[tokio::test(start_paused = true)]
    async fn full_queue_and_deadline_shed() {
        let a = Arc::new(Admission::register(&Registry::new()).unwrap());
        let soon = Instant::now() + Duration::from_millis(100);
        let a2 = a.clone();
        let waiting = tokio::spawn(async move { a2.wait(0, 1, soon, 1).await });
        tokio::task::yield_now().await;
        assert_eq!(a.wait(0, 2, soon, 1).await, Err(Shed::QueueFull));
        assert_eq!(waiting.await.unwrap(), Err(Shed::Deadline));
        // The timed-out waiter no longer counts, and a wake-up is not lost on it.
        assert_eq!(a.depth(), 0);
        let a3 = a.clone();
        let later = tokio::spawn(async move {
            a3.wait(0, 3, Instant::now() + Duration::from_secs(5), 1)
                .await
        });
        tokio::task::yield_now().await;
        a.wake_one();
        assert_eq!(later.await.unwrap(), Ok(()));
    }
}
