"""The CUDA copy engine's streams and completion events.

`CopyStreams` keeps one stream per worker and direction, so that a worker's jobs
run in order and other workers' beside them (per device and direction for a
worker that sent no event), and one completion event per copy thread and device,
which the thread records behind its job and waits on (`wait_behind`): it waits for
its own job, not for the jobs other threads queue after it.

Owned by `CudaCopyEngine` (kvdepot.server.cuda.dma); `stream`, `done_event` and
`wait_behind` run on the copy threads, `drop_worker` where a worker's last region
closes, `close` at shutdown. Thread-safe.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

from kvdepot.common.cuda_driver import CudaError
from kvdepot.server.cuda.ipc_region import ServedDevice, WorkerEvent

log = logging.getLogger("kvdepot.cuda")


class CopyStreams:
    """Streams per (device, direction, worker) and each copy thread's completion events."""

    def __init__(self, driver: Any) -> None:
        self.driver = driver
        self._lock = threading.Lock()
        self._local = threading.local()
        # (device uuid, direction, the worker's event handle, b"" for workers that sent
        # none) -> stream. A worker's go with its event (drop_worker).
        self._streams: dict[tuple[bytes, int, bytes], int] = {}
        # Each copy thread's completion event per device, for close().
        self._done_events: list[tuple[ServedDevice, int]] = []

    def stream(self, dev: ServedDevice, direction: int, worker: WorkerEvent | None) -> int:
        """The stream for a worker's jobs in one direction (created on first use)."""
        key = (dev.info.uuid, direction, worker.handle if worker is not None else b"")
        with self._lock:
            s = self._streams.get(key)
            if s is None:
                dev.make_current()
                s = self._streams[key] = self.driver.stream_create()
            return s

    def done_event(self, dev: ServedDevice) -> int:
        """This copy thread's completion event on `dev` (one job at a time uses it)."""
        events: dict[bytes, int] | None = getattr(self._local, "done", None)
        if events is None:
            events = self._local.done = {}
        ev = events.get(dev.info.uuid)
        if ev is None:
            dev.make_current()
            ev = events[dev.info.uuid] = self.driver.event_create()
            with self._lock:
                self._done_events.append((dev, ev))
        return ev

    def wait_behind(self, dev: ServedDevice, stream: int) -> None:
        """Blocks until the work queued on `stream` so far is done, but not the jobs
        other threads queue after it (an event recorded here, waited on)."""
        try:
            done = self.done_event(dev)
            self.driver.event_record(done, stream)
        except CudaError:
            self.driver.stream_synchronize(stream)
            raise
        self.driver.event_synchronize(done)

    def drop_worker(self, worker: WorkerEvent) -> None:
        """Destroys a worker's streams (its last region closed)."""
        uuid = worker.device.info.uuid
        with self._lock:
            mine = [k for k in self._streams if k[0] == uuid and k[2] == worker.handle]
            streams = [self._streams.pop(k) for k in mine]
        self._destroy(worker.device, streams)

    def _destroy(self, dev: ServedDevice, streams: list[int]) -> None:
        """Streams with no job left (work still queued would finish first anyway)."""
        for s in streams:
            try:
                dev.make_current()
                self.driver.stream_destroy(s)
            except CudaError as exc:
                log.warning("destroying a copy stream on %s failed: %s", dev.uuid, exc)

    def close(self, devices: Mapping[bytes, ServedDevice]) -> None:
        """Destroys every stream and completion event (`devices`: uuid -> device)."""
        with self._lock:
            streams, self._streams = self._streams, {}
            done, self._done_events = self._done_events, []
        for (uuid, _, _), s in streams.items():
            self._destroy(devices[uuid], [s])
        for dev, ev in done:
            try:
                dev.make_current()
                self.driver.event_destroy(ev)
            except CudaError as exc:
                log.warning("destroying a completion event on %s failed: %s", dev.uuid, exc)
