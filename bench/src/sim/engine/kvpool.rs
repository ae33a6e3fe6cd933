//! The engine's KV block pool, after vLLM's block manager.
//!
//! A pool of `total` blocks. A block held by a request is either *anonymous* (its content has
//! no reusable identity yet: partial prompt blocks, output blocks while decoding, duplicates)
//! or *hashed* (a full block named by its chained prefix hash, see `kvcache::block_hashes`).
//! Hashed blocks stay in the pool when their last holder lets go: they are then free for reuse
//! by a request with the same prefix, and evictable, least recently released first. Only
//! unreferenced blocks are ever evicted; when no block can be had, `allocate` says no and the
//! scheduler preempts.
//!
//! A finished request's output is named too (`release_finished`): vLLM keeps every full block
//! of prompt + output cached, and a chat client sends that output back as the prefix of its
//! next turn.
//!
//! With `record_changes`, the pool also keeps, in order, every change to its set of hashed
//! blocks (a block named, a block evicted), which the scheduler turns into vLLM's KV events.
//! Those two are the only changes the set ever sees: nothing else adds or drops a name.

use std::collections::{BTreeMap, HashMap};

/// A change to the pool's set of hashed blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolChange {
    Named(u64),
    Evicted(u64),
}

struct Entry {
    refs: u32,
    /// Key in `lru` while `refs == 0`.
    tick: u64,
}

pub struct KvPool {
    total: usize,
    hashed: HashMap<u64, Entry>,
    /// Unreferenced hashed blocks by release tick, oldest first.
    lru: BTreeMap<u64, u64>,
    tick: u64,
    /// Referenced blocks: anonymous ones plus hashed ones with `refs > 0`.
    used: usize,
    /// Changes not yet taken, in order; None unless `record_changes` was called.
    changes: Option<Vec<PoolChange>>,
}

impl KvPool {
    pub fn new(total: usize) -> Self {
        Self {
            total: total.max(1),
            hashed: HashMap::new(),
            lru: BTreeMap::new(),
            tick: 0,
            used: 0,
            changes: None,
        }
    }

    /// Starts keeping the changes `take_changes` returns.
    pub fn record_changes(&mut self) {
        self.changes.get_or_insert_with(Vec::new);
    }

    /// The changes since the last call, oldest first (empty when not recording).
    pub fn take_changes(&mut self) -> Vec<PoolChange> {
        self.changes
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    fn note(&mut self, change: PoolChange) {
        if let Some(changes) = &mut self.changes {
            changes.push(change);
        }
    }

    /// Every hashed block, referenced or not (what a consumer of the events should hold).
    #[cfg(test)]
    pub fn hashed_blocks(&self) -> std::collections::HashSet<u64> {
        self.hashed.keys().copied().collect()
    }

    /// Blocks held by requests (what vLLM's `kv_cache_usage_perc` counts).
    pub fn used(&self) -> usize {
        self.used
    }

    /// Blocks that hold a reusable prefix, referenced or not.
    pub fn cached(&self) -> usize {
        self.hashed.len()
    }

    /// Number of leading `hashes` present in the pool.
    pub fn lookup(&self, hashes: &[u64]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.hashed.contains_key(h))
            .count()
    }

    /// Takes a reference on each of `hashes`, which `lookup` just found: a reused block leaves
    /// the eviction order, so allocating right after cannot evict it.
    pub fn acquire(&mut self, hashes: &[u64]) {
        for h in hashes {
            if let Some(e) = self.hashed.get_mut(h) {
                if e.refs == 0 {
                    self.lru.remove(&e.tick);
                    self.used += 1;
                }
                e.refs += 1;
            }
        }
    }

    /// Takes `n` anonymous blocks, evicting unreferenced cached blocks as needed; false (and no
    /// change) when fewer than `n` blocks are unreferenced.
    pub fn allocate(&mut self, n: usize) -> bool {
        if self.total - self.used < n {
            return false;
        }
        while self.total - self.used - self.lru.len() < n {
            match self.lru.pop_first() {
                Some((_, h)) => {
                    self.hashed.remove(&h);
                    self.note(PoolChange::Evicted(h));
                }
                None => return false,
            }
        }
        self.used += n;
        true
    }

    /// Gives one of the caller's anonymous blocks the identity `hash` now that it is computed.
    /// False when the pool already has that block (a concurrent request computed the same
    /// prefix): the caller's copy stays anonymous, as vLLM keeps such duplicates uncached.
    pub fn promote(&mut self, hash: u64) -> bool {
        if self.hashed.contains_key(&hash) {
            return false;
        }
        self.hashed.insert(hash, Entry { refs: 1, tick: 0 });
        self.note(PoolChange::Named(hash));
        true
    }

    /// Drops a finished request's blocks after naming its output: block `from + k` becomes
    /// `names[k]`, the chained hashes of the stream the next turn will send (prompt + reply).
    ///
    /// The stand-in tokenizer counts the reply's text as more tokens than the engine generated
    /// (`" tok17"` is one generated token but 6 bytes), so `names` can outrun the blocks held:
    /// the rest are allocated here, evicting older cached blocks, so that the next turn finds
    /// as many blocks as its own prompt count says the reply takes. That stops at the first
    /// block that cannot be had, since nothing past a hole in the chain is reachable. A name
    /// the pool already has (a concurrent identical request) is held rather than duplicated,
    /// which also keeps it from being evicted by the allocations after it.
    pub fn release_finished(&mut self, held: Vec<Option<u64>>, from: usize, names: &[u64]) {
        let held = self.name_into(held, from, names);
        self.release(&held);
    }

    /// Brings in blocks computed elsewhere (a P/D transfer), as `release_finished` names a
    /// reply's: each of `names` in turn is referenced if the pool has it, else allocated
    /// (evicting unreferenced blocks) and named, stopping at the first that cannot be had.
    /// Unlike there, the blocks stay referenced (returned, for `release`) until the request
    /// they were brought in for is admitted and takes its own references.
    pub fn import(&mut self, names: &[u64]) -> Vec<Option<u64>> {
        self.name_into(Vec::new(), 0, names)
    }

    /// The naming of `release_finished` and `import`: block `from + k` of `held` becomes
    /// `names[k]`, allocated past the end of `held`; returns `held`, every block referenced.
    fn name_into(
        &mut self,
        mut held: Vec<Option<u64>>,
        from: usize,
        names: &[u64],
    ) -> Vec<Option<u64>> {
        for (j, &h) in (from..).zip(names) {
            if j > held.len() {
                break;
            }
            let ours = held.get(j).copied();
            if matches!(ours, Some(Some(_))) {
                continue;
            }
            let have = ours.is_some();
            if self.hashed.contains_key(&h) {
                self.acquire(&[h]);
                if have {
                    self.used -= 1;
                }
            } else if have || self.allocate(1) {
                self.hashed.insert(h, Entry { refs: 1, tick: 0 });
                self.note(PoolChange::Named(h));
            } else {
                break;
            }
            if have {
                held[j] = Some(h);
            } else {
                held.push(Some(h));
            }
        }
        held
    }

    /// Drops a request's blocks (`None` = anonymous). Released in reverse so that a prompt's
    /// tail is evicted before its head: the head is what later requests share.
    pub fn release(&mut self, held: &[Option<u64>]) {
        for block in held.iter().rev() {
            match block {
                None => self.used -= 1,
                Some(h) => {
                    if let Some(e) = self.hashed.get_mut(h) {
                        e.refs -= 1;
                        if e.refs == 0 {
                            self.tick += 1;
                            e.tick = self.tick;
                            self.lru.insert(self.tick, *h);
                            self.used -= 1;
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn released_prefix_is_reused_then_evicted_lru_tail_first() {
        let mut pool = KvPool::new(6);
        assert!(pool.allocate(4));
        for h in [1, 2, 3] {
            assert!(pool.promote(h));
        }
        assert_eq!(pool.used(), 4);
        pool.release(&[Some(1), Some(2), Some(3), None]);
        assert_eq!((pool.used(), pool.cached()), (0, 3));
        assert_eq!(pool.lookup(&[1, 2, 3, 4]), 3);

        // Reuse the head: it cannot be evicted while held.
        pool.acquire(&[1]);
        assert!(pool.allocate(5));
        assert_eq!(pool.lookup(&[1, 2, 3]), 1);
        assert_eq!(pool.used(), 6);
        assert!(!pool.allocate(1));
        pool.release(&[Some(1)]);
        assert!(pool.allocate(1));
        assert_eq!(pool.lookup(&[1]), 0);
    }

    #[test]
    fn tail_goes_before_head() {
        let mut pool = KvPool::new(4);
        assert!(pool.allocate(3));
        for h in [10, 11, 12] {
            pool.promote(h);
        }
        pool.release(&[Some(10), Some(11), Some(12)]);
        assert!(pool.allocate(2));
        assert_eq!(pool.lookup(&[10, 11, 12]), 2);
    }

    #[test]
    fn finished_output_is_cached_and_evictable() {
        let mut pool = KvPool::new(6);
        // A request with one prompt block (1) and two output blocks; its reply names three.
        assert!(pool.allocate(3));
        assert!(pool.promote(1));
        pool.release_finished(vec![Some(1), None, None], 1, &[2, 3, 4]);
        assert_eq!((pool.used(), pool.cached()), (0, 4));
        assert_eq!(pool.lookup(&[1, 2, 3, 4, 5]), 4);
        // Unreferenced, so evictable: the tail goes first.
        assert!(pool.allocate(3));
        assert_eq!(pool.lookup(&[1, 2, 3, 4]), 3);
        assert!(pool.allocate(2));
        assert_eq!(pool.lookup(&[1, 2, 3, 4]), 1);
        assert_eq!(pool.used(), 5);
    }

    #[test]
    fn finished_output_shares_and_stops_when_full() {
        let mut pool = KvPool::new(4);
        assert!(pool.allocate(2));
        pool.release_finished(vec![None, None], 0, &[1, 2]);
        assert_eq!((pool.used(), pool.cached()), (0, 2));
        // A second stream that starts like the first and then diverges, while a running
        // request holds block 2: the pool's 1 replaces this request's copy, 9 is named in
        // place, 3 gets the last free block and 4 finds none.
        assert!(pool.allocate(2));
        pool.acquire(&[2]);
        assert_eq!(pool.used(), 3);
        pool.release_finished(vec![None, None], 0, &[1, 9, 3, 4]);
        assert_eq!(pool.used(), 1);
        assert_eq!(pool.lookup(&[1, 9, 3, 4]), 3);
        assert_eq!(pool.cached(), 4);
        pool.release(&[Some(2)]);
        assert_eq!((pool.used(), pool.cached()), (0, 4));
    }

    #[test]
    fn changes_are_the_named_set_in_order() {
        let mut pool = KvPool::new(3);
        assert!(pool.allocate(2));
        assert!(pool.promote(1));
        assert!(pool.take_changes().is_empty(), "not recording yet");
        pool.record_changes();
        assert!(pool.promote(2));
        assert!(!pool.promote(2));
        // Reply blocks named on release: 3 in a held block, 4 in a newly allocated one.
        pool.release_finished(vec![Some(1), None], 1, &[2, 3, 4]);
        pool.acquire(&[1]);
        assert!(pool.allocate(2));
        use PoolChange::{Evicted, Named};
        assert_eq!(
            pool.take_changes(),
            [Named(2), Named(3), Named(4), Evicted(4), Evicted(3)]
        );
        assert!(pool.take_changes().is_empty());
        assert_eq!(pool.hashed_blocks(), [1, 2].into());
    }

    /// A transfer's blocks: named (or shared, when the pool has them), referenced until the
    /// caller lets go, then cached like any released prefix; a full pool stops the chain.
    #[test]
    fn import_names_and_holds_until_released() {
        let mut pool = KvPool::new(4);
        assert!(pool.allocate(1));
        assert!(pool.promote(1));
        pool.release(&[Some(1)]);
        pool.record_changes();
        let held = pool.import(&[1, 2, 3]);
        assert_eq!(held, [Some(1), Some(2), Some(3)]);
        assert_eq!((pool.used(), pool.cached()), (3, 3));
        assert_eq!(
            pool.take_changes(),
            [PoolChange::Named(2), PoolChange::Named(3)]
        );
        // Referenced, so not evictable: one block is left, and the chain stops there.
        assert!(!pool.allocate(2));
        assert_eq!(pool.import(&[7, 8]), [Some(7)]);
        pool.release(&held);
        pool.release(&[Some(7)]);
        assert_eq!((pool.used(), pool.lookup(&[1, 2, 3])), (0, 3));
    }

    #[test]
    fn duplicate_stays_anonymous() {
        let mut pool = KvPool::new(4);
        assert!(pool.allocate(2));
        assert!(pool.promote(7));
        assert!(!pool.promote(7));
        pool.release(&[Some(7), None]);
        assert_eq!((pool.used(), pool.cached()), (0, 1));
    }
}
