//! The access log: one line per request on stderr (so the journal under systemd), as text in
//! env_logger's format or as JSON (`kvroute.log.format: json`), handed to a writer thread
//! through a bounded channel so that neither formatting the time nor a slow stderr ever
//! stalls a proxy thread. A line that does not fit in the channel is dropped and counted
//! (`kvroute_access_log_dropped_total`), never waited for.
//!
//! The writer sleeps `BATCH_WAIT` after each write instead of waiting on the channel at once: a
//! proxy thread that sends to a waiting receiver must wake it (a futex call and a context switch
//! per request, a quarter of the proxy's CPU at 1 KB in the profile), while one that sends to a
//! sleeping writer only stores the line. Lines still queued at exit are flushed (`flush`).

use prometheus::IntCounter;
use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant, SystemTime};

/// One queued line: a text line is stamped with the time of its request's end.
enum Line {
    Text(SystemTime, String),
    Json(String),
}

/// Lines that may wait for the writer.
const BACKLOG: usize = 16_384;

/// How long lines gather before the writer takes them: a line reaches stderr at most this late,
/// and the backlog holds this long's lines at over a million requests per second.
const BATCH_WAIT: Duration = Duration::from_millis(10);

/// The sending side of one writer thread.
struct Writer {
    tx: SyncSender<Line>,
    /// Lines sent, and lines written, so that `flush` knows when the writer has caught up.
    queued: AtomicU64,
    written: Arc<AtomicU64>,
}

impl Writer {
    fn start(out: impl Write + Send + 'static) -> Writer {
        let (tx, rx) = sync_channel::<Line>(BACKLOG);
        let written = Arc::new(AtomicU64::new(0));
        let progress = written.clone();
        let spawned = std::thread::Builder::new()
            .name("kvroute-access-log".into())
            .spawn(move || drain(rx, out, &progress));
        if let Err(e) = spawned {
            log::error!("cannot start the access log writer, access lines are dropped: {e}");
        }
        Writer {
            tx,
            queued: AtomicU64::new(0),
            written,
        }
    }

    fn send(&self, line: Line, dropped: &IntCounter) {
        // Counted before the send, so that the writer never counts a line `flush` has not seen.
        self.queued.fetch_add(1, Ordering::AcqRel);
        match self.tx.try_send(line) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                self.queued.fetch_sub(1, Ordering::AcqRel);
                dropped.inc();
            }
        }
    }

    /// Wait, at most `limit`, until every line sent so far is written; false if it was not.
    fn flush(&self, limit: Duration) -> bool {
        let until = Instant::now() + limit;
        loop {
            if self.written.load(Ordering::Acquire) >= self.queued.load(Ordering::Acquire) {
                return true;
            }
            if Instant::now() >= until {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// The writer thread: batch what has queued, write it at once, let the next batch gather.
fn drain(rx: Receiver<Line>, mut out: impl Write, written: &AtomicU64) {
    let mut buf = Vec::with_capacity(64 << 10);
    while let Ok(line) = rx.recv() {
        put(&mut buf, line);
        let mut lines = 1;
        while let Ok(line) = rx.try_recv() {
            put(&mut buf, line);
            lines += 1;
            if buf.len() >= 64 << 10 {
                break;
            }
        }
        let _ = out.write_all(&buf);
        let _ = out.flush();
        buf.clear();
        written.fetch_add(lines, Ordering::Release);
        std::thread::sleep(BATCH_WAIT);
    }
}

/// stderr, locked only for each batch's write: the logger's lines from other threads go to
/// stderr too, and a lock held between batches would block them for good.
struct Stderr;

impl Write for Stderr {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        std::io::stderr().lock().write(buf)
    }
    fn write_all(&mut self, buf: &[u8]) -> std::io::Result<()> {
        std::io::stderr().lock().write_all(buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().lock().flush()
    }
}

/// Started on first use, in the process that serves (after `-d` forks: a thread started before
/// would not survive the fork).
static WRITER: OnceLock<Writer> = OnceLock::new();

fn writer() -> &'static Writer {
    WRITER.get_or_init(|| Writer::start(Stderr))
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

/// Queue one JSON access-log object; count it in `dropped` when the writer is behind.
pub(super) fn write_json(entry: &serde_json::Value, dropped: &IntCounter) {
    writer().send(Line::Json(entry.to_string()), dropped);
}

/// Queue one text access line (the logger's `kvroute::access` target at info must be on).
pub(super) fn write_text(text: String, dropped: &IntCounter) {
    writer().send(Line::Text(SystemTime::now(), text), dropped);
}

/// Before the process exits: wait, at most `limit`, for the queued lines to be written.
pub fn flush(limit: Duration) {
    // A process that never wrote a line has no writer to wait for (and starts none now).
    let Some(writer) = WRITER.get() else { return };
    if !writer.flush(limit) {
        log::warn!("access log: lines still queued at exit after {limit:?}; they are lost");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[derive(Clone, Default)]
    struct Sink(Arc<Mutex<Vec<u8>>>);

    impl Write for Sink {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0
                .lock()
                .map_err(|_| std::io::ErrorKind::Other)?
                .extend(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn lines(sink: &Sink) -> usize {
        let text = sink.0.lock().map(|b| b.clone()).unwrap_or_default();
        String::from_utf8_lossy(&text).lines().count()
    }

    /// Lines sent while the writer sleeps between batches wait for it, and `flush` waits until
    /// they are written: the exit path's guarantee.
    #[test]
    fn flush_waits_for_the_lines_the_writer_has_not_taken() {
        let sink = Sink::default();
        let w = Writer::start(sink.clone());
        let dropped = IntCounter::new("d", "d").expect("counter");
        w.send(Line::Json("{\"n\":0}".into()), &dropped);
        assert!(w.flush(Duration::from_secs(5)), "the first line is written");
        // The writer now sleeps BATCH_WAIT before it takes the next batch.
        for n in 1..50 {
            w.send(Line::Json(format!("{{\"n\":{n}}}")), &dropped);
        }
        assert!(lines(&sink) < 50, "lines gather while the writer sleeps");
        assert!(w.flush(Duration::from_secs(5)));
        assert_eq!(lines(&sink), 50);
        assert_eq!(dropped.get(), 0);
    }

    /// A text line reads as env_logger's: `[time INFO  kvroute::access] text`.
    #[test]
    fn text_lines_carry_the_loggers_prefix() {
        let mut out = Vec::new();
        put(
            &mut out,
            Line::Text(SystemTime::UNIX_EPOCH, "GET / 200".into()),
        );
        assert_eq!(
            String::from_utf8_lossy(&out),
            "[1970-01-01T00:00:00Z INFO  kvroute::access] GET / 200\n"
        );
    }
}
