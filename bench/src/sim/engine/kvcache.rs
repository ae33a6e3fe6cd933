//! The engine's prefix cache, v1: which 16-token blocks of past prompts (and the replies that
//! followed them, see `continued_hashes`) a server still holds.
//!
//! A block is 64 bytes of canonical prompt (16 stand-in tokens). Its hash is chained,
//! `hash_i = xxh3_64_with_seed(block_i, hash_{i-1})` with `hash_{-1} = 0`, so a block's hash
//! names the whole prefix up to it and a lookup can stop at the first miss. Only full blocks are
//! cached, as in vLLM. The set is bounded by the KV pool's size and evicts least recently used
//! blocks. Later work grows this into the full pool (reference counts held by running requests,
//! preemption); the API below is the part the serving code depends on.
//!
//! P/D disaggregation pins blocks here (`pin`) as the engine's pool references them: a pinned
//! block still counts against the capacity and still hits, but leaves the LRU order, so it is
//! never evicted, until `unpin` puts it back as the most recently used.

use std::collections::{HashMap, VecDeque};

pub const BLOCK_TOKENS: u64 = 16;
pub const BLOCK_BYTES: usize = 64;

/// Chained hashes of every full block of `canonical` (no salt).
#[cfg(test)]
pub fn block_hashes(canonical: &[u8]) -> Vec<u64> {
    seeded_block_hashes(canonical, 0)
}

/// The chain of a request with a `cache_salt` starts from its seed (`salt_seed`) instead of
/// 0, so it shares no block with another salt's or an unsalted prompt, as on vLLM.
pub fn seeded_block_hashes(canonical: &[u8], seed: u64) -> Vec<u64> {
    let mut prev = seed;
    canonical
        .chunks_exact(BLOCK_BYTES)
        .map(|block| {
            prev = xxhash_rust::xxh3::xxh3_64_with_seed(block, prev);
            prev
        })
        .collect()
}

/// The seed of a salted request's chain (0: no salt).
pub fn salt_seed(salt: Option<&str>) -> u64 {
    salt.map_or(0, |s| xxhash_rust::xxh3::xxh3_64(s.as_bytes()) | 1)
}

/// Hashes of the full blocks past `hashes` (= `seeded_block_hashes(canonical, seed)`) of
/// `canonical` followed by the `appended` pieces, continuing the chain: a request's reply
/// extends its prompt's stream. Only the prompt's last partial block is rehashed, and the
/// appended text is never held whole, so a long reply costs one block of memory besides the
/// result.
pub fn continued_hashes<I, B>(canonical: &[u8], hashes: &[u64], seed: u64, appended: I) -> Vec<u64>
where
    I: IntoIterator<Item = B>,
    B: AsRef<[u8]>,
{
    let start = (hashes.len() * BLOCK_BYTES).min(canonical.len());
    let mut prev = hashes.last().copied().unwrap_or(seed);
    let mut pending: Vec<u8> = Vec::with_capacity(2 * BLOCK_BYTES);
    let mut out = Vec::new();
    let mut feed = |bytes: &[u8], pending: &mut Vec<u8>| {
        pending.extend_from_slice(bytes);
        let full = pending.len() / BLOCK_BYTES * BLOCK_BYTES;
        for block in pending[..full].chunks_exact(BLOCK_BYTES) {
            prev = xxhash_rust::xxh3::xxh3_64_with_seed(block, prev);
            out.push(prev);
        }
        pending.drain(..full);
    };
    feed(&canonical[start..], &mut pending);
    for piece in appended {
        feed(piece.as_ref(), &mut pending);
    }
    out
}

pub struct KvCache {
    capacity_blocks: usize,
    /// Block hash -> tick of its last use.
    last_use: HashMap<u64, u64>,
    /// Uses in tick order; an entry is stale when `last_use` holds a newer tick for its hash.
    /// Lazy deletion keeps touch O(1); `compact` bounds the garbage.
    order: VecDeque<(u64, u64)>,
    tick: u64,
    /// Pinned blocks (not in `last_use`) and how many pins each has.
    pinned: HashMap<u64, u32>,
}

impl KvCache {
    pub fn new(capacity_blocks: usize) -> Self {
        Self {
            capacity_blocks: capacity_blocks.max(1),
            last_use: HashMap::new(),
            order: VecDeque::new(),
            tick: 0,
            pinned: HashMap::new(),
        }
    }

    fn contains(&self, h: &u64) -> bool {
        self.last_use.contains_key(h) || self.pinned.contains_key(h)
    }

    /// Number of leading blocks of `hashes` already cached, without touching them.
    pub fn lookup(&self, hashes: &[u64]) -> usize {
        hashes.iter().take_while(|h| self.contains(h)).count()
    }

    /// Number of leading blocks of `hashes` already cached; those blocks count as used now.
    pub fn match_prefix(&mut self, hashes: &[u64]) -> usize {
        let hit = self.lookup(hashes);
        self.touch_all(&hashes[..hit]);
        hit
    }

    /// Records that the blocks were computed (prefilled), evicting the least recently used
    /// blocks past capacity.
    pub fn insert(&mut self, hashes: &[u64]) {
        self.touch_all(hashes);
        self.shrink_to_capacity();
    }

    fn shrink_to_capacity(&mut self) {
        while self.len() > self.capacity_blocks && self.evict_one() {}
        if self.order.len() > 2 * self.capacity_blocks + 1024 {
            self.compact();
        }
    }

    /// Blocks cached, pinned or not.
    pub fn len(&self) -> usize {
        self.last_use.len() + self.pinned.len()
    }

    /// Pins the leading cached blocks of `hashes` and returns them: they stay until `unpin`.
    pub fn pin(&mut self, hashes: &[u64]) -> Vec<u64> {
        let n = self.lookup(hashes);
        for &h in &hashes[..n] {
            // Its entries in `order` go stale, as after a touch.
            self.last_use.remove(&h);
            *self.pinned.entry(h).or_insert(0) += 1;
        }
        hashes[..n].to_vec()
    }

    /// Drops one pin from each of `hashes` (as `pin` returned them); a block with none left
    /// is the most recently used again, its prefix's head most recent of all.
    pub fn unpin(&mut self, hashes: &[u64]) {
        let mut free = Vec::with_capacity(hashes.len());
        for h in hashes {
            if let Some(n) = self.pinned.get_mut(h) {
                *n -= 1;
                if *n == 0 {
                    self.pinned.remove(h);
                    free.push(*h);
                }
            }
        }
        self.touch_all(&free);
        self.shrink_to_capacity();
    }

    /// Touches the tail first so a prompt's first blocks are the most recent: when eviction
    /// reaches this prompt it drops the tail, and the prefix that later requests share survives
    /// (vLLM frees a request's blocks in reverse order for the same reason).
    fn touch_all(&mut self, hashes: &[u64]) {
        for &h in hashes.iter().rev() {
            if self.pinned.contains_key(&h) {
                continue;
            }
            self.tick += 1;
            self.last_use.insert(h, self.tick);
            self.order.push_back((h, self.tick));
        }
    }

    /// False when nothing is left to evict (every cached block is pinned).
    fn evict_one(&mut self) -> bool {
        while let Some((h, tick)) = self.order.pop_front() {
            if self.last_use.get(&h) == Some(&tick) {
                self.last_use.remove(&h);
                return true;
            }
        }
        false
    }

    fn compact(&mut self) {
        let mut live: Vec<(u64, u64)> = self.last_use.iter().map(|(&h, &t)| (h, t)).collect();
        live.sort_unstable_by_key(|&(_, t)| t);
        self.order = live.into_iter().collect();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(n: usize, seed: u8) -> Vec<u8> {
        (0..n)
            .map(|i| b'a' + ((i + seed as usize) % 26) as u8)
            .collect()
    }

    #[test]
    fn hashes_are_chained_and_full_blocks_only() {
        let a = text(64 * 3 + 10, 0);
        let h = block_hashes(&a);
        assert_eq!(h.len(), 3);
        assert_eq!(h[0], xxhash_rust::xxh3::xxh3_64_with_seed(&a[..64], 0));
        assert_eq!(
            h[1],
            xxhash_rust::xxh3::xxh3_64_with_seed(&a[64..128], h[0])
        );
        // The same block content after a different prefix hashes differently.
        let mut b = text(64, 5);
        b.extend_from_slice(&a[64..128]);
        assert_ne!(block_hashes(&b)[1], h[1]);
    }

    #[test]
    fn continued_hashes_extend_the_chain() {
        let prompt = text(64 * 3 + 10, 0);
        let reply = text(150, 7);
        let mut whole = prompt.clone();
        whole.extend_from_slice(&reply);
        whole.extend_from_slice(b"<end>");
        let h = block_hashes(&prompt);
        let more = continued_hashes(&prompt, &h, 0, [&reply[..20], &reply[20..], &b"<end>"[..]]);
        let all = block_hashes(&whole);
        assert_eq!(all.len(), 5);
        assert_eq!(&all[..3], &h[..]);
        assert_eq!(&all[3..], &more[..]);
        assert!(continued_hashes(&prompt, &h, 0, [b""]).is_empty());
    }

    #[test]
    fn repeated_prompt_is_fully_cached() {
        let mut kv = KvCache::new(1000);
        let h = block_hashes(&text(64 * 5 + 3, 0));
        assert_eq!(kv.match_prefix(&h), 0);
        kv.insert(&h);
        assert_eq!(kv.match_prefix(&h) as u64 * BLOCK_TOKENS, 80);
    }

    #[test]
    fn extended_prompt_hits_its_prefix() {
        let mut kv = KvCache::new(1000);
        let first = text(64 * 4 + 20, 0);
        kv.insert(&block_hashes(&first));
        let mut longer = first.clone();
        longer.extend_from_slice(&text(200, 3));
        let h = block_hashes(&longer);
        assert_eq!(h.len(), 7);
        assert_eq!(kv.match_prefix(&h), 4);
        // A prompt that diverges in its first block shares nothing.
        assert_eq!(kv.match_prefix(&block_hashes(&text(64 * 4, 1))), 0);
    }

    #[test]
    fn pinned_blocks_hit_count_and_outlive_eviction_until_unpinned() {
        let mut kv = KvCache::new(4);
        let a = block_hashes(&text(64 * 3, 0));
        kv.insert(&a);
        assert_eq!(kv.pin(&a[..2]), a[..2]);
        assert_eq!(kv.pin(&a[..2]), a[..2], "two holds of one prefix");
        // Past capacity: only unpinned blocks go, even those used after the pinned ones.
        for i in 1..20u8 {
            kv.insert(&block_hashes(&text(64 * 3, i)));
        }
        assert_eq!((kv.len(), kv.lookup(&a)), (4, 2));
        kv.unpin(&a[..2]);
        assert_eq!(kv.match_prefix(&a), 2, "one pin left");
        kv.unpin(&a[..2]);
        // Unpinned, the prefix is the most recent: the next insert evicts older blocks first.
        kv.insert(&block_hashes(&text(64, 99)));
        assert_eq!(kv.lookup(&a), 2);
        for i in 1..=10u8 {
            kv.insert(&block_hashes(&text(64 * 2, i)));
        }
        assert_eq!(kv.lookup(&a), 0);
        assert_eq!(kv.len(), 4);
        // A pinned cache over capacity gives back what it can and no more.
        let mut full = KvCache::new(2);
        let b = block_hashes(&text(64 * 2, 1));
        full.insert(&b);
        full.pin(&b);
        full.insert(&block_hashes(&text(64, 2)));
        assert_eq!((full.len(), full.lookup(&b)), (2, 2));
    }

    #[test]
    fn bounded_with_lru_eviction_keeping_prefixes() {
        let mut kv = KvCache::new(8);
        let a = block_hashes(&text(64 * 4, 0));
        let b = block_hashes(&text(64 * 4, 1));
        kv.insert(&a);
        kv.insert(&b);
        assert_eq!(kv.match_prefix(&a), 4); // a is now the most recent
        let c = block_hashes(&text(64 * 2, 2));
        kv.insert(&c);
        assert_eq!(kv.len(), 8);
        // b lost its tail, not its head.
        assert_eq!(kv.match_prefix(&b), 2);
        assert_eq!(kv.match_prefix(&a), 4);
        for i in 0..200u8 {
            kv.insert(&block_hashes(&text(64 * 3, i)));
        }
        assert_eq!(kv.len(), 8);
        assert!(kv.order.len() <= 2 * 8 + 1024 + 3);
    }
}
