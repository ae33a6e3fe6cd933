//! `sim --kv-events`: an engine's KV events (`kvevents`) on ZMQ sockets, served as vLLM's
//! `ZmqEventPublisher` serves them.
//!
//! # Sockets
//! Server k binds a PUB socket at `--kv-events` PORT + 2k and a ROUTER replay socket at
//! PORT + 2k + 1, on `--host`. Each batch goes out on PUB as the multipart message
//! `[topic, seq, payload]`: `--kv-events-topic` (default empty), the batch's sequence number
//! as a u64 big-endian (0 first, one more per batch) and its msgpack. The ROUTER keeps the
//! last `REPLAY_BATCHES` batches. A request `[identity, "", start_seq]` (what a DEALER sends
//! as `["", start_seq]`; start_seq a u64 big-endian) gets, for each kept batch with
//! `seq >= start_seq` in order, `[identity, "", seq, payload]`, then the end marker
//! `[identity, "", -1 as an i64 big-endian, ""]`. A request of any other shape is logged and
//! ignored.
//!
//! # Never stalling the engine
//! `publish` runs on the engine task and never waits: it numbers and encodes the batch, keeps
//! it for replay (a short lock) and hands it to the PUB task through a bounded channel. When
//! that channel is full the PUB send is skipped and counted (`overflow`), but the batch is
//! kept for replay all the same, so a subscriber sees a gap in the sequence and repairs it by
//! replay, exactly as after a loss on the network. The replay task copies what it sends out of
//! the ring under the lock and sends after, so only the slow replay client waits.
//!
//! # Injected loss
//! `--kv-events-drop-percent P` skips the PUB send of about P% of batches, chosen by a hash of
//! the sequence number (the same batches every run); they are numbered and kept for replay
//! like the others, so a subscriber's gap repair can be tested.
//!
//! # Replay memory
//! vLLM keeps 10,000 batches (`buffer_steps`). A simulated prefill step of 8192 tokens makes a
//! ~45 KB batch, so the ring also stops at `REPLAY_BYTES`, dropping the oldest first: under
//! heavy prefill it then holds fewer than 10,000 batches.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::{mpsc, oneshot};
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use super::kvevents::{encode_batch, KvEvent};

/// Batches kept for replay, as vLLM's default `buffer_steps`.
pub const REPLAY_BATCHES: usize = 10_000;
/// Bytes of payload kept for replay, at most (see the module comment).
pub const REPLAY_BYTES: usize = 64 << 20;
/// Batches waiting for the PUB task; ~20 s of engine steps at 5 ms.
const QUEUE_BATCHES: usize = 4096;
/// What follows the last replayed batch, in place of a sequence number.
const END_SEQ: [u8; 8] = (-1i64).to_be_bytes();
const DROP_SALT: u64 = 0x6b76_6576_656e_7473;

/// What every server's publisher shares (`--kv-events-topic`, `--kv-events-drop-percent`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct KvEventsOptions {
    pub topic: String,
    pub drop_percent: f64,
}

/// Batch counts for `/metrics`.
#[derive(Debug, Default)]
pub struct KvEventCounters {
    /// Numbered, whether sent or not (the next sequence number).
    pub batches: AtomicU64,
    /// Handed to the PUB socket (which, like any ZMQ PUB, drops them when no one subscribes).
    pub published: AtomicU64,
    /// Not sent by `--kv-events-drop-percent`.
    pub dropped: AtomicU64,
    /// Not sent because the PUB task was behind.
    pub overflow: AtomicU64,
}

/// The endpoints a publisher bound, as ZMQ names them (`tcp://127.0.0.1:5557`).
#[derive(Debug, Clone)]
pub struct Bound {
    pub publish: String,
    pub replay: String,
}

pub struct Publisher {
    next_seq: u64,
    drop_percent: f64,
    ring: Arc<Mutex<Ring>>,
    tx: mpsc::Sender<(u64, Bytes)>,
    counters: Arc<KvEventCounters>,
    bound: Bound,
    /// Dropped with the publisher, which ends the replay task.
    _stop: oneshot::Sender<()>,
}

impl Publisher {
    /// Binds both sockets (port 0: an ephemeral one) and starts their tasks on the current
    /// runtime.
    pub async fn bind(
        publish: SocketAddr,
        replay: SocketAddr,
        options: &KvEventsOptions,
    ) -> Result<Self, String> {
        let mut pub_socket = PubSocket::new();
        let pub_at = pub_socket
            .bind(&format!("tcp://{publish}"))
            .await
            .map_err(|e| format!("--kv-events: cannot bind PUB tcp://{publish}: {e}"))?;
        let mut router = RouterSocket::new();
        let replay_at = router
            .bind(&format!("tcp://{replay}"))
            .await
            .map_err(|e| format!("--kv-events: cannot bind ROUTER tcp://{replay}: {e}"))?;
        let ring = Arc::new(Mutex::new(Ring::default()));
        let counters = Arc::new(KvEventCounters::default());
        let (tx, rx) = mpsc::channel(QUEUE_BATCHES);
        let (stop, stopped) = oneshot::channel();
        let topic = Bytes::from(options.topic.clone().into_bytes());
        tokio::spawn(send_loop(pub_socket, topic, rx, counters.clone()));
        tokio::spawn(replay_loop(router, ring.clone(), stopped));
        Ok(Self {
            next_seq: 0,
            drop_percent: options.drop_percent,
            ring,
            tx,
            counters,
            bound: Bound {
                publish: pub_at.to_string(),
                replay: replay_at.to_string(),
            },
            _stop: stop,
        })
    }

    pub fn bound(&self) -> &Bound {
        &self.bound
    }

    pub fn counters(&self) -> Arc<KvEventCounters> {
        self.counters.clone()
    }

    /// Sends one step's events as one batch (none when there are none); never waits.
    pub fn publish(&mut self, events: &[KvEvent]) {
        if events.is_empty() {
            return;
        }
        let payload = match encode_batch(unix_seconds(), events) {
            Ok(p) => Bytes::from(p),
            Err(e) => {
                log::error!("kv events: batch not sent: {e}");
                return;
            }
        };
        let seq = self.next_seq;
        self.next_seq += 1;
        self.counters.batches.store(self.next_seq, Relaxed);
        lock(&self.ring).push(seq, payload.clone());
        if injected_drop(seq, self.drop_percent) {
            self.counters.dropped.fetch_add(1, Relaxed);
            return;
        }
        match self.tx.try_send((seq, payload)) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(_)) => {
                self.counters.overflow.fetch_add(1, Relaxed);
            }
            Err(mpsc::error::TrySendError::Closed(_)) => {
                self.counters.overflow.fetch_add(1, Relaxed);
                log::warn!("kv events: the PUB task is gone; batch {seq} kept for replay only");
            }
        }
    }
}

fn unix_seconds() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Whether `--kv-events-drop-percent` skips batch `seq`: a hash, so the choice is spread
/// evenly and the same every run.
fn injected_drop(seq: u64, percent: f64) -> bool {
    let draw = xxhash_rust::xxh3::xxh3_64_with_seed(&seq.to_le_bytes(), DROP_SALT) % 10_000;
    (draw as f64) < percent * 100.0
}

fn lock(ring: &Mutex<Ring>) -> MutexGuard<'_, Ring> {
    ring.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The batches kept for replay, oldest first.
#[derive(Default)]
struct Ring {
    batches: VecDeque<(u64, Bytes)>,
    bytes: usize,
}

impl Ring {
    fn push(&mut self, seq: u64, payload: Bytes) {
        self.bytes += payload.len();
        self.batches.push_back((seq, payload));
        while self.batches.len() > REPLAY_BATCHES
            || (self.bytes > REPLAY_BYTES && self.batches.len() > 1)
        {
            if let Some((_, old)) = self.batches.pop_front() {
                self.bytes -= old.len();
            }
        }
    }

    fn since(&self, start: u64) -> Vec<(u64, Bytes)> {
        // Sequence numbers are consecutive, so the first wanted batch is found by arithmetic.
        let first = self.batches.front().map_or(0, |&(seq, _)| seq);
        let skip = usize::try_from(start.saturating_sub(first)).unwrap_or(usize::MAX);
        self.batches.iter().skip(skip).cloned().collect()
    }
}

async fn send_loop(
    mut socket: PubSocket,
    topic: Bytes,
    mut rx: mpsc::Receiver<(u64, Bytes)>,
    counters: Arc<KvEventCounters>,
) {
    while let Some((seq, payload)) = rx.recv().await {
        let mut message = ZmqMessage::from(topic.clone());
        message.push_back(Bytes::copy_from_slice(&seq.to_be_bytes()));
        message.push_back(payload);
        match socket.send(message).await {
            Ok(()) => {
                counters.published.fetch_add(1, Relaxed);
            }
            Err(e) => log::warn!("kv events: PUB send of batch {seq} failed: {e}"),
        }
    }
}

async fn replay_loop(
    mut socket: RouterSocket,
    ring: Arc<Mutex<Ring>>,
    mut stop: oneshot::Receiver<()>,
) {
    loop {
        let received = tokio::select! {
            _ = &mut stop => return,
            r = socket.recv() => r,
        };
        let frames = match received {
            Ok(message) => message.into_vec(),
            Err(e) => {
                // Not expected while the socket lives; a pause keeps a persistent error from
                // spinning.
                log::debug!("kv events: replay recv: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Some((identity, start)) = parse_request(&frames) else {
            let sizes: Vec<usize> = frames.iter().map(Bytes::len).collect();
            log::warn!("kv events: malformed replay request ignored (frame sizes {sizes:?})");
            continue;
        };
        let batches = lock(&ring).since(start);
        let sent = batches.len();
        for (seq, payload) in batches {
            let seq = Bytes::copy_from_slice(&seq.to_be_bytes());
            if let Err(e) = socket.send(reply(&identity, seq, payload)).await {
                log::debug!("kv events: replay client gone: {e}");
                break;
            }
        }
        let end = reply(&identity, Bytes::from_static(&END_SEQ), Bytes::new());
        if let Err(e) = socket.send(end).await {
            log::debug!("kv events: replay client gone: {e}");
        }
        log::debug!("kv events: replayed {sent} batch(es) from seq {start}");
    }
}

/// `[identity, "", start_seq]`, start_seq 8 bytes big-endian.
fn parse_request(frames: &[Bytes]) -> Option<(Bytes, u64)> {
    let [identity, delimiter, start] = frames else {
        return None;
    };
    if !delimiter.is_empty() {
        return None;
    }
    let start: [u8; 8] = start.as_ref().try_into().ok()?;
    Some((identity.clone(), u64::from_be_bytes(start)))
}

fn reply(identity: &Bytes, seq: Bytes, payload: Bytes) -> ZmqMessage {
    let mut message = ZmqMessage::from(identity.clone());
    message.push_back(Bytes::new());
    message.push_back(seq);
    message.push_back(payload);
    message
}

#[cfg(test)]
#[path = "kvpublish_tests.rs"]
mod tests;
