"""Eviction across the pool and the disk keeps prefixes (the real daemon, `kvdepot
serve --disk`): requests that share documents, replayed as the connector does them
(lookup, Prefetch of what RAM misses, load, store the rest, touch the whole prompt),
over a pool and a disk that together hold about half the working set. After every
request no row of either tier is behind a chunk that neither holds (a row no lookup
and no Prefetch reaches), and what a lookup and a Prefetch find loads byte for byte.

The touch comes while the request's new rows are still being written to disk: the
disk applies it again once they are (kvdepot.server.core.touch_order); before that,
new tails were younger on disk than their heads and outlived them there."""

from __future__ import annotations

import hashlib
import random

import pytest

from kvdepot.client import DepotClient
from kvdepot.testing.tiers import DiskRecords, unreachable_keys
from kvdepot.testing.waiting import wait_for
from kvdepot.v1 import depot_pb2 as pb
from tests.support.daemon import connect, stats
from tests.support.engine import Engine, Geometry

pytest.importorskip("blake3")

FETCHING = pb.PrefetchResponse.FETCHING
# One group, one rank: a row is 2 layers x 16 KiB x 2 blocks = 64 KiB. The pool holds
# 64 rows, the disk 128 records (a record: its header page and the row).
GEO = Geometry(groups=[[16384, 16384]], world_size=1, num_blocks=1024, namespace="prefix-ns")
BPC = GEO.blocks_per_chunk
POOL = "4MiB"
DISK_RECORDS = 128
DISK_SIZE = DISK_RECORDS * (4096 + (64 << 10)) + 4096  # the last page is the probe's
DOCS, DOC_CHUNKS, QUESTIONS, QUESTION_CHUNKS = 10, 6, 5, 3  # 210 rows in all
REQUESTS = 120
LOAD_BASE = 512  # loads land in blocks the stores never use


def chunk_key(*parts: int) -> bytes:
    return hashlib.sha256(repr(parts).encode()).digest() + (0).to_bytes(4, "big")


def prompt(doc: int, question: int) -> list[bytes]:
    """A document's chunks, then a question's about it: the document is shared."""
    return [chunk_key(doc, c) for c in range(DOC_CHUNKS)] + [
        chunk_key(doc, DOC_CHUNKS, question, c) for c in range(QUESTION_CHUNKS)
    ]


def job(engine: Engine, direction: int, keys: list[bytes], first: int, base: int) -> None:
    """One job of `keys`, chunks `first`.. of their prompt, in blocks from `base`."""
    blocks = list(range(base, base + len(keys) * BPC))
    if direction == pb.STORE:
        engine.fill(0, keys, blocks, first * BPC)
    res = engine.job(direction, keys, [blocks], [first * BPC])
    assert res.success, res.error
    if direction == pb.LOAD:
        assert engine.mismatches(0, keys, blocks, first * BPC) == 0, "loaded other bytes"


def leading(found: list[bool]) -> int:
    return found.index(False) if False in found else len(found)


def request(c: DepotClient, engine: Engine, keys: list[bytes]) -> tuple[int, int]:
    """What the connector does for one prompt; (chunks hit in RAM, more from disk).
    Hits are pinned until loaded, as the connector's scheduler pins them (rows the
    Prefetch brings in take room: they must not push out the hits before them)."""
    ns = GEO.namespace
    in_ram = leading(c.lookup(ns, keys))
    pinned = keys[:in_ram]
    assert all(c.pin(ns, pinned)), "a hit went before it was pinned"
    if in_ram < len(keys):
        states = list(c.prefetch(ns, keys[in_ram:], timeout=5.0).states)
        run = leading([s == FETCHING for s in states])
        fetched = keys[in_ram : in_ram + run]
        wait_for(lambda: all(c.lookup(ns, fetched)), what="the rows Prefetch fetched")
        more = leading(c.pin(ns, fetched))
        pinned += fetched[:more]
    hit = len(pinned)
    if hit:
        job(engine, pb.LOAD, keys[:hit], 0, LOAD_BASE)
    if hit < len(keys):
        job(engine, pb.STORE, keys[hit:], hit, hit * BPC)
    # The request ends: its pins go, and every chunk it used is touched, its head youngest.
    c.unpin(ns, pinned, touch=keys, wait=True)
    return in_ram, hit - in_ram


def test_no_row_of_either_tier_outlives_a_chunk_before_it(daemon_factory, tmp_path) -> None:
    d = daemon_factory(
        "--pool-size", POOL, "--disk", str(tmp_path / "disk"), "--disk-size", str(DISK_SIZE),
        # One engine owns the pool (the shares per session are for many tenants).
        "--max-pinned-per-session", "100%", "--max-writing-per-session", "100%",
    )  # fmt: skip
    c = connect(d, "engine")
    engine = Engine(c, GEO, 0)
    records = DiskRecords(c, GEO.namespace)
    parents: dict[bytes, bytes | None] = {}
    for doc in range(DOCS):
        for q in range(QUESTIONS):
            keys = prompt(doc, q)
            parents.update(zip(keys, [None, *keys[:-1]], strict=True))
    every = list(parents)
    rng = random.Random(48)
    hits = from_disk = 0
    worst: list[tuple[int, int, int]] = []  # (request, rows unreachable, of them on disk)
    try:
        for n in range(REQUESTS):
            ram, disk = request(c, engine, prompt(rng.randrange(DOCS), rng.randrange(QUESTIONS)))
            hits, from_disk = hits + ram, from_disk + disk
            s = records.wait_settled(lambda: stats(c))
            found = c.lookup(GEO.namespace, every)
            pool = {k for k, ready in zip(every, found, strict=True) if ready}
            on_disk = records.keys()
            lost = unreachable_keys(pool | on_disk, parents)
            if lost:
                worst.append((n, len(lost), len(lost & on_disk)))
    finally:
        records.close()
    # The tiers were full (both evicted) and both served hits.
    assert s.evictions > 0 and s.disk_evicted > 0 and not s.disk_write_drops
    assert hits > 0 and from_disk > 0 and s.disk_hits >= from_disk
    assert worst == [], f"rows no lookup reaches (request, rows, on disk): {worst}"
    c.close()
