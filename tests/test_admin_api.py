"""The Admin service on a live daemon: --no-destructive-admin refuses Evict and Clear with
PERMISSION_DENIED, ListBlocks pages and filters, Evict validates its request, and
ListEngines reports registrations and pins.
"""

from __future__ import annotations

import base64
import os

import grpc
import pytest

from kvdepot.v1 import admin_pb2
from tests.support.daemon import connect
from tests.support.engine import Engine, Geometry, make_key
from tests.support.faults import DaemonFactory
from tests.support.guide import GEO_A
from tests.support.ops import GEO_M, admin, keys_m, store


def test_no_destructive_admin_refuses_evict_and_clear(daemon_factory: DaemonFactory) -> None:
    """With --no-destructive-admin, Evict (by namespace and by keys) and Clear answer
    PERMISSION_DENIED with a message naming the setting, and delete nothing; the
    read-only calls still answer."""
    d = daemon_factory("--pool-size", "16MiB", "--no-destructive-admin")
    client = connect(d.target, "readonly-test")
    try:
        store(Engine(client, GEO_M, 0), range(0, 3))
        ch, stub = admin(d)
        with ch:
            for call, req in (
                (stub.Evict, admin_pb2.EvictRequest(namespace_id=GEO_M.namespace)),
                (
                    stub.Evict,
                    admin_pb2.EvictRequest(namespace_id=GEO_M.namespace, keys=keys_m([0])),
                ),
                (stub.Clear, admin_pb2.ClearRequest()),
            ):
                with pytest.raises(grpc.RpcError) as err:
                    call(req, timeout=10)
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert "--no-destructive-admin" in err.value.details()
                assert "KVDEPOT_NO_DESTRUCTIVE_ADMIN" in err.value.details()
            blocks = stub.ListBlocks(admin_pb2.ListBlocksRequest(), timeout=10)
            assert blocks.total_blocks == 3
            stats = stub.GetStats(admin_pb2.GetStatsRequest(), timeout=10)
            assert stats.ready_blocks == 3 and stats.evictions == 0
    finally:
        client.close()


def test_list_blocks_paging_filters_and_evict_validation(daemon_factory: DaemonFactory) -> None:
    """Pages cover every block once even when blocks go away between pages; the group
    filter works with has_group (group 0) and without (non-zero); bad input gets
    INVALID_ARGUMENT or NOT_FOUND with a message, and the daemon goes on."""
    d = daemon_factory("--pool-size", "16MiB")
    client = connect(d.target, "paging-test")
    geo = Geometry(namespace="paging-test", world_size=1)  # 2 groups
    try:
        store(Engine(client, geo, 0), range(0, 10))  # 20 blocks
        ch, stub = admin(d)
        with ch:
            every = stub.ListBlocks(admin_pb2.ListBlocksRequest(page_size=100))
            assert every.total_blocks == 20 and not every.next_page_token
            assert [b.key for b in every.blocks] == sorted(b.key for b in every.blocks)
            assert all(bytes.fromhex(b.key_hex) == b.key for b in every.blocks)

            seen: list[bytes] = []
            token = ""
            evicted_mid_way: list[bytes] = []
            while True:
                page = stub.ListBlocks(admin_pb2.ListBlocksRequest(page_size=3, page_token=token))
                seen += [b.key for b in page.blocks]
                if len(seen) == 6:  # evict two blocks not yet listed and the first one
                    evicted_mid_way = [
                        every.blocks[0].key,
                        every.blocks[10].key,
                        every.blocks[11].key,
                    ]
                    ev = stub.Evict(
                        admin_pb2.EvictRequest(namespace_id="paging-test", keys=evicted_mid_way)
                    )
                    assert ev.evicted_blocks == 3
                token = page.next_page_token
                if not token:
                    break
            want = [b.key for b in every.blocks if b.key not in evicted_mid_way[1:]]
            assert seen == want  # no block twice, none skipped, in order

            for req, group in (
                (admin_pb2.ListBlocksRequest(has_group=True, group=0), 0),
                (admin_pb2.ListBlocksRequest(group=1), 1),
            ):
                blocks = stub.ListBlocks(req).blocks
                assert blocks and all(b.group == group for b in blocks)

            # Duplicated keys count once; unknown ones are reported.
            key = next(b.key for b in stub.ListBlocks(admin_pb2.ListBlocksRequest()).blocks)
            ev = stub.Evict(
                admin_pb2.EvictRequest(namespace_id="paging-test", keys=[key, key, make_key(99, 0)])
            )
            assert (ev.evicted_blocks, ev.skipped_blocks, ev.not_found_blocks) == (1, 0, 1)

            bad = [
                (
                    stub.ListBlocks,
                    admin_pb2.ListBlocksRequest(page_token="garbage"),
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "page_token",
                ),
                (
                    stub.ListBlocks,
                    admin_pb2.ListBlocksRequest(page_size=10001),
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "page_size",
                ),
                (
                    stub.ListBlocks,
                    admin_pb2.ListBlocksRequest(namespace_id="paging-test", group=7),
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "group 7",
                ),
                (
                    stub.ListBlocks,
                    admin_pb2.ListBlocksRequest(namespace_id="nope"),
                    grpc.StatusCode.NOT_FOUND,
                    "ListNamespaces",
                ),
                (stub.Evict, admin_pb2.EvictRequest(), grpc.StatusCode.INVALID_ARGUMENT, "Clear"),
                (
                    stub.Evict,
                    admin_pb2.EvictRequest(namespace_id="nope"),
                    grpc.StatusCode.NOT_FOUND,
                    "ListNamespaces",
                ),
                # A hex key pasted where base64 belongs decodes to the wrong length.
                (
                    stub.Evict,
                    admin_pb2.EvictRequest(
                        namespace_id="paging-test", keys=[base64.b64decode(key.hex())]
                    ),
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "base64",
                ),
            ]
            for call, req, code, hint in bad:
                with pytest.raises(grpc.RpcError) as err:
                    call(req, timeout=10)
                assert err.value.code() == code, (req, err.value.details())
                assert hint in err.value.details(), err.value.details()
            assert stub.GetStats(admin_pb2.GetStatsRequest()).ready_blocks == 20 - 3 - 1
    finally:
        client.close()


def test_list_engines_reports_registrations_and_pins(daemon_factory: DaemonFactory) -> None:
    """ListEngines: process, ranks, registered bytes, memory path, pinned blocks."""
    d = daemon_factory("--pool-size", "16MiB")
    client = connect(d.target, "engines-test")
    try:
        r0, r1 = Engine(client, GEO_A, 0), Engine(client, GEO_A, 1)
        store(r0, range(0, 2))
        store(r1, range(0, 2))
        client.pin(GEO_A.namespace, [make_key(0, 0), make_key(1, 1)])
        client.pin(GEO_A.namespace, [make_key(0, 0)])  # twice: still one block
        ch, stub = admin(d)
        with ch:
            (e,) = stub.ListEngines(admin_pb2.ListEnginesRequest()).engines
        assert (e.client_name, e.engine_id, e.pid) == ("engines-test", "engines-test", os.getpid())
        assert e.pinned_blocks == 2
        assert [(r.rank, r.memory_path, r.namespace_id) for r in e.registrations] == [
            (0, "shm", GEO_A.namespace),
            (1, "shm", GEO_A.namespace),
        ]
        assert all(r.registered_bytes == r0.buffer.size for r in e.registrations)
    finally:
        client.close()
