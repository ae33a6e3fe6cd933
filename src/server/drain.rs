//! Notices when Pingora begins a graceful upgrade (SIGQUIT) or shutdown (SIGTERM), so `/readyz`
//! turns not-ready while this process finishes its in-flight streams.

use async_trait::async_trait;
use pingora::server::{ExecutionPhase, ShutdownWatch};
use pingora::services::background::BackgroundService;
use std::sync::{Arc, Mutex};
use tokio::sync::broadcast::{error::RecvError, Receiver};

use crate::edge::EdgeState;

pub(super) struct DrainWatch {
    pub edge: Arc<EdgeState>,
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

#[async_trait]
impl BackgroundService for DrainWatch {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let Some(mut phases) = self.phases.lock().ok().and_then(|mut p| p.take()) else {
            return;
        };
        loop {
            tokio::select! {
                phase = phases.recv() => match phase {
                    Ok(p) if is_draining(&p) => {
                        log::info!("draining ({p:?}): /readyz now reports not ready");
                        self.edge.draining.start();
                    }
                    Ok(_) | Err(RecvError::Lagged(_)) => {}
                    Err(RecvError::Closed) => return,
                },
                // Pingora's own shutdown broadcast: draining for certain from here on.
                _ = shutdown.changed() => {
                    self.edge.draining.start();
                    return;
                }
            }
        }
    }
}
