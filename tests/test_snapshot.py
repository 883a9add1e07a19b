"""Unit tests of the warm-restart index snapshot: the pure half
(kvdepot.server.core.snapshot) and the file half (kvdepot.server.memory.pool_file).

The end-to-end behaviour (SIGTERM, restart, SIGKILL) is in test_warm_restart.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdepot.server.core import snapshot
from kvdepot.server.core.allocator import ExtentAllocator
from kvdepot.server.core.index import BlockIndex, StoreOutcome
from kvdepot.server.core.layout import NamespaceLayout
from kvdepot.server.core.snapshot import (
    IndexSnapshot,
    PoolFileIdentity,
    SnapshotError,
    SnapshotSlot,
)
from kvdepot.server.memory import pool_file

POOL = 1 << 20
GRAN = 4096
IDENTITY = PoolFileIdentity(device=1, inode=2, size=POOL, mtime_ns=3, ctime_ns=4)
LAYOUTS = [
    NamespaceLayout("ns-a", world_size=2, blocks_per_chunk=2, groups=((1024, 1024), (512,))),
    NamespaceLayout(
        "ns-b", world_size=1, blocks_per_chunk=4, groups=((3000,),), description="model b"
    ),
]


def key(i: int, group: int = 0) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "big")).digest() + group.to_bytes(4, "big")


def new_index() -> BlockIndex:
    return BlockIndex(ExtentAllocator(POOL, GRAN))


def store(index: BlockIndex, ns: str, k: bytes, ranks: int | None = None) -> bool:
    """Writes `ranks` of the row (default all); True if the key became READY."""
    layout = index.namespaces[ns].layout
    ready = False
    for rank in range(layout.world_size if ranks is None else ranks):
        d = index.begin_store(ns, k, rank, "owner")
        if d.outcome is StoreOutcome.WRITE:
            assert d.slot is not None
            ready = index.finish_store(d.slot, rank, True)
    return ready


def populated() -> BlockIndex:
    index = new_index()
    for layout in LAYOUTS:
        index.declare_namespace(layout)
    for i in range(20):
        store(index, "ns-a", key(i, i % 2))
    for i in range(5):
        store(index, "ns-b", key(100 + i))
    store(index, "ns-a", key(999), ranks=1)  # half-written row: never in a snapshot
    index.pin("ns-a", [key(0)], "owner")
    index.lookup("ns-a", [key(3)])  # lookups do not count as use; reads do
    slot = index.begin_read("ns-a", key(4, 0))
    assert slot is not None
    index.end_read(slot)
    return index


def ready_view(index: BlockIndex) -> list[tuple[str, bytes, int, int]]:
    return [
        (s.namespace, s.key, s.extent.offset, s.extent.size) for s in index.ready_slots_by_age()
    ]


def test_roundtrip_keeps_ready_slots_offsets_and_lru_order() -> None:
    index = populated()
    snap = snapshot.capture(index, POOL, IDENTITY, boot_id="b1")
    assert len(snap.slots) == 25
    assert key(999) not in {s.key for s in snap.slots}
    decoded = snapshot.decode(snapshot.encode(snap))
    assert decoded == snap

    fresh = new_index()
    report = snapshot.restore(fresh, decoded)
    assert (report.namespaces, report.blocks) == (2, 25)
    fresh.check_invariants()
    # Same slots at the same offsets, in the same age order (the block pinned at
    # capture time was youngest-but-held; it comes back as the youngest).
    assert ready_view(fresh) == ready_view(index)
    assert ready_view(fresh)[-1][1] == key(0)
    assert fresh.allocator.used_bytes == sum(s.size for s in snap.slots)
    assert fresh.lookup("ns-a", [key(1, 1), key(999)]) == [True, False]
    assert fresh.namespaces["ns-b"].layout == LAYOUTS[1]


def test_rows_a_fleet_key_admitted_are_not_kept() -> None:
    """A row fetched from the fleet is fetched again after a restart (and checked under
    the keys held then): never in a snapshot (docs/security.md)."""
    index = populated()
    fleet = index.namespaces["ns-b"].slots[key(101)]
    fleet.admitted_by = b"K" * 8
    snap = snapshot.capture(index, POOL, IDENTITY)
    assert len(snap.slots) == 24 and key(101) not in {s.key for s in snap.slots}


def format_1(snap: IndexSnapshot) -> bytes:
    """`snap` as a kvdepot before chunk events wrote it (format 1: no event field)."""
    data = snapshot.encode(replace(snap, slots=[replace(s, chunk_event=b"") for s in snap.slots]))
    body = bytearray(data[16:-32])
    (hlen,) = struct.unpack_from("<I", body)
    header = json.loads(bytes(body[4 : 4 + hlen]))
    header["format"] = 1
    head = json.dumps(header, separators=(",", ":")).encode()
    out = bytearray(struct.pack("<I", len(head)) + head)
    pos = 4 + hlen
    while pos < len(body):  # each record loses its event length (0: no event follows)
        ns_i, klen, offset, size, elen = struct.unpack_from("<HHQQH", body, pos)
        assert elen == 0
        out += struct.pack("<HHQQ", ns_i, klen, offset, size)
        out += body[pos + 22 : pos + 22 + klen]
        pos += 22 + klen
    return snapshot.MAGIC + struct.pack("<Q", len(out)) + out + hashlib.sha256(out).digest()


def test_chunk_events_survive_a_restart_and_format_1_snapshots_still_load() -> None:
    """Each row's chunk event (what routers index it by) comes back with the row, and is
    counted again; a snapshot an older kvdepot wrote (format 1) restores its rows."""
    index = populated()
    events = {key(i, i % 2): os.urandom(100 + i) for i in range(0, 20, 3)}
    ns = index.namespace("ns-a")
    index.keep_chunk_events("ns-a", [ns.slots[k] for k in events], events)
    snap = snapshot.capture(index, POOL, IDENTITY)
    decoded = snapshot.decode(snapshot.encode(snap))
    assert {s.key: s.chunk_event for s in decoded.slots if s.chunk_event} == events
    fresh = new_index()
    snapshot.restore(fresh, decoded)
    assert fresh.chunk_events("ns-a", list(events)) == list(events.values())
    assert fresh.chunk_event_totals() == (len(events), sum(map(len, events.values())))

    old = snapshot.decode(format_1(snap))
    assert [(s.key, s.offset) for s in old.slots] == [(s.key, s.offset) for s in snap.slots]
    older = new_index()
    snapshot.restore(older, old)
    assert ready_view(older) == ready_view(index)
    assert older.chunk_event_totals() == (0, 0)


def test_group_ids_survive_a_restart_and_older_snapshots_mean_0_to_n() -> None:
    """A namespace of groups 0 and 2 (vLLM does not offload group 1): its layout keeps
    its ids through the snapshot, so its keys find their groups after a restart."""
    lay = NamespaceLayout("ns-ids", 1, 2, ((1024,), (512, 512)), group_ids=(0, 2))
    index = new_index()
    index.declare_namespace(lay)
    for i in range(4):
        assert store(index, "ns-ids", key(i, 0)) and store(index, "ns-ids", key(i, 2))
    snap = snapshot.capture(index, POOL, IDENTITY)
    fresh = new_index()
    snapshot.restore(fresh, snapshot.decode(snapshot.encode(snap)))
    assert fresh.namespaces["ns-ids"].layout == lay
    assert ready_view(fresh) == ready_view(index)
    assert fresh.lookup("ns-ids", [key(3, 2), key(3, 1)]) == [True, False]
    # A layout of groups 0, 1, ... is written as before (no ids), and read back so.
    plain = snapshot._layout_to_json(LAYOUTS[0])
    assert "group_ids" not in plain
    assert snapshot._layout_from_json(plain) == LAYOUTS[0]
    assert snapshot._layout_to_json(lay)["group_ids"] == [0, 2]


def test_lru_order_survives_so_the_oldest_block_is_evicted_first() -> None:
    index = new_index()
    index.declare_namespace(LAYOUTS[1])
    for i in range(5):
        store(index, "ns-b", key(i))
    slot = index.begin_read("ns-b", key(0))  # key 0 becomes the youngest
    assert slot is not None
    index.end_read(slot)
    fresh = new_index()
    snapshot.restore(
        fresh, snapshot.decode(snapshot.encode(snapshot.capture(index, POOL, IDENTITY)))
    )
    assert [s.key for s in fresh.ready_slots_by_age()] == [key(1), key(2), key(3), key(4), key(0)]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["store", "half", "evict", "read", "pin"]), st.integers(0, 40)),
        max_size=120,
    )
)
def test_any_index_history_restores_to_an_equivalent_index(ops: list[tuple[str, int]]) -> None:
    index = new_index()
    for layout in LAYOUTS:
        index.declare_namespace(layout)
    for op, i in ops:
        ns = "ns-a" if i % 2 else "ns-b"
        k = key(i, (i // 2) % 2 if ns == "ns-a" else 0)
        if op == "store":
            store(index, ns, k)
        elif op == "half" and ns == "ns-a":
            store(index, ns, k, ranks=1)
        elif op == "evict":
            index.evict(ns, [k])
        elif op == "read" and (slot := index.begin_read(ns, k)) is not None:
            index.end_read(slot)
        elif op == "pin":
            index.pin(ns, [k], "owner")
    snap = snapshot.capture(index, POOL, IDENTITY)
    fresh = new_index()
    snapshot.restore(fresh, snapshot.decode(snapshot.encode(snap)))
    fresh.check_invariants()
    assert set(ready_view(fresh)) == set(ready_view(index))
    assert fresh.counts()["writing"] == 0


@pytest.mark.parametrize("damage", ["flip", "truncate", "extend", "magic", "empty"])
def test_damaged_snapshots_are_refused(damage: str) -> None:
    data = bytearray(snapshot.encode(snapshot.capture(populated(), POOL, IDENTITY)))
    if damage == "flip":
        data[len(data) // 2] ^= 0x40
    elif damage == "truncate":
        del data[-7:]
    elif damage == "extend":
        data += b"\0"
    elif damage == "magic":
        data[:8] = b"NOTASNAP"
    else:
        data = bytearray()
    with pytest.raises(SnapshotError):
        snapshot.decode(bytes(data))


def test_compatibility_checks_name_what_changed() -> None:
    snap = IndexSnapshot(POOL, GRAN, IDENTITY)
    assert snapshot.check_compatible(snap, POOL, GRAN, IDENTITY) is None
    assert "pool size changed" in snapshot.check_compatible(snap, 2 * POOL, GRAN, IDENTITY)
    assert "granularity" in snapshot.check_compatible(snap, POOL, 8192, IDENTITY)
    assert "gone" in snapshot.check_compatible(snap, POOL, GRAN, None)
    touched = PoolFileIdentity(1, 2, POOL, 99, 4)
    assert "mtime_ns" in snapshot.check_compatible(snap, POOL, GRAN, touched)
    replaced = PoolFileIdentity(1, 77, POOL, 3, 4)
    assert "inode" in snapshot.check_compatible(snap, POOL, GRAN, replaced)
    resized = PoolFileIdentity(1, 2, POOL + GRAN, 3, 4)
    assert "bytes" in snapshot.check_compatible(snap, POOL, GRAN, resized)


@pytest.mark.parametrize(
    "slots",
    [
        # Two slots over the same bytes.
        [SnapshotSlot("ns-b", key(1), 0, 12288), SnapshotSlot("ns-b", key(2), 4096, 12288)],
        # A size that is not the layout's row size.
        [SnapshotSlot("ns-b", key(1), 0, 4096)],
        # The same key twice.
        [SnapshotSlot("ns-b", key(1), 0, 12288), SnapshotSlot("ns-b", key(1), 12288, 12288)],
        # Past the end of the pool.
        [SnapshotSlot("ns-b", key(1), POOL - 4096, 12288)],
        # Misaligned.
        [SnapshotSlot("ns-b", key(1), 100, 12288)],
        # A key whose group the namespace does not have.
        [SnapshotSlot("ns-b", key(1, group=3), 0, 12288)],
    ],
)
def test_inconsistent_snapshots_are_refused_whole(slots: list[SnapshotSlot]) -> None:
    snap = IndexSnapshot(POOL, GRAN, IDENTITY, layouts=[LAYOUTS[1]], slots=slots)
    with pytest.raises(SnapshotError):
        snapshot.restore(new_index(), snapshot.decode(snapshot.encode(snap)))


def test_restore_needs_an_empty_index() -> None:
    snap = snapshot.capture(populated(), POOL, IDENTITY)
    with pytest.raises(SnapshotError):
        snapshot.restore(populated(), snap)


def _pool_file(tmp_path: Path) -> Path:
    pool = tmp_path / "pool"
    pool.write_bytes(b"\0" * POOL)
    return pool


def _shut_down(index: BlockIndex, pool: Path) -> None:
    pool_file.save_at_shutdown(index, str(pool), POOL, "boot")


def test_start_after_clean_shutdown_restores_and_consumes(tmp_path: Path) -> None:
    pool = _pool_file(tmp_path)
    index = populated()
    _shut_down(index, pool)
    assert set(os.listdir(tmp_path)) == {"pool", "pool.index"}  # no temporary left behind
    plan = pool_file.prepare_start(str(pool), POOL, GRAN)
    assert plan.snapshot is not None
    assert not Path(snapshot.snapshot_path(pool)).exists(), "the snapshot must be consumed"
    fresh = new_index()
    assert pool_file.finish_start(plan, fresh) is not None
    assert set(ready_view(fresh)) == set(ready_view(index))
    # A second start (as after a SIGKILL of the first) finds nothing to trust.
    again = pool_file.prepare_start(str(pool), POOL, GRAN)
    assert again.snapshot is None and "did not shut down cleanly" in again.reason
    assert not again.fresh


def test_start_with_a_new_pool_file_is_routine(tmp_path: Path) -> None:
    plan = pool_file.prepare_start(str(tmp_path / "pool"), POOL, GRAN)
    assert plan.snapshot is None and plan.fresh


@pytest.mark.parametrize("how", ["write", "truncate", "replace", "resize-pool"])
def test_start_refuses_a_pool_file_changed_between_runs(tmp_path: Path, how: str) -> None:
    pool = _pool_file(tmp_path)
    _shut_down(populated(), pool)
    size = POOL
    if how == "write":
        with open(pool, "r+b") as f:
            f.seek(4096)
            f.write(b"someone else")
    elif how == "truncate":
        os.truncate(pool, POOL // 2)
    elif how == "replace":
        tmp = tmp_path / "other"
        tmp.write_bytes(b"\0" * POOL)
        os.replace(tmp, pool)
    else:
        size = 2 * POOL
    plan = pool_file.prepare_start(str(pool), size, GRAN)
    if how == "write" and plan.snapshot is not None:  # mtime granularity too coarse
        pytest.skip("this filesystem's mtime did not move on a write")
    assert plan.snapshot is None, plan
    assert "does not apply" in plan.reason
    assert not Path(snapshot.snapshot_path(pool)).exists()


def test_start_refuses_a_damaged_snapshot_file(tmp_path: Path) -> None:
    pool = _pool_file(tmp_path)
    _shut_down(populated(), pool)
    path = Path(snapshot.snapshot_path(pool))
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    plan = pool_file.prepare_start(str(pool), POOL, GRAN)
    assert plan.snapshot is None and "unusable" in plan.reason


def test_a_pool_file_is_locked_by_one_daemon_at_a_time(tmp_path: Path) -> None:
    pool = str(tmp_path / "pool")
    fd = pool_file.lock_pool_file(pool)
    try:
        assert not os.path.exists(pool), "locking must not create the pool file"
        with pytest.raises(pool_file.PoolFileBusy, match=f"pid {os.getpid()}"):
            pool_file.lock_pool_file(pool)
    finally:
        os.close(fd)
    os.close(pool_file.lock_pool_file(pool))  # free again once the holder closed it
