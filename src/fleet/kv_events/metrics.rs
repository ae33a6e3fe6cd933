//! The KV-event families: what each backend's event stream delivered, and how well kvroute
//! follows it.

use prometheus::{IntCounterVec, IntGaugeVec, Registry};

use crate::metrics::{counter_vec, int_gauge_vec};
use crate::placement::SyncState;

#[derive(Clone)]
pub struct KvEventMetrics {
    pub(super) batches: IntCounterVec,
    pub(super) events: IntCounterVec,
    pub(super) blocks: IntCounterVec,
    pub(super) sync: IntGaugeVec,
}

/// Outcomes of a batch, each exported at zero from the first sight of a backend.
const BATCH_OUTCOMES: &[&str] = &["received", "replayed", "malformed", "lost", "duplicate"];
const EVENT_OUTCOMES: &[&str] = &["applied", "skipped", "undecodable"];
const BLOCK_CHANGES: &[&str] = &["stored", "removed", "unresolved"];
const STATES: &[SyncState] = &[SyncState::Off, SyncState::Partial, SyncState::Synced];

impl KvEventMetrics {
    pub fn register(r: &Registry) -> prometheus::Result<KvEventMetrics> {
        Ok(KvEventMetrics {
            batches: counter_vec(
                r,
                "kvroute_kv_event_batches_total",
                "Engine KV-event batches by backend: received live, replayed after a gap, \
                 malformed (skipped), lost (a gap replay could not fill), duplicate (delivered \
                 again, already applied).",
                &["backend", "rank", "outcome"],
            )?,
            events: counter_vec(
                r,
                "kvroute_kv_events_total",
                "Engine KV events by backend: applied to the exact index, skipped (another \
                 block size, or blocks not on the GPU), or undecodable (its backend's earlier \
                 blocks forgotten).",
                &["backend", "rank", "outcome"],
            )?,
            blocks: counter_vec(
                r,
                "kvroute_kv_event_blocks_total",
                "Blocks the engine's events stored and removed, and stored blocks whose parent \
                 kvroute did not know (not indexed).",
                &["backend", "rank", "change"],
            )?,
            sync: int_gauge_vec(
                r,
                "kvroute_kv_events_sync",
                "1 for the state kvroute's knowledge of a backend's cache is in: synced (every \
                 block known), partial (followed since a later point), off (not followed).",
                &["backend", "rank", "state"],
            )?,
        })
    }

    /// Export a backend's (rank's) families at zero, so alerts see them before the first
    /// event. `who`: the backend and its data-parallel rank ("0" for a single engine).
    pub(super) fn known(&self, who: [&str; 2]) {
        let [backend, rank] = who;
        for o in BATCH_OUTCOMES {
            self.batches.with_label_values(&[backend, rank, o]);
        }
        for o in EVENT_OUTCOMES {
            self.events.with_label_values(&[backend, rank, o]);
        }
        for c in BLOCK_CHANGES {
            self.blocks.with_label_values(&[backend, rank, c]);
        }
        self.set_sync(who, SyncState::Off);
    }

    /// A backend no longer followed has no sync state: an alert on `off` then means a stream
    /// that is configured but not connected.
    pub(super) fn forget(&self, [backend, rank]: [&str; 2]) {
        for s in STATES {
            let _ = self.sync.remove_label_values(&[backend, rank, s.as_str()]);
        }
    }

    pub(super) fn set_sync(&self, [backend, rank]: [&str; 2], state: SyncState) {
        for s in STATES {
            self.sync
                .with_label_values(&[backend, rank, s.as_str()])
                .set(i64::from(*s == state));
        }
    }

    pub(super) fn batch(&self, [backend, rank]: [&str; 2], outcome: &str) {
        self.batches
            .with_label_values(&[backend, rank, outcome])
            .inc();
    }

    pub(super) fn count(
        &self,
        vec: &IntCounterVec,
        [backend, rank]: [&str; 2],
        what: &str,
        n: u64,
    ) {
        vec.with_label_values(&[backend, rank, what]).inc_by(n);
    }
}
