#!/usr/bin/env python3
# Used by: tests/kv_events.rs
"""A reference KV event publisher, built on the libraries vLLM publishes with (msgspec, pyzmq).

It sends the batches of a JSON file the way vLLM's ZmqEventPublisher
(vllm/distributed/kv_events.py) does, so a subscriber can be tested against the engine's own
encoder and socket library rather than against `kvbench sim --kv-events` alone:

- a PUB socket bound at --pub sends each batch as `[topic, seq, payload]`: seq an 8-byte
  big-endian unsigned integer from 0, payload the msgpack of a KVEventBatch, array-like
  `[ts, events, data_parallel_rank]` (rank 0, or --data-parallel-rank);
- a ROUTER socket bound at --replay keeps the last 10,000 batches. A request
  `[identity, b"", start_seq]` (a DEALER sends `[b"", start_seq]`) gets
  `[identity, b"", seq, payload]` for every kept batch with seq >= start_seq, then
  `[identity, b"", (-1) as 8 signed big-endian bytes, b""]`. Other requests are reported on
  stderr and ignored.

Events are tagged maps, `{"type": "BlockStored", ...fields}`, as vLLM's KVCacheEvent
(tag=True) encodes them; with --array-events they are tagged arrays,
`["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
lora_name, ...]`, the array-like form SGLang sends (and vLLM did before its events became
maps).

FILE.json lists batches, each a list of events in plain JSON:

    [[{"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": null,
       "token_ids": [...32 ints...], "block_size": 16}],
     [{"type": "BlockRemoved", "block_hashes": [2]}],
     [{"type": "AllBlocksCleared"}]]

Omitted fields take these values: parent_block_hash null, block_size 16, lora_id null,
medium "GPU", lora_name null, and null for the fields newer vLLM releases added (extra_keys:
one entry per block, null or a list of keys; group_idx; kv_cache_spec_kind;
kv_cache_spec_sliding_window), which msgspec then leaves out. One line per sent batch goes to
stderr.

    /tmp/pyev/bin/python bench/scripts/kv_events_reference.py \\
        --pub tcp://127.0.0.1:5557 --replay tcp://127.0.0.1:5558 --events batches.json \\
        --interval-ms 50 --repeat-seconds 5

--repeat-seconds S keeps the process serving replay (and sending nothing more) until S
seconds after it started, so a subscriber that connects late can still replay from seq 0.

--resend SEQ sends batch SEQ again, same sequence number and payload, right after the batch
that follows it: the at-least-once redelivery a subscriber must not take for a restart.
--bogus-after SEQ sends, right after batch SEQ, a copy of it under a sequence number 2**40
ahead that the replay buffer never holds: a corrupt frame a subscriber must not wipe a backend
for. --garbage-in SEQ adds to batch SEQ an event of a kind no engine sends
(`{"type": "BlockMangled"}`), after its own events.
"""

import argparse
import collections
import json
import sys
import time
from typing import Any

import msgspec
import zmq

REPLAY_BATCHES = 10_000
END_SEQ = (-1).to_bytes(8, "big", signed=True)


# The shapes of vllm/distributed/kv_events.py: the batch array-like, events tagged maps.


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the events; tag=True puts the class name under "type"."""


# Each event's fields in vLLM's order (those with a default may be left out of an event). The map
# and the array form are built from this one list, so they cannot drift apart.
EVENT_FIELDS = {
    "BlockStored": [
        ("block_hashes", list[int]),
        ("parent_block_hash", int | None),
        ("token_ids", list[int]),
        ("block_size", int),
        ("lora_id", int | None),
        ("medium", str | None),
        ("lora_name", str | None),
        ("extra_keys", list[tuple[Any, ...] | None] | None, None),
        ("group_idx", int | None, None),
        ("kv_cache_spec_kind", str | None, None),
        ("kv_cache_spec_sliding_window", int | None, None),
    ],
    "BlockRemoved": [
        ("block_hashes", list[int]),
        ("medium", str | None),
        ("group_idx", int | None, None),
    ],
    "AllBlocksCleared": [],
}


# The same events array-like (--array-events): the tag, then the fields in order.
class ArrayKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    pass


MAP_EVENTS = {k: msgspec.defstruct(k, f, bases=(KVCacheEvent,)) for k, f in EVENT_FIELDS.items()}
ARRAY_EVENTS = {
    k: msgspec.defstruct("Array" + k, f, bases=(ArrayKVCacheEvent,), tag=k) for k, f in EVENT_FIELDS.items()
}


FIELDS = {
    "BlockStored": {
        "block_hashes": None,
        "parent_block_hash": None,
        "token_ids": None,
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": None,
        "group_idx": None,
        "kv_cache_spec_kind": None,
        "kv_cache_spec_sliding_window": None,
    },
    "BlockRemoved": {"block_hashes": None, "medium": "GPU", "group_idx": None},
    "AllBlocksCleared": {},
}
REQUIRED = {"BlockStored": ("block_hashes", "token_ids"), "BlockRemoved": ("block_hashes",)}


def make_event(raw: dict, array_events: bool):
    """One event of FILE.json as its struct; a typo in a name is an error, not a default."""
    if not isinstance(raw, dict) or raw.get("type") not in FIELDS:
        raise ValueError(f"not an event (type must be one of {sorted(FIELDS)}): {raw!r}")
    kind = raw["type"]
    fields = dict(FIELDS[kind])
    unknown = set(raw) - set(fields) - {"type"}
    if unknown:
        raise ValueError(f"{kind}: unknown field(s) {sorted(unknown)}")
    missing = [f for f in REQUIRED.get(kind, ()) if f not in raw]
    if missing:
        raise ValueError(f"{kind}: missing field(s) {missing}")
    fields.update((k, v) for k, v in raw.items() if k != "type")
    cls = (ARRAY_EVENTS if array_events else MAP_EVENTS)[kind]
    return cls(**fields)


def encode_batch(raw_events: list, array_events: bool, ts: float, rank: int = 0,
                 garbage: bool = False) -> bytes:
    """The payload of one batch, as the publisher thread encodes it."""
    events: list[Any] = [make_event(e, array_events) for e in raw_events]
    if garbage:
        events.append({"type": "BlockMangled"})
    return msgspec.msgpack.encode(EventBatch(ts=ts, events=events, data_parallel_rank=rank))


def load_batches(path: str, array_events: bool) -> list:
    with open(path, encoding="utf-8") as f:
        batches = json.load(f)
    if not isinstance(batches, list) or not all(isinstance(b, list) for b in batches):
        raise ValueError(f"{path}: want a list of batches, each a list of events")
    for i, batch in enumerate(batches):
        for event in batch:
            try:
                make_event(event, array_events)
            except (ValueError, TypeError) as e:
                raise ValueError(f"{path}: batch {i}: {e}") from e
    return batches


class Publisher:
    def __init__(self, pub: str, replay: str, topic: str):
        self.ctx = zmq.Context.instance()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.set_hwm(100_000)
        self.pub.bind(pub)
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind(replay)
        self.poller = zmq.Poller()
        self.poller.register(self.router, zmq.POLLIN)
        self.topic = topic.encode("utf-8")
        self.buffer = collections.deque(maxlen=REPLAY_BATCHES)
        self.seq = 0

    def send(self, payload: bytes) -> int:
        seq = self.seq
        self.seq += 1
        self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
        self.buffer.append((seq, payload))
        return seq

    def serve_until(self, deadline: float) -> None:
        """Answers replay requests until `deadline` (time.monotonic())."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            if self.poller.poll(left * 1000):
                self.serve_replay()

    def serve_replay(self) -> None:
        frames = self.router.recv_multipart()
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            sizes = [len(f) for f in frames]
            print(f"kv-events-reference: malformed replay request ignored (frame sizes {sizes})",
                  file=sys.stderr)
            return
        identity, _, start = frames
        start_seq = int.from_bytes(start, "big")
        sent = 0
        for seq, payload in self.buffer:
            if seq >= start_seq:
                self.router.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
                sent += 1
        self.router.send_multipart((identity, b"", END_SEQ, b""))
        print(f"kv-events-reference: replayed {sent} batch(es) from seq {start_seq}", file=sys.stderr)

    def close(self) -> None:
        # A short linger lets the last messages leave before the process does.
        self.pub.close(linger=200)
        self.router.close(linger=200)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pub", required=True, help="PUB endpoint to bind, e.g. tcp://127.0.0.1:5557")
    ap.add_argument("--replay", required=True, help="ROUTER endpoint to bind, e.g. tcp://127.0.0.1:5558")
    ap.add_argument("--events", required=True, help="JSON file: a list of batches of events")
    ap.add_argument("--topic", default="", help="topic frame of every message (default empty)")
    ap.add_argument("--array-events", action="store_true",
                    help="encode events as tagged arrays (SGLang's form) instead of tagged maps")
    ap.add_argument("--interval-ms", type=float, default=50.0, help="wait between batches (default 50)")
    ap.add_argument("--data-parallel-rank", type=int, default=0,
                    help="the rank every batch names (vLLM: one publisher per rank, default 0)")
    ap.add_argument("--garbage-in", type=int, default=None,
                    help="add an event of an unknown kind to batch SEQ")
    ap.add_argument("--bogus-after", type=int, default=None,
                    help="after batch SEQ, send it again under a far-ahead sequence number")
    ap.add_argument("--resend", type=int, default=None,
                    help="send batch SEQ again after the next one (at-least-once redelivery)")
    ap.add_argument("--repeat-seconds", type=float, default=0.0,
                    help="serve replay until this many seconds after start (default 0: exit after the last batch)")
    args = ap.parse_args()
    try:
        batches = load_batches(args.events, args.array_events)
    except (OSError, ValueError) as e:
        print(f"kv-events-reference: {e}", file=sys.stderr)
        return 2
    started = time.monotonic()
    publisher = Publisher(args.pub, args.replay, args.topic)
    try:
        for i, batch in enumerate(batches):
            if i > 0:
                publisher.serve_until(time.monotonic() + args.interval_ms / 1000)
            payload = encode_batch(batch, args.array_events, time.time(), args.data_parallel_rank,
                                   garbage=i == args.garbage_in)
            seq = publisher.send(payload)
            kinds = ",".join(e["type"] for e in batch) or "-"
            print(f"kv-events-reference: sent seq {seq}: {len(batch)} event(s) [{kinds}], "
                  f"{len(payload)} bytes", file=sys.stderr)
            if args.bogus_after is not None and seq == args.bogus_after:
                publisher.pub.send_multipart((publisher.topic, (seq + 2**40).to_bytes(8, "big"), payload))
                print(f"kv-events-reference: sent seq {seq + 2**40} (bogus)", file=sys.stderr)
            if args.resend is not None and seq == args.resend + 1:
                again = next(p for s, p in publisher.buffer if s == args.resend)
                publisher.pub.send_multipart((publisher.topic, args.resend.to_bytes(8, "big"), again))
                print(f"kv-events-reference: sent seq {args.resend} again", file=sys.stderr)
        publisher.serve_until(started + args.repeat_seconds)
    except KeyboardInterrupt:
        pass
    finally:
        publisher.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
