//! The router queue: when every eligible backend is at its hard cap
//! (`limits.backend_max_inflight`), a request waits here until a request finishes somewhere or
//! its deadline passes. Strict priority bands; inside a band, the tenant served least lately
//! goes first ([`super::fair_share`]), so one tenant's flood cannot take everyone else's turn;
//! inside a tenant, first come first served. A full queue or a passed deadline sheds the
//! request (429 with `Retry-After`), and a sheddable one (priority below 0) is shed at once
//! rather than queued.
//!
//! Waiting here instead of in an engine's queue keeps placement late: the request is placed
//! when it can start, on whichever backend is best then.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;
use tokio::sync::oneshot;
use tokio::time::Instant;

use prometheus::{HistogramVec, IntCounterVec, IntGauge, Registry};

use super::fair_share::FairShare;
use crate::config::LimitsConfig;
use crate::error::ApiError;
use crate::metrics::{counter_vec, int_gauge, seconds_vec};

/// A waiter re-checks the fleet this often even without a wake-up (none is ever lost for
/// longer than this).
const QUEUE_RECHECK: Duration = Duration::from_millis(200);
/// How long the room a waiter was woken for stays its own against re-checking waiters: long
/// enough for a woken task on a loaded host to run, short enough that a woken request whose
/// client left meanwhile does not hold the room for long.
const WOKEN_HOLD: Duration = Duration::from_secs(1);

/// Why a request was shed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shed {
    QueueFull,
    Deadline,
    /// Its priority is below 0 and the fleet is saturated.
    Sheddable,
}

impl Shed {
    pub fn as_str(self) -> &'static str {
        match self {
            Shed::QueueFull => "queue_full",
            Shed::Deadline => "queue_timeout",
            Shed::Sheddable => "sheddable",
        }
    }
}

/// Who a request is for, as the queue orders and counts it.
#[derive(Debug, Clone, Copy)]
pub struct Who<'a> {
    pub priority: i32,
    pub tenant: &'a str,
    /// The tenant as metrics name it (bounded: configured tenants, else `other`).
    pub label: &'a str,
}

struct Waiter {
    priority: i32,
    tenant: String,
    seq: u64,
    wake: oneshot::Sender<()>,
}

#[derive(Default)]
struct Queue {
    waiters: Vec<Waiter>,
    seq: u64,
    /// Waiters woken and not yet back with their answer (placed, or queued again): the room
    /// they were woken for is theirs, not a re-checking waiter's. Forgotten after
    /// [`WOKEN_HOLD`] (a woken request whose client left never comes back).
    woken: Vec<(u64, std::time::Instant)>,
}

/// Who goes before a waiter that found room on its own re-check.
enum Before {
    Nobody,
    /// A waiter the queue's order puts first: it should be woken.
    Waiter,
    /// A woken waiter, about to take the room.
    Woken,
}

/// The queue's order, with each tenant's attained service read once per decision.
struct Rank<'a> {
    fair: &'a FairShare,
    now: std::time::Instant,
    served: HashMap<String, f64>,
}

impl<'a> Rank<'a> {
    fn new(fair: &'a FairShare) -> Self {
        Rank {
            fair,
            now: std::time::Instant::now(),
            served: HashMap::new(),
        }
    }

    fn attained(&mut self, tenant: &str) -> f64 {
        let (fair, now) = (self.fair, self.now);
        *self
            .served
            .entry(tenant.to_owned())
            .or_insert_with(|| fair.attained(tenant, now))
    }

    /// `Less`: `a` goes first. Higher band, then less served tenant, then earlier arrival.
    fn order(&mut self, a: (i32, &str, u64), b: (i32, &str, u64)) -> std::cmp::Ordering {
        let (sa, sb) = (self.attained(a.1), self.attained(b.1));
        b.0.cmp(&a.0).then(sa.total_cmp(&sb)).then(a.2.cmp(&b.2))
    }

    fn cmp(&mut self, a: &Waiter, b: &Waiter) -> std::cmp::Ordering {
        self.order(
            (a.priority, &a.tenant, a.seq),
            (b.priority, &b.tenant, b.seq),
        )
    }
}

/// The router queue's own families.
struct QueueMetrics {
    depth: IntGauge,
    wait: HistogramVec,
    shed: IntCounterVec,
    tenant_wait: HistogramVec,
    tenant_shed: IntCounterVec,
}

pub struct Admission {
    queue: Mutex<Queue>,
    metrics: QueueMetrics,
    /// What each tenant has been served lately; charged by the proxy.
    pub fair: FairShare,
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
                    "Requests answered 429 because the fleet was saturated, by reason (queue_full, queue_timeout, sheddable).",
                    &["reason"],
                )?,
                tenant_wait: seconds_vec(
                    r,
                    "kvroute_tenant_queue_wait_seconds",
                    "Time requests spent in the router queue, by tenant (configured tenants, else other) and outcome (admitted, shed).",
                    &["tenant", "outcome"],
                )?,
                tenant_shed: counter_vec(
                    r,
                    "kvroute_tenant_shed_requests_total",
                    "Requests shed because the fleet was saturated, by tenant (configured tenants, else other) and reason.",
                    &["tenant", "reason"],
                )?,
            },
            fair: FairShare::default(),
        };
        // Exported from start at zero, so an alert on their increase sees the first event.
        for reason in ["queue_full", "queue_timeout", "sheddable"] {
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
        tenant: &str,
        ticket: u64,
        deadline: Instant,
        capacity: usize,
    ) -> Result<(), Shed> {
        let rx = {
            let Ok(mut q) = self.queue.lock() else {
                return Err(Shed::QueueFull);
            };
            // Waiters that gave up leave closed senders behind: drop them before counting.
            q.waiters.retain(|w| !w.wake.is_closed());
            if q.waiters.len() >= capacity {
                return Err(Shed::QueueFull);
            }
            let (tx, rx) = oneshot::channel();
            q.waiters.push(Waiter {
                priority,
                tenant: tenant.to_owned(),
                seq: ticket,
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

    /// A request finished or failed somewhere: let the best live waiter try again: the highest
    /// band, in it the tenant served least, in it the earliest arrival.
    pub fn wake_one(&self) {
        let Ok(mut q) = self.queue.lock() else {
            return;
        };
        let mut rank = Rank::new(&self.fair);
        loop {
            q.waiters.retain(|w| !w.wake.is_closed());
            let best = q
                .waiters
                .iter()
                .enumerate()
                .min_by(|(_, a), (_, b)| rank.cmp(a, b))
                .map(|(i, _)| i);
            let Some(i) = best else {
                return;
            };
            let w = q.waiters.swap_remove(i);
            if w.wake.send(()).is_ok() {
                q.woken.push((w.seq, std::time::Instant::now()));
                return;
            }
        }
    }

    /// Who goes before the request `(priority, tenant, ticket)`, which found room on its own.
    fn before(&self, who: Who<'_>, ticket: u64) -> Before {
        let Ok(mut q) = self.queue.lock() else {
            return Before::Nobody;
        };
        q.woken.retain(|(_, at)| at.elapsed() < WOKEN_HOLD);
        if q.woken.iter().any(|(t, _)| *t != ticket) {
            return Before::Woken;
        }
        let mut rank = Rank::new(&self.fair);
        let me = (who.priority, who.tenant, ticket);
        let first = q.waiters.iter().any(|w| {
            !w.wake.is_closed()
                && w.seq != ticket
                && rank.order((w.priority, &w.tenant, w.seq), me).is_lt()
        });
        if first {
            Before::Waiter
        } else {
            Before::Nobody
        }
    }

    /// A woken waiter is back: placed, shed, or queued again.
    fn back(&self, ticket: u64) {
        if let Ok(mut q) = self.queue.lock() {
            q.woken.retain(|(t, _)| *t != ticket);
        }
    }

    /// Wait while `saturated()` (every eligible backend at its hard cap), in band and fair
    /// order, until `limits.queue_timeout_ms` after `start`; 429 `fleet_saturated` when the
    /// queue is full, the deadline passes, or the request is sheddable.
    pub async fn wait_for_capacity(
        &self,
        limits: &LimitsConfig,
        who: Who<'_>,
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
            let mut woken = false;
            let shed = if who.priority < 0 {
                Some(Shed::Sheddable)
            } else {
                let until = deadline.min(Instant::now() + QUEUE_RECHECK);
                match self
                    .wait(who.priority, who.tenant, ticket, until, limits.queue_size)
                    .await
                {
                    Err(Shed::Deadline) if Instant::now() < deadline => None,
                    Err(e) => Some(e),
                    Ok(()) => {
                        woken = true;
                        None
                    }
                }
            };
            let waited = entered.elapsed().as_secs_f64();
            if woken {
                self.back(ticket);
            }
            if let Some(reason) = shed {
                metrics.wait.with_label_values(&["shed"]).observe(waited);
                metrics
                    .tenant_wait
                    .with_label_values(&[who.label, "shed"])
                    .observe(waited);
                metrics.shed.with_label_values(&[reason.as_str()]).inc();
                metrics
                    .tenant_shed
                    .with_label_values(&[who.label, reason.as_str()])
                    .inc();
                let message = match reason {
                    Shed::QueueFull => {
                        "every backend is at capacity and the router queue is full".to_string()
                    }
                    Shed::Deadline => format!(
                        "every backend stayed at capacity for {} ms",
                        limits.queue_timeout_ms
                    ),
                    Shed::Sheddable => format!(
                        "every backend is at capacity and the request's priority ({}) is sheddable",
                        who.priority
                    ),
                };
                return Err(ApiError::shed(
                    reason.as_str(),
                    message,
                    limits.retry_after_seconds,
                ));
            }
            if !saturated() {
                // A waiter that found room on its own re-check, not by a wake-up, lets the one
                // the queue's order puts first have it.
                if !woken {
                    match self.before(who, ticket) {
                        Before::Nobody => {}
                        Before::Waiter => {
                            self.wake_one();
                            continue;
                        }
                        Before::Woken => continue,
                    }
                }
                metrics
                    .wait
                    .with_label_values(&["admitted"])
                    .observe(waited);
                metrics
                    .tenant_wait
                    .with_label_values(&[who.label, "admitted"])
                    .observe(waited);
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
            .map(|q| q.waiters.iter().filter(|w| !w.wake.is_closed()).count())
            .unwrap_or(0)
    }

    /// The live waiters, in no order: (priority, tenant, arrival).
    pub fn waiting(&self) -> Vec<(i32, String, u64)> {
        self.queue
            .lock()
            .map(|q| {
                q.waiters
                    .iter()
                    .filter(|w| !w.wake.is_closed())
                    .map(|w| (w.priority, w.tenant.clone(), w.seq))
                    .collect()
            })
            .unwrap_or_default()
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
                a.wait(prio, "t", t, far, 10).await.unwrap();
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
        let waiting = tokio::spawn(async move { a2.wait(0, "t", 1, soon, 1).await });
        tokio::task::yield_now().await;
        assert_eq!(a.wait(0, "t", 2, soon, 1).await, Err(Shed::QueueFull));
        assert_eq!(waiting.await.unwrap(), Err(Shed::Deadline));
        // The timed-out waiter no longer counts, and a wake-up is not lost on it.
        assert_eq!(a.depth(), 0);
        let a3 = a.clone();
        let later = tokio::spawn(async move {
            a3.wait(0, "t", 3, Instant::now() + Duration::from_secs(5), 1)
                .await
        });
        tokio::task::yield_now().await;
        a.wake_one();
        assert_eq!(later.await.unwrap(), Ok(()));
    }

    #[tokio::test(start_paused = true)]
    async fn inside_a_band_the_tenant_served_least_goes_first() {
        let a = Arc::new(Admission::register(&Registry::new()).unwrap());
        let far = Instant::now() + Duration::from_secs(60);
        // The flooder has been served a lot; quiet has not.
        a.fair
            .charge("flooder", 100_000.0, std::time::Instant::now());
        a.fair.charge("quiet", 10.0, std::time::Instant::now());
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for (name, tenant, prio) in [
            ("flood1", "flooder", 0),
            ("flood2", "flooder", 0),
            ("quiet1", "quiet", 0),
            ("new1", "newcomer", 0),
            ("flood-urgent", "flooder", 1),
            ("quiet2", "quiet", 0),
        ] {
            let (a, order) = (a.clone(), order.clone());
            let t = a.ticket();
            tasks.push(tokio::spawn(async move {
                a.wait(prio, tenant, t, far, 10).await.unwrap();
                order.lock().unwrap().push(name);
            }));
            tokio::task::yield_now().await;
        }
        assert_eq!(a.depth(), 6);
        for _ in 0..6 {
            a.wake_one();
            tokio::task::yield_now().await;
            tokio::task::yield_now().await;
        }
        for t in tasks {
            t.await.unwrap();
        }
        // The higher band first whoever asks; then least served first, in arrival order.
        assert_eq!(
            *order.lock().unwrap(),
            vec![
                "flood-urgent",
                "new1",
                "quiet1",
                "quiet2",
                "flood1",
                "flood2"
            ]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_sheddable_request_is_shed_at_once_when_the_fleet_is_saturated() {
        let a = Admission::register(&Registry::new()).unwrap();
        let limits = LimitsConfig::default();
        let who = |priority| Who {
            priority,
            tenant: "t",
            label: "t",
        };
        let start = std::time::Instant::now();
        let e = a
            .wait_for_capacity(&limits, who(-1), start, || true)
            .await
            .unwrap_err();
        assert_eq!((e.status, e.code), (429, "fleet_saturated"));
        assert_eq!(e.dropped_reason, Some("sheddable"));
        assert_eq!(a.depth(), 0);
        // Not saturated: a sheddable request goes through like any other.
        assert!(a
            .wait_for_capacity(&limits, who(-1), start, || false)
            .await
            .is_ok());
    }
}
