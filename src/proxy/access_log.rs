//! The access log: one line per request on stderr (so the journal under systemd), as text in
//! env_logger's format or as JSON (`kvroute.log.format: json`), handed to a writer thread
//! through a bounded channel so that neither formatting the time nor a slow stderr ever
//! stalls a proxy thread. A line that does not fit in the channel is dropped and counted
//! (`kvroute_access_log_dropped_total`), never waited for.

use prometheus::IntCounter;
use std::io::Write;
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::OnceLock;
use std::time::SystemTime;

/// One queued line: a text line is stamped with the time of its request's end.
enum Line {
    Text(SystemTime, String),
    Json(String),
}

/// Lines that may wait for the writer.
const BACKLOG: usize = 16_384;

/// Started on first use, in the process that serves (after `-d` forks: a thread started before
/// would not survive the fork).
fn writer() -> &'static SyncSender<Line> {
    static WRITER: OnceLock<SyncSender<Line>> = OnceLock::new();
    WRITER.get_or_init(|| {
        let (tx, rx) = sync_channel::<Line>(BACKLOG);
        let spawned = std::thread::Builder::new()
            .name("kvroute-access-log".into())
            .spawn(move || {
                let mut buf = Vec::with_capacity(64 << 10);
                while let Ok(line) = rx.recv() {
                    put(&mut buf, line);
                    // Batch while lines queue up, then write them at once. stderr is locked only
                    // for that write: the logger's lines from other threads go to stderr too,
                    // and a lock held between batches would block them for good.
                    while let Ok(line) = rx.try_recv() {
                        put(&mut buf, line);
                        if buf.len() >= 64 << 10 {
                            break;
                        }
                    }
                    let _ = std::io::stderr().lock().write_all(&buf);
                    buf.clear();
                }
            });
        if let Err(e) = spawned {
            log::error!("cannot start the access log writer, access lines are dropped: {e}");
        }
        tx
    })
}

fn put(out: &mut impl Write, line: Line) {
    let _ = match line {
        // As env_logger writes its own lines, so a text access log reads as before.
        Line::Text(at, text) => {
            let ts = jiff::Timestamp::try_from(at).unwrap_or(jiff::Timestamp::UNIX_EPOCH);
            writeln!(out, "[{ts:.0} INFO  kvroute::access] {text}")
        }
        Line::Json(text) => writeln!(out, "{text}"),
    };
}

fn send(line: Line, dropped: &IntCounter) {
    match writer().try_send(line) {
        Ok(()) => {}
        Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => dropped.inc(),
    }
}

/// Queue one JSON access-log object; count it in `dropped` when the writer is behind.
pub(super) fn write_json(entry: &serde_json::Value, dropped: &IntCounter) {
    send(Line::Json(entry.to_string()), dropped);
}

/// Queue one text access line (the logger's `kvroute::access` target at info must be on).
pub(super) fn write_text(text: String, dropped: &IntCounter) {
    send(Line::Text(SystemTime::now(), text), dropped);
}
