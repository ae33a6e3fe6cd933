//! How long a request would wait in the router queue before a backend has room for it: what
//! a TTFT deadline is judged against while the fleet is saturated.

use std::time::Instant;

use super::backend::since_epoch_ms;
use super::roster::Fleet;

impl Fleet {
    /// Seconds until room frees for the request with `ahead` waiters before it, among the
    /// backends `eligible`, each at most `cap` requests in flight per unit of weight.
    pub fn router_wait_s(&self, eligible: &[usize], cap: u64, ahead: usize) -> f64 {
        let now = since_epoch_ms(Instant::now());
        let per_backend: Vec<(Vec<u64>, usize)> = eligible
            .iter()
            .filter_map(|&i| self.backends.get(i))
            .map(|b| {
                let left = b.live.ends.lock().map_or_else(
                    |_| Vec::new(),
                    |ends| ends.iter().map(|&(_, e)| e.saturating_sub(now)).collect(),
                );
                let limit = cap.saturating_mul(u64::from(b.weight));
                (left, b.inflight().saturating_sub(limit) as usize)
            })
            .collect();
        nth_release_ms(per_backend, ahead) as f64 / 1000.0
    }
}

/// When the `n`-th (from 0) room frees, in ms from now, given each backend's requests' expected
/// ends (ms from now) and how many it is over its cap: a backend over its cap by `excess` frees
/// its first room at its `excess + 1`-th end, and one more at each end after. Past the rooms
/// the requests in flight free, rooms are assumed to keep freeing at the rate they do until
/// then (the requests placed meanwhile are like the ones before them). 0 when nothing is known.
fn nth_release_ms(per_backend: Vec<(Vec<u64>, usize)>, n: usize) -> u64 {
    let mut releases: Vec<u64> = Vec::new();
    for (mut ends, excess) in per_backend {
        ends.sort_unstable();
        releases.extend(ends.into_iter().skip(excess));
    }
    releases.sort_unstable();
    match (releases.get(n), releases.last()) {
        (Some(&at), _) => at,
        // n rooms past the known m, at the rate of the known ones: the m-th frees at `last`.
        (None, Some(&last)) => {
            let m = releases.len() as u64;
            last.max(1).saturating_mul(n as u64 + 1) / m
        }
        (None, None) => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rooms_free_in_order_of_the_requests_ends_past_each_backends_excess() {
        // Backend a is at its cap (excess 0): its first end frees a room. Backend b is one over
        // its cap (a reload lowered it): its first end only brings it back to the cap.
        let fleet = vec![(vec![300, 100], 0), (vec![50, 200, 400], 1)];
        assert_eq!(nth_release_ms(fleet.clone(), 0), 100);
        assert_eq!(nth_release_ms(fleet.clone(), 1), 200);
        assert_eq!(nth_release_ms(fleet.clone(), 2), 300);
        assert_eq!(nth_release_ms(fleet.clone(), 3), 400);
        // Past the four known rooms (the 4th at 400 ms: one a 100 ms), at the same rate.
        assert_eq!(nth_release_ms(fleet.clone(), 7), 800);
        assert_eq!(nth_release_ms(vec![], 3), 0);
        assert_eq!(nth_release_ms(vec![(vec![], 0)], 0), 0);
    }
}
