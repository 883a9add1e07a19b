"""Shards by rank: how a node's ranks are dealt to the daemon's shards.

A daemon run with `--shards S` is S processes (shards), each with its own event loop,
copy threads, pool and index; shard 0 listens on the configured socket and shard s on
`shard_socket(socket, s)`. An engine of world size W uses E = gcd(S, W) of them,
consecutive ones from `first_shard`, each serving K = W / E consecutive ranks: rank r
goes to the engine's shard r // K (its `part`), where it is rank r % K of a world of K
ranks, in a namespace of its own (`shard_namespace_id`), so that a shard's rows hold
the sections of exactly the ranks it serves and every guarantee of one daemon (rows
ready when all their ranks wrote, pins, eviction, restart) holds per shard.
Consecutive, not dealt round robin: GPUs are numbered by NUMA node on the hosts this
serves (0-3 on one socket, 4-7 on the other), so a shard's ranks share a node and its
pool and copy threads can sit there. The scheduler reads every shard the engine uses
and counts a key ready when all of them have it.

Pipeline stages split the same way: an engine of P > 1 stages (vLLM numbers a stage's
W / P ranks consecutively) holds each stage's layers on that stage's ranks only, and
stages may hold different numbers of layers (61 on two stages: 31 and 30), so a rank's
section is as long as its stage makes it. A row holds sections of one size, so each
stage gets a namespace of its own too (`stage_suffix`): a rank's namespace part is the
ranks that share both its shard and its stage (`route_rank`), and the scheduler reads
every part (`engine_parts`) and counts a key ready when all of them have it, the way it
does across shards.

An engine that uses fewer shards than the node has (E < S: TP=1, or TP=2 on four
shards) starts at a shard its namespace picks (`first_shard`): the engines of one
namespace, which share blocks, always meet on the same shards, and engines of other
models or salts spread over the node's shards and pools rather than all crowding
shard 0.

Pure functions of their arguments: the daemon, the connector and the benchmarks all
route with these, so they cannot disagree.
"""

from __future__ import annotations

import hashlib
import math
from typing import NamedTuple

MAX_SHARDS = 64


def shard_socket(socket: str, shard: int) -> str:
    """The socket (a path or a unix:// target) of `shard`: shard 0's is `socket` itself,
    so a daemon of one shard and a client that knows nothing of shards are unchanged."""
    return socket if shard == 0 else f"{socket}.shard{shard}"


def engine_shards(node_shards: int, world_size: int) -> int:
    """How many of the node's shards an engine of `world_size` ranks uses: gcd, so that
    every shard it uses serves the same number of its ranks (TP=1 engines use shard 0)."""
    return math.gcd(max(1, node_shards), max(1, world_size))


class RankRoute(NamedTuple):
    """Where one rank of an engine goes."""

    shard: int  # the shard it talks to
    rank: int  # its rank in its namespace part
    world_size: int  # the ranks of its namespace part: the sections of a row there
    shards: int  # the shards its engine uses (E)
    part: int = 0  # which of those E shards, from the engine's first: names its namespace
    stage: int = 0  # its pipeline stage: names its namespace when the engine has several
    stages: int = 1  # the engine's pipeline stages (P)

    def namespace_id(self, namespace_id: str) -> str:
        """The engine's `namespace_id` as this rank's namespace part names it."""
        return shard_namespace_id(namespace_id, self.part, self.shards) + stage_suffix(
            self.stage, self.stages
        )


def first_shard(namespace_id: str, node_shards: int, world_size: int) -> int:
    """The first of the E consecutive shards an engine of `world_size` ranks in
    `namespace_id` uses on a node of `node_shards`: a multiple of E picked by a hash of
    the namespace (0 when E is every shard). The same for every rank and the scheduler
    of the engine, for every engine of the namespace, and across restarts: nothing to
    agree on."""
    used = engine_shards(node_shards, world_size)
    groups = max(1, node_shards) // used
    if groups == 1:
        return 0
    digest = hashlib.sha256(namespace_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") % groups * used


def route_rank(
    rank: int, world_size: int, node_shards: int, first: int = 0, stages: int = 1
) -> RankRoute:
    """Rank `rank` of an engine of `world_size` ranks in `stages` pipeline stages on a
    node of `node_shards` shards, whose shards start at `first` (`first_shard`). Its
    namespace part is the run of consecutive ranks on its shard and in its stage: both
    are runs of consecutive ranks, so their overlap is one too (of another length than
    its neighbours' when neither run length divides the other)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size}")
    if stages < 1 or world_size % stages:
        raise ValueError(f"{world_size} ranks cannot make {stages} pipeline stages")
    used = engine_shards(node_shards, world_size)
    if first % used or first + used > max(1, node_shards):
        raise ValueError(f"an engine's {used} shard(s) cannot start at shard {first}")
    per_shard, per_stage = world_size // used, world_size // stages
    part, stage = rank // per_shard, rank // per_stage
    start = max(part * per_shard, stage * per_stage)
    end = min((part + 1) * per_shard, (stage + 1) * per_stage)
    return RankRoute(first + part, rank - start, end - start, used, part, stage, stages)


def engine_parts(
    world_size: int, node_shards: int, first: int = 0, stages: int = 1
) -> list[RankRoute]:
    """The namespace parts of an engine, in rank order: the route of each part's first
    rank (rank 0 there). The scheduler reads every one and counts a key ready when all
    of them hold it. One part, on `first`, for an engine on one shard in one stage."""
    parts: list[RankRoute] = []
    rank = 0
    while rank < world_size:
        route = route_rank(rank, world_size, node_shards, first, stages)
        parts.append(route)
        rank += route.world_size
    return parts


def shard_namespace_id(namespace_id: str, part: int, shards: int) -> str:
    """The namespace an engine's `namespace_id` is on the `part`-th of the `shards` it
    uses (RankRoute.part): the id itself when it uses one shard (unsharded daemons see
    what they always saw), else an id of that shard's own (its rows hold other ranks'
    sections, so its bytes, disk records and remote entries must never meet another
    shard's)."""
    return namespace_id if shards == 1 else f"{namespace_id}.s{part}of{shards}"


def stage_suffix(stage: int, stages: int) -> str:
    """What names pipeline stage `stage` of `stages` in a namespace part's id: nothing
    for an engine of one stage (its ids are what they always were)."""
    return "" if stages == 1 else f".pp{stage}of{stages}"


def shard_mismatch(route: RankRoute, node_shards: int, shard: int, shard_count: int) -> str | None:
    """Why a daemon whose hello says it is `shard` of `shard_count` (0: unsharded) cannot
    serve a rank routed to `route` on a node of `node_shards`; None when it can. An engine
    that uses shard 0 alone talks to shard 0's socket, which serves whole rows on any
    daemon."""
    if route.shards == 1 and route.shard == 0:
        return None
    count = shard_count or 1
    if (shard, count) == (route.shard, node_shards):
        return None
    return (
        f"the daemon there is shard {shard} of {count}, but this rank expects shard "
        f"{route.shard} of {node_shards} (kvdepot_shards must equal the daemon's --shards)"
    )
