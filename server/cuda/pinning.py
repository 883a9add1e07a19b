"""Page-locking the pool arena with cuMemHostRegister, chunk by chunk, in the background.

The arena pre-faults itself in chunks on its warm-up thread; `PoolPinner.after_chunk`
is the `Arena.start_warmup(after_chunk=...)` hook that page-locks each chunk right
after it is faulted, so `warmup_done_bytes` counts bytes that are faulted *and*
page-locked. Never one giant `cudaHostAlloc` (the pool is ours, in a memfd or a
named file that outlives the daemon) and never torch `pin_memory` (it rounds up to
a power of two). Each chunk is its own registration, registered PORTABLE so every
device's context sees it pinned; the copy engine cuts DMA at chunk boundaries.

Failure to pin (an RLIMIT_MEMLOCK too low for a non-root daemon, say) is logged
once with what to do, and pinning stops: copies still work, through the driver's
slower staging path. `close()` unregisters every chunk; call it before the arena
is unmapped.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from kvdepot.common.cuda_driver import CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, CudaError
from kvdepot.server.sizes import format_size

log = logging.getLogger("kvdepot.cuda")


class PoolPinner:
    """Registers arena chunks with the CUDA driver; thread-safe; hooks never raise.

    `device` is a `ServedDevice` (its primary context does the registering; the
    PORTABLE flag makes the pages pinned for every context).
    """

    def __init__(self, driver: Any, device: Any, base: int, size: int) -> None:
        self.driver = driver
        self.device = device
        self.base = base
        self.size = size
        self._lock = threading.Lock()
        self._ranges: list[tuple[int, int]] = []  # (offset, nbytes), registered
        self.pinned_bytes = 0
        self.failed: str | None = None
        self.closed = False
        self._split = 0
        self._started: float | None = None
        self._last_decile = -1

    @property
    def split_bytes(self) -> int:
        """The chunk size DMA must not straddle (0 until the first chunk is pinned)."""
        return self._split

    @property
    def complete(self) -> bool:
        return self.pinned_bytes >= self.size

    def after_chunk(self, offset: int, nbytes: int) -> None:
        """Page-locks arena bytes [offset, offset + nbytes). The warm-up hook; never raises."""
        with self._lock:
            if self.closed or self.failed is not None or nbytes <= 0:
                return
            if self._started is None:
                self._started = time.monotonic()
            try:
                self.device.make_current()  # per thread: the warm-up thread needs it too
                self.driver.host_register(self.base + offset, nbytes)
            except CudaError as exc:
                if exc.code != CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED:
                    self.failed = str(exc)
                    log.warning(
                        "page-locking the pool stopped at %s of %s: %s. Copies still work, "
                        "slower (staged). For a non-root daemon raise the locked-memory limit "
                        "(systemd LimitMEMLOCK=infinity, docker --ulimit memlock=-1)",
                        format_size(self.pinned_bytes),
                        format_size(self.size),
                        exc,
                    )
                    return
                # Someone registered it already: pinned all the same, but not ours to undo.
            except Exception as exc:  # never kill the warm-up thread
                self.failed = str(exc)
                log.warning("page-locking the pool failed: %s", exc)
                return
            else:
                self._ranges.append((offset, nbytes))
            if self._split == 0:
                self._split = nbytes
            self.pinned_bytes += nbytes
            self._report()

    def _report(self) -> None:
        pct = int(100 * self.pinned_bytes / self.size) if self.size else 100
        if pct // 10 != self._last_decile:  # a line per 10%, not per chunk
            self._last_decile = pct // 10
            took = time.monotonic() - (self._started or time.monotonic())
            log.info(
                "pool page-locked: %s of %s (%d%%, %.1fs)",
                format_size(self.pinned_bytes),
                format_size(self.size),
                pct,
                took,
            )

    def close(self) -> None:
        """Stops pinning and unregisters every chunk. Idempotent; never raises."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            ranges, self._ranges = self._ranges, []
            if not ranges:
                return
            try:
                self.device.make_current()
            except Exception as exc:
                log.warning("cannot unregister the pool (no CUDA context): %s", exc)
                return
            for offset, _ in ranges:
                try:
                    self.driver.host_unregister(self.base + offset)
                except CudaError as exc:
                    log.warning("cuMemHostUnregister at offset %d failed: %s", offset, exc)
            log.info("pool unregistered from CUDA (%d chunk(s))", len(ranges))
