"""The --kv-events publisher's queue between the event loop and its thread is bounded:
past QUEUE_LIMIT waiting index events, `on_event` drops and counts (GetStats'
`kv_events_dropped`), never blocks; once the thread runs, the queue drains and a
subscriber (a real ZMQ SUB socket on the real PUB socket) reads what was kept.

The whole stream with real engines and a subscriber that never reads:
tests/vllm/test_kv_event_stream.py; its cost: `python -m kvdepot.bench.kv_events_stuck`.
"""

from __future__ import annotations

import time

import msgspec
import zmq

from kvdepot.server.core.index_types import IndexEvent
from kvdepot.server.core.kinds import EventKind
from kvdepot.server.kv_events import QUEUE_LIMIT, BlockStored, KVEventBatch, KvEventPublisher
from tests.support.ops import free_port


def test_a_full_queue_drops_and_counts_and_the_rest_is_published() -> None:
    port = free_port()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind(f"tcp://127.0.0.1:{port}")  # a router's bound SUB socket: the daemon connects
    publisher = KvEventPublisher(f"tcp://127.0.0.1:{port}", lambda ns, keys: [b""] * len(keys))
    try:
        key = (7).to_bytes(32, "big") + (0).to_bytes(4, "big")
        event = IndexEvent("ns", EventKind.STORED, (key,))
        extra = 25
        for _ in range(QUEUE_LIMIT + extra):  # the thread not started: nothing drains
            publisher.on_event(event)
        assert (publisher.dropped, len(publisher._queue)) == (extra, QUEUE_LIMIT)

        publisher.start()
        deadline = time.monotonic() + 30
        stored = 0
        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        while stored < QUEUE_LIMIT:
            assert time.monotonic() < deadline, f"{stored} of {QUEUE_LIMIT} events read"
            if sub.poll(200):
                _topic, _seq, payload = sub.recv_multipart()
                batch = decoder.decode(payload)
                stored += sum(isinstance(e, BlockStored) for e in batch.events)
        assert stored == QUEUE_LIMIT and len(publisher._queue) == 0
        publisher.on_event(event)  # room again: kept, not dropped
        assert publisher.dropped == extra
    finally:
        publisher.close()
        ctx.destroy(linger=0)
