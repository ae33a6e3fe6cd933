//! Exact index: the blocks each backend's engine says it caches, from its KV events.
//!
//! Engines name blocks by their own hashes (over token ids, with seeds and extra keys kvroute
//! cannot reproduce), so every stored block is renamed into kvroute's own chain hash of its
//! token ids ([`chain`]), which kvroute computes the same way for a request's tokens. A table per
//! backend maps the engine's name to kvroute's, so a later block's `parent` and a
//! `BlockRemoved` resolve.
//!
//! A backend's knowledge is *synced* (every block the engine holds is known: its stream was
//! followed from the engine's start, or from a clear) or *partial* (followed from some later
//! point, so blocks stored before that are missing but nothing known is stale). Placement
//! trusts a synced backend's blocks alone and merges a partial one with the approximate index.
//!
//! Between dispatch and the engine's event for it, a request's blocks are *pending* on its
//! backend, at most for [`PENDING_TTL`], so a request right behind it finds them there. The
//! engine's `BlockStored` ends a block's pending time: from then on its events alone say
//! whether it is cached.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::index::{IdMap, MAX_BACKENDS};
pub use crate::request::engine_tokens::{chain, keyed_chain, root};

/// How long a dispatched request's blocks count as cached before the engine says so: longer
/// than a long prompt's queue and prefill on a busy engine.
pub const PENDING_TTL: Duration = Duration::from_secs(15);

/// Blocks one backend may report (16M tokens at 16 a block): far past any GPU's KV cache. A
/// stream past it is not an engine's and is dropped rather than grow without bound.
pub const MAX_BLOCKS_PER_BACKEND: usize = 1 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyncState {
    /// No event stream (not configured, or not connected yet).
    Off,
    /// Knows a subset of the engine's blocks, none stale.
    Partial,
    /// Knows every block the engine holds.
    Synced,
}

impl SyncState {
    pub fn as_str(self) -> &'static str {
        match self {
            SyncState::Off => "off",
            SyncState::Partial => "partial",
            SyncState::Synced => "synced",
        }
    }
}

/// What applying one event did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Applied {
    pub blocks_stored: usize,
    pub blocks_removed: usize,
    /// Stored blocks whose parent the index does not know (stored before it followed the
    /// engine): skipped, as their chain hash cannot be computed.
    pub unresolved: usize,
}

/// What a `BlockStored` event's blocks hold.
#[derive(Debug, Clone, Copy, Default)]
pub struct Stored<'a> {
    /// `block_size` tokens per block.
    pub tokens: &'a [u32],
    pub block_size: usize,
    /// The LoRA adapter they were computed for.
    pub lora: Option<&'a str>,
    /// Each block's extra key (see [`keyed_chain`]); empty when none has one.
    pub keys: &'a [u64],
}

impl<'a> Stored<'a> {
    pub fn tokens(tokens: &'a [u32], block_size: usize) -> Self {
        Stored {
            tokens,
            block_size,
            ..Stored::default()
        }
    }
}

struct Slot {
    sync: SyncState,
    /// Engine hash -> kvroute hash.
    names: IdMap<u64>,
    /// kvroute hash -> how many engine blocks name it.
    held: IdMap<u32>,
    pending: VecDeque<(Instant, Vec<u64>)>,
    pending_refs: IdMap<u32>,
}

impl Slot {
    fn new() -> Slot {
        Slot {
            sync: SyncState::Off,
            names: IdMap::default(),
            held: IdMap::default(),
            pending: VecDeque::new(),
            pending_refs: IdMap::default(),
        }
    }
}

pub struct ExactIndex {
    /// kvroute hash -> backends (bit per slot) holding it or having it pending.
    owners: IdMap<u64>,
    slots: Vec<Slot>,
}

impl Default for ExactIndex {
    fn default() -> Self {
        ExactIndex::new(0)
    }
}

impl ExactIndex {
    pub fn new(slots: usize) -> ExactIndex {
        ExactIndex {
            owners: IdMap::default(),
            slots: (0..slots.min(MAX_BACKENDS)).map(|_| Slot::new()).collect(),
        }
    }

    /// The owner map and `slot`'s state, adding slots up to it.
    fn slot_mut(&mut self, slot: usize) -> Option<(&mut IdMap<u64>, &mut Slot)> {
        if slot >= MAX_BACKENDS {
            return None;
        }
        while self.slots.len() <= slot {
            self.slots.push(Slot::new());
        }
        let ExactIndex { owners, slots } = self;
        slots.get_mut(slot).map(|s| (owners, s))
    }

    pub fn sync(&self, slot: usize) -> SyncState {
        self.slots.get(slot).map_or(SyncState::Off, |s| s.sync)
    }

    /// Blocks the engine of `slot` is known to hold.
    pub fn blocks_of(&self, slot: usize) -> usize {
        self.slots.get(slot).map_or(0, |s| s.names.len())
    }

    /// Forget `slot`'s blocks and set what is known of it from here on.
    pub fn reset(&mut self, slot: usize, sync: SyncState) {
        let Some((owners, s)) = self.slot_mut(slot) else {
            return;
        };
        let old = std::mem::replace(s, Slot::new());
        s.sync = sync;
        let bit = 1u64 << slot;
        for &h in old.held.keys().chain(old.pending_refs.keys()) {
            clear_bit(owners, h, bit);
        }
    }

    /// The engine of `slot` caches `engine_hashes` (in chain order after `parent`), holding
    /// `blocks`.
    pub fn stored(
        &mut self,
        slot: usize,
        engine_hashes: &[u64],
        parent: Option<u64>,
        blocks: Stored<'_>,
    ) -> Applied {
        let Stored {
            tokens,
            block_size,
            lora,
            keys,
        } = blocks;
        let bit = 1u64 << slot;
        let Some((owners, s)) = self.slot_mut(slot) else {
            return Applied::default();
        };
        let start = match parent {
            None => root(lora),
            Some(p) => match s.names.get(&p) {
                Some(&own) => own,
                None => {
                    return Applied {
                        unresolved: engine_hashes.len(),
                        ..Applied::default()
                    }
                }
            },
        };
        if s.names.len() + engine_hashes.len() > MAX_BLOCKS_PER_BACKEND {
            return Applied {
                unresolved: engine_hashes.len(),
                ..Applied::default()
            };
        }
        let own = keyed_chain(start, tokens, block_size, keys);
        let mut applied = Applied::default();
        for (&e, &o) in engine_hashes.iter().zip(&own) {
            // The engine renaming a block it holds: the old name goes.
            if let Some(prev) = s.names.insert(e, o) {
                if prev == o {
                    continue;
                }
                if release(&mut s.held, prev) && !s.pending_refs.contains_key(&prev) {
                    clear_bit(owners, prev, bit);
                }
            }
            *s.held.entry(o).or_insert(0) += 1;
            *owners.entry(o).or_insert(0) |= bit;
            // The engine has it: from here its events say how long it stays. Still counting
            // it as pending would outlive an early eviction under memory pressure.
            s.pending_refs.remove(&o);
            applied.blocks_stored += 1;
        }
        applied
    }

    /// The engine of `slot` evicted `engine_hashes`.
    pub fn removed(&mut self, slot: usize, engine_hashes: &[u64]) -> Applied {
        let bit = 1u64 << slot;
        let Some(s) = self.slots.get_mut(slot) else {
            return Applied::default();
        };
        let mut applied = Applied::default();
        for e in engine_hashes {
            let Some(own) = s.names.remove(e) else {
                continue;
            };
            applied.blocks_removed += 1;
            if release(&mut s.held, own) && !s.pending_refs.contains_key(&own) {
                clear_bit(&mut self.owners, own, bit);
            }
        }
        applied
    }

    /// kvroute sends `blocks` to `slot` now: count them there until [`PENDING_TTL`] passes.
    pub fn pending(&mut self, slot: usize, blocks: &[u64], now: Instant) {
        let bit = 1u64 << slot;
        self.expire(slot, now);
        let Some((owners, s)) = self.slot_mut(slot) else {
            return;
        };
        if blocks.is_empty() || s.sync == SyncState::Off {
            return;
        }
        // Blocks the engine already holds are its to account for: a reused block gets no
        // new event, so a pending claim on it would outlast its eviction.
        let new: Vec<u64> = blocks
            .iter()
            .copied()
            .filter(|h| !s.held.contains_key(h))
            .collect();
        for &h in &new {
            *s.pending_refs.entry(h).or_insert(0) += 1;
            *owners.entry(h).or_insert(0) |= bit;
        }
        if !new.is_empty() {
            s.pending.push_back((now + PENDING_TTL, new));
        }
    }

    /// Drop `slot`'s pending blocks whose time is up.
    pub fn expire(&mut self, slot: usize, now: Instant) {
        let bit = 1u64 << slot;
        let Some(s) = self.slots.get_mut(slot) else {
            return;
        };
        while s.pending.front().is_some_and(|(until, _)| *until <= now) {
            let Some((_, blocks)) = s.pending.pop_front() else {
                break;
            };
            for h in blocks {
                if release(&mut s.pending_refs, h) && !s.held.contains_key(&h) {
                    clear_bit(&mut self.owners, h, bit);
                }
            }
        }
    }

    /// For every slot that follows its engine (not `SyncState::Off`), how many leading `blocks`
    /// it holds, written to `out[slot]`; other slots get `None`.
    pub fn longest_matches(&self, blocks: &[u64], out: &mut [Option<(u32, SyncState)>]) {
        let n = self.slots.len().min(out.len());
        let mut alive = 0u64;
        for (i, s) in self.slots.iter().take(n).enumerate() {
            out[i] = (s.sync != SyncState::Off).then_some((0, s.sync));
            if s.sync != SyncState::Off {
                alive |= 1 << i;
            }
        }
        for (k, h) in blocks.iter().enumerate() {
            if alive == 0 {
                return;
            }
            let held = self.owners.get(h).copied().unwrap_or(0) & alive;
            alive = held;
            let mut set = held;
            while set != 0 {
                let b = set.trailing_zeros() as usize;
                if let Some(Some((m, _))) = out.get_mut(b) {
                    *m = k as u32 + 1;
                }
                set &= set - 1;
            }
        }
    }

    /// Whether `h` is believed held (or pending) on `slot`.
    #[cfg(test)]
    fn holds(&self, slot: usize, h: u64) -> bool {
        self.slots
            .get(slot)
            .is_some_and(|s| s.held.contains_key(&h) || s.pending_refs.contains_key(&h))
    }

    /// Approximate bytes the index holds.
    pub fn bytes(&self) -> usize {
        let map = |n: usize, entry: usize| n * (entry + 1);
        map(self.owners.capacity(), 16)
            + self
                .slots
                .iter()
                .map(|s| {
                    map(s.names.capacity(), 16)
                        + map(s.held.capacity(), 12)
                        + map(s.pending_refs.capacity(), 12)
                        + s.pending.iter().map(|(_, b)| b.len() * 8).sum::<usize>()
                })
                .sum::<usize>()
    }
}

/// The data-parallel rank a request is pinned to, given each rank's cost in prefill tokens
/// (priced as `kv_aware` prices backends; the ranks of one backend are alike): the cheapest.
/// Among equals (most often: an idle backend none of whose ranks holds the prompt) the
/// conversation's own, from its session `key`, so its later turns and every replica pin it
/// alike. Pinning even then, rather than leaving it to the engine's balancer, is what lets the
/// next turn find this one's blocks where kvroute expects them.
pub fn pick_rank(cost: &[u64], key: u64) -> u32 {
    let n = cost.len().max(1) as u64;
    // Not `key % n` alone: the ring already cut the keys by their value.
    let own = (key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) % n;
    let best = cost.iter().copied().min().unwrap_or(0);
    if cost.get(own as usize) == Some(&best) {
        return own as u32;
    }
    cost.iter().position(|&c| c == best).unwrap_or(0) as u32
}

/// Drop one reference to `h`; whether it was the last.
fn release(refs: &mut IdMap<u32>, h: u64) -> bool {
    match refs.get_mut(&h) {
        Some(n) if *n > 1 => {
            *n -= 1;
            false
        }
        Some(_) => {
            refs.remove(&h);
            true
        }
        None => false,
    }
}

fn clear_bit(owners: &mut IdMap<u64>, h: u64, bit: u64) {
    if let Some(mask) = owners.get_mut(&h) {
        *mask &= !bit;
        if *mask == 0 {
            owners.remove(&h);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokens(n: u32, from: u32) -> Vec<u32> {
        (from..from + n).collect()
    }

    fn matches(ix: &ExactIndex, blocks: &[u64], n: usize) -> Vec<Option<u32>> {
        let mut out = vec![None; n];
        ix.longest_matches(blocks, &mut out);
        out.into_iter().map(|m| m.map(|(k, _)| k)).collect()
    }

    #[test]
    fn events_resolve_parents_into_the_requests_chain() {
        let mut ix = ExactIndex::new(2);
        ix.reset(0, SyncState::Synced);
        ix.reset(1, SyncState::Partial);
        let prompt = tokens(64, 100);
        let want = chain(root(None), &prompt, 16);
        // The engine stores the first two blocks, then two more naming the second as parent.
        let a = ix.stored(0, &[11, 12], None, Stored::tokens(&prompt[..32], 16));
        assert_eq!(a.blocks_stored, 2);
        let b = ix.stored(0, &[13, 14], Some(12), Stored::tokens(&prompt[32..], 16));
        assert_eq!(b.blocks_stored, 2);
        assert_eq!(matches(&ix, &want, 3), vec![Some(4), Some(0), None]);
        // A parent the index never saw cannot be chained.
        let c = ix.stored(1, &[21], Some(99), Stored::tokens(&prompt[16..32], 16));
        assert_eq!(c.unresolved, 1);
        assert_eq!(matches(&ix, &want, 2), vec![Some(4), Some(0)]);
        // Eviction of the third block cuts the match there.
        assert_eq!(ix.removed(0, &[13, 77]).blocks_removed, 1);
        assert_eq!(matches(&ix, &want, 2), vec![Some(2), Some(0)]);
        // An adapter's blocks are a different chain.
        let lora = chain(root(Some("ad")), &prompt, 16);
        assert_ne!(lora[0], want[0]);
        ix.reset(0, SyncState::Synced);
        assert_eq!(ix.blocks_of(0), 0);
        assert_eq!(matches(&ix, &want, 1), vec![Some(0)]);
        assert!(ix.owners.is_empty(), "a reset leaves no owner bits");
    }

    #[test]
    fn extra_keys_keep_equal_tokens_apart() {
        use crate::request::engine_tokens::{opaque_key, salt_key};
        let mut ix = ExactIndex::new(1);
        ix.reset(0, SyncState::Synced);
        let prompt = tokens(48, 5);
        let salt = [salt_key("a")];
        let salted = Stored {
            keys: &salt,
            ..Stored::tokens(&prompt, 16)
        };
        ix.stored(0, &[1, 2, 3], None, salted);
        let plain = chain(root(None), &prompt, 16);
        let same_salt = keyed_chain(root(None), &prompt, 16, &salt);
        let other_salt = keyed_chain(root(None), &prompt, 16, &[salt_key("b")]);
        assert_eq!(matches(&ix, &same_salt, 1), vec![Some(3)]);
        assert_eq!(matches(&ix, &plain, 1), vec![Some(0)]);
        assert_eq!(matches(&ix, &other_salt, 1), vec![Some(0)]);
        // An image in the second block: the first still matches a text prompt, nothing after.
        ix.reset(0, SyncState::Synced);
        let image = [0, opaque_key(b"img"), 0];
        let with_image = Stored {
            keys: &image,
            ..Stored::tokens(&prompt, 16)
        };
        ix.stored(0, &[1, 2, 3], None, with_image);
        assert_eq!(matches(&ix, &plain, 1), vec![Some(1)]);
    }

    #[test]
    fn the_rank_finishing_first_wins_and_equals_go_by_the_key() {
        // Rank 1 holds most of the prompt: the least prefill before its first token.
        assert_eq!(pick_rank(&[900, 100, 100, 1000], 0) % 4, 1);
        // ... unless its queue outweighs what it holds.
        assert_eq!(pick_rank(&[900, 100 + 5000, 950, 1000], 0), 0);
        // Among equals the key decides, the same way every time.
        let spread: std::collections::BTreeSet<u32> = (0..64u64)
            .map(|k| pick_rank(&[7; 4], k.wrapping_mul(0x1234_5678_9abc_def1)))
            .collect();
        assert_eq!(spread.len(), 4, "conversations spread over the ranks");
        for k in 0..64u64 {
            let r = pick_rank(&[7; 4], k);
            let mut cost = [9; 4];
            cost[r as usize] = 7;
            assert_eq!(pick_rank(&cost, k), r);
            cost[(r as usize + 1) % 4] = 7;
            assert_eq!(pick_rank(&cost, k), r, "a tie keeps the key's rank");
        }
        assert_eq!(pick_rank(&[], 7), 0);
    }

    #[test]
    fn pending_blocks_count_until_their_time_is_up() {
        let mut ix = ExactIndex::new(1);
        let blocks = chain(0, &tokens(48, 0), 16);
        let t0 = Instant::now();
        ix.pending(0, &blocks, t0);
        assert_eq!(matches(&ix, &blocks, 1), vec![None], "off: not followed");
        ix.reset(0, SyncState::Synced);
        ix.pending(0, &blocks, t0);
        assert_eq!(matches(&ix, &blocks, 1), vec![Some(3)]);
        // A block the engine already holds is not pending: its eviction ends the claim.
        ix.stored(0, &[9], None, Stored::tokens(&tokens(16, 0), 16));
        ix.pending(0, &blocks[..1], t0);
        ix.removed(0, &[9]);
        assert_eq!(matches(&ix, &blocks, 1), vec![Some(0)]);
        ix.pending(0, &blocks, t0);
        // The engine confirms the first block: evicted at once, it is gone, pending or not.
        ix.stored(0, &[5], None, Stored::tokens(&tokens(16, 0), 16));
        ix.removed(0, &[5]);
        assert_eq!(matches(&ix, &blocks, 1), vec![Some(0)]);
        // The others lapse.
        ix.expire(0, t0 + PENDING_TTL);
        assert!(ix.owners.is_empty());
    }

    #[test]
    fn a_block_named_twice_stays_until_both_names_go() {
        let mut ix = ExactIndex::new(1);
        ix.reset(0, SyncState::Synced);
        let t = tokens(16, 7);
        let want = chain(0, &t, 16);
        ix.stored(0, &[1], None, Stored::tokens(&t, 16));
        ix.stored(0, &[2], None, Stored::tokens(&t, 16));
        ix.removed(0, &[1]);
        assert_eq!(matches(&ix, &want, 1), vec![Some(1)]);
        ix.removed(0, &[2]);
        assert_eq!(matches(&ix, &want, 1), vec![Some(0)]);
    }

    proptest::proptest! {
        /// Whatever the order of stores and removals, the index holds exactly the blocks the
        /// engine was last told to hold.
        #[test]
        fn index_equals_a_replay_of_the_events(ops in proptest::collection::vec((0u64..12, proptest::bool::ANY), 0..80)) {
            let mut ix = ExactIndex::new(1);
            ix.reset(0, SyncState::Synced);
            let mut model = std::collections::HashMap::new();
            for (e, store) in ops {
                let t = tokens(4, e as u32 * 4);
                if store {
                    ix.stored(0, &[e], None, Stored::tokens(&t, 4));
                    model.insert(e, chain(0, &t, 4)[0]);
                } else {
                    ix.removed(0, &[e]);
                    model.remove(&e);
                }
            }
            for e in 0u64..12 {
                let h = chain(0, &tokens(4, e as u32 * 4), 4)[0];
                proptest::prop_assert_eq!(ix.holds(0, h), model.contains_key(&e));
            }
            proptest::prop_assert_eq!(ix.blocks_of(0), model.len());
        }
    }
}
