"""How a node's ranks are dealt to the daemon's shards (kvdepot.common.shards): the
daemon, the connector and the benchmarks all route with these functions."""

from __future__ import annotations

import pytest

from kvdepot.common.shards import (
    RankRoute,
    engine_shards,
    first_shard,
    route_rank,
    shard_mismatch,
    shard_namespace_id,
    shard_socket,
)


def test_every_shard_an_engine_uses_serves_the_same_number_of_its_ranks() -> None:
    routes = [route_rank(r, 8, 4) for r in range(8)]
    # Consecutive ranks share a shard (and so, on a real host, a NUMA node).
    assert [(x.shard, x.rank) for x in routes] == [
        (0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (3, 1)
    ]  # fmt: skip
    assert {x.world_size for x in routes} == {2} and {x.shards for x in routes} == {4}
    # Each shard sees a complete world: local ranks 0..W/E-1, each exactly once.
    for shard in range(4):
        assert sorted(x.rank for x in routes if x.shard == shard) == [0, 1]


@pytest.mark.parametrize(
    ("node", "world", "used"), [(1, 8, 1), (2, 8, 2), (8, 8, 8), (16, 8, 8), (3, 8, 1), (4, 1, 1)]
)
def test_an_engine_uses_the_gcd_of_shards_and_world(node: int, world: int, used: int) -> None:
    assert engine_shards(node, world) == used
    assert {route_rank(r, world, node).shard for r in range(world)} == set(range(used))


def test_one_shard_changes_nothing() -> None:
    assert route_rank(3, 4, 1) == RankRoute(0, 3, 4, 1)
    assert shard_socket("unix:///run/kvdepot/kvdepot.sock", 0) == "unix:///run/kvdepot/kvdepot.sock"
    assert shard_namespace_id("kvd1-abc", 0, 1) == "kvd1-abc"


def test_shards_have_their_own_sockets_and_namespaces() -> None:
    assert shard_socket("unix:///run/k.sock", 2) == "unix:///run/k.sock.shard2"
    assert shard_socket("/run/k.sock", 1) == "/run/k.sock.shard1"
    ids = {shard_namespace_id("kvd1-abc.r1-ff", s, 4) for s in range(4)}
    assert len(ids) == 4 and all(i.startswith("kvd1-abc.r1-ff.s") for i in ids)


def test_a_rank_outside_its_world_is_refused() -> None:
    with pytest.raises(ValueError, match="outside a world of 2"):
        route_rank(2, 2, 2)


def test_a_daemon_that_is_not_the_expected_shard_is_named() -> None:
    route = route_rank(1, 2, 2)
    assert shard_mismatch(route, 2, 1, 2) is None
    unsharded = shard_mismatch(route, 2, 0, 0)
    assert unsharded is not None and "shard 0 of 1" in unsharded and "kvdepot_shards" in unsharded
    assert shard_mismatch(route, 2, 1, 4) is not None
    # An engine on one shard talks to shard 0's socket, which serves whole rows anywhere.
    assert shard_mismatch(route_rank(0, 1, 2), 2, 0, 2) is None


def test_an_engine_on_fewer_shards_than_the_node_starts_where_its_namespace_says() -> None:
    """TP=1 and TP=2 engines on an 8-shard node: engines of one namespace always meet on
    the same shards (they share blocks); engines of many namespaces spread over all of
    them, each on E consecutive shards starting at a multiple of E."""
    for world in (1, 2, 4):
        used = engine_shards(8, world)
        firsts = {first_shard(f"kvd1-model{i}", 8, world) for i in range(64)}
        assert firsts == set(range(0, 8, used)), world  # every group of E shards in use
        first = first_shard("kvd1-model7", 8, world)
        assert first == first_shard("kvd1-model7", 8, world)
        routes = [route_rank(r, world, 8, first) for r in range(world)]
        assert [x.shard for x in routes] == [first + r // (world // used) for r in range(world)]
        assert [x.part for x in routes] == [r // (world // used) for r in range(world)]
    # An engine that uses every shard starts at shard 0, and a daemon of one shard
    # is shard 0 for everyone.
    assert first_shard("kvd1-any", 8, 8) == 0 and first_shard("kvd1-any", 1, 1) == 0
    with pytest.raises(ValueError, match="cannot start at shard 3"):
        route_rank(0, 2, 8, 3)


def test_a_single_shard_engine_off_shard_0_checks_whom_it_reached() -> None:
    """A TP=1 engine the namespace put on shard 5 of 8 must reach shard 5 of 8: another
    shard, or an unsharded daemon, is named; shard 0 alone serves whole rows anywhere."""
    route = route_rank(0, 1, 8, 5)
    assert (route.shard, route.rank, route.world_size, route.shards, route.part) == (5, 0, 1, 1, 0)
    assert shard_mismatch(route, 8, 5, 8) is None
    wrong = shard_mismatch(route, 8, 0, 0)
    assert wrong is not None and "expects shard 5 of 8" in wrong
    assert shard_namespace_id("kvd1-abc", route.part, route.shards) == "kvd1-abc"
