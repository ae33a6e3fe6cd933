//! The JSON access log (`kvroute.log.format: json`): one object per request on stderr (so the
//! journal under systemd), handed to a writer thread through a bounded channel so a slow
//! stderr never stalls a proxy thread. A line that does not fit in the channel is dropped and
//! counted (`kvroute_access_log_dropped_total`), never waited for.

use prometheus::IntCounter;
use std::io::Write;
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::OnceLock;

/// Lines that may wait for the writer.
const BACKLOG: usize = 16_384;

/// Started on first use, in the process that serves (after `-d` forks: a thread started before
/// would not survive the fork).
fn writer() -> &'static SyncSender<String> {
    static WRITER: OnceLock<SyncSender<String>> = OnceLock::new();
    WRITER.get_or_init(|| {
        let (tx, rx) = sync_channel::<String>(BACKLOG);
        let spawned = std::thread::Builder::new()
            .name("kvroute-access-log".into())
            .spawn(move || {
                let stderr = std::io::stderr();
                let mut out = std::io::BufWriter::new(stderr.lock());
                while let Ok(line) = rx.recv() {
                    let _ = writeln!(out, "{line}");
                    // Batch while lines queue up; flush when the queue is empty.
                    while let Ok(line) = rx.try_recv() {
                        let _ = writeln!(out, "{line}");
                    }
                    let _ = out.flush();
                }
            });
        if let Err(e) = spawned {
            log::error!("cannot start the access log writer, JSON lines are dropped: {e}");
        }
        tx
    })
}

/// Queue one JSON access-log object; count it in `dropped` when the writer is behind.
pub(super) fn write_json(entry: &serde_json::Value, dropped: &IntCounter) {
    match writer().try_send(entry.to_string()) {
        Ok(()) => {}
        Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => dropped.inc(),
    }
}
