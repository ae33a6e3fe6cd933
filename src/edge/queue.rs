//! The router queue: when every eligible backend is at its hard cap
//! (`limits.backend_max_inflight`), a request waits here until a request finishes somewhere or
//! its deadline passes. Strict priority bands; inside a band, the tenant served least lately
//! goes first ([`super::fair_share`]), so one tenant's flood cannot take everyone else's turn
//! (tenants served alike: the one waiting longest); inside a tenant, the request with the
//! least slack to its TTFT deadline, then the cheapest, then the first come. A full queue (or band) or a passed queue TTL sheds the request (429
//! with `Retry-After`), and a sheddable one (priority below 0) is shed at once rather than
//! queued.
//!
//! Waiting here instead of in an engine's queue keeps placement late: the request is placed
//! when it can start, on whichever backend is best then.

use std::cmp::Ordering;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;
use tokio::sync::oneshot;
use tokio::time::Instant;

use prometheus::{HistogramVec, IntCounterVec, IntGauge, Registry};

use super::fair_share::FairShare;
use crate::config::{BandConfig, LimitsConfig};
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
    /// Its band's `max_requests` or `max_bytes` is reached.
    BandFull,
    /// It waited its queue TTL.
    Timeout,
    /// Its priority is below 0 and the fleet is saturated.
    Sheddable,
    /// It is sheddable and its predicted TTFT is past its deadline on every backend.
    SloUnattainable,
}

impl Shed {
    pub fn as_str(self) -> &'static str {
        match self {
            Shed::QueueFull | Shed::BandFull => "queue_full",
            Shed::Timeout => "queue_timeout",
            Shed::Sheddable => "sheddable",
            Shed::SloUnattainable => "slo_unattainable",
        }
    }

    /// Every reason a request is shed for, as metrics name them.
    pub const REASONS: [&'static str; 4] = [
        "queue_full",
        "queue_timeout",
        "sheddable",
        "slo_unattainable",
    ];
}

/// Who a request is for and what it asks of the queue, as the queue orders and counts it.
#[derive(Debug, Clone, Copy)]
pub struct Who<'a> {
    pub priority: i32,
    pub tenant: &'a str,
    /// The tenant as metrics name it (bounded: configured tenants, else `other`).
    pub label: &'a str,
    /// The body held while it waits (a band's `max_bytes`).
    pub bytes: u64,
    /// Its estimated prompt tokens: inside a tenant, the cheaper goes first.
    pub cost: u64,
    /// The latest it can leave the queue and still meet its TTFT deadline
    /// (`x-slo-ttft-ms`): inside a tenant, the least slack goes first.
    pub latest_start: Option<std::time::Instant>,
}

impl Who<'_> {
    fn key(&self, seq: u64) -> Key<'_> {
        Key {
            priority: self.priority,
            tenant: self.tenant,
            latest_start: self.latest_start,
            cost: self.cost,
            seq,
        }
    }
}

struct Waiter {
    priority: i32,
    tenant: String,
    bytes: u64,
    cost: u64,
    latest_start: Option<std::time::Instant>,
    seq: u64,
    wake: oneshot::Sender<()>,
}

impl Waiter {
    fn key(&self) -> Key<'_> {
        Key {
            priority: self.priority,
            tenant: &self.tenant,
            latest_start: self.latest_start,
            cost: self.cost,
            seq: self.seq,
        }
    }

    fn live(&self) -> bool {
        !self.wake.is_closed()
    }
}

/// What the queue's order reads of a request.
#[derive(Clone, Copy)]
struct Key<'a> {
    priority: i32,
    tenant: &'a str,
    latest_start: Option<std::time::Instant>,
    cost: u64,
    seq: u64,
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

    /// Inside one tenant's band: the least slack first (a request without a deadline after
    /// every one with), then the cheapest, then the earliest.
    fn within(a: &Key<'_>, b: &Key<'_>) -> Ordering {
        let by_slack = match (a.latest_start, b.latest_start) {
            (Some(x), Some(y)) => x.cmp(&y),
            (Some(_), None) => Ordering::Less,
            (None, Some(_)) => Ordering::Greater,
            (None, None) => Ordering::Equal,
        };
        by_slack.then(a.cost.cmp(&b.cost)).then(a.seq.cmp(&b.seq))
    }

    /// Among the tenants' (bands') first requests, each with the arrival of its tenant's
    /// longest-waiting request: the higher band, then the less served tenant, then the tenant
    /// waiting longest. Tenants are ordered by their service and their wait alone, never by
    /// their requests' deadlines or sizes: those only order a tenant's own requests.
    fn across(&mut self, (a, a_since): (&Key<'_>, u64), (b, b_since): (&Key<'_>, u64)) -> Ordering {
        let by_band = b.priority.cmp(&a.priority);
        if by_band != Ordering::Equal {
            return by_band;
        }
        let (sa, sb) = (self.attained(a.tenant), self.attained(b.tenant));
        sa.total_cmp(&sb).then(a_since.cmp(&b_since))
    }

    /// Which of `keys` the queue lets go first: each tenant's (and band's) first request by
    /// [`Rank::within`], and of those the first by [`Rank::across`].
    fn first(&mut self, keys: &[Key<'_>]) -> Option<usize> {
        // (head, the group's earliest arrival)
        let mut heads: Vec<(usize, u64)> = Vec::new();
        for (i, k) in keys.iter().enumerate() {
            let same =
                |h: &(usize, u64)| keys[h.0].priority == k.priority && keys[h.0].tenant == k.tenant;
            match heads.iter_mut().find(|h| same(h)) {
                Some(h) => {
                    if Self::within(k, &keys[h.0]).is_lt() {
                        h.0 = i;
                    }
                    h.1 = h.1.min(k.seq);
                }
                None => heads.push((i, k.seq)),
            }
        }
        heads
            .into_iter()
            .min_by(|a, b| self.across((&keys[a.0], a.1), (&keys[b.0], b.1)))
            .map(|h| h.0)
    }

    /// Whether `w` goes before `me` (arriving now), as a prediction of the wait: the higher
    /// bands, the requests of tenants served less, and `me`'s tenant's requests before it.
    fn ahead_of(&mut self, w: &Key<'_>, me: &Key<'_>) -> bool {
        if w.priority != me.priority {
            return w.priority > me.priority;
        }
        if w.tenant == me.tenant {
            return Self::within(w, me).is_lt();
        }
        self.attained(w.tenant) <= self.attained(me.tenant)
    }
}

/// The router queue's own families.
struct QueueMetrics {
    depth: IntGauge,
    wait: HistogramVec,
    shed: IntCounterVec,
    tenant_wait: HistogramVec,
    tenant_shed: IntCounterVec,
    tenant_slo: IntCounterVec,
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
                    "Requests answered 429 because the fleet was saturated, by reason (queue_full, queue_timeout, sheddable, slo_unattainable).",
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
                tenant_slo: counter_vec(
                    r,
                    "kvroute_tenant_slo_requests_total",
                    "Answered requests with a TTFT deadline (x-slo-ttft-ms), by tenant and whether the first byte met it (met, missed).",
                    &["tenant", "outcome"],
                )?,
            },
            fair: FairShare::default(),
        };
        // Exported from start at zero, so an alert on their increase sees the first event.
        for reason in Shed::REASONS {
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
    /// waiters, `band` those of the request's priority.
    pub async fn wait(
        &self,
        who: &Who<'_>,
        ticket: u64,
        deadline: Instant,
        capacity: usize,
        band: Option<&BandConfig>,
    ) -> Result<(), Shed> {
        let rx = {
            let Ok(mut q) = self.queue.lock() else {
                return Err(Shed::QueueFull);
            };
            // Waiters that gave up leave closed senders behind: drop them before counting.
            q.waiters.retain(Waiter::live);
            if q.waiters.len() >= capacity {
                return Err(Shed::QueueFull);
            }
            if let Some(band) = band {
                let (n, bytes) = q
                    .waiters
                    .iter()
                    .filter(|w| w.priority == who.priority)
                    .fold((0, 0), |(n, b), w| (n + 1, b + w.bytes));
                let over_bytes = band.max_bytes.is_some_and(|m| bytes + who.bytes > m);
                if band.max_requests.is_some_and(|m| n >= m) || over_bytes {
                    return Err(Shed::BandFull);
                }
            }
            let (tx, rx) = oneshot::channel();
            q.waiters.push(Waiter {
                priority: who.priority,
                tenant: who.tenant.to_owned(),
                bytes: who.bytes,
                cost: who.cost,
                latest_start: who.latest_start,
                seq: ticket,
                wake: tx,
            });
            rx
        };
        match tokio::time::timeout_at(deadline, rx).await {
            Ok(Ok(())) => Ok(()),
            // The sender was dropped without a wake-up (cannot happen while queued) or the
            // deadline passed.
            Ok(Err(_)) | Err(_) => Err(Shed::Timeout),
        }
    }

    /// A request finished or failed somewhere: let the best live waiter try again, in the
    /// queue's order ([`Rank::order`]).
    pub fn wake_one(&self) {
        let Ok(mut q) = self.queue.lock() else {
            return;
        };
        let mut rank = Rank::new(&self.fair);
        loop {
            q.waiters.retain(Waiter::live);
            let keys: Vec<Key<'_>> = q.waiters.iter().map(Waiter::key).collect();
            let Some(i) = rank.first(&keys) else {
                return;
            };
            let w = q.waiters.swap_remove(i);
            if w.wake.send(()).is_ok() {
                q.woken.push((w.seq, std::time::Instant::now()));
                return;
            }
        }
    }

    /// How many live waiters the queue's order puts before `who` (arriving now): what its
    /// wait is predicted from.
    pub fn ahead(&self, who: &Who<'_>) -> usize {
        let Ok(q) = self.queue.lock() else {
            return 0;
        };
        let mut rank = Rank::new(&self.fair);
        let me = who.key(u64::MAX);
        q.waiters
            .iter()
            .filter(|w| w.live() && rank.ahead_of(&w.key(), &me))
            .count()
    }

    /// Who goes before `who`, which found room on its own.
    fn before(&self, who: &Who<'_>, ticket: u64) -> Before {
        let Ok(mut q) = self.queue.lock() else {
            return Before::Nobody;
        };
        q.woken.retain(|(_, at)| at.elapsed() < WOKEN_HOLD);
        if q.woken.iter().any(|(t, _)| *t != ticket) {
            return Before::Woken;
        }
        let mut rank = Rank::new(&self.fair);
        let mut keys: Vec<Key<'_>> = q
            .waiters
            .iter()
            .filter(|w| w.live() && w.seq != ticket)
            .map(Waiter::key)
            .collect();
        keys.push(who.key(ticket));
        if rank.first(&keys) == Some(keys.len() - 1) {
            Before::Nobody
        } else {
            Before::Waiter
        }
    }

    /// A woken waiter is back: placed, shed, or queued again.
    fn back(&self, ticket: u64) {
        if let Ok(mut q) = self.queue.lock() {
            q.woken.retain(|(t, _)| *t != ticket);
        }
    }

    /// Count an answered request with a TTFT deadline: `met` it or not.
    pub fn count_slo(&self, label: &str, met: bool) {
        let outcome = if met { "met" } else { "missed" };
        self.metrics
            .tenant_slo
            .with_label_values(&[label, outcome])
            .inc();
    }

    /// Count a request shed for `reason` after `waited` seconds in the queue.
    pub fn count_shed(&self, who: &Who<'_>, reason: Shed, waited: f64) {
        let m = &self.metrics;
        m.wait.with_label_values(&["shed"]).observe(waited);
        m.tenant_wait
            .with_label_values(&[who.label, "shed"])
            .observe(waited);
        m.shed.with_label_values(&[reason.as_str()]).inc();
        m.tenant_shed
            .with_label_values(&[who.label, reason.as_str()])
            .inc();
    }

    /// Wait while `saturated()` (every eligible backend at its hard cap), in the queue's
    /// order, until the queue TTL after `start` (its band's `queue_timeout_ms`, else
    /// `limits.queue_timeout_ms`); 429 `fleet_saturated` when the queue or the band is full,
    /// the TTL passes, or the request is sheddable.
    pub async fn wait_for_capacity(
        &self,
        limits: &LimitsConfig,
        band: Option<&BandConfig>,
        who: Who<'_>,
        start: std::time::Instant,
        saturated: impl Fn() -> bool,
    ) -> Result<(), ApiError> {
        let metrics = &self.metrics;
        if !saturated() {
            return Ok(());
        }
        let entered = Instant::now();
        let ttl_ms = band
            .and_then(|b| b.queue_timeout_ms)
            .unwrap_or(limits.queue_timeout_ms);
        let deadline = Instant::from_std(start) + Duration::from_millis(ttl_ms);
        let ticket = self.ticket();
        loop {
            let mut woken = false;
            let shed = if who.priority < 0 {
                Some(Shed::Sheddable)
            } else {
                let until = deadline.min(Instant::now() + QUEUE_RECHECK);
                match self
                    .wait(&who, ticket, until, limits.queue_size, band)
                    .await
                {
                    Err(Shed::Timeout) if Instant::now() < deadline => None,
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
                self.count_shed(&who, reason, waited);
                let message = match reason {
                    Shed::QueueFull => {
                        "every backend is at capacity and the router queue is full".to_string()
                    }
                    Shed::BandFull => format!(
                        "every backend is at capacity and the router queue's band {} is full",
                        who.priority
                    ),
                    Shed::Timeout => {
                        format!("every backend stayed at capacity for {ttl_ms} ms")
                    }
                    Shed::Sheddable | Shed::SloUnattainable => format!(
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
                    match self.before(&who, ticket) {
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
            .map(|q| q.waiters.iter().filter(|w| w.live()).count())
            .unwrap_or(0)
    }

    /// The live waiters, in no order: (priority, tenant, arrival).
    pub fn waiting(&self) -> Vec<(i32, String, u64)> {
        self.queue
            .lock()
            .map(|q| {
                q.waiters
                    .iter()
                    .filter(|w| w.live())
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

    fn who(priority: i32, tenant: &str) -> Who<'_> {
        Who {
            priority,
            tenant,
            label: tenant,
            bytes: 0,
            cost: 0,
            latest_start: None,
        }
    }

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
                a.wait(&who(prio, "t"), t, far, 10, None).await.unwrap();
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
        let waiting = tokio::spawn(async move { a2.wait(&who(0, "t"), 1, soon, 1, None).await });
        tokio::task::yield_now().await;
        assert_eq!(
            a.wait(&who(0, "t"), 2, soon, 1, None).await,
            Err(Shed::QueueFull)
        );
        assert_eq!(waiting.await.unwrap(), Err(Shed::Timeout));
        // The timed-out waiter no longer counts, and a wake-up is not lost on it.
        assert_eq!(a.depth(), 0);
        let a3 = a.clone();
        let later = tokio::spawn(async move {
            let soon = Instant::now() + Duration::from_secs(5);
            a3.wait(&who(0, "t"), 3, soon, 1, None).await
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
                a.wait(&who(prio, tenant), t, far, 10, None).await.unwrap();
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
        let start = std::time::Instant::now();
        let e = a
            .wait_for_capacity(&limits, None, who(-1, "t"), start, || true)
            .await
            .unwrap_err();
        assert_eq!((e.status, e.code), (429, "fleet_saturated"));
        assert_eq!(e.dropped_reason, Some("sheddable"));
        assert_eq!(a.depth(), 0);
        // Not saturated: a sheddable request goes through like any other.
        assert!(a
            .wait_for_capacity(&limits, None, who(-1, "t"), start, || false)
            .await
            .is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn inside_a_tenant_the_least_slack_goes_first_then_the_cheapest() {
        let a = Arc::new(Admission::register(&Registry::new()).unwrap());
        let far = Instant::now() + Duration::from_secs(60);
        let now = std::time::Instant::now();
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for (name, cost, slack_ms) in [
            ("big", 9000, None),
            ("small", 100, None),
            ("loose", 5000, Some(900)),
            ("tight", 5000, Some(200)),
        ] {
            let (a, order) = (a.clone(), order.clone());
            let t = a.ticket();
            tasks.push(tokio::spawn(async move {
                let w = Who {
                    cost,
                    latest_start: slack_ms.map(|ms| now + Duration::from_millis(ms)),
                    ..who(0, "t")
                };
                a.wait(&w, t, far, 10, None).await.unwrap();
                order.lock().unwrap().push(name);
            }));
            tokio::task::yield_now().await;
        }
        // A request arriving now with a deadline between the two would go after `tight`.
        let probe = Who {
            latest_start: Some(now + Duration::from_millis(500)),
            ..who(0, "t")
        };
        assert_eq!(a.ahead(&probe), 1);
        assert_eq!(
            a.ahead(&Who {
                cost: 50,
                ..who(0, "t")
            }),
            2
        );
        assert_eq!(a.ahead(&who(1, "t")), 0);
        for _ in 0..4 {
            a.wake_one();
            tokio::task::yield_now().await;
            tokio::task::yield_now().await;
        }
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(
            *order.lock().unwrap(),
            vec!["tight", "loose", "small", "big"]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_band_holds_at_most_its_requests_and_bytes_and_waits_its_own_ttl() {
        let a = Arc::new(Admission::register(&Registry::new()).unwrap());
        let band = BandConfig {
            priority: 0,
            max_requests: Some(2),
            max_bytes: Some(1000),
            queue_timeout_ms: Some(300),
        };
        let far = Instant::now() + Duration::from_secs(60);
        let sized = |bytes| Who {
            bytes,
            ..who(0, "t")
        };
        let mut held = Vec::new();
        for (t, bytes) in [(1, 400), (2, 500)] {
            let (a, band) = (a.clone(), band.clone());
            held.push(tokio::spawn(async move {
                a.wait(&sized(bytes), t, far, 100, Some(&band)).await
            }));
            tokio::task::yield_now().await;
        }
        // Two waiting: the band is full, whatever the size; another band is not.
        assert_eq!(
            a.wait(&sized(1), 3, far, 100, Some(&band)).await,
            Err(Shed::BandFull)
        );
        let other = tokio::spawn({
            let a = a.clone();
            async move { a.wait(&who(1, "t"), 4, far, 100, None).await }
        });
        tokio::task::yield_now().await;
        a.wake_one();
        assert_eq!(other.await.unwrap(), Ok(()));
        // Bytes: 900 held of 1000, so 200 more do not fit even with a place free.
        let roomy = BandConfig {
            max_requests: Some(3),
            ..band.clone()
        };
        assert_eq!(
            a.wait(&sized(200), 5, far, 100, Some(&roomy)).await,
            Err(Shed::BandFull)
        );
        for _ in 0..2 {
            a.wake_one();
        }
        for h in held {
            assert_eq!(h.await.unwrap(), Ok(()));
        }
        // The band's TTL, not the fleet-wide one, bounds the wait.
        let limits = LimitsConfig {
            queue_timeout_ms: 60_000,
            ..LimitsConfig::default()
        };
        let start = std::time::Instant::now();
        let e = a
            .wait_for_capacity(&limits, Some(&band), who(0, "t"), start, || true)
            .await
            .unwrap_err();
        assert_eq!(e.dropped_reason, Some("queue_timeout"));
        assert!(e.message.contains("300 ms"), "{}", e.message);
        assert!(start.elapsed() < Duration::from_secs(1));
    }

    #[tokio::test(start_paused = true)]
    async fn tenants_served_alike_go_by_arrival_whatever_their_sizes() {
        // Nobody charged (fair share weights 0): first come first served across tenants, a
        // tenant's cheaper request ahead of its own dearer one only.
        let a = Arc::new(Admission::register(&Registry::new()).unwrap());
        let far = Instant::now() + Duration::from_secs(60);
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for (name, tenant, cost) in [
            ("a-big", "a", 20_000),
            ("b-small", "b", 500),
            ("a-small", "a", 400),
            ("c-small", "c", 300),
        ] {
            let (a, order) = (a.clone(), order.clone());
            let t = a.ticket();
            tasks.push(tokio::spawn(async move {
                let w = Who {
                    cost,
                    ..who(0, tenant)
                };
                a.wait(&w, t, far, 10, None).await.unwrap();
                order.lock().unwrap().push(name);
            }));
            tokio::task::yield_now().await;
        }
        // A newcomer of a tenant served alike would wait behind all four.
        assert_eq!(a.ahead(&who(0, "d")), 4);
        for _ in 0..4 {
            a.wake_one();
            tokio::task::yield_now().await;
            tokio::task::yield_now().await;
        }
        for t in tasks {
            t.await.unwrap();
        }
        // Tenant a has waited longest (its first request arrived first): its two go first, the
        // cheaper one ahead; then b, then c, in arrival order.
        assert_eq!(
            *order.lock().unwrap(),
            vec!["a-small", "a-big", "b-small", "c-small"]
        );
    }
}
