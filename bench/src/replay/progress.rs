//! Shared counters and the one-line progress display on stderr.

use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Debug, Default)]
pub struct Counters {
    pub sent: AtomicU64,
    pub done: AtomicU64,
    pub errors: AtomicU64,
}

impl Counters {
    /// Claims one request slot under `max` and returns its id; `None` once the budget is spent.
    pub fn try_send(&self, max: Option<u64>) -> Option<u64> {
        self.sent
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| match max {
                Some(m) if n >= m => None,
                _ => Some(n + 1),
            })
            .ok()
    }

    pub fn finished(&self, ok: bool) {
        self.done.fetch_add(1, Ordering::Relaxed);
        if !ok {
            self.errors.fetch_add(1, Ordering::Relaxed);
        }
    }

    pub fn line(&self, label: &str, elapsed: Duration, limit_s: f64) -> String {
        format!(
            "\r[{label}] sent {} done {} errors {} elapsed {:.1}s / {:.0}s ",
            self.sent.load(Ordering::Relaxed),
            self.done.load(Ordering::Relaxed),
            self.errors.load(Ordering::Relaxed),
            elapsed.as_secs_f64(),
            limit_s,
        )
    }
}

/// Redraws the line twice a second until `stop`, then ends it with a newline.
pub async fn show(
    counters: Arc<Counters>,
    label: String,
    start: Instant,
    limit_s: f64,
    stop: Arc<AtomicBool>,
) {
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    loop {
        tick.tick().await;
        let mut err = std::io::stderr().lock();
        // A closed stderr must not stop the benchmark.
        let _ = write!(err, "{}", counters.line(&label, start.elapsed(), limit_s));
        let _ = err.flush();
        if stop.load(Ordering::Relaxed) {
            let _ = writeln!(err);
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn send_budget() {
        let c = Counters::default();
        assert_eq!(c.try_send(Some(2)), Some(0));
        assert_eq!(c.try_send(Some(2)), Some(1));
        assert_eq!(c.try_send(Some(2)), None);
        assert_eq!(c.try_send(None), Some(2));
        c.finished(false);
        assert!(c
            .line("x", Duration::from_secs(1), 10.0)
            .contains("errors 1"));
    }
}
