//! Prefix index: what the router believes each backend holds in its KV cache.
//!
//! Per backend, an LRU set of the block hashes the router sent it, bounded by that backend's KV
//! capacity in blocks; plus a reverse map `hash -> backends` so one pass over a request's
//! blocks finds every backend's longest cached prefix. It is a belief (optimistic: the router
//! believes what it routed), corrected later by engine telemetry and KV events.
//!
//! Memory: block hashes are already uniformly distributed (xxh3), so the maps use them as their
//! own hash. One tracked (backend, block) pair costs a node (16 B) and an LRU map entry (~19 B
//! with hashbrown's control byte and load factor); the reverse map adds ~19 B per distinct
//! block. `bytes()` reports the allocation.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// Backends an index can track: owners are a 64-bit mask.
pub use crate::config::MAX_INDEXED_BACKENDS as MAX_BACKENDS;

/// Identity hasher for keys that are already hashes.
#[derive(Default)]
pub struct IdentityHasher(u64);

impl Hasher for IdentityHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Only u64 keys are used; fold anything else so the hasher stays total.
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

pub(crate) type IdMap<V> = HashMap<u64, V, BuildHasherDefault<IdentityHasher>>;

const NIL: u32 = u32::MAX;

#[derive(Clone, Copy)]
struct Node {
    hash: u64,
    prev: u32,
    next: u32,
}

/// One backend's blocks in LRU order (an intrusive list over a slab).
struct Lru {
    capacity: usize,
    slot_of: IdMap<u32>,
    nodes: Vec<Node>,
    free: Vec<u32>,
    /// Most recently used.
    head: u32,
    /// Least recently used: evicted first.
    tail: u32,
}

impl Lru {
    fn new(capacity: usize) -> Lru {
        Lru {
            capacity,
            slot_of: IdMap::default(),
            nodes: Vec::new(),
            free: Vec::new(),
            head: NIL,
            tail: NIL,
        }
    }

    fn len(&self) -> usize {
        self.slot_of.len()
    }

    fn unlink(&mut self, i: u32) {
        let Node { prev, next, .. } = self.nodes[i as usize];
        match prev {
            NIL => self.head = next,
            p => self.nodes[p as usize].next = next,
        }
        match next {
            NIL => self.tail = prev,
            n => self.nodes[n as usize].prev = prev,
        }
    }

    fn push_front(&mut self, i: u32) {
        self.nodes[i as usize].prev = NIL;
        self.nodes[i as usize].next = self.head;
        if self.head != NIL {
            self.nodes[self.head as usize].prev = i;
        }
        self.head = i;
        if self.tail == NIL {
            self.tail = i;
        }
    }

    /// Mark `hash` most recent; returns true if it was new.
    fn touch(&mut self, hash: u64) -> bool {
        if let Some(&i) = self.slot_of.get(&hash) {
            if self.head != i {
                self.unlink(i);
                self.push_front(i);
            }
            return false;
        }
        let node = Node {
            hash,
            prev: NIL,
            next: NIL,
        };
        let i = match self.free.pop() {
            Some(i) => {
                self.nodes[i as usize] = node;
                i
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        };
        self.slot_of.insert(hash, i);
        self.push_front(i);
        true
    }

    fn pop_lru(&mut self) -> Option<u64> {
        let i = self.tail;
        if i == NIL {
            return None;
        }
        self.unlink(i);
        self.free.push(i);
        let hash = self.nodes[i as usize].hash;
        self.slot_of.remove(&hash);
        Some(hash)
    }

    fn bytes(&self) -> usize {
        // hashbrown: key + value per bucket plus one control byte.
        self.slot_of.capacity() * (8 + 4 + 1)
            + self.nodes.capacity() * std::mem::size_of::<Node>()
            + self.free.capacity() * 4
    }
}

pub struct PrefixIndex {
    owners: IdMap<u64>,
    lrus: Vec<Lru>,
}

impl PrefixIndex {
    /// One slot per backend, with its capacity in blocks.
    pub fn new(capacities: &[usize]) -> PrefixIndex {
        PrefixIndex {
            owners: IdMap::default(),
            lrus: capacities
                .iter()
                .take(MAX_BACKENDS)
                .map(|&c| Lru::new(c))
                .collect(),
        }
    }

    pub fn slots(&self) -> usize {
        self.lrus.len()
    }

    /// Record that `slot` was sent `blocks` (a request's chained prefix hashes). The first
    /// blocks become the most recent, so a backend that must forget forgets suffixes first, as
    /// an engine does.
    pub fn insert(&mut self, slot: usize, blocks: &[u64]) {
        let Some(lru) = self.lrus.get_mut(slot) else {
            return;
        };
        let bit = 1u64 << slot;
        for &h in blocks.iter().rev() {
            if lru.touch(h) {
                *self.owners.entry(h).or_insert(0) |= bit;
            }
        }
        while lru.len() > lru.capacity {
            let Some(old) = lru.pop_lru() else { break };
            if let Some(mask) = self.owners.get_mut(&old) {
                *mask &= !bit;
                if *mask == 0 {
                    self.owners.remove(&old);
                }
            }
        }
    }

    /// For every slot, how many leading `blocks` it holds, written to `out[slot]` (one pass,
    /// stopping once no backend matches).
    pub fn longest_matches(&self, blocks: &[u64], out: &mut [u32]) {
        let n = self.lrus.len().min(out.len());
        out[..n].iter_mut().for_each(|m| *m = 0);
        let mut alive: u64 = if n == 64 { u64::MAX } else { (1u64 << n) - 1 };
        for (i, h) in blocks.iter().enumerate() {
            let held = self.owners.get(h).copied().unwrap_or(0) & alive;
            let mut dropped = alive & !held;
            while dropped != 0 {
                let b = dropped.trailing_zeros() as usize;
                out[b] = i as u32;
                dropped &= dropped - 1;
            }
            alive = held;
            if alive == 0 {
                return;
            }
        }
        while alive != 0 {
            let b = alive.trailing_zeros() as usize;
            out[b] = blocks.len() as u32;
            alive &= alive - 1;
        }
    }

    /// Forget everything about `slot` (backend removed or its cache known lost).
    pub fn purge(&mut self, slot: usize) {
        let Some(lru) = self.lrus.get_mut(slot) else {
            return;
        };
        let cap = lru.capacity;
        let bit = 1u64 << slot;
        while let Some(h) = lru.pop_lru() {
            if let Some(mask) = self.owners.get_mut(&h) {
                *mask &= !bit;
                if *mask == 0 {
                    self.owners.remove(&h);
                }
            }
        }
        *lru = Lru::new(cap);
    }

    /// Make `slot` an empty backend of `capacity` blocks, adding slots up to it if needed.
    /// Slots past [`MAX_BACKENDS`] are not tracked.
    pub fn open_slot(&mut self, slot: usize, capacity: usize) {
        if slot >= MAX_BACKENDS {
            return;
        }
        while self.lrus.len() <= slot {
            self.lrus.push(Lru::new(1));
        }
        self.purge(slot);
        self.lrus[slot].capacity = capacity;
    }

    pub fn set_capacity(&mut self, slot: usize, capacity: usize) {
        if let Some(lru) = self.lrus.get_mut(slot) {
            lru.capacity = capacity;
        }
        // Shrinking takes effect at the next insert on that slot.
    }

    /// Tracked (backend, block) pairs.
    pub fn blocks(&self) -> usize {
        self.lrus.iter().map(Lru::len).sum()
    }

    pub fn blocks_of(&self, slot: usize) -> usize {
        self.lrus.get(slot).map_or(0, Lru::len)
    }

    /// Heap bytes held by the index.
    pub fn bytes(&self) -> usize {
        self.owners.capacity() * (8 + 8 + 1) + self.lrus.iter().map(Lru::bytes).sum::<usize>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn seq(start: u64, n: u64) -> Vec<u64> {
        (start..start + n)
            .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
            .collect()
    }

    #[test]
    fn longest_prefix_per_backend() {
        let mut idx = PrefixIndex::new(&[100, 100, 100]);
        let conv = seq(1, 10);
        idx.insert(0, &conv[..4]);
        idx.insert(1, &conv[..8]);
        let mut out = [0u32; 3];
        idx.longest_matches(&conv, &mut out);
        assert_eq!(out, [4, 8, 0]);
        // A different request sharing only the first block.
        let mut other = seq(100, 5);
        other[0] = conv[0];
        idx.longest_matches(&other, &mut out);
        assert_eq!(out, [1, 1, 0]);
    }

    #[test]
    fn capacity_bounds_blocks_and_evicts_suffix_first() {
        let mut idx = PrefixIndex::new(&[6]);
        let a = seq(1, 4);
        let b = seq(50, 4);
        idx.insert(0, &a);
        idx.insert(0, &b);
        assert_eq!(idx.blocks(), 6);
        let mut out = [0u32; 1];
        // b is newer and whole; a lost its last two blocks, not its first.
        idx.longest_matches(&b, &mut out);
        assert_eq!(out[0], 4);
        idx.longest_matches(&a, &mut out);
        assert_eq!(out[0], 2);
    }

    #[test]
    fn purge_forgets_one_backend_only() {
        let mut idx = PrefixIndex::new(&[10, 10]);
        let a = seq(1, 5);
        idx.insert(0, &a);
        idx.insert(1, &a);
        idx.purge(0);
        let mut out = [0u32; 2];
        idx.longest_matches(&a, &mut out);
        assert_eq!(out, [0, 5]);
        assert_eq!(idx.blocks(), 5);
        idx.purge(1);
        assert_eq!(idx.blocks(), 0);
        assert!(idx.owners.is_empty());
    }

    #[test]
    fn memory_per_block_is_bounded() {
        let per_backend = 20_000;
        let mut idx = PrefixIndex::new(&vec![per_backend; 50]);
        for slot in 0..50 {
            for r in 0..(per_backend as u64 / 50) {
                idx.insert(slot, &seq((slot as u64) << 32 | r << 8, 50));
            }
        }
        assert_eq!(idx.blocks(), 1_000_000);
        let per_block = idx.bytes() as f64 / idx.blocks() as f64;
        assert!(per_block < 100.0, "{per_block:.1} bytes per block");
    }

    proptest! {
        /// Against a naive model: every slot holds at most its capacity, and the index answers
        /// longest matches exactly as a per-backend set of the most recent blocks would.
        #[test]
        fn matches_a_naive_model(ops in proptest::collection::vec((0usize..3, 0u64..6, 1u64..6), 1..60)) {
            let caps = [5usize, 8, 12];
            let mut idx = PrefixIndex::new(&caps);
            let mut model: Vec<Vec<u64>> = vec![Vec::new(); 3]; // most recent last
            for (slot, conv, len) in ops {
                let blocks = seq(conv * 1000, len);
                idx.insert(slot, &blocks);
                let m = &mut model[slot];
                for h in blocks.iter().rev() {
                    m.retain(|x| x != h);
                    m.push(*h);
                }
                while m.len() > caps[slot] {
                    m.remove(0);
                }
                for (s, m) in model.iter().enumerate() {
                    prop_assert_eq!(idx.blocks_of(s), m.len());
                }
                for probe in 0..6u64 {
                    let q = seq(probe * 1000, 6);
                    let mut out = [0u32; 3];
                    idx.longest_matches(&q, &mut out);
                    for (s, m) in model.iter().enumerate() {
                        let want = q.iter().take_while(|h| m.contains(h)).count() as u32;
                        prop_assert_eq!(out[s], want);
                    }
                }
            }
        }
    }
}
