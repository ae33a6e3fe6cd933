//! What each tenant has been served lately: weighted tokens, decayed by a half-life. The router
//! queue lets the waiting tenant that has been served least go first inside a priority band
//! (least attained service), so a tenant flooding a saturated fleet waits behind everyone
//! else's fair share rather than in front of it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Tenants kept before the ones served next to nothing are forgotten (tenant ids can come from
/// a header: the map must not grow with every id a client makes up).
const PRUNE_ABOVE: usize = 1024;
/// Served less than this, a tenant is as good as new.
const NEGLIGIBLE: f64 = 1.0;

struct Served {
    tokens: f64,
    at: Instant,
}

pub struct FairShare {
    served: Mutex<HashMap<String, Served>>,
    half_life_ms: AtomicU64,
}

impl Default for FairShare {
    fn default() -> Self {
        FairShare {
            served: Mutex::default(),
            half_life_ms: AtomicU64::new(60_000),
        }
    }
}

fn decayed(tokens: f64, since: Duration, half_life_ms: u64) -> f64 {
    tokens * 0.5f64.powf(since.as_secs_f64() * 1000.0 / half_life_ms.max(1) as f64)
}

impl FairShare {
    /// The half-life in force (`tenants.fair_share.half_life_ms`), set by each request from its
    /// own config so a reload takes effect.
    pub fn set_half_life(&self, ms: u64) {
        self.half_life_ms.store(ms.max(1), Ordering::Relaxed);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Served>> {
        // A panic elsewhere while holding it leaves plain numbers, still consistent.
        self.served.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `tenant` was served `tokens` (already weighted).
    pub fn charge(&self, tenant: &str, tokens: f64, now: Instant) {
        if !(tokens.is_finite() && tokens > 0.0) {
            return;
        }
        let hl = self.half_life_ms.load(Ordering::Relaxed);
        let mut m = self.lock();
        if m.len() > PRUNE_ABOVE {
            m.retain(|_, s| {
                decayed(s.tokens, now.saturating_duration_since(s.at), hl) >= NEGLIGIBLE
            });
        }
        match m.get_mut(tenant) {
            Some(s) => {
                s.tokens = decayed(s.tokens, now.saturating_duration_since(s.at), hl) + tokens;
                s.at = now;
            }
            None => {
                m.insert(tenant.to_owned(), Served { tokens, at: now });
            }
        }
    }

    /// What `tenant` has been served, decayed to `now`.
    pub fn attained(&self, tenant: &str, now: Instant) -> f64 {
        let hl = self.half_life_ms.load(Ordering::Relaxed);
        self.lock().get(tenant).map_or(0.0, |s| {
            decayed(s.tokens, now.saturating_duration_since(s.at), hl)
        })
    }

    /// Every tenant's attained service, decayed to `now` (for metrics and `/debug/queue`).
    pub fn snapshot(&self, now: Instant) -> Vec<(String, f64)> {
        let hl = self.half_life_ms.load(Ordering::Relaxed);
        let mut v: Vec<_> = self
            .lock()
            .iter()
            .map(|(t, s)| {
                (
                    t.clone(),
                    decayed(s.tokens, now.saturating_duration_since(s.at), hl),
                )
            })
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn service_adds_up_and_halves_every_half_life() {
        let f = FairShare::default();
        f.set_half_life(1000);
        let t0 = Instant::now();
        f.charge("a", 100.0, t0);
        f.charge("a", 100.0, t0);
        assert!((f.attained("a", t0) - 200.0).abs() < 1e-9);
        let later = t0 + Duration::from_secs(2);
        assert!((f.attained("a", later) - 50.0).abs() < 1e-6);
        assert_eq!(f.attained("b", later), 0.0);
        // Nothing negative or not a number is charged.
        f.charge("b", -5.0, later);
        f.charge("b", f64::NAN, later);
        assert_eq!(f.attained("b", later), 0.0);
    }

    #[test]
    fn tenants_served_next_to_nothing_are_forgotten_past_the_bound() {
        let f = FairShare::default();
        f.set_half_life(1);
        let t0 = Instant::now();
        for i in 0..=PRUNE_ABOVE {
            f.charge(&format!("t{i}"), 10.0, t0);
        }
        let later = t0 + Duration::from_secs(1);
        f.charge("fresh", 10.0, later);
        assert_eq!(f.snapshot(later).len(), 1);
    }
}
