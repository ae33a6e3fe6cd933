//! One subscriber per backend that publishes KV events (per rank of a data-parallel engine, at
//! the configured ports + rank): a ZMQ SUB on the engine's PUB socket, and a DEALER on its
//! replay socket to ask for the batches a gap skipped.
//!
//! On connecting, kvroute asks the replay socket for the engine's history from seq 0, then
//! follows the live stream, asking again for any gap in the sequence numbers. What it knows
//! ([`SyncState`]):
//! - **synced** when it has every batch from the engine's first (the replay buffer, 10,000
//!   batches on vLLM, still reached back to it) or since an `AllBlocksCleared`;
//! - **partial** when it joined later or a gap could not be filled: the blocks it knows are
//!   cached, others may be too. A gap first clears the backend's blocks, as the missed
//!   batches may have removed some;
//! - a lost connection (the engine stopped, or its host) clears the backend's blocks and turns
//!   it **off** until the stream is back: a restarted engine's cache is empty.
//!
//! Malformed payloads are counted and skipped; nothing here can stall the proxy, which only
//! reads the index.

use bytes::Bytes;
use futures_util::StreamExt;
use pingora::server::ShutdownWatch;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;
use zeromq::{DealerSocket, Socket, SocketEvent, SocketRecv, SocketSend, SubSocket, ZmqMessage};

use super::metrics::KvEventMetrics;
use super::wire;
use super::{ExactWriter, Groups};
use crate::config::BackendKvEvents;
use crate::fleet::generation::Current;
use crate::placement::SyncState;

/// How often the set of followed backends is compared with the config in force.
const RECONCILE: Duration = Duration::from_secs(1);
/// A replay that does not answer (or finish) within this is a failed one.
const REPLAY_TIMEOUT: Duration = Duration::from_secs(2);
/// Batches one replay may return: vLLM keeps 10,000.
const REPLAY_MAX: usize = 100_000;
/// The engine's PUB socket must accept the connection within this.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// A stream quiet for this long is asked, through the replay socket, for what it sent since.
const IDLE_PROBE: Duration = Duration::from_secs(1);
/// The replay socket's end marker: seq -1.
const END_SEQ: [u8; 8] = (-1i64).to_be_bytes();

/// What one follower needs; a change restarts it.
#[derive(Clone, PartialEq)]
struct Target {
    backend: String,
    /// The data-parallel rank followed (0 for a single engine), and as a label.
    rank: u32,
    rank_label: String,
    /// The backend, and its rank when it has several: how logs name this stream.
    name: String,
    /// This rank's own endpoints.
    events: BackendKvEvents,
    block_size: usize,
}

impl Target {
    fn who(&self) -> [&str; 2] {
        [&self.backend, &self.rank_label]
    }
}

/// Follow every backend the config in force says publishes KV events, until `shutdown`.
pub async fn follow_forever(
    current: &Current,
    metrics: KvEventMetrics,
    shutdown: &mut ShutdownWatch,
) {
    type Stream = (std::net::SocketAddr, u32);
    let mut running: HashMap<Stream, (Target, tokio::task::JoinHandle<()>)> = HashMap::new();
    loop {
        let generation = current.load();
        let mut wanted = HashMap::new();
        if let Some(k) = &generation.config.kv_events {
            for (i, b) in generation.config.backends.iter().enumerate() {
                let Some(events) = &b.kv_events else { continue };
                let ranks = events.data_parallel_size;
                for rank in 0..ranks {
                    let Some(writer) = generation.fleet.exact_writer(i, rank) else {
                        continue;
                    };
                    let target = Target {
                        backend: b.addr.clone(),
                        rank,
                        rank_label: rank.to_string(),
                        name: if ranks > 1 {
                            format!("{} rank {rank}", b.addr)
                        } else {
                            b.addr.clone()
                        },
                        events: events.for_rank(rank),
                        block_size: k.block_size,
                    };
                    wanted.insert((writer.addr, rank), (target, writer));
                }
            }
        }
        running.retain(|(addr, rank), (target, task)| {
            let keep = wanted
                .get(&(*addr, *rank))
                .is_some_and(|(t, _)| t == target);
            if !keep {
                task.abort();
                log::info!("kv events: no longer following {}", target.name);
                if let Some(w) = generation
                    .fleet
                    .backends()
                    .iter()
                    .position(|b| b.addr == *addr)
                    .and_then(|i| generation.fleet.exact_writer(i, *rank))
                {
                    w.reset(SyncState::Off);
                }
                metrics.forget(target.who());
            }
            keep
        });
        for (stream, (target, writer)) in wanted {
            if running.contains_key(&stream) {
                continue;
            }
            metrics.known(target.who());
            let task = tokio::spawn(follow(target.clone(), writer, metrics.clone()));
            running.insert(stream, (target, task));
        }
        tokio::select! {
            _ = tokio::time::sleep(RECONCILE) => {}
            _ = shutdown.changed() => break,
        }
    }
    for (_, (_, task)) in running {
        task.abort();
    }
}

/// Follow one backend's stream for as long as the task runs, reconnecting with backoff.
async fn follow(target: Target, writer: ExactWriter, metrics: KvEventMetrics) {
    let writer = Arc::new(writer);
    let mut backoff = Duration::from_millis(100);
    loop {
        let mut f = Follower {
            target: &target,
            writer: &writer,
            metrics: &metrics,
            expected: None,
            replayed_upto: None,
            recent: VecDeque::new(),
            malformed: Malformed::default(),
            groups: Groups::default(),
            rank_mismatch: false,
        };
        match f.session().await {
            Ok(()) => {
                log::warn!(
                    "kv events: {} disconnected; its blocks are forgotten until it is back",
                    target.name
                );
                backoff = Duration::from_millis(100);
            }
            Err(e) => log::warn!("kv events: {}: {e}", target.name),
        }
        f.set(SyncState::Off);
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
}

struct Follower<'a> {
    target: &'a Target,
    writer: &'a ExactWriter,
    metrics: &'a KvEventMetrics,
    /// The next sequence number, once a batch was seen.
    expected: Option<u64>,
    /// Live batches up to this were already applied from a replay.
    replayed_upto: Option<u64>,
    /// The last batches applied, by sequence number and payload hash: a publisher delivers at
    /// least once (vLLM), and a batch seen again is not the engine restarting.
    recent: VecDeque<(u64, u64)>,
    malformed: Malformed,
    /// The engine's KV cache group that is followed (learnt anew for each connection).
    groups: Groups,
    /// The stream said it is another rank (warned once per connection).
    rank_mismatch: bool,
}

/// How many applied batches are remembered to recognise one delivered again.
const RECENT_BATCHES: usize = 1024;
/// Malformed batches are logged at warn at most this often per backend, with a count of those
/// not logged.
const MALFORMED_WARN_EVERY: Duration = Duration::from_secs(60);

/// Rate-limits the warning about malformed batches.
#[derive(Default)]
struct Malformed {
    last_warned: Option<std::time::Instant>,
    unlogged: u64,
}

impl Malformed {
    fn warn(&mut self, name: &str, what: &dyn std::fmt::Display) {
        let now = std::time::Instant::now();
        if self
            .last_warned
            .is_some_and(|t| now.duration_since(t) < MALFORMED_WARN_EVERY)
        {
            self.unlogged += 1;
            return;
        }
        let unlogged = std::mem::take(&mut self.unlogged);
        self.last_warned = Some(now);
        log::warn!(
            "kv events: {name}: malformed batch skipped: {what} ({unlogged} more since the last \
             warning)"
        );
    }
}

impl Follower<'_> {
    /// Forget the backend's blocks; what is known of it from here on is `state`.
    fn set(&self, state: SyncState) {
        self.writer.reset(state);
        self.metrics.set_sync(self.target.who(), state);
    }

    /// Connected until the engine goes away (`Ok`) or the socket fails (`Err`).
    async fn session(&mut self) -> Result<(), String> {
        let mut sub = SubSocket::new();
        let mut monitor = sub.monitor();
        tokio::time::timeout(CONNECT_TIMEOUT, sub.connect(&self.target.events.endpoint))
            .await
            .map_err(|_| {
                format!(
                    "{} did not accept within {CONNECT_TIMEOUT:?}",
                    self.target.events.endpoint
                )
            })?
            .map_err(|e| format!("connect {}: {e}", self.target.events.endpoint))?;
        sub.subscribe(&self.target.events.topic)
            .await
            .map_err(|e| format!("subscribe: {e}"))?;
        log::info!(
            "kv events: following {} at {}",
            self.target.name,
            self.target.events.endpoint
        );
        // Nothing known yet, and nothing stale: what the stream stores from here is cached.
        self.set(SyncState::Partial);
        // The engine's history, as far as its replay buffer reaches back.
        self.catch_up(0, false).await;
        let mut idle = tokio::time::interval(IDLE_PROBE);
        idle.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut heard = false;
        loop {
            tokio::select! {
                msg = sub.recv() => {
                    let msg = msg.map_err(|e| format!("receive: {e}"))?;
                    self.on_message(msg).await;
                    heard = true;
                }
                ev = monitor.next() => match ev {
                    Some(SocketEvent::Disconnected(_)) | None => return Ok(()),
                    Some(_) => {}
                },
                // A lost batch shows as a gap only when the next one comes: on a quiet engine
                // that may be never. So after a quiet interval, ask whether anything was sent.
                _ = idle.tick() => {
                    if !std::mem::take(&mut heard) {
                        if let Some(e) = self.expected {
                            self.catch_up(e, true).await;
                        }
                    }
                }
            }
        }
    }

    async fn on_message(&mut self, msg: ZmqMessage) {
        let frames = msg.into_vec();
        let (Some(seq), Some(payload)) = (frames.get(1).and_then(seq_of), frames.get(2)) else {
            self.metrics.batch(self.target.who(), "malformed");
            let what = format!(
                "a message of {} frame(s), not [topic, seq, batch]",
                frames.len()
            );
            self.malformed.warn(&self.target.name, &what);
            return;
        };
        self.metrics.batch(self.target.who(), "received");
        if self.replayed(seq) {
            return;
        }
        match self.expected {
            Some(e) if seq == e => {}
            Some(e) if seq > e => {
                // A gap, or a number the engine never published (a corrupt frame): its own
                // history tells them apart. Not one to wipe a backend for.
                if !self.gap_until(e, seq).await {
                    self.metrics.batch(self.target.who(), "malformed");
                    let what =
                        format!("sequence number {seq} is past the engine's history (next {e})");
                    self.malformed.warn(&self.target.name, &what);
                    return;
                }
            }
            None => self.catch_up(0, false).await,
            // The same batch again (delivery is at least once): already applied.
            Some(_) if self.recent.contains(&(seq, payload_hash(payload))) => {
                self.metrics.batch(self.target.who(), "duplicate");
                return;
            }
            Some(_) => {
                log::warn!(
                    "kv events: {} restarted its sequence at {seq}; its blocks are forgotten",
                    self.target.name
                );
                self.set(SyncState::Partial);
                self.catch_up(0, false).await;
            }
        }
        if self.replayed(seq) {
            return;
        }
        self.apply(seq, payload);
        self.expected = Some(seq + 1);
    }

    /// Whether batch `seq` was already applied from a replay.
    fn replayed(&mut self, seq: u64) -> bool {
        match self.replayed_upto {
            Some(upto) if seq <= upto => true,
            _ => {
                self.replayed_upto = None;
                false
            }
        }
    }

    /// Ask the replay socket for every batch from `from` and apply those it still has. From 0
    /// (joining, or after a restart) that is the engine's whole history when its buffer
    /// reaches back to its start, and kvroute is then synced; an engine that has published
    /// nothing yet has nothing cached. A gap the buffer no longer covers leaves the backend
    /// partial: its blocks are forgotten (the missed batches may have removed some) and
    /// followed from the first batch the buffer has. `probe`: nothing is known to be missing,
    /// so an empty answer is not a loss.
    /// A live batch `seq` came while `from` was expected. Replays the gap, and returns whether
    /// the engine's history confirms `seq`: when the replay answers with every batch from
    /// `from` on and none reaches `seq`, the engine never published it, and what was replayed
    /// is applied without forgetting anything. Without an answer it is taken as a gap.
    async fn gap_until(&mut self, from: u64, seq: u64) -> bool {
        let Some(r) = &self.target.events.replay_endpoint else {
            self.catch_up(from, false).await;
            return true;
        };
        if let Ok(batches) = replay(r, from).await {
            let contiguous = batches.first().is_none_or(|(s, _)| *s == from);
            if contiguous && batches.last().is_none_or(|(s, _)| *s < seq) {
                for (s, payload) in &batches {
                    self.metrics.batch(self.target.who(), "replayed");
                    self.apply(*s, payload);
                    self.expected = Some(s + 1);
                }
                return false;
            }
        }
        self.catch_up(from, false).await;
        true
    }

    async fn catch_up(&mut self, from: u64, probe: bool) {
        let got = match &self.target.events.replay_endpoint {
            Some(r) => replay(r, from).await,
            None => Err("no replay_endpoint is configured".into()),
        };
        let batches = match got {
            Ok(b) => b,
            Err(e) => {
                if probe {
                    log::debug!("kv events: {}: replay probe failed: {e}", self.target.name);
                } else if self.expected.is_some() {
                    self.metrics.batch(self.target.who(), "lost");
                    log::warn!(
                        "kv events: {} skipped batches from {from} and the replay failed ({e}); \
                         its blocks are forgotten and followed from here",
                        self.target.name
                    );
                    self.set(SyncState::Partial);
                } else {
                    log::info!(
                        "kv events: {}: no history ({e}); partial until the engine clears or restarts",
                        self.target.name
                    );
                }
                return;
            }
        };
        let first = batches.first().map(|(s, _)| *s);
        let whole = first == Some(from)
            || (first.is_none() && (probe || (from == 0 && self.expected.is_none())));
        if !whole {
            if let Some(f) = first {
                let lost = f.saturating_sub(from).max(1);
                self.metrics
                    .count(&self.metrics.batches, self.target.who(), "lost", lost);
            }
            log::warn!(
                "kv events: {} missed batches from {from} its replay buffer no longer holds; \
                 its blocks are forgotten and followed from here",
                self.target.name
            );
            self.set(SyncState::Partial);
        } else if from == 0 {
            self.set(SyncState::Synced);
        }
        for (seq, payload) in &batches {
            self.metrics.batch(self.target.who(), "replayed");
            self.apply(*seq, payload);
            self.expected = Some(seq + 1);
        }
        self.replayed_upto = batches.last().map(|(s, _)| *s);
    }

    fn apply(&mut self, seq: u64, payload: &Bytes) {
        if self.recent.len() == RECENT_BATCHES {
            self.recent.pop_front();
        }
        self.recent.push_back((seq, payload_hash(payload)));
        let who = self.target.who();
        match wire::decode_events(payload) {
            Ok((batch, undecodable)) => {
                if let Some(first) = undecodable.first() {
                    // What an event kvroute cannot read did is unknown (a removal it missed
                    // would leave a block believed cached): the backend's blocks are forgotten
                    // and it is followed from here, with the events of this batch that did
                    // decode.
                    self.metrics.count(
                        &self.metrics.events,
                        who,
                        "undecodable",
                        undecodable.len() as u64,
                    );
                    let what = format!(
                        "{} undecodable event(s), the first {first}; the backend's blocks are \
                         forgotten and it is followed from here",
                        undecodable.len()
                    );
                    self.malformed.warn(&self.target.name, &what);
                    self.set(SyncState::Partial);
                }
                // Ports offset otherwise than vLLM does would put one rank's blocks under
                // another's name, and pin requests to a rank that lacks them.
                if let Some(r) = batch.dp_rank.filter(|&r| r != self.target.rank) {
                    if !self.rank_mismatch {
                        self.rank_mismatch = true;
                        log::warn!(
                            "kv events: {} publishes as data-parallel rank {r}: its endpoints \
                             are not rank {}'s (kv_events.data_parallel_size)",
                            self.target.name,
                            self.target.rank
                        );
                    }
                }
                if let Some((a, skipped)) =
                    self.writer
                        .apply(&batch, self.target.block_size, &mut self.groups)
                {
                    let m = self.metrics;
                    let applied = (batch.events.len() - skipped) as u64;
                    m.count(&m.events, who, "applied", applied);
                    m.count(&m.events, who, "skipped", skipped as u64);
                    m.count(&m.blocks, who, "stored", a.blocks_stored as u64);
                    m.count(&m.blocks, who, "removed", a.blocks_removed as u64);
                    m.count(&m.blocks, who, "unresolved", a.unresolved as u64);
                    if batch
                        .events
                        .iter()
                        .any(|e| matches!(e, wire::Event::Cleared))
                    {
                        m.set_sync(who, self.writer.sync());
                    }
                }
            }
            Err(e) => {
                self.metrics.batch(who, "malformed");
                self.malformed.warn(&self.target.name, &e);
            }
        }
    }
}

fn payload_hash(payload: &Bytes) -> u64 {
    xxhash_rust::xxh3::xxh3_64(payload)
}

fn seq_of(frame: &Bytes) -> Option<u64> {
    <[u8; 8]>::try_from(frame.as_ref())
        .ok()
        .map(u64::from_be_bytes)
}

/// The batches an engine's replay socket still holds from `from` on: the contiguous run from
/// the first it sends, in order.
async fn replay(endpoint: &str, from: u64) -> Result<Vec<(u64, Bytes)>, String> {
    let mut dealer = DealerSocket::new();
    tokio::time::timeout(REPLAY_TIMEOUT, dealer.connect(endpoint))
        .await
        .map_err(|_| "the replay socket did not accept".to_string())?
        .map_err(|e| format!("replay connect: {e}"))?;
    let ask = ZmqMessage::try_from(vec![
        Bytes::new(),
        Bytes::copy_from_slice(&from.to_be_bytes()),
    ])
    .map_err(|e| format!("replay request: {e}"))?;
    dealer
        .send(ask)
        .await
        .map_err(|e| format!("replay send: {e}"))?;
    let mut out: Vec<(u64, Bytes)> = Vec::new();
    let deadline = tokio::time::Instant::now() + REPLAY_TIMEOUT;
    loop {
        let msg = tokio::time::timeout_at(deadline, dealer.recv())
            .await
            .map_err(|_| "the replay did not finish in time".to_string())?
            .map_err(|e| format!("replay receive: {e}"))?;
        let frames = msg.into_vec();
        // [empty, seq, payload]; a socket that strips the empty delimiter is read alike.
        let rest = match frames.first() {
            Some(f) if f.is_empty() => &frames[1..],
            _ => &frames[..],
        };
        let Some(seq) = rest.first() else {
            return Err("an empty replay frame".into());
        };
        if seq.as_ref() == END_SEQ {
            return Ok(out);
        }
        let (Some(seq), Some(payload)) = (seq_of(seq), rest.get(1)) else {
            return Err("a malformed replay frame".into());
        };
        let next = out.last().map_or(seq.max(from), |(s, _)| s + 1);
        if seq == next && out.len() < REPLAY_MAX {
            out.push((seq, payload.clone()));
        }
    }
}
