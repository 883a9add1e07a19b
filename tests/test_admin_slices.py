"""Admin calls stay off the data path's back (docs/architecture.md §11): figures
come from counters kept on every state change, ListBlocks pages by key in
O(log n + page), and bulk eviction runs in slices that let other calls in.

Speed itself is a benchmark figure (`python -m kvdepot.bench.admin_scale`); here
the structure is checked: counters equal a full count, pages cover every block
once, and a Lookup completes between two slices of a Clear.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
from collections.abc import Iterator

import pytest

from kvdepot.server.config import ServeConfig
from kvdepot.server.core.layout import NamespaceLayout
from kvdepot.server.core.sorted_keys import SortedKeys
from kvdepot.server.state import DepotState
from kvdepot.server.state.admin_evict import EVICT_SLICE

GRAN = 64
LAYOUT = NamespaceLayout("ns", world_size=1, blocks_per_chunk=1, groups=((GRAN,),))


def key(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "big")).digest() + (0).to_bytes(4, "big")


def test_sorted_keys_matches_a_sorted_list() -> None:
    rng = random.Random(7)
    sk, ref = SortedKeys(), set()
    for _ in range(20000):
        k = rng.randbytes(3)
        if k in ref and rng.random() < 0.5:
            sk.remove(k)
            ref.discard(k)
        elif k not in ref:
            sk.add(k)
            ref.add(k)
        if not rng.randrange(1000):  # each chunk's first key indexed, no chunk empty
            assert sk._firsts == [c[0] for c in sk._chunks] and all(sk._chunks)
    want = sorted(ref)
    assert list(sk) == want and len(sk) == len(want)
    assert len(sk._chunks) > 2  # chunks split on the way
    assert sk._firsts == [c[0] for c in sk._chunks] and all(sk._chunks)
    for k in list(sk._chunks[0]):  # a chunk emptied goes, with its first key
        sk.remove(k)
        ref.discard(k)
    want = sorted(ref)
    assert list(sk) == want and sk._firsts == [c[0] for c in sk._chunks] and all(sk._chunks)
    for probe in (None, want[0], want[len(want) // 2], b"\x00", b"\xff\xff\xff\xff"):
        start = 0 if probe is None else sum(k <= probe for k in want)
        assert sk.after(probe, 50) == want[start : start + 50]
    for absent in (b"absent-key", b""):  # b"": before every key
        with pytest.raises(KeyError):
            sk.remove(absent)


@pytest.fixture
def state() -> Iterator[DepotState]:
    blocks = 5 * EVICT_SLICE + 17
    st = DepotState.create(
        ServeConfig(
            socket="/nonexistent/kvdepot.sock",
            pool_size=(blocks + 64) * GRAN,
            copy_threads=1,
            slot_granularity=GRAN,
        )
    )
    st.debug_invariants = True
    yield st
    st.close()


def fill(st: DepotState, n: int, owner: str) -> list[bytes]:
    keys = [key(i) for i in range(n)]
    for k in keys:
        d = st.index.begin_store("ns", k, 0, owner)
        assert d.slot is not None
        st.index.finish_store(d.slot, 0, True)
    return keys


def test_clear_yields_between_slices_and_counters_stay_exact(state: DepotState) -> None:
    session = state.open_session("test", os.getpid(), "")
    state.register(session.id, LAYOUT, 0, [], [], [])
    n = 5 * EVICT_SLICE + 17
    keys = fill(state, n, session.id)
    assert state.pin(session.id, "ns", keys[:3]) == [True] * 3
    s = state.stats()
    assert (s["ready_blocks"], s["pinned_blocks"], s["writing_blocks"]) == (n, 3, 0)
    assert s["pinned_bytes"] == 3 * GRAN
    state.check_invariants()  # the counters equal a full count

    async def run() -> tuple[tuple[int, int], list[int]]:
        seen: list[int] = []  # ready blocks each Lookup saw while Clear ran
        clear = asyncio.create_task(state.clear_in_slices())
        while not clear.done():
            assert state.lookup(session.id, "ns", keys[-1:]) in ([True], [False])
            seen.append(state.stats()["ready_blocks"])  # type: ignore[arg-type]
            await asyncio.sleep(0)
        return await clear, seen

    (evicted, skipped), seen = asyncio.run(run())
    assert (evicted, skipped) == (n - 3, 3)
    # Lookups ran in between: they saw the index part-way through the Clear.
    assert len({v for v in seen if 3 < v < n}) >= 3, seen
    assert state.slices_yielded >= n // EVICT_SLICE
    assert state.verify_invariants() is None
    s = state.stats()
    assert (s["ready_blocks"], s["pinned_blocks"], s["used_bytes"]) == (3, 3, 3 * GRAN)
    state.close_session(session.id)
    assert state.stats()["pinned_blocks"] == 0
    state.check_invariants()
