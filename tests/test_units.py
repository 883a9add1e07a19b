"""Registrations of several ranks (RegisterKVRequest.unit_count): a canonical namespace's
rows hold one section per unit (a KV head), and an engine's rank holds several units
side by side in each page (docs/architecture.md §4). A real daemon, real memfds: a rank
of 4 units stores, ranks of 2 units and of 1 load each unit's bytes where their pages
hold it; bad unit counts are refused with reasons, and the daemon keeps serving."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from kvdepot.client import DepotClient, SharedKVBuffer
from kvdepot.common.jobs import Job
from kvdepot.v1 import admin_pb2
from kvdepot.v1 import depot_pb2 as pb
from tests.support.engine import make_key

UNITS = 4
UNIT_PAGES = [1024, 512]  # one unit's page of each layer
BLOCKS = 16
BPC = 2
CHUNKS = 3
LAYOUT = pb.NamespaceLayout(
    id="units",
    world_size=UNITS,
    blocks_per_chunk=BPC,
    groups=[pb.GroupLayout(layer_page_bytes=UNIT_PAGES)],
)


class Rank:
    """One engine rank holding units [first, first + count): each layer a tensor of
    (BLOCKS, count x unit page), unit k's page at k x unit page."""

    def __init__(self, client: DepotClient, first: int, count: int, *, register: bool = True):
        self.client, self.first, self.count = client, first, count
        self.pages = [count * p for p in UNIT_PAGES]
        self.offsets = [0, BLOCKS * self.pages[0]]
        self.buffer = SharedKVBuffer.allocate(BLOCKS * sum(self.pages))
        self.mem = np.frombuffer(self.buffer.memoryview(), dtype=np.uint8)
        self.tensors = [
            pb.KVTensor(
                region_index=0,
                region_offset=o,
                num_blocks=BLOCKS,
                block_stride_bytes=p,
                page_bytes=p,
            )
            for o, p in zip(self.offsets, self.pages, strict=True)
        ]
        self.refs = [
            pb.GroupRefs(
                layers=[pb.LayerRef(tensor_index=i, page_bytes=p) for i, p in enumerate(UNIT_PAGES)]
            )
        ]
        if register:
            self.reg = self.register(first, count)
            self.stream = client.transfer_stream()

    def register(self, rank: int, units: int) -> pb.RegisterKVResponse:
        return self.client.register_kv(
            LAYOUT, rank, self.buffer, self.tensors, self.refs, units=units
        )

    def page(self, layer: int, block: int) -> np.ndarray:
        start = self.offsets[layer] + block * self.pages[layer]
        return self.mem[start : start + self.pages[layer]]

    def unit_page(self, layer: int, block: int, unit: int) -> bytes:
        """The bytes of model-wide `unit` in this rank's page."""
        size = UNIT_PAGES[layer]
        k = unit - self.first
        return self.page(layer, block)[k * size : (k + 1) * size].tobytes()

    def job(self, direction: int, keys: list[bytes], blocks: list[int]) -> None:
        self.stream.submit(
            Job(
                job_id=1 + direction,
                direction=direction,
                keys=keys,
                block_ids=blocks,
                group_sizes=[len(blocks)],
                block_indices=[0],
                registration_id=self.reg.registration_id,
            )
        )
        assert self.stream.wait({1 + direction}, timeout=30)
        (result,) = self.stream.poll()
        assert result.success, result.error


@pytest.fixture
def client(daemon_factory):
    d = daemon_factory("--pool-size", "16MiB")
    c = DepotClient(d.target, client_name="units").start()
    assert c.wait_connected(10)
    yield c
    c.close()


def test_ranks_of_other_unit_counts_load_each_unit_where_their_pages_hold_it(client) -> None:
    keys = [make_key(c, 0, b"units") for c in range(CHUNKS)]
    blocks = list(range(CHUNKS * BPC))
    wide = Rank(client, 0, UNITS)
    wide.mem[:] = np.random.default_rng(7).integers(0, 256, wide.mem.size, dtype=np.uint8)
    wide.job(pb.STORE, keys, blocks)
    assert all(client.lookup(LAYOUT.id, keys))
    stats = client.admin.GetStats(admin_pb2.GetStatsRequest())
    (engine,) = client.admin.ListEngines(admin_pb2.ListEnginesRequest()).engines
    assert [(r.rank, r.unit_count) for r in engine.registrations] == [(0, UNITS)]
    row = UNITS * BPC * sum(UNIT_PAGES)  # the wide rank's pages, once
    assert (stats.ready_blocks, stats.used_bytes) == (CHUNKS, CHUNKS * row)

    loaders = [Rank(client, 0, 2), Rank(client, 2, 2), Rank(client, 3, 1)]
    for loader in loaders:
        loader.job(pb.LOAD, keys, [b + 3 for b in blocks])  # into other blocks
        for layer in range(len(UNIT_PAGES)):
            for block in blocks:
                for unit in range(loader.first, loader.first + loader.count):
                    got = loader.unit_page(layer, block + 3, unit)
                    assert got == wide.unit_page(layer, block, unit), (loader.first, unit)

    # A rank of 2 units stores where the wide rank stored nothing: a row is ready only
    # once every unit is written, and the wide rank then loads it whole.
    fresh = [make_key(c, 0, b"fresh") for c in range(CHUNKS)]
    low, high = loaders[0], loaders[1]
    low.mem[:] = 1
    high.mem[:] = 2
    low.job(pb.STORE, fresh, blocks)
    assert not any(client.lookup(LAYOUT.id, fresh))
    high.job(pb.STORE, fresh, blocks)
    assert all(client.lookup(LAYOUT.id, fresh))
    wide.job(pb.LOAD, fresh, blocks)
    for block in blocks:
        assert [wide.unit_page(0, block, u)[0] for u in range(UNITS)] == [1, 1, 2, 2]
    assert client.admin.GetStats(admin_pb2.GetStatsRequest()).writing_blocks == 0


def test_bad_unit_counts_are_refused_with_reasons(client) -> None:
    rank = Rank(client, 0, 2, register=False)
    for first, units, words in (
        (1, 4, "reaches past the namespace's 4 ranks"),
        (3, 2, "reaches past"),
    ):
        with pytest.raises(grpc.RpcError) as info:
            rank.register(first, units)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert words in info.value.details()
    # 3 units' pages do not fit a page of 2.
    with pytest.raises(grpc.RpcError) as info:
        rank.register(0, 3)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "exceed" in info.value.details()
    # Inline (no memory): one rank only.
    inline = pb.RegisterKVRequest(
        session_id=client.session_id, namespace=LAYOUT, rank=0, unit_count=2
    )
    with pytest.raises(grpc.RpcError) as info:
        client.stub.RegisterKV(inline)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "inline" in info.value.details()
    # The legitimate registration beside them still works.
    assert rank.register(0, 2).registration_id > 0
