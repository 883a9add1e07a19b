"""The in-process limit: the daemon's own planner and CPU copy engine, no daemon.

An engine that offloaded inside its own process would gather its pages into a
host arena exactly like this: plan the runs (`plan_job`), then memmove them
(`CpuCopyEngine`). No gRPC, no event loop, no index, no thread hand-off. What
the daemon path loses against this is the price of being out of process.

Both sides of the copy are pre-faulted before anything is timed: the engine's
memfd by the worker, the arena by `Arena`'s warm-up (as the daemon does).
"""

from __future__ import annotations

import time

from kvdepot.bench.geometry import BenchGeometry, JobShape
from kvdepot.server.core.layout import NamespaceLayout
from kvdepot.server.core.memory_map import LayerRef, MemoryMap, TensorView
from kvdepot.server.core.planner import plan_job
from kvdepot.server.memory.arena import Arena
from kvdepot.server.memory.copy_engine import LOAD, STORE, CpuCopyEngine, MappedRegion


class LocalRegion(MappedRegion):
    """The engine's own memfd mapping, handed to the copy engine by address."""

    kind = "local"

    def __init__(self, address: int, size: int) -> None:
        self.address = address
        self.size = size

    def close(self) -> None:
        """Nothing to unmap: the worker owns the mapping."""


class InProcessCopier:
    """Copies jobs between one rank's KV memfd and a private, pre-faulted arena."""

    def __init__(
        self,
        geo: BenchGeometry,
        rank: int,
        kv_address: int,
        kv_size: int,
        tensor_offsets: list[int],
        num_blocks: int,
        arena_bytes: int,
    ) -> None:
        self.geo = geo
        self.rank = rank
        self.layout = NamespaceLayout(
            id="inproc",
            world_size=geo.tp,
            blocks_per_chunk=geo.blocks_per_chunk,
            groups=tuple(tuple(g) for g in geo.groups),
        )
        pages = geo.layer_pages
        tensors = [
            TensorView(0, o, num_blocks, p, p) for o, p in zip(tensor_offsets, pages, strict=True)
        ]
        refs, t = [], 0
        for g in geo.groups:
            refs.append([LayerRef(t + i, 0, p) for i, p in enumerate(g)])
            t += len(g)
        self.memory = MemoryMap.build(self.layout, [kv_size], tensors, refs)
        self.regions = [LocalRegion(kv_address, kv_size)]
        self.engine = CpuCopyEngine()
        self.arena = Arena(arena_bytes)
        self.arena.start_warmup()

    def wait_warm(self) -> None:
        """Blocks until the arena is pre-faulted (never time a cold arena)."""
        self.arena.wait_warmup()

    def frames(self, chunks: int) -> int:
        """How many jobs of `chunks` chunks fit side by side in the arena."""
        return max(1, self.arena.size // self.frame_bytes(chunks))

    def frame_bytes(self, chunks: int) -> int:
        return chunks * sum(self.layout.slot_bytes(g) for g in range(self.layout.num_groups))

    def slot_offsets(self, chunks: int, frame: int) -> list[int | None]:
        """Slots of a job's keys (group-major) in frame `frame` of the arena.

        Frames wrap around the arena, so stores keep landing on memory the cache
        has not seen lately, as the daemon's fresh slots do.
        """
        base = (frame % self.frames(chunks)) * self.frame_bytes(chunks)
        out: list[int | None] = []
        off = base
        for g in range(self.layout.num_groups):
            size = self.layout.slot_bytes(g)
            for _ in range(chunks):
                out.append(off)
                off += size
        return out

    def run(self, direction: int, shape: JobShape, chunks: int, frame: int) -> tuple[float, int]:
        """Plans and copies one job; returns (copy seconds, bytes)."""
        if direction not in (STORE, LOAD):
            raise ValueError(f"unknown direction {direction}")
        plan = plan_job(
            self.layout,
            self.rank,
            self.memory,
            shape.block_ids,
            shape.group_sizes,
            shape.block_indices,
            self.slot_offsets(chunks, frame),
        )
        t = time.monotonic()
        self.engine.copy(direction, self.regions, self.arena.address, plan)
        return time.monotonic() - t, plan.nbytes

    def close(self) -> None:
        self.arena.close()
