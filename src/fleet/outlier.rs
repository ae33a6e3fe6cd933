//! Passive outlier ejection: a backend that fails requests in a row (connect errors, resets and
//! timeouts before a response, 5xx other than 503) leaves placement for a while, twice as long
//! each time it fails again without a success in between. 503 and 429 mean "busy", not
//! "broken", and count as neither. Health checks alone miss a backend that answers `/health`
//! but fails real requests.

use std::time::{Duration, Instant};

use crate::config::OutlierConfig;

/// What one upstream attempt says about its backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Success,
    Failure,
    /// Busy (503, 429) or not the backend's fault.
    Neutral,
}

impl Outcome {
    /// The outcome of a response with this status.
    pub fn of_status(status: u16) -> Outcome {
        match status {
            503 | 429 => Outcome::Neutral,
            500..=599 => Outcome::Failure,
            _ => Outcome::Success,
        }
    }
}

/// One backend's record.
#[derive(Debug, Default, Clone)]
pub struct Outlier {
    consecutive_failures: u32,
    /// Ejections since the last success: each doubles the next ejection's length.
    ejections: u32,
    ejected_until: Option<Instant>,
}

impl Outlier {
    pub fn ejected(&self, now: Instant) -> bool {
        self.ejected_until.is_some_and(|t| now < t)
    }

    /// Record `outcome`. Returns how long the backend is ejected for if this ejects it;
    /// `may_eject` is false when the fleet already has its maximum share ejected.
    pub fn observe(
        &mut self,
        outcome: Outcome,
        now: Instant,
        cfg: &OutlierConfig,
        may_eject: bool,
    ) -> Option<Duration> {
        match outcome {
            Outcome::Neutral => None,
            Outcome::Success => {
                self.consecutive_failures = 0;
                if !self.ejected(now) {
                    self.ejections = 0;
                }
                None
            }
            Outcome::Failure => {
                self.consecutive_failures = self.consecutive_failures.saturating_add(1);
                let due = cfg.enabled
                    && self.consecutive_failures >= cfg.consecutive_failures
                    && !self.ejected(now);
                if !(due && may_eject) {
                    return None;
                }
                let factor = 1u64 << self.ejections.min(16);
                let ms = cfg
                    .base_ejection_ms
                    .saturating_mul(factor)
                    .min(cfg.max_ejection_ms);
                let d = Duration::from_millis(ms);
                self.ejections += 1;
                self.consecutive_failures = 0;
                self.ejected_until = Some(now + d);
                Some(d)
            }
        }
    }
}

/// Whether one more of `n` backends may be ejected when `ejected` already are.
pub fn may_eject(ejected: usize, n: usize, max_percent: u32) -> bool {
    (ejected + 1) * 100 <= n * max_percent as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> OutlierConfig {
        OutlierConfig {
            enabled: true,
            consecutive_failures: 3,
            base_ejection_ms: 1000,
            max_ejection_ms: 5000,
            max_ejected_percent: 50,
        }
    }

    #[test]
    fn consecutive_failures_eject_for_growing_times_until_a_success() {
        let (c, t0) = (cfg(), Instant::now());
        let mut o = Outlier::default();
        assert_eq!(o.observe(Outcome::Failure, t0, &c, true), None);
        assert_eq!(o.observe(Outcome::Failure, t0, &c, true), None);
        assert_eq!(
            o.observe(Outcome::Failure, t0, &c, true),
            Some(Duration::from_secs(1))
        );
        assert!(o.ejected(t0));
        let t1 = t0 + Duration::from_millis(1001);
        assert!(!o.ejected(t1), "back after its ejection");
        for _ in 0..2 {
            o.observe(Outcome::Failure, t1, &c, true);
        }
        assert_eq!(
            o.observe(Outcome::Failure, t1, &c, true),
            Some(Duration::from_secs(2)),
            "failing again right away doubles the time"
        );
        let t2 = t1 + Duration::from_secs(3);
        for _ in 0..3 {
            o.observe(Outcome::Failure, t2, &c, true);
        }
        let t3 = t2 + Duration::from_secs(5);
        for _ in 0..2 {
            o.observe(Outcome::Failure, t3, &c, true);
        }
        assert_eq!(
            o.observe(Outcome::Failure, t3, &c, true),
            Some(Duration::from_secs(5)),
            "capped at max_ejection_ms"
        );
        let t4 = t3 + Duration::from_secs(6);
        o.observe(Outcome::Success, t4, &c, true);
        for _ in 0..2 {
            o.observe(Outcome::Failure, t4, &c, true);
        }
        assert_eq!(
            o.observe(Outcome::Failure, t4, &c, true),
            Some(Duration::from_secs(1)),
            "a success resets the growth"
        );
    }

    #[test]
    fn busy_answers_and_interleaved_successes_never_eject() {
        let (c, t) = (cfg(), Instant::now());
        let mut o = Outlier::default();
        for _ in 0..20 {
            assert_eq!(o.observe(Outcome::of_status(503), t, &c, true), None);
            assert_eq!(o.observe(Outcome::of_status(429), t, &c, true), None);
        }
        for _ in 0..20 {
            o.observe(Outcome::Failure, t, &c, true);
            o.observe(Outcome::Failure, t, &c, true);
            o.observe(Outcome::of_status(200), t, &c, true);
        }
        assert!(!o.ejected(t));
        assert_eq!(Outcome::of_status(500), Outcome::Failure);
        assert_eq!(Outcome::of_status(404), Outcome::Success);
    }

    #[test]
    fn the_ejected_share_is_capped() {
        let (c, t) = (cfg(), Instant::now());
        let mut o = Outlier::default();
        for _ in 0..10 {
            assert_eq!(o.observe(Outcome::Failure, t, &c, false), None);
        }
        assert!(!o.ejected(t));
        assert!(may_eject(0, 2, 50));
        assert!(!may_eject(1, 2, 50));
        assert!(may_eject(3, 8, 50) && !may_eject(4, 8, 50));
        assert!(
            !may_eject(0, 1, 50),
            "a lone backend is never ejected at 50%"
        );
        let off = OutlierConfig {
            enabled: false,
            ..c
        };
        for _ in 0..10 {
            assert_eq!(o.observe(Outcome::Failure, t, &off, true), None);
        }
    }
}
