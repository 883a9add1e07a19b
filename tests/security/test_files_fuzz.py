"""Hypothesis against the journal replay and the snapshot decoder (docs/security.md):
whatever a journal or snapshot file holds, start-up never raises.

Journals are built of records with valid frames (length and CRC right, so the
fuzz reaches the decoders, not just the CRC check): headers with missing, wrong
or huge fields, layouts of arbitrary JSON, READY/SUM/FREED records of any length
and any field values (huge extents, offsets outside the pool, overlaps,
unknown namespaces), unknown record types, truncation and flipped bytes.
Snapshots carry a valid SHA-256 over such bodies. For each, replay/decode either
refuses the file with its own error (JournalError/SnapshotError) or returns a
state, and crash recovery / restore of that state into a fresh index either
claims extents that lie inside the pool, one slot size each, never overlapping
(the index's invariants hold), or refuses it with SnapshotError.

Short by default (fixed examples, a few seconds); `KVDEPOT_LONG=1` runs 20x the
examples, random each run (tests/README.md, "Long runs").
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvdepot.server.core import journal, snapshot
from kvdepot.server.core.allocator import ExtentAllocator
from kvdepot.server.core.index import BlockIndex
from kvdepot.server.core.layout import NamespaceLayout
from kvdepot.server.core.snapshot import IndexSnapshot, PoolFileIdentity, SnapshotSlot
from kvdepot.server.memory.journal_file import RecoveryProgress, begin_recovery

pytestmark = pytest.mark.slow

LONG = os.environ.get("KVDEPOT_LONG") == "1"
POOL = 4 << 20
GRAN = 4096
U64 = 2**64 - 1
LAYOUTS = [
    NamespaceLayout("a", 2, 2, ((1024, 1024), (512,))),  # slots of 8 KiB and 4 KiB
    NamespaceLayout("b", 1, 4, ((4096,),)),  # 16 KiB
]


def fuzz_settings(examples: int) -> settings:
    return settings(
        max_examples=examples * 20 if LONG else examples,
        derandomize=not LONG,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# -- strategies -------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)
numbers = st.one_of(
    st.integers(0, 64).map(lambda n: n * GRAN),
    st.sampled_from([0, 1, GRAN - 1, POOL - GRAN, POOL, POOL + GRAN, 2**40, U64 - GRAN + 1, U64]),
    st.integers(0, U64),
)
sizes = st.one_of(st.sampled_from([GRAN, 2 * GRAN, 4 * GRAN]), numbers)  # slot sizes, often
keys = st.one_of(
    st.tuples(st.binary(min_size=32, max_size=32), st.integers(0, 3)).map(
        lambda t: t[0] + t[1].to_bytes(4, "big")
    ),
    st.binary(max_size=80),
)


def _layout_json(lay: NamespaceLayout) -> dict:
    return snapshot._layout_to_json(lay)


layout_objects = st.one_of(
    st.sampled_from(LAYOUTS).map(_layout_json),
    st.builds(
        lambda base, key, value: {**_layout_json(base), key: value},
        st.sampled_from(LAYOUTS),
        st.sampled_from(["id", "world_size", "blocks_per_chunk", "groups", "description"]),
        json_values,
    ),
    json_values,
)


@st.composite
def plausible_rows(draw: st.DrawFn) -> tuple[int, bytes, int, int]:
    """(namespace index, key, offset, size) of a row that fits LAYOUTS, with at most
    one field swapped for an arbitrary value: what reaches the claim checks."""
    ns = draw(st.integers(0, len(LAYOUTS) - 1))
    lay = LAYOUTS[ns]
    group = draw(st.integers(0, lay.num_groups - 1))
    key = draw(st.binary(min_size=32, max_size=32)) + group.to_bytes(4, "big")
    size = -(-lay.slot_bytes(group) // GRAN) * GRAN
    offset = draw(st.integers(0, POOL // GRAN - 1)) * GRAN
    swap = draw(st.sampled_from(["none", "none", "ns", "key", "offset", "size"]))
    if swap == "ns":
        ns = draw(st.integers(0, 0xFFFF))
    elif swap == "key":
        key = draw(keys)
    elif swap == "offset":
        offset = draw(numbers)
    elif swap == "size":
        size = draw(sizes)
    return ns, key, offset, size


@st.composite
def header_payloads(draw: st.DrawFn, dirty: bool) -> bytes:
    head: dict = {"format": 1, "pool_size": POOL, "granularity": GRAN, "boot_id": "x"}
    if not dirty:
        return journal.HEADER + json.dumps(head).encode()
    for name in draw(st.lists(st.sampled_from(list(head)), max_size=2, unique=True)):
        if draw(st.booleans()):
            del head[name]
        else:
            head[name] = draw(json_values | numbers)
    body = json.dumps(head).encode() if draw(st.integers(0, 9)) else draw(st.binary(max_size=40))
    return journal.HEADER + body


@st.composite
def record_payloads(draw: st.DrawFn, dirty: bool) -> bytes:
    kinds = ["layout", "ready", "sum", "freed", "raw"] if dirty else ["ready", "ready", "freed"]
    kind = draw(st.sampled_from(kinds))
    ns = draw(st.sampled_from([0, 1, 2]) | st.integers(0, 0xFFFF))
    if kind == "layout":
        body = json.dumps(draw(layout_objects)).encode()
        return journal.LAYOUT + struct.pack("<H", ns) + body
    if kind == "ready":
        flag = draw(st.sampled_from([0, 1, 1, 1, 2, 255] if dirty else [0, 1, 1, 1]))
        ns, key, offset, size = draw(plausible_rows())
        if dirty:
            ns, key, offset, size = ns, draw(keys), draw(numbers), draw(sizes)
        crc = draw(st.integers(0, 2**32 - 1))
        payload = journal.READY + struct.pack("<HQQBI", ns, offset, size, flag, crc) + key
    elif kind == "sum":
        payload = journal.SUM + struct.pack("<HI", ns, draw(st.integers(0, 2**32 - 1))) + draw(keys)
    elif kind == "freed":
        payload = journal.FREED + struct.pack("<H", ns) + draw(keys)
    else:
        return draw(st.binary(min_size=1, max_size=40))  # unknown types, short bodies
    if dirty and draw(st.integers(0, 9)) == 0:  # cut short, with a valid frame around it
        payload = payload[: draw(st.integers(1, len(payload)))]
    return payload


@st.composite
def journals(draw: st.DrawFn) -> bytes:
    # Clean ones (well-formed records, any field values) reach crash recovery's
    # checks; dirty ones (damaged headers and records, flips, cuts) the decoder's.
    dirty = draw(st.booleans())
    parts = [journal._frame(draw(header_payloads(dirty)))]
    parts += [
        journal.layout(i, lay) for i, lay in enumerate(LAYOUTS) if not dirty or draw(st.booleans())
    ]
    parts += [journal._frame(p) for p in draw(st.lists(record_payloads(dirty), max_size=24))]
    data = bytearray(b"".join(parts))
    if dirty and draw(st.integers(0, 2)) == 0:
        data[draw(st.integers(0, len(data) - 1))] ^= draw(st.integers(1, 255))
    if dirty and draw(st.integers(0, 2)) == 0:
        del data[draw(st.integers(0, len(data))) :]
    return bytes(data)


def _fresh_index() -> BlockIndex:
    return BlockIndex(ExtentAllocator(POOL, GRAN))


def _assert_claims_sound(index: BlockIndex, extents: list) -> None:
    index.check_invariants()
    spans = sorted((e.offset, e.offset + e.size) for e in extents)
    ends = [start for start, _ in spans[1:]] + [index.allocator.capacity] * bool(spans)
    for (start, end), limit in zip(spans, ends, strict=True):
        assert 0 <= start < end <= limit, (start, end, limit)  # inside, no overlap


# -- the journal ------------------------------------------------------------------------------


@fuzz_settings(300)
@given(data=journals())
def test_replay_and_recovery_never_raise(data: bytes) -> None:
    try:
        state = journal.replay(data)
    except journal.JournalError:
        return  # not a journal: the daemon starts empty and says why
    index = _fresh_index()
    progress = RecoveryProgress()
    to_verify, listed = begin_recovery(index, state, progress)
    assert progress.total == len(state.rows) == progress.rejected + len(to_verify)
    assert len(listed) == len(to_verify)
    for ns_id, key, extent, crc, _event in to_verify:
        lay = index.namespaces[ns_id].layout
        group = int.from_bytes(key[-4:], "big")
        assert extent.size == index.allocator.round_up(lay.slot_bytes(group)), (key, extent)
        assert isinstance(crc, int)
    _assert_claims_sound(index, [e for _, _, e, _, _ in to_verify])


@fuzz_settings(200)
@given(data=st.binary(max_size=200))
def test_replay_of_raw_bytes_never_raises(data: bytes) -> None:
    with contextlib.suppress(journal.JournalError):
        journal.replay(data)


# -- the snapshot -----------------------------------------------------------------------------


@st.composite
def snapshot_files(draw: st.DrawFn) -> bytes:
    rows = draw(st.lists(plausible_rows(), max_size=8))
    slots = [SnapshotSlot(LAYOUTS[ns % 2].id, key, off, size) for ns, key, off, size in rows]
    snap = IndexSnapshot(POOL, GRAN, PoolFileIdentity(1, 2, POOL, 3, 4), list(LAYOUTS), [])
    good = snapshot.encode(snap)
    body = bytearray(good[16:-32])
    (hlen,) = struct.unpack_from("<I", body)
    header = json.loads(bytes(body[4 : 4 + hlen]))
    header["slots"] = len(slots)
    # Clean ones (well-formed, any slot values) reach restore; dirty ones the decoder.
    dirty = draw(st.booleans())
    if dirty:
        for name in draw(st.lists(st.sampled_from(list(header)), max_size=2, unique=True)):
            if draw(st.booleans()):
                del header[name]
            else:
                header[name] = draw(json_values | numbers | st.sampled_from([["x"], {"id": 1}]))
    if dirty and draw(st.integers(0, 2)) == 0:
        header["namespaces"] = draw(st.lists(layout_objects, max_size=3))
    head = json.dumps(header).encode()
    hlen = draw(numbers) % 2**32 if dirty and draw(st.integers(0, 3)) == 0 else len(head)
    parts = [struct.pack("<I", hlen), head]
    for s in slots:
        ns_i = (
            draw(st.sampled_from([0, 1, 2, 0xFFFF]))
            if dirty
            else LAYOUTS.index(next(lay for lay in LAYOUTS if lay.id == s.namespace))
        )
        klen = draw(st.integers(0, 0xFFFF)) if dirty and draw(st.booleans()) else len(s.key)
        parts.append(struct.pack("<HHQQ", ns_i, klen, s.offset % 2**64, s.size % 2**64))
        parts.append(s.key)
    if dirty:
        parts.append(draw(st.binary(max_size=8)))
    new_body = b"".join(parts)
    return (
        snapshot.MAGIC
        + struct.pack("<Q", len(new_body))
        + new_body
        + hashlib.sha256(new_body).digest()
    )


@fuzz_settings(300)
@given(data=snapshot_files())
def test_snapshot_decode_and_restore_never_raise(data: bytes) -> None:
    try:
        snap = snapshot.decode(data)
    except snapshot.SnapshotError:
        return
    why = snapshot.check_compatible(snap, POOL, GRAN, PoolFileIdentity(1, 2, POOL, 3, 4))
    assert why is None or isinstance(why, str)
    index = _fresh_index()
    try:
        snapshot.restore(index, snap)
    except snapshot.SnapshotError:
        return  # the caller discards this index and starts empty
    slots = [s for ns in index.namespaces.values() for s in ns.slots.values()]
    _assert_claims_sound(index, [s.extent for s in slots])


@fuzz_settings(200)
@given(data=st.binary(max_size=200))
def test_snapshot_decode_of_raw_bytes_never_raises(data: bytes) -> None:
    with contextlib.suppress(snapshot.SnapshotError):
        snapshot.decode(data)
