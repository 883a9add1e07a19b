"""How a node's ranks are dealt to the daemon's shards (kvdepot.common.shards): the
daemon, the connector and the benchmarks all route with these functions."""

from __future__ import annotations

import pytest

from kvdepot.common.shards import (
    RankRoute,
    engine_parts,
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


# -- pipeline stages: a namespace part per stage (and shard) ------------------------------


def assert_parts_cover_the_world(world: int, node: int, stages: int, first: int = 0) -> None:
    """Every rank is in exactly one part, at its place there, and a part's ranks share
    one shard and one stage: its rows hold sections of one length."""
    parts = engine_parts(world, node, first, stages)
    seen = []
    for part in parts:
        assert part.rank == 0
        ranks = range(len(seen), len(seen) + part.world_size)
        routes = [route_rank(r, world, node, first, stages) for r in ranks]
        assert [x.rank for x in routes] == list(range(part.world_size))
        assert {(x.shard, x.stage, x.world_size, x.namespace_id("ns")) for x in routes} == {
            (part.shard, part.stage, part.world_size, part.namespace_id("ns"))
        }
        assert {r // (world // stages) for r in ranks} == {part.stage}
        seen += ranks
    assert seen == list(range(world))
    assert len({part.namespace_id("ns") for part in parts}) == len(parts)


def test_each_pipeline_stage_is_a_namespace_part_of_its_own() -> None:
    """TP=2 x PP=2 on one shard: a part per stage, two ranks each, on shard 0."""
    parts = engine_parts(4, 1, 0, 2)
    assert [(x.shard, x.stage, x.world_size) for x in parts] == [(0, 0, 2), (0, 1, 2)]
    assert [x.namespace_id("kvd1-abc") for x in parts] == ["kvd1-abc.pp0of2", "kvd1-abc.pp1of2"]
    assert route_rank(3, 4, 1, 0, 2) == RankRoute(0, 1, 2, 1, 0, 1, 2)
    # One stage: the parts and ids of before.
    assert engine_parts(4, 1) == [RankRoute(0, 0, 4, 1)]
    assert engine_parts(4, 1)[0].namespace_id("kvd1-abc") == "kvd1-abc"
    # On four shards: a part per rank, named by its shard and its stage.
    assert [x.namespace_id("n") for x in engine_parts(4, 4, 0, 2)] == [
        "n.s0of4.pp0of2", "n.s1of4.pp0of2", "n.s2of4.pp1of2", "n.s3of4.pp1of2"
    ]  # fmt: skip
    for world, node, stages in [(4, 1, 2), (4, 2, 2), (4, 4, 2), (8, 2, 4), (8, 8, 2), (6, 1, 3)]:
        assert_parts_cover_the_world(world, node, stages)
    assert_parts_cover_the_world(2, 8, 2, first=6)
    with pytest.raises(ValueError, match="cannot make 3 pipeline stages"):
        route_rank(0, 4, 1, 0, 3)


def test_shards_and_stages_that_do_not_divide_each_other_make_parts_of_two_sizes() -> None:
    """TP=6 x PP=2 on three shards: 4 ranks a shard, 6 a stage; the shard in the middle
    holds two ranks of each stage."""
    parts = engine_parts(12, 3, 0, 2)
    assert [(x.shard, x.stage, x.world_size) for x in parts] == [
        (0, 0, 4), (1, 0, 2), (1, 1, 2), (2, 1, 4)
    ]  # fmt: skip
    assert_parts_cover_the_world(12, 3, 2)
