//! Notices when Pingora begins a graceful upgrade (SIGQUIT) or shutdown (SIGTERM), so `/readyz`
//! turns not-ready while this process finishes its in-flight streams, and ends the drain when
//! the work ends.
//!
//! Pingora's graceful shutdown sleeps the whole `grace_period_seconds` however little is in
//! flight, and stops listening for signals while it does. Once the grace period begins (the
//! listeners are closed, or handed over on upgrade), this service exits the process as soon as
//! no request is in flight, and at once on a second SIGTERM or a SIGINT. Streams still running
//! a second before the grace period's end (half-way through a shorter one) are cut here, before
//! Pingora would drop them: so they get the SSE error event and their access lines, which a
//! dropped request never does.

use async_trait::async_trait;
use pingora::server::{ExecutionPhase, ShutdownWatch};
use pingora::services::background::BackgroundService;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::broadcast::{error::RecvError, Receiver};

use crate::edge::EdgeState;

/// How often the drain checks for requests still in flight.
const DRAIN_POLL: Duration = Duration::from_millis(100);
/// How long cut streams get to send their error event before the process exits.
const CUT_GRACE: Duration = Duration::from_millis(500);
/// How long an open connection with nothing in flight may hold the drain.
const IDLE_SETTLE: Duration = Duration::from_secs(2);
/// How long before the grace period's end the drain cuts the streams still running (at most
/// half the period): time for their error events, access lines and the exit.
const GRACE_LEAD: Duration = Duration::from_millis(1000);

pub(super) struct DrainWatch {
    pub edge: Arc<EdgeState>,
    /// Pingora's `grace_period_seconds` (its default when unset).
    pub grace: Duration,
    /// Taken by the one task that watches.
    pub phases: Mutex<Option<Receiver<ExecutionPhase>>>,
}

fn is_draining(phase: &ExecutionPhase) -> bool {
    matches!(
        phase,
        ExecutionPhase::GracefulUpgradeTransferringFds
            | ExecutionPhase::GracefulUpgradeCloseTimeout
            | ExecutionPhase::GracefulTerminate
            | ExecutionPhase::ShutdownStarted
            | ExecutionPhase::ShutdownGracePeriod
            | ExecutionPhase::ShutdownRuntimes
            | ExecutionPhase::Terminated
    )
}

fn exit_now(why: &str) -> ! {
    log::info!("{why}: exiting now");
    crate::proxy::access_log::flush(Duration::from_millis(500));
    log::logger().flush();
    std::process::exit(0);
}

impl DrainWatch {
    /// The grace period has begun: exit once nothing is in flight, or on a second signal.
    async fn end_when_idle(&self) {
        let (Ok(mut term), Ok(mut int)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) else {
            log::warn!("cannot watch signals during the drain; it lasts the grace period");
            return;
        };
        let budget = &self.edge.retry_budget;
        log::info!(
            "drain: {} request(s) in flight; exiting when they finish",
            budget.in_flight()
        );
        let open = &self.edge.open_connections;
        let mut idle_since: Option<std::time::Instant> = None;
        let lead = GRACE_LEAD.min(self.grace / 2);
        let cut_at = tokio::time::Instant::now() + self.grace.saturating_sub(lead);
        let mut cut = false;
        loop {
            // Done when no request is in flight and the clients' connections have closed
            // (Pingora wakes and closes idle keep-alive connections at shutdown); a connection
            // that lingers with nothing in flight holds the drain for `IDLE_SETTLE` at most.
            if budget.in_flight() == 0 {
                let since = *idle_since.get_or_insert_with(std::time::Instant::now);
                if open.load(std::sync::atomic::Ordering::Relaxed) == 0
                    || since.elapsed() >= IDLE_SETTLE
                {
                    exit_now("drain: no request in flight");
                }
            } else {
                idle_since = None;
            }
            tokio::select! {
                _ = tokio::time::sleep(DRAIN_POLL) => {}
                _ = term.recv() => self.cut_and_exit("SIGTERM again").await,
                _ = int.recv() => self.cut_and_exit("SIGINT").await,
                // Streams only: they end at their next chunk, and the drain then ends as above,
                // so a connection still in its handshake or its request is not cut off.
                _ = tokio::time::sleep_until(cut_at), if !cut => {
                    cut = true;
                    log::warn!(
                        "drain: the grace period is ending: cutting {} request(s) in flight",
                        budget.in_flight()
                    );
                    self.edge.draining.cut();
                }
            }
        }
    }
}

impl DrainWatch {
    /// End the streams still running (each gets the SSE error event at its next chunk), give
    /// them `CUT_GRACE` to go, and exit.
    async fn cut_and_exit(&self, why: &str) -> ! {
        log::warn!(
            "drain: {why}: cutting {} request(s) in flight",
            self.edge.retry_budget.in_flight()
        );
        self.edge.draining.cut();
        let deadline = tokio::time::Instant::now() + CUT_GRACE;
        while self.edge.retry_budget.in_flight() > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        exit_now(&format!("drain: {why}"))
    }
}

#[async_trait]
impl BackgroundService for DrainWatch {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let Some(mut phases) = self.phases.lock().ok().and_then(|mut p| p.take()) else {
            return;
        };
        let mut watching_shutdown = true;
        loop {
            tokio::select! {
                phase = phases.recv() => match phase {
                    Ok(ExecutionPhase::ShutdownGracePeriod) => {
                        self.edge.draining.start();
                        self.end_when_idle().await;
                        return;
                    }
                    Ok(p) if is_draining(&p) => {
                        log::info!("draining ({p:?}): /readyz now reports not ready");
                        self.edge.draining.start();
                    }
                    Ok(_) | Err(RecvError::Lagged(_)) => {}
                    Err(RecvError::Closed) => return,
                },
                // Pingora's own shutdown broadcast: draining for certain from here on.
                _ = shutdown.changed(), if watching_shutdown => {
                    self.edge.draining.start();
                    watching_shutdown = false;
                }
            }
        }
    }
}
