"""`IOThreads`: the disk tier's I/O threads, which a hung disk can never hold forever.

    threads = IOThreads(4, "kvdepot-disk-write", initializer, idle=(5.0, on_idle))
    threads.submit(fn, *args)     # from any thread; runs on one of them, in order
    threads.shutdown()            # no more work; the threads end once it is done
    threads.wait_idle(timeout)    # True: every call submitted has returned

Why not a ThreadPoolExecutor: its threads are joined at interpreter exit, so one
call stuck in the kernel (a frozen or hung file system blocks pwritev and
fdatasync without a timeout) would keep the daemon from ever exiting. These are
daemon threads, and `wait_idle` gives the tier a bounded wait at its close.

`idle` (seconds, hook): a thread that has had no work for that long calls the hook
(the tier's periodic fdatasync runs there, off the event loop). A call that raises
is logged; the caller's functions report their own failures.

`lower_priority` is the write threads' initializer with `--disk-write-priority low`.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("kvdepot.disk")

_STOP = object()
_IOPRIO_SET = {"x86_64": 251, "aarch64": 30}.get(os.uname().machine)  # syscall numbers
_IOPRIO_CLASS_BE, _IOPRIO_WHO_PROCESS = 2, 1


def lower_priority() -> None:
    """Lowers the calling thread's CPU priority (nice 19) and I/O priority
    (best-effort, level 7, the lowest that is never starved), best effort: the
    disk's write threads use what the copies and the event loop leave."""
    tid = threading.get_native_id()
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, tid, 19)
    if _IOPRIO_SET is not None:
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.syscall(_IOPRIO_SET, _IOPRIO_WHO_PROCESS, tid, (_IOPRIO_CLASS_BE << 13) | 7)


class IOThreads:
    def __init__(
        self,
        count: int,
        name: str,
        initializer: Callable[[], None] | None = None,
        idle: tuple[float, Callable[[], None]] | None = None,
    ) -> None:
        self._count = count
        self._name = name
        self._initializer = initializer
        self._idle = idle
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Condition()
        self._pending = 0  # calls submitted and not yet returned
        self._started = False
        self._closed = False

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        """Runs `fn(*args)` on a thread; RuntimeError once shut down."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self._name} threads are shut down")
            self._pending += 1
            if not self._started:  # started with the first call, as an executor's
                self._started = True
                for i in range(self._count):
                    name = f"{self._name}_{i}"
                    threading.Thread(target=self._run, name=name, daemon=True).start()
        self._queue.put((fn, args))

    def shutdown(self) -> None:
        """Takes no more calls; the threads end after the ones queued."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            started = self._started
        if started:
            for _ in range(self._count):
                self._queue.put(_STOP)

    def wait_idle(self, timeout: float | None) -> bool:
        """Waits until every call submitted has returned; False when `timeout` passed
        first (a call is stuck: the disk hangs)."""
        with self._lock:
            return self._lock.wait_for(lambda: self._pending == 0, timeout)

    @property
    def pending(self) -> int:
        with self._lock:
            return self._pending

    def _run(self) -> None:
        if self._initializer is not None:
            try:
                self._initializer()
            except Exception:
                log.exception("%s: a thread's set-up failed", self._name)
        every, hook = self._idle if self._idle is not None else (None, None)
        while True:
            try:
                item = self._queue.get(timeout=every)
            except queue.Empty:
                # `every` is None without a hook: the get blocks, Empty never comes
                self._call(hook)  # type: ignore[arg-type]
                continue
            if item is _STOP:
                return
            fn, args = item
            self._call(fn, *args)
            with self._lock:
                self._pending -= 1
                if self._pending == 0:
                    self._lock.notify_all()

    def _call(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except Exception:
            log.exception("%s: a disk tier call failed", self._name)
