//! Engine KV events: what each engine says it caches, applied to the fleet's exact index
//! (`placement::exact`), and the per-request matching that reads it.

use std::time::Instant;

use super::roster::Fleet;
use crate::placement::exact::Applied;
use crate::placement::{self, Stored, SyncState};

mod metrics;
mod subscriber;
pub mod wire;

pub use metrics::KvEventMetrics;
pub use subscriber::follow_forever;

/// A request's prompt in the engines' terms: kvroute's chain hashes of its token blocks.
#[derive(Debug, Clone, PartialEq)]
pub struct ExactBlocks {
    pub blocks: Vec<u64>,
    pub block_tokens: u64,
    /// The prompt's exact token count.
    pub prompt_tokens: u64,
}

/// What a request is believed to find cached on each backend.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Matches {
    /// Prompt tokens, per backend.
    pub tokens: Vec<u64>,
    /// Whether the engine's own events said so (the backend follows them).
    pub exact: Vec<bool>,
    /// For a backend of several data-parallel ranks, the rank to pin the request to (whose
    /// cache `tokens` counts; see `placement::pick_rank`).
    pub rank: Vec<Option<u32>>,
}

impl Fleet {
    /// Per backend, how many prompt tokens it is believed to cache: from the engine's KV
    /// events where kvroute follows them and the prompt is tokenized (`exact`), else from the
    /// approximate index of what kvroute sent it (`blocks`). `key`: the request's session
    /// key, which picks a rank where none is better than another; `dup_weight`:
    /// `routing.duplicate_prefill_weight`, the price of recomputing a prefix a sibling rank
    /// holds.
    pub fn matches(
        &self,
        blocks: &[u64],
        exact: Option<&ExactBlocks>,
        key: u64,
        dup_weight: f64,
    ) -> Matches {
        let backends = self.backends();
        let n = backends.len();
        let mut out = Matches {
            tokens: vec![0; n],
            exact: vec![false; n],
            rank: vec![None; n],
        };
        let Ok(mut beliefs) = self.shared.beliefs.lock() else {
            return out;
        };
        let mut by_slot = vec![0; beliefs.index.slots()];
        beliefs.index.longest_matches(blocks, &mut by_slot);
        // Per rank, per slot: the leading blocks that rank's engine holds.
        let mut exact_by_rank: Vec<Vec<Option<(u32, SyncState)>>> = Vec::new();
        if let Some(e) = exact {
            let now = Instant::now();
            let ranks = backends
                .iter()
                .map(|b| b.dp_size as usize)
                .max()
                .unwrap_or(1);
            for x in beliefs.exact.iter_mut().take(ranks) {
                for s in backends.iter().filter_map(|b| b.slot) {
                    x.expire(s, now);
                }
                let mut held = vec![None; by_slot.len().max(1)];
                x.longest_matches(&e.blocks, &mut held);
                exact_by_rank.push(held);
            }
        }
        let block_tokens = exact.map_or(0, |e| e.block_tokens);
        let mut cost = Vec::new();
        for (i, b) in backends.iter().enumerate() {
            let Some(s) = b.slot else { continue };
            let approx = by_slot.get(s).map_or(0, |&m| m as u64 * self.block_tokens);
            let of_rank = |r: usize| {
                exact_by_rank
                    .get(r)
                    .and_then(|v| v.get(s).copied().flatten())
            };
            let mut rank = 0;
            if let (true, Some(e)) = (b.dp_size > 1, exact) {
                // Per rank, in prefill tokens as kv_aware prices backends: what kvroute queued
                // there, the prompt's uncached part, and the part a sibling holds computed
                // again (a second copy, and the group's requests split between two ranks).
                let ranks = b.dp_size as usize;
                let held = |r: usize| {
                    of_rank(r)
                        .map_or(0, |m| u64::from(m.0) * block_tokens)
                        .min(e.prompt_tokens)
                };
                let best = (0..ranks).map(held).max().unwrap_or(0);
                cost.clear();
                cost.extend((0..ranks).map(|r| {
                    let dup = (dup_weight * (best - held(r)) as f64) as u64;
                    b.rank_prefill(r) + (e.prompt_tokens - held(r)) + dup
                }));
                let r = placement::pick_rank(&cost, key);
                out.rank[i] = Some(r);
                rank = r as usize;
            }
            out.tokens[i] = match of_rank(rank) {
                Some((m, SyncState::Synced)) => {
                    out.exact[i] = true;
                    m as u64 * block_tokens
                }
                // Blocks stored before kvroute followed the engine are missing from what it
                // knows exactly; what kvroute sent there may still be cached.
                Some((m, _)) => {
                    out.exact[i] = true;
                    approx.max(m as u64 * block_tokens)
                }
                None => approx,
            };
        }
        out
    }

    /// What kvroute knows from each data-parallel rank of backend `i` (one for most): how,
    /// and how many blocks.
    pub fn exact_state(&self, i: usize) -> Vec<(SyncState, usize)> {
        let Some(b) = self.backends().get(i) else {
            return Vec::new();
        };
        let ranks = b.dp_size.max(1) as usize;
        let off = vec![(SyncState::Off, 0); ranks];
        let Some(slot) = b.slot else { return off };
        let Ok(beliefs) = self.shared.beliefs.lock() else {
            return off;
        };
        (0..ranks)
            .map(|r| {
                beliefs
                    .exact
                    .get(r)
                    .map_or((SyncState::Off, 0), |x| (x.sync(slot), x.blocks_of(slot)))
            })
            .collect()
    }

    /// Bytes the exact index holds.
    pub fn exact_bytes(&self) -> usize {
        self.shared
            .beliefs
            .lock()
            .map_or(0, |b| b.exact.iter().map(|x| x.bytes()).sum())
    }

    /// A handle that applies events to rank `rank` of backend `i` in the exact index for as
    /// long as the backend keeps its slot: it outlives this generation, as the index does.
    pub(crate) fn exact_writer(&self, i: usize, rank: u32) -> Option<ExactWriter> {
        let b = self.backends().get(i)?;
        Some(ExactWriter {
            fleet_shared: self.shared.clone(),
            slot: b.slot?,
            rank: rank as usize,
            addr: b.addr,
        })
    }
}

/// Which of an engine's KV cache groups its events are followed in. A hybrid model (sliding
/// window or Mamba layers beside full attention) caches one group per layer kind, and its
/// events name a block by the same hash in each: a sliding-window group dropping a block it
/// has slid past must not remove the full-attention copy a prompt's prefix reuses. So one
/// full-attention group is followed (the first one stored to), and events of no group (a
/// single-group engine) always are.
#[derive(Debug, Default)]
pub struct Groups {
    followed: Option<u32>,
}

impl Groups {
    fn follows_store(&mut self, group: Option<u32>, kind: Option<&str>) -> bool {
        let Some(g) = group else { return true };
        // Kinds are vLLM's `KVCacheSpecKind`: full_attention, mla_attention, sink_full_attention
        // hold a prefix whole; sliding windows, chunked local attention and Mamba states do not.
        let whole_prefix = kind.is_none_or(|k| k.contains("full") || k.contains("mla"));
        if self.followed.is_none() && whole_prefix {
            self.followed = Some(g);
        }
        self.follows(group)
    }

    fn follows(&self, group: Option<u32>) -> bool {
        group.is_none() || group == self.followed
    }
}

/// Writes one backend's (one rank's) events into the exact index.
pub(crate) struct ExactWriter {
    fleet_shared: std::sync::Arc<super::roster::Shared>,
    slot: usize,
    rank: usize,
    pub(crate) addr: std::net::SocketAddr,
}

impl ExactWriter {
    /// Run `f` on the rank's exact index and this backend's slot, if the slot is still the
    /// backend's.
    fn with<R>(&self, f: impl FnOnce(&mut crate::placement::ExactIndex, usize) -> R) -> Option<R> {
        let mut beliefs = self.fleet_shared.beliefs.lock().ok()?;
        if beliefs.owner.get(self.slot) != Some(&Some(self.addr)) {
            return None;
        }
        let exact = &mut beliefs.exact;
        while exact.len() <= self.rank {
            exact.push(crate::placement::ExactIndex::default());
        }
        exact.get_mut(self.rank).map(|x| f(x, self.slot))
    }

    pub fn reset(&self, sync: SyncState) {
        self.with(|x, s| x.reset(s, sync));
    }

    pub fn sync(&self) -> SyncState {
        self.with(|x, s| x.sync(s)).unwrap_or(SyncState::Off)
    }

    /// Apply a decoded batch; `None` when the backend no longer holds its slot. `groups`
    /// remembers, for this engine, which KV cache group its events are followed in.
    pub fn apply(
        &self,
        batch: &wire::Batch,
        block_size: usize,
        groups: &mut Groups,
    ) -> Option<(Applied, usize)> {
        self.with(|x, s| {
            let mut total = Applied::default();
            let mut skipped = 0;
            for e in &batch.events {
                let a = match e {
                    wire::Event::Stored {
                        hashes,
                        parent,
                        token_ids,
                        block_size: bs,
                        lora,
                        medium,
                        keys,
                        group,
                        kind,
                    } => {
                        // Another block size cannot be matched against kvroute's blocks.
                        if *bs != block_size
                            || !wire::on_gpu(medium.as_deref())
                            || !groups.follows_store(*group, kind.as_deref())
                        {
                            skipped += 1;
                            continue;
                        }
                        let blocks = Stored {
                            tokens: token_ids,
                            block_size: *bs,
                            lora: lora.as_deref(),
                            keys,
                        };
                        x.stored(s, hashes, *parent, blocks)
                    }
                    wire::Event::Removed {
                        hashes,
                        medium,
                        group,
                    } => {
                        if !wire::on_gpu(medium.as_deref()) || !groups.follows(*group) {
                            skipped += 1;
                            continue;
                        }
                        x.removed(s, hashes)
                    }
                    wire::Event::Cleared => {
                        x.reset(s, SyncState::Synced);
                        Applied::default()
                    }
                };
                total.blocks_stored += a.blocks_stored;
                total.blocks_removed += a.blocks_removed;
                total.unresolved += a.unresolved;
            }
            (total, skipped)
        })
    }
}
