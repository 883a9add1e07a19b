"""`kvdepot serve --kv-events tcp://HOST:PORT`: the node's pool as one KV-event stream.

KV-cache-aware routers (llm-d's precise prefix-cache scorer, Dynamo's KV router) index
an engine's blocks from vLLM's KV events. The daemon's pool is the node's: any engine
on the node loads from it, so it publishes its rows itself, in vLLM 0.33.0's wire
format (vllm.distributed.kv_events.ZmqEventPublisher's): a ZMQ PUB socket sending
(topic, 8-byte big-endian sequence number, msgpack `KVEventBatch`) frames. As vLLM's,
it binds an address with `*` (every interface) and connects to any other (a router
that binds its SUB socket and collects every publisher's, as llm-d's indexer does);
when it binds, a ROUTER socket on the next port answers a replay request (an empty
frame and an 8-byte start sequence number) with every buffered batch from it on, then
(b"", -1, b""). The first batch says `AllBlocksCleared`: a router forgets what an
earlier daemon had.

Events: a pool row that became READY is a BlockStored of medium "CPU" (complete when
the storing engine sent its chunk event, kvdepot.v1.ChunkEvent; otherwise vLLM's own
placeholder: the key's hash, no tokens, block size 0); a removed row a BlockRemoved
naming the same block hashes. Hashes are vLLM's external form: the low 64 bits as an
int unless VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 (vLLM's variable and default).

The daemon never waits for it: `on_event` runs on the event loop inside the index's
change and only appends to a bounded queue (a full queue drops the event and counts
it); one thread decodes, encodes and sends. A subscriber that never reads fills its
own ZMQ queue (the PUB socket's high-water mark, PUB_HWM batches of at most
BATCH_EVENTS events, drops for it), never the daemon's; the replay buffer keeps at most
BUFFER_BATCHES batches and BUFFER_BYTES.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import zmq

from kvdepot.server.core.index import IndexEvent
from kvdepot.server.core.kinds import EventKind
from kvdepot.v1 import depot_pb2

log = logging.getLogger("kvdepot.kv_events")

QUEUE_LIMIT = 65536  # index events waiting for the thread; more are dropped, counted
# A batch of complete 4-block chunk events is about 380 bytes an event encoded: 256
# events make at most ~100 KiB, which bounds what a subscriber can hold in bytes.
BATCH_EVENTS = 256  # vLLM events a batch carries at most
# Batches kept for replay: vLLM's buffer_steps default, and at most 64 MiB of them.
BUFFER_BATCHES = 10_000
BUFFER_BYTES = 64 << 20
# Batches ZMQ queues for one subscriber that does not read: ~100 MiB at most (vLLM's
# default, 100,000, would let a stuck router hold tens of GiB). Past it ZMQ drops for
# that subscriber alone; it sees the gap in the sequence numbers and replays.
PUB_HWM = 1_000
END_SEQ = (-1).to_bytes(8, "big", signed=True)


# vLLM's structs, field for field (vllm.distributed.kv_events): msgspec tags each event
# with its class name, so the names are part of the wire format.
class BlockStored(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None


class BlockRemoved(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def replay_endpoint(endpoint: str) -> str | None:
    """The replay ROUTER's address: the PUB address's port plus one, when the PUB
    socket binds (vLLM's rule: an address with `*`); None when it connects."""
    if "*" not in endpoint:
        return None
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + 1}"


class EventTranslator:
    """Index events as vLLM's KV events, sans I/O (the publisher thread's).

    Keeps, per pool row with a multi-block chunk event, its block hashes, so that the
    row's removal names the same hashes its store did (as vLLM's tracker does)."""

    def __init__(self, int_hashes: bool = True) -> None:
        self._external: Callable[[bytes], int | bytes] = _low64 if int_hashes else bytes
        self._hashes: dict[tuple[str, bytes], tuple[bytes, ...]] = {}

    @property
    def rows_remembered(self) -> int:
        return len(self._hashes)

    def stored(
        self, namespace: str, keys: Sequence[bytes], chunk_events: Sequence[bytes]
    ) -> list[BlockStored]:
        ext = self._external
        out = []
        for i, key in enumerate(keys):
            data = chunk_events[i] if i < len(chunk_events) else b""
            msg = _parse(data)
            if msg is None or not msg.block_hashes:
                out.append(
                    BlockStored([ext(key[:-4])], None, [], 0, None, "CPU", None, None, _group(key))
                )
                continue
            hashes = tuple(msg.block_hashes)
            if len(hashes) > 1 or hashes[0] != key[:-4]:
                self._hashes[(namespace, key)] = hashes
            out.append(
                BlockStored(
                    block_hashes=[ext(h) for h in hashes],
                    parent_block_hash=ext(msg.parent_block_hash) if msg.parent_block_hash else None,
                    token_ids=list(msg.token_ids),
                    block_size=msg.block_size,
                    lora_id=msg.lora_id if msg.has_lora else None,
                    medium="CPU",
                    lora_name=(msg.lora_name or None) if msg.has_lora else None,
                    group_idx=msg.group_idx,
                    kv_cache_spec_kind=msg.kv_cache_spec_kind or None,
                    kv_cache_spec_sliding_window=msg.kv_cache_spec_sliding_window or None,
                )
            )
        return out

    def removed(self, namespace: str, keys: Sequence[bytes]) -> list[BlockRemoved]:
        ext = self._external
        by_group: dict[int, list[Any]] = {}
        for key in keys:
            hashes = self._hashes.pop((namespace, key), None) or (key[:-4],)
            by_group.setdefault(_group(key), []).extend(ext(h) for h in hashes)
        return [BlockRemoved(h, "CPU", group_idx=g) for g, h in by_group.items()]


def _low64(h: bytes) -> int:
    return int.from_bytes(h, "big") & ((1 << 64) - 1)


def _group(key: bytes) -> int:
    return int.from_bytes(key[-4:], "big")


def _parse(data: bytes) -> depot_pb2.ChunkEvent | None:
    if not data:
        return None
    try:
        return depot_pb2.ChunkEvent.FromString(data)
    except Exception:  # an engine's bad event: the placeholder instead
        return None


class KvEventPublisher:
    """The PUB and replay sockets and the thread that feeds them.

    `on_event` is the index's listener (event loop); `chunk_events(ns, keys)` reads
    the rows' chunk events there, before the rows can go. `start`, `close` and the
    counters are read from the event loop; everything else is the thread's.
    """

    def __init__(
        self,
        endpoint: str,
        chunk_events: Callable[[str, Sequence[bytes]], list[bytes]],
        topic: str = "",
    ) -> None:
        self.endpoint = endpoint
        self.replay = replay_endpoint(endpoint)
        self._chunk_events = chunk_events
        self._topic = topic.encode()
        self._queue: deque[tuple[str, EventKind, tuple[bytes, ...], list[bytes]]] = deque()
        self._wake = threading.Event()
        self._running = True
        self.published = 0  # batches sent
        self.dropped = 0  # index events dropped (the queue was full)
        self._translator = EventTranslator(
            os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1") != "0"
        )
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(PUB_HWM)
        self._router: zmq.Socket | None = None
        try:
            if self.replay is None:
                self._pub.connect(endpoint)
            else:
                self._pub.bind(endpoint)
                self._router = self._ctx.socket(zmq.ROUTER)
                self._router.setsockopt(zmq.SNDHWM, 2 * (BUFFER_BATCHES + 1))
                self._router.bind(self.replay)
        except zmq.ZMQError:
            self._ctx.destroy(linger=0)
            raise
        self._thread = threading.Thread(target=self._run, name="kvdepot-kv-events", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def on_event(self, event: IndexEvent) -> None:
        """Queues one pool event (event loop; never blocks, never raises)."""
        if len(self._queue) >= QUEUE_LIMIT:
            self.dropped += 1
            return
        stored = event.kind is EventKind.STORED
        events = self._chunk_events(event.namespace, event.keys) if stored else []
        self._queue.append((event.namespace, event.kind, event.keys, events))
        self._wake.set()

    def close(self) -> None:
        self._running = False
        self._wake.set()
        self._thread.join(timeout=2.0)
        self._ctx.destroy(linger=0)

    # -- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        buffer: deque[tuple[int, bytes]] = deque()
        buffered = 0  # bytes in `buffer`
        seq = 0
        pending: list[BlockStored | BlockRemoved | AllBlocksCleared] = [AllBlocksCleared()]
        poller = zmq.Poller()
        if self._router is not None:
            poller.register(self._router, zmq.POLLIN)
        while self._running:
            try:
                while pending:
                    batch, pending = pending[:BATCH_EVENTS], pending[BATCH_EVENTS:]
                    payload = encoder.encode(KVEventBatch(time.time(), batch))
                    self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                    buffer.append((seq, payload))
                    buffered += len(payload)
                    while len(buffer) > BUFFER_BATCHES or buffered > BUFFER_BYTES:
                        buffered -= len(buffer.popleft()[1])
                    seq += 1
                    self.published += 1
                if poller.poll(0):
                    self._answer_replay(buffer)
                self._wake.wait(0.05)
                self._wake.clear()
                pending = self._translate()
            except Exception:  # keep publishing: a router must not stop the daemon's stream
                log.exception("kv events: publishing failed")
                time.sleep(0.1)

    def _translate(self) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
        out: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
        q, tr = self._queue, self._translator
        while q:
            namespace, kind, keys, events = q.popleft()
            if kind is EventKind.STORED:
                out.extend(tr.stored(namespace, keys, events))
            else:
                out.extend(tr.removed(namespace, keys))
        return out

    def _answer_replay(self, buffer: deque[tuple[int, bytes]]) -> None:
        router = self._router
        assert router is not None  # polled only when bound
        frames = router.recv_multipart()
        if len(frames) != 3:
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(buffer):
            if seq >= first:
                router.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        router.send_multipart((client, b"", b"", END_SEQ, b""))
