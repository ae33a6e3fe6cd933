//! The consistent-hashing ring and the bounded-load rule.
//!
//! The ring is Pingora's weighted Ketama (`pingora_load_balancing::selection::consistent`), built
//! over the configured backends. Walking it from a session key gives that key a stable order of
//! distinct backends: owner first, then its spill targets. Adding or removing a backend moves only
//! that backend's share of keys.

use pingora_load_balancing::selection::consistent::KetamaHashing;
use pingora_load_balancing::selection::{BackendIter, BackendSelection};
use pingora_load_balancing::Backend;
use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;

/// Ketama ring over backends identified by their index in the fleet's backend list.
pub struct Ring {
    ketama: Arc<KetamaHashing>,
    index_of: HashMap<SocketAddr, usize>,
    len: usize,
}

impl Ring {
    /// `backends`: `(addr, weight)` in fleet order; the index of each is what the walk yields.
    pub fn new(backends: &[(SocketAddr, u32)]) -> Ring {
        let set: BTreeSet<Backend> = backends
            .iter()
            .map(|(addr, w)| Backend {
                addr: pingora::protocols::l4::socket::SocketAddr::Inet(*addr),
                weight: *w as usize,
                ext: Default::default(),
            })
            .collect();
        let index_of = backends
            .iter()
            .enumerate()
            .map(|(i, (a, _))| (*a, i))
            .collect();
        Ring {
            ketama: Arc::new(KetamaHashing::build(&set)),
            index_of,
            len: backends.len(),
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Distinct backend indices in ring order from `key`'s point. `max` caps how many.
    pub fn walk(&self, key: u64, max: usize) -> RingWalk<'_> {
        RingWalk {
            iter: self.ketama.iter(&key.to_le_bytes()),
            ring: self,
            seen: 0,
            seen_big: if self.len > 128 {
                vec![0; self.len.div_ceil(64)]
            } else {
                Vec::new()
            },
            yielded: 0,
            max: max.min(self.len),
            // Ketama holds ~160 points per unit of weight; stop if distinct ones run out.
            budget: 160 * 64 * self.len.max(1),
        }
    }
}

/// Iterator over distinct backend indices along the ring.
pub struct RingWalk<'a> {
    iter: <KetamaHashing as BackendSelection>::Iter,
    ring: &'a Ring,
    /// Indices already yielded: a register for fleets up to 128 backends, a heap bitset above.
    seen: u128,
    seen_big: Vec<u64>,
    yielded: usize,
    max: usize,
    budget: usize,
}

impl Iterator for RingWalk<'_> {
    type Item = usize;

    fn next(&mut self) -> Option<usize> {
        while self.yielded < self.max && self.budget > 0 {
            self.budget -= 1;
            let b = self.iter.next()?;
            let pingora::protocols::l4::socket::SocketAddr::Inet(addr) = b.addr else {
                continue;
            };
            let Some(&idx) = self.ring.index_of.get(&addr) else {
                continue;
            };
            if self.seen_big.is_empty() {
                if self.seen & (1u128 << idx) != 0 {
                    continue;
                }
                self.seen |= 1u128 << idx;
            } else {
                let (word, bit) = (idx / 64, 1u64 << (idx % 64));
                if self.seen_big[word] & bit != 0 {
                    continue;
                }
                self.seen_big[word] |= bit;
            }
            self.yielded += 1;
            return Some(idx);
        }
        None
    }
}

/// The bounded-load capacity of one backend (Mirrokni, Thorup, Zadimoghaddam, SODA 2018):
/// `ceil((1 + epsilon) * (total_load + 1) * weight / total_weight) + slack`.
///
/// `total_load` counts requests already placed on eligible backends; the `+ 1` is the request
/// being placed, so the bound is never below one request for a backend of average weight.
/// Rounded up: a float bound at low concurrency would spill half of all requests.
pub fn capacity(total_load: u64, weight: u32, total_weight: u64, epsilon: f64, slack: u32) -> u64 {
    if total_weight == 0 {
        return slack as u64;
    }
    let fair = (total_load + 1) as f64 * weight as f64 / total_weight as f64;
    ((1.0 + epsilon) * fair).ceil() as u64 + slack as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn addrs(n: usize) -> Vec<(SocketAddr, u32)> {
        (0..n)
            .map(|i| (SocketAddr::from(([127, 0, 0, 1], 8000 + i as u16)), 1))
            .collect()
    }

    #[test]
    fn walk_visits_every_backend_once() {
        let ring = Ring::new(&addrs(8));
        for key in 0..200u64 {
            let order: Vec<usize> = ring.walk(key, usize::MAX).collect();
            let mut sorted = order.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, (0..8).collect::<Vec<_>>(), "key {key}");
        }
    }

    #[test]
    fn weights_shift_ownership() {
        let mut b = addrs(2);
        b[1].1 = 3;
        let ring = Ring::new(&b);
        let owned_by_1 = (0..4000u64)
            .filter(|k| ring.walk(k.wrapping_mul(0x9E37_79B9_7F4A_7C15), 1).next() == Some(1))
            .count();
        // Expect about 3/4.
        assert!((2600..3400).contains(&owned_by_1), "{owned_by_1}");
    }

    #[test]
    fn capacity_rounds_up_and_adds_slack() {
        assert_eq!(capacity(0, 1, 4, 0.5, 0), 1);
        assert_eq!(capacity(0, 1, 4, 0.5, 1), 2);
        assert_eq!(capacity(7, 1, 4, 0.5, 1), 4); // 1.5 * 2 = 3, +1
        assert_eq!(capacity(7, 2, 5, 0.0, 0), 4); // 8 * 2 / 5 = 3.2 -> 4
    }

    proptest! {
        #[test]
        fn removing_one_backend_moves_only_its_keys(n in 3usize..12, victim in 0usize..12, seed in any::<u64>()) {
            let victim = victim % n;
            let all = addrs(n);
            let full = Ring::new(&all);
            let mut rest = all.clone();
            rest.remove(victim);
            let smaller = Ring::new(&rest);
            for k in 0..300u64 {
                let key = seed ^ k.wrapping_mul(0x9E37_79B9_7F4A_7C15);
                let before = full.walk(key, 1).next().unwrap();
                let after_idx = smaller.walk(key, 1).next().unwrap();
                let after = all.iter().position(|a| a.0 == rest[after_idx].0).unwrap();
                if before != victim {
                    prop_assert_eq!(before, after);
                }
            }
        }
    }
}
