//! The publisher on real sockets on 127.0.0.1: a zeromq SUB and DEALER connect as a router's
//! subscriber would.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use zeromq::{DealerSocket, SubSocket};

use super::*;
use crate::sim::api::server;
use crate::sim::config::SimConfig;
use crate::sim::engine::kv_events::kvevents::decode_batch;
use crate::sim::engine::kvcache::block_hashes;
use crate::sim::text::prompt::render_chat;

const WAIT: Duration = Duration::from_secs(10);
const TOPIC: &str = "kv@sim";

fn batch(n: u64) -> Vec<KvEvent> {
    vec![
        KvEvent::BlockStored {
            block_hashes: vec![n + 1, n + 2],
            parent_block_hash: (n > 0).then_some(n),
            token_ids: (0..32).map(|t| t + n as u32).collect(),
            salt: None,
        },
        KvEvent::BlockRemoved {
            block_hashes: vec![n + 1000],
        },
    ]
}

async fn start(drop_percent: f64) -> (Publisher, SubSocket, DealerSocket) {
    let any = "127.0.0.1:0".parse().unwrap();
    let options = KvEventsOptions {
        topic: TOPIC.into(),
        drop_percent,
    };
    let publisher = Publisher::bind(any, any, &options).await.unwrap();
    let (sub, dealer) = connect(publisher.bound()).await;
    (publisher, sub, dealer)
}

async fn connect(bound: &Bound) -> (SubSocket, DealerSocket) {
    assert!(bound.publish.starts_with("tcp://127.0.0.1:"), "{bound:?}");
    let mut sub = SubSocket::new();
    sub.connect(&bound.publish).await.unwrap();
    // A prefix of the topic, as ZMQ subscriptions match.
    sub.subscribe("kv@").await.unwrap();
    let mut dealer = DealerSocket::new();
    dealer.connect(&bound.replay).await.unwrap();
    (sub, dealer)
}

/// One PUB message: its seq and payload, after checking the topic and the frame count.
async fn receive(sub: &mut SubSocket) -> (u64, Bytes) {
    let message = tokio::time::timeout(WAIT, sub.recv())
        .await
        .unwrap()
        .unwrap();
    let frames = message.into_vec();
    assert_eq!(frames.len(), 3, "{frames:?}");
    assert_eq!(frames[0], TOPIC.as_bytes());
    let seq: [u8; 8] = frames[1].as_ref().try_into().unwrap();
    (u64::from_be_bytes(seq), frames[2].clone())
}

/// Publishes until the subscriber gets a batch: a SUB's subscription reaches the PUB a little
/// after it connects, and whatever goes out before is lost to it (replay is for that).
async fn publish_until_received(p: &mut Publisher, sub: &mut SubSocket) -> (u64, Bytes) {
    loop {
        p.publish(&batch(p.next_seq));
        let wait = Duration::from_millis(50);
        if let Ok(got) = tokio::time::timeout(wait, sub.recv()).await {
            let frames = got.unwrap().into_vec();
            let seq: [u8; 8] = frames[1].as_ref().try_into().unwrap();
            return (u64::from_be_bytes(seq), frames[2].clone());
        }
        assert!(p.next_seq < 200, "the subscriber received nothing");
    }
}

/// Asks for every batch from `start`; returns them, checking the frames and the end marker.
async fn replay(dealer: &mut DealerSocket, start: u64) -> Vec<(u64, Bytes)> {
    let mut request = ZmqMessage::from(Bytes::new());
    request.push_back(Bytes::copy_from_slice(&start.to_be_bytes()));
    dealer.send(request).await.unwrap();
    let mut got = Vec::new();
    loop {
        let frames = tokio::time::timeout(WAIT, dealer.recv())
            .await
            .unwrap()
            .unwrap()
            .into_vec();
        assert_eq!(frames.len(), 3, "{frames:?}");
        assert!(frames[0].is_empty(), "{frames:?}");
        if frames[1].as_ref() == (-1i64).to_be_bytes() {
            assert!(frames[2].is_empty());
            return got;
        }
        let seq: [u8; 8] = frames[1].as_ref().try_into().unwrap();
        got.push((u64::from_be_bytes(seq), frames[2].clone()));
    }
}

fn seqs(batches: &[(u64, Bytes)]) -> Vec<u64> {
    batches.iter().map(|(seq, _)| *seq).collect()
}

#[tokio::test]
async fn pub_sends_vllm_frames_and_replay_returns_them_then_the_end_marker() {
    let (mut p, mut sub, mut dealer) = start(0.0).await;
    let (first, payload) = publish_until_received(&mut p, &mut sub).await;
    let (ts, events) = decode_batch(&payload).unwrap();
    assert_eq!(events, batch(first));
    assert!((unix_seconds() - ts).abs() < 60.0, "ts {ts}");
    // A step with no events is no batch: it takes no number.
    p.publish(&[]);
    for n in first + 1..first + 4 {
        p.publish(&batch(n));
        let (seq, payload) = receive(&mut sub).await;
        assert_eq!(seq, n);
        assert_eq!(decode_batch(&payload).unwrap().1, batch(n));
    }
    let last = first + 3;

    // Everything from 0, including what went out before the subscription took.
    let all = replay(&mut dealer, 0).await;
    assert_eq!(seqs(&all), (0..=last).collect::<Vec<_>>());
    for (seq, payload) in &all {
        assert_eq!(decode_batch(payload).unwrap().1, batch(*seq));
    }
    assert_eq!(all[first as usize].1, payload);
    assert_eq!(seqs(&replay(&mut dealer, last - 1).await), [last - 1, last]);
    assert!(replay(&mut dealer, last + 1).await.is_empty());

    // A malformed request gets no answer; the next good one is answered alone.
    let mut bad = ZmqMessage::from(Bytes::new());
    bad.push_back(Bytes::from_static(b"\0\0\0\x01"));
    dealer.send(bad).await.unwrap();
    assert_eq!(seqs(&replay(&mut dealer, last).await), [last]);

    let c = p.counters();
    assert_eq!(c.batches.load(Relaxed), last + 1);
    assert_eq!(c.published.load(Relaxed), last + 1);
    assert_eq!((c.dropped.load(Relaxed), c.overflow.load(Relaxed)), (0, 0));
}

#[tokio::test]
async fn injected_drops_leave_gaps_that_replay_repairs() {
    let (mut p, mut sub, mut dealer) = start(30.0).await;
    let (ready, _) = publish_until_received(&mut p, &mut sub).await;
    let sent: Vec<u64> = (ready + 1..=ready + 60)
        .filter(|&seq| !injected_drop(seq, 30.0))
        .collect();
    for n in ready + 1..=ready + 60 {
        p.publish(&batch(n));
    }
    let mut received = BTreeMap::new();
    while received.len() < sent.len() {
        let (seq, payload) = receive(&mut sub).await;
        received.insert(seq, payload);
    }
    assert_eq!(received.keys().copied().collect::<Vec<_>>(), sent);
    let gaps = 60 - sent.len();
    assert!((8..=30).contains(&gaps), "{gaps} of 60 dropped at 30%");

    let repaired = replay(&mut dealer, ready + 1).await;
    assert_eq!(
        seqs(&repaired),
        (ready + 1..=ready + 60).collect::<Vec<_>>()
    );
    for (seq, payload) in &repaired {
        if let Some(got) = received.get(seq) {
            assert_eq!(got, payload);
        }
        assert_eq!(decode_batch(payload).unwrap().1, batch(*seq));
    }
    let c = p.counters();
    let dropped = (0..=ready + 60).filter(|&s| injected_drop(s, 30.0)).count();
    assert_eq!(c.dropped.load(Relaxed), dropped as u64);
    assert_eq!(c.batches.load(Relaxed), ready + 61);
}

#[test]
fn drop_choice_is_about_p_percent_and_fixed_by_seq() {
    let count = |p: f64| (0..10_000u64).filter(|&s| injected_drop(s, p)).count();
    assert_eq!(count(0.0), 0);
    assert_eq!(count(100.0), 10_000);
    assert!((900..1100).contains(&count(10.0)), "{}", count(10.0));
    assert!((4800..5200).contains(&count(50.0)), "{}", count(50.0));
    // The batches dropped at 10% are dropped at 50% too.
    assert!((0..10_000u64)
        .filter(|&s| injected_drop(s, 10.0))
        .all(|s| injected_drop(s, 50.0)));
}

#[test]
fn ring_keeps_the_last_batches_within_its_bytes() {
    let mut ring = Ring::default();
    for seq in 0..REPLAY_BATCHES as u64 + 5 {
        ring.push(seq, Bytes::from_static(b"payload"));
    }
    assert_eq!(ring.batches.len(), REPLAY_BATCHES);
    assert_eq!(ring.since(0)[0].0, 5);
    assert_eq!(
        seqs(&ring.since(REPLAY_BATCHES as u64 + 3)),
        [10_003, 10_004]
    );
    assert!(ring.since(REPLAY_BATCHES as u64 + 5).is_empty());

    let big = Bytes::from(vec![0u8; REPLAY_BYTES / 3 + 1]);
    let mut ring = Ring::default();
    for seq in 0..4 {
        ring.push(seq, big.clone());
    }
    assert_eq!(seqs(&ring.since(0)), [2, 3]);
    assert_eq!(ring.bytes, 2 * big.len());
    // One batch larger than the whole budget is still kept, until the next.
    ring.push(4, Bytes::from(vec![0u8; REPLAY_BYTES + 1]));
    assert_eq!(seqs(&ring.since(0)), [4]);
}

#[test]
fn replay_requests_must_be_identity_empty_and_eight_bytes() {
    let id = Bytes::from_static(b"peer");
    let seq = Bytes::copy_from_slice(&7u64.to_be_bytes());
    let ok = parse_request(&[id.clone(), Bytes::new(), seq.clone()]);
    assert_eq!(ok, Some((id.clone(), 7)));
    assert_eq!(parse_request(&[id.clone(), seq.clone()]), None);
    assert_eq!(
        parse_request(&[id.clone(), Bytes::from_static(b"x"), seq.clone()]),
        None
    );
    let short = Bytes::from_static(b"\0\0\0\x07");
    assert_eq!(parse_request(&[id.clone(), Bytes::new(), short]), None);
    let extra = [id, Bytes::new(), seq.clone(), seq];
    assert_eq!(parse_request(&extra), None);
}

/// A server in engine mode, one chat request: the replayed stream names the prompt's blocks,
/// in chain order, and `/metrics` counts the batches.
#[tokio::test]
async fn engine_server_publishes_the_blocks_its_pool_names() {
    let any = "127.0.0.1:0".parse().unwrap();
    let publisher = Publisher::bind(any, any, &KvEventsOptions::default())
        .await
        .unwrap();
    let bound = publisher.bound().clone();
    let (_sub, mut dealer) = connect(&bound).await;
    let config = SimConfig::for_engine_tests(64_000, 20.0);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = server::spawn(listener, 0, Arc::new(config), vec![publisher]).unwrap();
    let messages = json!([
        {"role": "system", "content": "You are a helpful assistant. ".repeat(30)},
        {"role": "user", "content": "What does a KV event carry?"},
    ]);
    let body = json!({"model": "sim-llama-8b", "messages": messages, "max_tokens": 8});
    let http = reqwest::Client::new();
    let res = http
        .post(format!("http://{addr}/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);

    let batches = replay(&mut dealer, 0).await;
    assert_eq!(
        seqs(&batches),
        (0..batches.len() as u64).collect::<Vec<_>>()
    );
    let mut named = Vec::new();
    for (_, payload) in &batches {
        for event in decode_batch(payload).unwrap().1 {
            match event {
                KvEvent::BlockStored { block_hashes, .. } => named.extend(block_hashes),
                other => panic!("a 4,000-block pool evicts nothing: {other:?}"),
            }
        }
    }
    let prompt = block_hashes(&render_chat(&messages).unwrap());
    assert!(prompt.len() >= 10, "{}", prompt.len());
    assert_eq!(named[..prompt.len()], prompt[..]);

    let metrics = http
        .get(format!("http://{addr}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let line = format!("kvbench_kv_events_batches_total {}", batches.len());
    assert!(
        metrics.lines().any(|l| l == line),
        "{line} not in\n{metrics}"
    );
    assert!(metrics.contains("# TYPE kvbench_kv_events_published counter"));
    assert!(metrics
        .lines()
        .any(|l| l == "kvbench_kv_events_dropped_total 0"));
}
