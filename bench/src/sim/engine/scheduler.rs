//! The engine's scheduler: continuous batching after vLLM v1, as a plain struct with injected
//! time. `step` decides one batch, advances every request in it and returns the model time the
//! batch takes; the async engine (`engine`) sleeps that long and then delivers the tokens.
//!
//! Token accounting: a request with `g` tokens emitted needs KV for `prompt + g` tokens before
//! it can sample the next one. A fresh request prefills `prompt` (in chunks of the step's
//! budget) and emits its first token when the last chunk is done; a decoding request computes
//! one token a step and emits one. A preempted request loses its KV and re-prefills
//! `prompt + g` tokens (prefix hits permitting), then continues where it stopped, so it still
//! emits exactly `max_tokens` tokens.
//!
//! Prefill time: the scheduler keeps a model clock (the sum of its steps' times) and reports,
//! with a request's first token, the span from the start of the step that first scheduled any
//! of its prompt tokens to the end of the step that emitted that token (vLLM's
//! `request_prefill_time_seconds`; a preemption before the first token stays inside the span),
//! and how many prompt tokens it computed in that span (llama.cpp's
//! `n_prompt_tokens_processed`: prefix-cache hits excluded, recomputation included).
//!
//! Each step, as vLLM does: running requests first, in admission order, each taking what it
//! needs from the token budget; a request that cannot get a block preempts the most recently
//! admitted running request (possibly itself). Then, unless someone was preempted, waiting
//! requests are admitted first come first served while seats, budget and blocks allow.
//!
//! Decode time: with its last token, a request reports the model time from the end of the
//! step that emitted its first token to the end of this one (llama.cpp's
//! `t_token_generation`, which it counts in `tokens_predicted_seconds_total` when the request
//! ends).
//!
//! The same loop schedules llama.cpp's slots with the `cpu-smollm2` profile: `max_num_seqs`
//! is `--parallel` (a request waits, deferred, until a slot is free), the token budget is
//! `n_batch`, and the counters include llama.cpp's `n_decode_total` (steps), the busy slots
//! summed over steps and the longest sequence seen.
//!
//! KV events (`record_kv_events`): each step also returns the pool's changes as vLLM's KV
//! events (`kvevents`), in the order they happened.
//!
//! P/D disaggregation (`NewRequest::kv_transfer`, after vLLM's NixlConnector): on the prefill
//! side a finished request can leave its prompt's full blocks referenced under a key
//! (`StepOutcome::held`) until `release_held`: pinned, counted as used, never evicted. On the
//! decode side a request can arrive with its prompt's leading blocks already transferred: they
//! are named in the pool as it is queued and referenced by it until it is admitted, where its
//! prefix lookup finds them; they count as cached tokens but not as prefix-cache hits.

use std::collections::VecDeque;
use std::sync::Arc;

use super::kv_events::kvevents::{Chain, EventLog, KvEvent};
use super::kvpool::KvPool;
use super::profile::{Profile, BLOCK_TOKENS};

pub struct NewRequest {
    pub prompt_tokens: u64,
    /// Chained hashes of the prompt's full blocks.
    pub hashes: Vec<u64>,
    /// The chain continued over the reply as the client will send it back (see
    /// `inference::reply_hashes`): the blocks past `hashes` that stay cached once the request
    /// finishes, so that the next turn of a conversation hits its previous reply too.
    pub reply_hashes: Vec<u64>,
    pub max_tokens: u64,
    /// The token stream `hashes` and `reply_hashes` name, 64 bytes a block: the token ids of
    /// the KV events. Empty unless the engine publishes them.
    pub tokens: Arc<[u8]>,
    /// The request's `cache_salt`: the KV events name it in the first block's extra keys.
    pub salt: Option<String>,
    /// P/D disaggregation's part (none for a plain request).
    pub kv_transfer: KvTransfer,
}

/// What P/D disaggregation asks of the engine for one request.
#[derive(Debug, Clone, Default)]
pub struct KvTransfer {
    /// Prefill side: when the request finishes, keep its prompt's full blocks referenced
    /// under this key until `release_held` (vLLM's delayed free for a remote decode).
    pub hold: Option<String>,
    /// Decode side: the leading prompt blocks brought in before the request is queued (its
    /// local hits and the transferred blocks after them), held for it until it is admitted,
    /// as vLLM allocates the blocks of a request waiting for remote KV.
    pub import_blocks: usize,
    /// Of those, the blocks read from the prefill server: vLLM counts them as external hits,
    /// so the prefix-cache hit counters leave them out (`usage` still reports them cached).
    pub transferred_blocks: usize,
}

impl NewRequest {
    fn chain(&self) -> Chain<'_> {
        Chain {
            prompt: &self.hashes,
            reply: &self.reply_hashes,
            tokens: &self.tokens,
            salt: self.salt.as_deref(),
        }
    }
}

struct Seq {
    id: u64,
    req: NewRequest,
    generated: u64,
    /// Tokens whose KV is in `held`.
    computed: u64,
    held: Vec<Option<u64>>,
    /// Prefix hit at first admission (reported in `usage`).
    cached_tokens: Option<u64>,
    /// Model clock at the start of the step that first scheduled the prompt.
    prefill_start: Option<f64>,
    /// Prompt tokens computed before the first token.
    prefill_computed: u64,
    /// Model clock at the end of the step that emitted the first token.
    first_token_at: Option<f64>,
    /// Imported blocks (`KvTransfer::import_blocks`) held while the request waits.
    imported: Vec<Option<u64>>,
}

impl Seq {
    fn target(&self) -> u64 {
        self.req.prompt_tokens + self.generated
    }

    fn decoding(&self) -> bool {
        self.generated > 0 && self.computed + 1 == self.target()
    }
}

/// A request's first admission: what the prefix cache gave it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Admission {
    pub id: u64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    /// Of `cached_tokens`, those a P/D transfer brought (not prefix-cache hits).
    pub transferred_tokens: u64,
}

/// A request emitted a token this step; `generated` counts all its tokens so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Emitted {
    pub id: u64,
    pub generated: u64,
    pub finished: bool,
}

/// A request finished its prefill this step (and emitted its first token).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Prefilled {
    pub id: u64,
    /// Model seconds from the start of the step that first scheduled its prompt to the end of
    /// this one.
    pub seconds: f64,
    /// Prompt tokens computed, not served from the prefix cache.
    pub computed_tokens: u64,
}

/// A finished request's prompt blocks kept referenced for a remote decode
/// (`KvTransfer::hold`): the pool's blocks of its prompt's leading full blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    pub id: u64,
    pub key: String,
    pub hashes: Vec<u64>,
}

/// A request emitted its last token this step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Finished {
    pub id: u64,
    /// Tokens it emitted.
    pub tokens: u64,
    /// Model seconds from the end of the step that emitted its first token to the end of
    /// this one (0 for a single token).
    pub decode_seconds: f64,
}

#[derive(Debug, Default)]
pub struct StepOutcome {
    /// Model time of the step, seconds.
    pub seconds: f64,
    pub prefill_tokens: u64,
    pub decode_seqs: u64,
    pub admitted: Vec<Admission>,
    pub emitted: Vec<Emitted>,
    pub prefilled: Vec<Prefilled>,
    pub finished: Vec<Finished>,
    /// Finished requests whose prompt blocks stay held, until `release_held`.
    pub held: Vec<Held>,
    /// The step's changes to the pool's named blocks, in order (with `record_kv_events`).
    pub kv_events: Vec<KvEvent>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    pub steps: u64,
    pub preemptions: u64,
    pub prefix_queries: u64,
    pub prefix_hits: u64,
    /// Over every step, the requests it ran (llama.cpp's busy slots per `llama_decode`).
    pub busy_seqs: u64,
    /// The most tokens one request has held in KV (llama.cpp's `n_tokens_max`).
    pub max_seq_tokens: u64,
}

pub struct Scheduler {
    profile: Profile,
    pool: KvPool,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    next_id: u64,
    counters: Counters,
    /// Model seconds of all steps so far.
    clock: f64,
    /// The current step's KV events; None unless `record_kv_events` was called.
    events: Option<EventLog>,
}

impl Scheduler {
    pub fn new(profile: Profile) -> Self {
        Self {
            pool: KvPool::new(profile.kv_blocks),
            profile,
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_id: 0,
            counters: Counters::default(),
            clock: 0.0,
            events: None,
        }
    }

    /// Makes every step report its KV events (`StepOutcome::kv_events`).
    pub fn record_kv_events(&mut self) {
        self.pool.record_changes();
        self.events.get_or_insert_with(EventLog::default);
    }

    pub fn add(&mut self, req: NewRequest) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        let imported = self.import(&req);
        self.waiting.push_back(Seq {
            id,
            req,
            generated: 0,
            computed: 0,
            held: Vec::new(),
            cached_tokens: None,
            prefill_start: None,
            prefill_computed: 0,
            first_token_at: None,
            imported,
        });
        id
    }

    /// Names and references the leading prompt blocks a P/D transfer brought in; their KV
    /// events are the request's own blocks, so they are absorbed with its chain now.
    fn import(&mut self, req: &NewRequest) -> Vec<Option<u64>> {
        let n = req.kv_transfer.import_blocks.min(req.hashes.len());
        if n == 0 {
            return Vec::new();
        }
        let held = self.pool.import(&req.hashes[..n]);
        if let Some(events) = &mut self.events {
            events.absorb(&mut self.pool, Some((&req.chain(), 0)));
        }
        held
    }

    /// Drops the references of a hold (`StepOutcome::held`): the blocks stay cached,
    /// evictable like any released prefix.
    pub fn release_held(&mut self, hashes: &[u64]) {
        let held: Vec<Option<u64>> = hashes.iter().copied().map(Some).collect();
        self.pool.release(&held);
    }

    /// Leading blocks of `hashes` the pool holds now (a decode server's local prefix, before
    /// it asks for the rest).
    pub fn lookup(&self, hashes: &[u64]) -> usize {
        self.pool.lookup(hashes)
    }

    /// Drops a request whose client went away, wherever it is.
    pub fn abort(&mut self, id: u64) {
        if let Some(i) = self.running.iter().position(|s| s.id == id) {
            let seq = self.running.remove(i);
            self.pool.release(&seq.held);
        } else if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            if let Some(seq) = self.waiting.remove(i) {
                self.pool.release(&seq.imported);
            }
        }
    }

    pub fn is_idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }

    pub fn running(&self) -> usize {
        self.running.len()
    }

    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn pool(&self) -> &KvPool {
        &self.pool
    }

    pub fn counters(&self) -> Counters {
        self.counters
    }

    #[cfg(test)]
    pub fn step(&mut self) -> StepOutcome {
        self.step_slowed(1.0)
    }

    /// One step that takes `slowdown` times its modelled time: its engine shares a CPU core
    /// with others (`--cores`).
    pub fn step_slowed(&mut self, slowdown: f64) -> StepOutcome {
        let mut out = StepOutcome::default();
        let mut budget = self.profile.max_num_batched_tokens;
        let mut kv_read = 0u64;
        // Tokens scheduled for running[k], k < batch.len().
        let mut batch: Vec<u64> = Vec::with_capacity(self.running.len());
        let mut preempted = false;
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let seq = &self.running[i];
            let n = (seq.target() - seq.computed).min(budget);
            if !self.grow(i, n) {
                preempted = true;
                if !self.preempt_last_for(i) {
                    // The request preempted itself: nothing after it is left either.
                    break;
                }
                continue;
            }
            let seq = &self.running[i];
            if seq.decoding() {
                out.decode_seqs += 1;
                kv_read += seq.computed;
            } else {
                out.prefill_tokens += n;
            }
            budget -= n;
            batch.push(n);
            i += 1;
        }
        if !preempted {
            self.admit(&mut budget, &mut batch, &mut out);
        }
        // (id, start, computed) of requests whose prefill ends with this step.
        let mut prefilled: Vec<(u64, f64, u64)> = Vec::new();
        let mut context_s = 0.0;
        for (i, n) in batch.into_iter().enumerate() {
            let seq = &mut self.running[i];
            let before = seq.computed;
            if !seq.decoding() {
                context_s += self.profile.context_seconds(n, before);
            }
            seq.computed += n;
            if seq.generated == 0 {
                seq.prefill_computed += n;
            }
            promote_full_blocks(&mut self.pool, seq, before);
            if let Some(events) = &mut self.events {
                let first = (before / BLOCK_TOKENS) as usize;
                events.absorb(&mut self.pool, Some((&seq.req.chain(), first)));
            }
            if seq.computed == seq.target() {
                if seq.generated == 0 {
                    let start = seq.prefill_start.unwrap_or(self.clock);
                    prefilled.push((seq.id, start, seq.prefill_computed));
                }
                seq.generated += 1;
                out.emitted.push(Emitted {
                    id: seq.id,
                    generated: seq.generated,
                    finished: seq.generated >= seq.req.max_tokens,
                });
            }
        }
        self.counters.busy_seqs += self.running.len() as u64;
        if let Some(longest) = self.running.iter().map(|s| s.computed).max() {
            self.counters.max_seq_tokens = self.counters.max_seq_tokens.max(longest);
        }
        let finished = self.finish_done(&mut out.held);
        if let Some(events) = &mut self.events {
            // Evictions after the last naming.
            events.absorb(&mut self.pool, None);
            out.kv_events = events.take();
        }
        let prompts = prefilled.len() as f64 * self.profile.t_prompt;
        out.seconds = (self
            .profile
            .step_seconds(out.prefill_tokens, out.decode_seqs, kv_read)
            + prompts
            + context_s)
            * slowdown.max(1.0);
        self.counters.steps += 1;
        self.clock += out.seconds;
        out.prefilled = prefilled
            .into_iter()
            .map(|(id, start, computed_tokens)| Prefilled {
                id,
                seconds: self.clock - start,
                computed_tokens,
            })
            .collect();
        for seq in &mut self.running {
            if seq.generated > 0 && seq.first_token_at.is_none() {
                seq.first_token_at = Some(self.clock);
            }
        }
        // A request whose first token was also its last has no first-token time yet: 0.
        out.finished = finished
            .into_iter()
            .map(|(id, tokens, first)| Finished {
                id,
                tokens,
                decode_seconds: first.map_or(0.0, |t| self.clock - t),
            })
            .collect();
        out
    }

    /// Gives running request `i` the blocks for `n` more tokens.
    fn grow(&mut self, i: usize, n: u64) -> bool {
        let seq = &mut self.running[i];
        let need = (seq.computed + n).div_ceil(BLOCK_TOKENS) as usize;
        let more = need.saturating_sub(seq.held.len());
        if more == 0 {
            return true;
        }
        if !self.pool.allocate(more) {
            return false;
        }
        seq.held.resize(need, None);
        true
    }

    /// Preempts the most recently admitted running request to make room for request `i`;
    /// false when that was `i` itself.
    fn preempt_last_for(&mut self, i: usize) -> bool {
        let Some(mut victim) = self.running.pop() else {
            return false;
        };
        self.pool.release(&victim.held);
        victim.held.clear();
        victim.computed = 0;
        self.counters.preemptions += 1;
        self.waiting.push_front(victim);
        i < self.running.len()
    }

    fn admit(&mut self, budget: &mut u64, batch: &mut Vec<u64>, out: &mut StepOutcome) {
        while *budget > 0 && self.running.len() < self.profile.max_num_seqs {
            let Some(seq) = self.waiting.front() else {
                return;
            };
            // vLLM recomputes at least the last token, so a full hit is one block short.
            let max_hit = (seq.target().saturating_sub(1) / BLOCK_TOKENS) as usize;
            let hit = self.pool.lookup(&seq.req.hashes).min(max_hit);
            let hit_tokens = hit as u64 * BLOCK_TOKENS;
            let n = (seq.target() - hit_tokens).min(*budget);
            let new_blocks = (hit_tokens + n).div_ceil(BLOCK_TOKENS) as usize - hit;
            let hits = &seq.req.hashes[..hit];
            self.pool.acquire(hits);
            if !self.pool.allocate(new_blocks) {
                let held: Vec<Option<u64>> = hits.iter().copied().map(Some).collect();
                self.pool.release(&held);
                return;
            }
            let Some(mut seq) = self.waiting.pop_front() else {
                return;
            };
            seq.held = seq.req.hashes[..hit].iter().copied().map(Some).collect();
            seq.held.resize(hit + new_blocks, None);
            // Its own references are taken: the import's can go.
            let imported = std::mem::take(&mut seq.imported);
            self.pool.release(&imported);
            seq.computed = hit_tokens;
            seq.prefill_start.get_or_insert(self.clock);
            if seq.cached_tokens.is_none() {
                seq.cached_tokens = Some(hit_tokens);
                // The hit is the local blocks, then the transferred ones.
                let kv = &seq.req.kv_transfer;
                let local = kv.import_blocks.saturating_sub(kv.transferred_blocks) as u64;
                let transferred = hit_tokens
                    .saturating_sub(local * BLOCK_TOKENS)
                    .min(kv.transferred_blocks as u64 * BLOCK_TOKENS);
                self.counters.prefix_queries += seq.req.prompt_tokens;
                self.counters.prefix_hits += hit_tokens - transferred;
                out.admitted.push(Admission {
                    id: seq.id,
                    prompt_tokens: seq.req.prompt_tokens,
                    cached_tokens: hit_tokens,
                    transferred_tokens: transferred,
                });
            }
            out.prefill_tokens += n;
            *budget -= n;
            batch.push(n);
            self.running.push(seq);
        }
    }

    /// Releases the requests that emitted their last token: (id, tokens, first token's time).
    /// A request to be held for a remote decode first takes a reference on its prompt's full
    /// blocks (before its own go, so none can be evicted in between) and is added to `held`.
    fn finish_done(&mut self, held_out: &mut Vec<Held>) -> Vec<(u64, u64, Option<f64>)> {
        let pool = &mut self.pool;
        let events = &mut self.events;
        let mut finished = Vec::new();
        self.running.retain_mut(|seq| {
            let done = seq.generated >= seq.req.max_tokens;
            if done {
                finished.push((seq.id, seq.generated, seq.first_token_at));
                if let Some(key) = seq.req.kv_transfer.hold.take() {
                    let n = pool.lookup(&seq.req.hashes);
                    let hashes = seq.req.hashes[..n].to_vec();
                    pool.acquire(&hashes);
                    held_out.push(Held {
                        id: seq.id,
                        key,
                        hashes,
                    });
                }
                let held = std::mem::take(&mut seq.held);
                let from = seq.req.hashes.len();
                pool.release_finished(held, from, &seq.req.reply_hashes);
                if let Some(events) = events {
                    events.absorb(pool, Some((&seq.req.chain(), from)));
                }
            }
            !done
        });
        finished
    }
}

/// Names the prompt blocks that became full this step, so later requests can reuse them.
/// vLLM caches a block as soon as the step that fills it is scheduled; so does this. Output
/// blocks are named when the request finishes (`finish_done`): only a later turn that sends
/// the reply back can hit them, and it comes after the reply.
fn promote_full_blocks(pool: &mut KvPool, seq: &mut Seq, before: u64) {
    let first = (before / BLOCK_TOKENS) as usize;
    let full = ((seq.computed / BLOCK_TOKENS) as usize).min(seq.req.hashes.len());
    for j in first..full {
        if seq.held[j].is_none() && pool.promote(seq.req.hashes[j]) {
            seq.held[j] = Some(seq.req.hashes[j]);
        }
    }
}

#[cfg(test)]
#[path = "scheduler_tests.rs"]
mod tests;
