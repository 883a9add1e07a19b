"""The pool arena: one mapping of `--pool-size` bytes, a memfd or a named file.

The arena is pre-faulted in the background (MADV_POPULATE_WRITE in chunks, or a
write per page where the kernel lacks it) so the daemon serves at once while the
pool warms; `warmup_done_bytes` says how far it is. A named file (for example
/dev/shm/kvdepot/kvdepot.pool or a hugetlbfs path) outlives the daemon, which is what
makes a warm restart possible.

Other parts plug in through hooks, not by patching: `add_warmup_hook(fn)` runs
`fn(offset, nbytes)` after each pre-faulted chunk (the CUDA path page-locks it
there), and `on_close(fn)` runs before the pool is unmapped (the CUDA path
unregisters the page-locked memory there).

NUMA: a `Placement` (server/memory/numa.py) sets the pool's memory policy with mbind(2)
as soon as it is mapped, before any page is faulted, so the warm-up allocates every page
where the policy says (on a memfd or a tmpfs file the policy is the file's own, shared
by every mapping). Pages a pool file already holds (a warm restart) stay where they are.
If the kernel refuses the policy, the pool is served all the same and `placement` says
"off" with the reason.
"""

from __future__ import annotations

import dataclasses
import logging
import mmap
import os
import threading
from collections.abc import Callable

from kvdepot.common.libc import (
    MADV_POPULATE_WRITE,
    MPOL_BIND,
    MPOL_INTERLEAVE,
    MPOL_PREFERRED,
    libc,
    mbind,
)
from kvdepot.server.memory import numa, private_files
from kvdepot.server.memory.regions import buffer_address

log = logging.getLogger("kvdepot.arena")

_POLICIES = {"preferred": MPOL_PREFERRED, "bind": MPOL_BIND, "interleave": MPOL_INTERLEAVE}


class Arena:
    """A shared mapping the copy engines read and write by address."""

    def __init__(
        self, size: int, path: str | None = None, placement: numa.Placement = numa.OFF
    ) -> None:
        if size <= 0:
            raise ValueError("pool size must be positive")
        self.size = size
        self.path = path
        self.existed = False
        if path is None:
            fd = os.memfd_create("kvdepot-pool", os.MFD_CLOEXEC)
            self.backing = "memfd"
        else:
            # O_NOFOLLOW, and refused unless the daemon's own with mode 0600
            # (someone else's pool file would let them read or plant KV bytes).
            fd = private_files.open_private(path, os.O_RDWR | os.O_CREAT, "the pool file")
            self.existed = os.fstat(fd).st_size == size  # a new file has size 0
            self.backing = path
        try:
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)
            self._mmap: mmap.mmap | None = mmap.mmap(
                fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE
            )
        finally:
            os.close(fd)
        self.address = buffer_address(self._mmap)
        self.placement = self._place(placement)
        self.warmup_done_bytes = 0
        self._warmup_thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._warmup_hooks: list[Callable[[int, int], None]] = []
        self._close_hooks: list[Callable[[], None]] = []

    def _place(self, placement: numa.Placement) -> numa.Placement:
        """Applies the placement's memory policy to the whole pool; what holds."""
        if placement.policy == "off":
            return placement
        err = mbind(self.address, self.size, _POLICIES[placement.policy], placement.nodes)
        if err:
            why = f"mbind {placement.policy} {numa.format_list(placement.nodes)} refused: " + (
                os.strerror(err)
            )
            log.warning("the pool's NUMA placement: %s; the kernel places it", why)
            # The threads stay as placed (the shared ones and each GPU's): they are
            # near the nodes asked for.
            return dataclasses.replace(placement, policy="off", nodes=(), basis=why)
        return placement

    def add_warmup_hook(self, hook: Callable[[int, int], None]) -> None:
        """Runs `hook(offset, nbytes)` on the warm-up thread after each chunk is
        faulted. Add hooks before `start_warmup` (chunks done earlier are not
        replayed: see `warmup_started`)."""
        self._warmup_hooks.append(hook)

    def on_close(self, callback: Callable[[], None]) -> None:
        """Runs `callback()` in `close`, after the warm-up stopped and before the
        pool is unmapped (last added, first run)."""
        self._close_hooks.append(callback)

    @property
    def warmup_started(self) -> bool:
        return self._warmup_thread is not None

    @property
    def warmup_complete(self) -> bool:
        return self.warmup_done_bytes >= self.size

    def view(self, offset: int, nbytes: int) -> memoryview:
        """A view of pool bytes; release it before `close` (Put/Get hold one for
        the length of one copy)."""
        if self._mmap is None:
            raise ValueError("the pool is closed")
        return memoryview(self._mmap)[offset : offset + nbytes]

    def start_warmup(
        self,
        chunk_bytes: int = 256 << 20,
        on_progress: Callable[[int, int], None] | None = None,
        after_chunk: Callable[[int, int], None] | None = None,
    ) -> None:
        """Pre-faults the arena in a background thread.

        After each chunk, `after_chunk(offset, nbytes)` and the warm-up hooks run;
        `on_progress(done, total)` reports progress.
        """
        hooks = [*self._warmup_hooks, *([after_chunk] if after_chunk is not None else [])]

        def run() -> None:
            off = 0
            while off < self.size and not self._stop.is_set():
                n = min(chunk_bytes, self.size - off)
                self._populate(off, n)
                for hook in hooks:
                    hook(off, n)
                off += n
                self.warmup_done_bytes = off
                if on_progress is not None:
                    on_progress(off, self.size)

        self._warmup_thread = threading.Thread(target=run, name="kvdepot-warmup", daemon=True)
        self._warmup_thread.start()

    def wait_warmup(self, timeout: float | None = None) -> bool:
        if self._warmup_thread is not None:
            self._warmup_thread.join(timeout)
        return self.warmup_complete

    def _populate(self, off: int, n: int) -> None:
        if libc.madvise(self.address + off, n, MADV_POPULATE_WRITE) == 0:
            return
        # Older kernels: touch one byte per page, preserving its value (a pool file
        # may hold blocks that a warm restart serves).
        page = mmap.PAGESIZE
        buf = self._mmap
        assert buf is not None  # the warm-up ends before close() drops the mapping
        for p in range(off, off + n, page):
            buf[p] = buf[p]

    def flush(self) -> None:
        if self.path is not None:
            assert self._mmap is not None, "the pool is closed"
            self._mmap.flush()

    def close(self, unmap: bool = True) -> None:
        """Stops the warm-up, runs the close hooks and unmaps the pool. The caller
        makes sure no copy uses the pool any more; `unmap=False` leaves the
        mapping in place (a copy thread that would not stop) until the process
        exits. Idempotent."""
        self._stop.set()
        if self._warmup_thread is not None:
            self._warmup_thread.join()
        hooks, self._close_hooks = self._close_hooks, []
        for hook in reversed(hooks):
            hook()
        m, self._mmap = self._mmap, None
        if m is not None and unmap:
            try:
                m.close()
            except BufferError:  # a view still exported: unmapped when it is released
                log.warning("the pool is still in use at close; it is unmapped at exit")
