"""Garbage collection for a daemon whose index holds millions of objects.

CPython's cyclic collector walks every tracked object in a full collection. At
10^6 blocks the index alone is about 3·10^6 objects, and one full collection
holds the event loop for about 0.6 s (`benchmarks/admin_scale.py`, phase
"churn"): twelve times vLLM's pin deadline. Full collections start by
themselves whenever a quarter more objects have survived than at the last one,
so a filling or churning pool meets them again and again.

The index keeps no reference cycles: a block's objects go away by reference
counting when the block leaves the index. The collector has nothing to find
among them, so the daemon takes them out of its reach:

- every TICK_S `tick()` runs a full collection, which walks only what is not
  frozen yet (what survived since the last tick: little, so it takes well under
  a millisecond), then `gc.freeze()`s the survivors into the permanent
  generation, which no collection walks again;
- young collections run as before, so the cyclic garbage a request makes and
  drops (gRPC's own, exceptions) is still collected within milliseconds.

The C heap gets a policy too (`keep_freed_heap`, at construction): glibc's malloc
gives the top of its heap back to the kernel whenever 128 KiB there are free, and
takes it back at the next allocation, page fault by page fault. A job's plan arrays
(tens of KiB each, made and freed per job) did that at every job: about 7 % of the
daemon's CPU in a TP=8 job series went to those faults and `brk` calls. The daemon
keeps freed heap up to TRIM_THRESHOLD instead (resident once touched, reused by the
next job).

The price: an object that was alive at a tick and later becomes part of an
unreachable cycle is not reclaimed; it would show as resident memory growing
while the block count stays flat. A frozen object freed by reference counting
leaves the permanent generation as usual. (The permanent generation's size is
not exported: `gc.get_freeze_count()` walks it, 0.1 s at 10^6 blocks.)
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import os
import time
from dataclasses import dataclass

log = logging.getLogger("kvdepot.gc")

TICK_S = 0.1  # short, so that few objects survive between two ticks
# A tick longer than this is logged: it means many objects survived one interval.
SLOW_TICK_S = 0.005
# glibc mallopt(3) parameters and the daemon's values (see the module docstring).
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
# Bounded, so that memory a burst freed (a large inline Put's) still goes back: at
# most TRIM_THRESHOLD + TOP_PAD of freed heap stays resident, per malloc arena (glibc
# gives threads arenas of their own: a few MiB each, not tens, or a busy daemon's
# threads would keep hundreds of MiB). A job's plan arrays are tens of KiB.
TRIM_THRESHOLD = 8 << 20  # free heap top kept before it goes back to the kernel
TOP_PAD = 1 << 20  # extra heap asked for at each growth
MMAP_THRESHOLD = 4 << 20  # larger allocations get their own mapping (fixed: no drift)


@dataclass
class GcStats:
    ticks: int = 0
    collected: int = 0  # unreachable objects the ticks' collections freed
    frozen: int = 0  # objects the ticks moved into the permanent generation, in all
    max_tick_seconds: float = 0.0


class GcPolicy:
    """Keeps full collections short by freezing long-lived objects; see the module
    docstring. Process-wide (the collector is): one per daemon process."""

    def __init__(self) -> None:
        self.stats = GcStats()
        self.heap_kept = keep_freed_heap()

    def start(self) -> None:
        """Freezes what start-up built (imports, the pool, the index) without a
        collection: there is no garbage worth a walk over all of it."""
        gc.freeze()
        self.stats.frozen += gc.get_freeze_count()  # walks them, once

    async def run(self, stop: asyncio.Event) -> None:
        """Ticks every TICK_S until `stop` is set (a task on the event loop).
        `KVDEPOT_GC_FREEZE=0` leaves Python's collector as it comes (to compare,
        or to rule the policy out when chasing memory growth)."""
        if os.environ.get("KVDEPOT_GC_FREEZE", "1") == "0":
            log.info("KVDEPOT_GC_FREEZE=0: full garbage collections walk the whole index")
            return
        self.start()
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=TICK_S)
            except TimeoutError:
                self.tick()

    def tick(self) -> None:
        """One collection of the unfrozen objects, then freezes the survivors.
        Call it on the event loop thread at a steady pace (`run`)."""
        t = time.perf_counter()
        collected = gc.collect()
        # After a full collection every survivor is in the oldest generation.
        # (gc.get_freeze_count() would walk the whole permanent generation.)
        survivors = len(gc.get_objects(generation=2))
        gc.freeze()
        took = time.perf_counter() - t
        s = self.stats
        s.ticks += 1
        s.collected += collected
        s.frozen += survivors
        s.max_tick_seconds = max(s.max_tick_seconds, took)
        if took > SLOW_TICK_S:
            log.info(
                "garbage collection took %.1f ms (%d unreachable objects freed, %d frozen)",
                took * 1e3,
                collected,
                survivors,
            )

    def stop(self) -> None:
        """Unfreezes (tests that run a daemon in-process leave the collector as found)."""
        gc.unfreeze()


def keep_freed_heap() -> bool:
    """Tells glibc's malloc to keep freed heap (module docstring); False where the C
    library has no mallopt (musl) or refuses. Process-wide, idempotent."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    settings = (
        (_M_MMAP_THRESHOLD, MMAP_THRESHOLD),
        (_M_TRIM_THRESHOLD, TRIM_THRESHOLD),
        (_M_TOP_PAD, TOP_PAD),
    )
    return all(mallopt(param, value) == 1 for param, value in settings)
