"""Inline Put/Get: one rank's section of one key, carried in the gRPC message.

For engines whose memory the daemon cannot reach (no shared memory, no CUDA
IPC, no process-memory access). The same index steps as a Transfer job of one
key (begin_store/finish_store, begin_read/end_read), counted and observed the
same way (kvdepot.server.state.traffic); the copy runs on a copy thread, and
is refused (UNAVAILABLE) while those threads are stalled, as a job's is.
"""

from __future__ import annotations

import time

from kvdepot.common.kinds import Direction
from kvdepot.server import errors
from kvdepot.server.copy_queue import CopyQueue
from kvdepot.server.core.index import BlockIndex
from kvdepot.server.core.kinds import PutOutcome, SlotState, StoreOutcome
from kvdepot.server.memory.arena import Arena
from kvdepot.server.state.traffic import Traffic


class InlinePath:
    def __init__(
        self, index: BlockIndex, arena: Arena, copy_queue: CopyQueue, traffic: Traffic
    ) -> None:
        self._index = index
        self._arena = arena
        self._copy_queue = copy_queue
        self._traffic = traffic

    def _section(self, namespace_id: str, key: bytes, rank: int) -> tuple[int, int]:
        """(offset in the slot, bytes) of `rank`'s section of `key`."""
        layout = self._index.namespace(namespace_id).layout
        group = layout.key_group(key)
        if not 0 <= rank < layout.world_size:
            raise errors.invalid(f"rank {rank} out of range [0, {layout.world_size})")
        size = layout.section_bytes(group)
        return rank * size, size

    def section_bytes(self, namespace_id: str, key: bytes, rank: int) -> int:
        """The bytes a Put of `rank`'s section of `key` carries (DepotError for a key
        of no group of the namespace, or a rank outside its world)."""
        return self._section(namespace_id, key, rank)[1]

    async def put(
        self, session_id: str, namespace_id: str, key: bytes, rank: int, data: bytes
    ) -> tuple[PutOutcome, bool, str]:
        """Stores one section: (outcome, whether the key is READY, drop reason text).
        A Put that fails counts as a failed store job (and raises)."""
        try:
            return await self._put(session_id, namespace_id, key, rank, data)
        except Exception:
            self._traffic.record(Direction.STORE, False, 0, 0, 0.0)
            raise

    async def get(self, namespace_id: str, key: bytes, rank: int) -> bytes:
        """Reads one section. A Get that fails counts as a failed load job (and raises)."""
        try:
            return await self._get(namespace_id, key, rank)
        except Exception:
            self._traffic.record(Direction.LOAD, False, 0, 0, 0.0)
            raise

    async def _put(
        self, session_id: str, namespace_id: str, key: bytes, rank: int, data: bytes
    ) -> tuple[PutOutcome, bool, str]:
        offset, size = self._section(namespace_id, key, rank)
        self._copy_queue.refuse_if_stalled()  # before anything is claimed
        if len(data) != size:
            raise errors.invalid(
                f"data has {len(data)} bytes; rank {rank}'s section of this key's group is "
                f"{size} bytes (blocks_per_chunk x the group's page bytes)"
            )
        decision = self._index.begin_store(namespace_id, key, rank, session_id)
        if decision.outcome is StoreOutcome.DROPPED:
            self._traffic.record(Direction.STORE, True, 0, 0, 0.0)
            return PutOutcome.DROPPED, False, decision.reason.text if decision.reason else ""
        slot = decision.slot
        assert slot is not None
        if decision.outcome is StoreOutcome.PRESENT:
            self._traffic.record(Direction.STORE, True, 0, 0, 0.0)
            return PutOutcome.PRESENT, slot.state is SlotState.READY, ""
        arena = self._arena
        ok = False
        t0 = time.perf_counter()
        try:
            await self._copy_queue.run(
                lambda: arena.view(slot.extent.offset + offset, size).__setitem__(slice(None), data)
            )
            ok = True
        finally:
            ready = self._index.finish_store(slot, rank, ok)
        self._traffic.record(Direction.STORE, True, 1, size, time.perf_counter() - t0)
        return PutOutcome.STORED, ready, ""

    async def _get(self, namespace_id: str, key: bytes, rank: int) -> bytes:
        offset, size = self._section(namespace_id, key, rank)
        self._copy_queue.refuse_if_stalled()
        slot = self._index.begin_read(namespace_id, key)
        if slot is None:
            raise errors.not_found(f"key {key.hex()} is not ready in namespace {namespace_id}")
        arena = self._arena
        t0 = time.perf_counter()
        try:
            data = await self._copy_queue.run(
                lambda: bytes(arena.view(slot.extent.offset + offset, size))
            )
        finally:
            self._index.end_read(slot)
        self._traffic.record(Direction.LOAD, True, 1, size, time.perf_counter() - t0)
        return data
