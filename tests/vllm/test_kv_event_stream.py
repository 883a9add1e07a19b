"""`kvdepot serve --kv-events`: the node's pool as one stream in vLLM's KV-event format.

Read with vLLM 0.33.0's own decoder (msgspec, vllm.distributed.kv_events.KVEventBatch)
over ZMQ, as a router would: every row stored appears once, in order, as the storing
engine's own complete BlockStored; every row evicted as a BlockRemoved of the same
hashes; and a replay request returns what was published while the subscriber was away,
from the daemon's first batch (AllBlocksCleared) on.
"""

from __future__ import annotations

import socket
import time

import pytest

pytest.importorskip("vllm")

import msgspec
import zmq
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

from kvdepot.testing.vllm_engine import prompt_for
from kvdepot.v1 import admin_pb2

pytestmark = pytest.mark.vllm

END_SEQ = (-1).to_bytes(8, "big", signed=True)
DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


def free_port_pair() -> int:
    """A port p with p and p + 1 free (the PUB and the replay socket)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port >= 65535:
            continue
        with socket.socket() as s2:
            try:
                s2.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair")


class Subscriber:
    """A router's view: a SUB socket and the batches it read, by sequence number."""

    def __init__(self, ctx: zmq.Context, endpoint: str, topic: bytes = b"") -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self.sock.connect(endpoint)
        self.batches: dict[int, KVEventBatch] = {}

    def read(self, timeout: float = 0.2) -> None:
        while self.sock.poll(int(timeout * 1000)):
            _topic, seq, payload = self.sock.recv_multipart()
            self.batches[int.from_bytes(seq, "big")] = DECODER.decode(payload)
            timeout = 0.05

    def events(self) -> list:
        return [e for seq in sorted(self.batches) for e in self.batches[seq].events]


def replay(ctx: zmq.Context, endpoint: str, start: int) -> dict[int, KVEventBatch]:
    """What the replay socket returns from sequence number `start` on."""
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    sock.send_multipart((b"", start.to_bytes(8, "big")))
    got: dict[int, KVEventBatch] = {}
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        assert sock.poll(5000), "no replay answer"
        _, _topic, seq, payload = sock.recv_multipart()
        if seq == END_SEQ:
            break
        got[int.from_bytes(seq, "big")] = DECODER.decode(payload)
    sock.close(linger=0)
    return got


def test_kv_event_stream_in_vllms_format(daemon_factory, make_engine) -> None:
    port = free_port_pair()
    endpoint, replay_endpoint = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}"
    d = daemon_factory("--pool-size", "64MiB", "--kv-events", f"tcp://*:{port}")
    ctx = zmq.Context()
    try:
        sub = Subscriber(ctx, endpoint)
        engine = make_engine(
            socket=d.target,
            num_gpu_blocks=64,
            enable_kv_events=True,
            blocks_per_chunk=4,
            extra_config={"self_describing_kv_events": True},
        )
        engine.wait_registered()
        own: list = []
        take_events = engine.scheduler_connector.take_events

        def recorded() -> list:
            events = list(take_events())
            own.extend(events)
            return events

        engine.scheduler_connector.take_events = recorded
        time.sleep(0.3)  # the SUB socket's subscription reaches the daemon
        prompt = prompt_for(21, 192)
        keys = engine.offload_keys(prompt)
        engine.generate([prompt])
        engine.wait_ready(keys)
        engine.wait_until(lambda: (sub.read(), len(sub.events()) >= len(keys))[1], what="events")

        # Each stored row once, in store order, as the engine's own complete event.
        stored = [e for e in sub.events() if isinstance(e, BlockStored)]
        engine.scheduler_connector.take_events()
        mine = [e for e in own if isinstance(e, BlockStored) and e.medium == "CPU"]
        assert [e.block_hashes[-1] for e in stored] == [e.block_hashes[-1] for e in mine]
        assert stored == mine
        assert all(len(e.token_ids) == 64 and e.block_size == 16 for e in stored)

        # Evicted: BlockRemoved events naming every hash the stores named, once (the
        # rows go one event each: the stream may batch them in several messages).
        res = engine.manager._client.admin.Evict(
            admin_pb2.EvictRequest(namespace_id=engine.manager.namespace_id, keys=keys)
        )
        assert res.evicted_blocks == len(keys)
        stored_hashes = sorted(h for e in stored for h in e.block_hashes)

        def removed_hashes() -> list:
            sub.read()
            return [h for e in sub.events() if isinstance(e, BlockRemoved) for h in e.block_hashes]

        engine.wait_until(lambda: len(removed_hashes()) >= len(stored_hashes), what="removals")
        assert sorted(removed_hashes()) == stored_hashes
        last_seen = max(sub.batches)
        assert sorted(sub.batches) == list(range(min(sub.batches), last_seen + 1))  # no gap

        # Away: a second prompt is stored while nobody listens; replay returns it.
        sub.sock.close(linger=0)
        prompt2 = prompt_for(22, 128)
        keys2 = engine.offload_keys(prompt2)
        engine.generate([prompt2])
        engine.wait_ready(keys2)
        # The engine's events not yet taken: `recorded` appends them to `own` (adding
        # them to `own` again counted the ones that came after the steps twice).
        engine.scheduler_connector.take_events()
        expected = [
            e.block_hashes[-1] for e in own if isinstance(e, BlockStored) and e.medium == "CPU"
        ][len(mine) :]
        assert len(expected) == len(keys2)

        def replayed() -> tuple[dict[int, KVEventBatch], list[int]]:
            missed = replay(ctx, replay_endpoint, last_seen + 1)
            again = [e for seq in sorted(missed) for e in missed[seq].events]
            return missed, [e.block_hashes[-1] for e in again if isinstance(e, BlockStored)]

        # The publisher's thread sends what the loop queued: wait until it sent them all.
        engine.wait_until(lambda: len(replayed()[1]) >= len(expected), what="published while away")
        missed, again = replayed()
        assert sorted(missed) == list(range(last_seen + 1, max(missed) + 1))
        assert again == expected

        # From the start: the daemon's first batch says AllBlocksCleared.
        everything = replay(ctx, replay_endpoint, 0)
        assert min(everything) == 0
        assert isinstance(everything[0].events[0], AllBlocksCleared)
        st = d.stats()
        assert st.kv_events_published == max(everything) + 1 and st.kv_events_dropped == 0
    finally:
        ctx.destroy(linger=0)


def test_a_subscriber_that_never_reads_changes_nothing(daemon_factory, make_engine) -> None:
    port = free_port_pair()
    endpoint = f"tcp://127.0.0.1:{port}"
    d = daemon_factory("--pool-size", "16MiB", "--kv-events", f"tcp://*:{port}")
    ctx = zmq.Context()
    try:
        stuck = ctx.socket(zmq.SUB)
        stuck.setsockopt(zmq.SUBSCRIBE, b"")
        stuck.setsockopt(zmq.RCVHWM, 1)  # and never reads
        stuck.connect(endpoint)
        engine = make_engine(socket=d.target, num_gpu_blocks=128)
        engine.wait_registered()
        # More than the pool holds: stores and evictions, each an event.
        for seed in range(30):
            prompt = prompt_for(100 + seed, 512)
            engine.generate([prompt])
        st = d.stats()
        assert st.evictions > 0 and st.kv_events_published > 1
        assert st.kv_events_dropped == 0  # the daemon's queue: the thread keeps up
        # A reader that comes now still gets the stream.
        sub = Subscriber(ctx, endpoint)
        time.sleep(0.3)
        prompt = prompt_for(999, 256)
        keys = engine.offload_keys(prompt)
        engine.generate([prompt])
        engine.wait_ready(keys)
        engine.wait_until(
            lambda: (sub.read(), any(isinstance(e, BlockStored) for e in sub.events()))[1],
            what="events for a late reader",
        )
    finally:
        ctx.destroy(linger=0)


def test_it_connects_to_a_routers_sub_socket_with_its_topic(daemon_factory, make_engine) -> None:
    """llm-d's indexer binds a SUB socket and reads the pod and model from the topic
    (kv@POD@MODEL): the daemon connects to it, as vLLM does for a host that is no `*`."""
    port = free_port_pair()
    ctx = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        sub.bind(f"tcp://127.0.0.1:{port}")
        topic = "kv@10.0.0.7@meta-llama/Llama-3.1-8B"
        d = daemon_factory(
            "--pool-size", "64MiB",
            "--kv-events", f"tcp://127.0.0.1:{port}", "--kv-events-topic", topic,
        )  # fmt: skip
        engine = make_engine(socket=d.target, num_gpu_blocks=64)
        engine.wait_registered()
        # A bound ZMQ socket takes a new peer (and sends it the subscription) only when
        # its owner calls it: a router's subscriber polls all along, so does this.
        sub.poll(500)
        prompt = prompt_for(31, 64)
        keys = engine.offload_keys(prompt)
        engine.generate([prompt])
        engine.wait_ready(keys)
        got: list = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(got) < len(keys):
            if sub.poll(500):
                frames = sub.recv_multipart()
                assert frames[0] == topic.encode()
                batch = DECODER.decode(frames[2])
                got += [e for e in batch.events if isinstance(e, BlockStored)]
        # Without chunk events (self-describing events off): vLLM's placeholder form.
        assert len(got) == len(keys)
        assert {(e.block_size, tuple(e.token_ids)) for e in got} == {(0, ())}
    finally:
        ctx.destroy(linger=0)


def test_a_taken_port_stops_the_start_with_a_clear_error(tmp_path) -> None:
    import subprocess

    from kvdepot.testing.daemon import kvdepot_command

    port = free_port_pair()
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", port))
        taken.listen()
        serve = ["serve", "--socket", str(tmp_path / "s.sock"), "--pool-size", "16MiB"]
        proc = subprocess.run(
            [*kvdepot_command(), *serve, "--kv-events", f"tcp://*:{port}"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert proc.returncode == 2
    assert f"--kv-events tcp://*:{port}: Address already in use" in proc.stderr
    assert "Traceback" not in proc.stderr
