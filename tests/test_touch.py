"""A finished request's touch against a real `kvdepot serve` (UnpinRequest.touch_keys, on
the unpin lane or over gRPC): the rows it names become the most recently used, head
youngest, so a full pool evicts the prompt nobody used again, tail first, and what stays
of every prompt is a loadable prefix (docs/architecture.md §6)."""

from __future__ import annotations

import pytest

from kvdepot.client import DepotClient
from kvdepot.testing.waiting import wait_for
from kvdepot.v1 import depot_pb2 as pb
from tests.support.daemon import stats
from tests.support.engine import Engine, Geometry, make_key
from tests.support.ops import store
from tests.support.prefixes import reach
from tests.test_pin_lane import open_unpin_lane

GEO = Geometry(
    world_size=1, namespace="touch", groups=[[4096, 4096]], blocks_per_chunk=1, num_blocks=128
)
ROW = 8192  # two 4 KiB layer pages


def keys(prompt: bytes, n: int) -> list[bytes]:
    return [make_key(c, 0, salt=prompt) for c in range(n)]


def lead(client: DepotClient, prompt_keys: list[bytes]) -> tuple[int, int]:
    """(leading chunks a lookup reaches, chunks held behind the first miss)."""
    return reach(client.lookup(GEO.namespace, prompt_keys))


@pytest.mark.parametrize("via", ["lane", "grpc"])
def test_a_touched_prompt_outlives_one_stored_after_it(daemon_factory, via: str) -> None:
    d = daemon_factory("--pool-size", "2MiB")
    client = DepotClient(d.target, client_name="pytest").start()
    try:
        assert client.wait_connected(10)
        eng = Engine(client, GEO, 0)
        rows = stats(d.admin_target).capacity_bytes // ROW  # 256
        a, b = keys(b"A", 96), keys(b"B", 96)
        store(eng, range(96), salt=b"A")
        store(eng, range(96), salt=b"B")
        # A's request ends (it used all of A): its touch makes A younger than B.
        if via == "lane":
            lane = open_unpin_lane(client)
            assert lane.touch(client.session_id, GEO.namespace, a) == ()
            assert lane.lane_touches == 1
        else:
            client.unpin(GEO.namespace, (), wait=True, touch=a)
        wait_for(lambda: stats(d.admin_target).touched_keys == 96, 10, what="the touch applied")
        store(eng, range(rows - 192 + 32), salt=b"C")  # 32 rows must go: B's tail
        s = stats(d.admin_target)
        assert s.evictions == 32 and s.pinned_blocks == 0
        assert lead(client, a) == (96, 0)
        assert lead(client, b) == (64, 0)
    finally:
        client.close()


def test_a_touch_of_another_namespace_is_refused(daemon, client) -> None:
    import grpc

    with pytest.raises(grpc.RpcError) as err:
        client.stub.Unpin(
            pb.UnpinRequest(
                session_id=client.session_id, namespace_id="not-joined", touch_keys=[b"k" * 36]
            ),
            timeout=5,
        )
    assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED


def test_a_touch_is_cut_last_part_first() -> None:
    """A touch in parts keeps the head youngest: the daemon refreshes each part as it
    comes, so the part holding the first chunk must come last."""
    from kvdepot.client.pin_lane import tail_first_parts

    assert list(tail_first_parts(5, 2)) == [(3, 5), (1, 3), (0, 1)]
    assert list(tail_first_parts(4, 4)) == [(0, 4)] and list(tail_first_parts(0, 4)) == []
