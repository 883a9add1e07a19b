"""Transfer counters: jobs and blocks by direction, counted alike on every path.

A *job* is one successful transfer request: a Transfer job (shared memory, CUDA
IPC, process memory) or one inline Put/Get. *Blocks* are the keys whose section
(this rank's share of the key's slot) the jobs wrote or read: a store counts the
keys it wrote (not those already present or dropped), a load every key it read.
Observers (the Prometheus histograms) hear about every finished job.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvdepot.common.kinds import Direction

# direction, ok, bytes, copy seconds; called on the event loop for every finished job.
TransferObserver = Callable[[Direction, bool, int, float], None]


@dataclass
class DirectionCounters:
    jobs: int = 0  # successful jobs (Transfer jobs and inline Put/Get)
    blocks: int = 0  # keys written (store) or read (load) by them
    bytes: int = 0  # bytes they copied
    failed_jobs: int = 0


@dataclass
class Traffic:
    store: DirectionCounters = field(default_factory=DirectionCounters)
    load: DirectionCounters = field(default_factory=DirectionCounters)
    inflight_jobs: int = 0  # Transfer jobs being validated or copied
    observers: list[TransferObserver] = field(default_factory=list)

    def of(self, direction: Direction) -> DirectionCounters:
        return self.store if direction is Direction.STORE else self.load

    def record(
        self, direction: Direction, ok: bool, blocks: int, nbytes: int, seconds: float
    ) -> None:
        """One job finished: counts it and tells the observers."""
        c = self.of(direction)
        if ok:
            c.jobs += 1
            c.blocks += blocks
            c.bytes += nbytes
        else:
            c.failed_jobs += 1
        for observer in self.observers:
            observer(direction, ok, nbytes, seconds)
