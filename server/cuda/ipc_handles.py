"""The CUDA copy engine's open IPC handles: one mapping per allocation, one event per worker.

`IpcHandleCache` maps a worker allocation with `cuIpcOpenMemHandle` and opens a
worker's inter-process event once per handle, however many registrations name it,
and counts the regions that share each (`IpcMapping`, `WorkerEvent`,
kvdepot.server.cuda.ipc_region). The last region's release unmaps the allocation
and destroys the event.

Owned by `CudaCopyEngine` (kvdepot.server.cuda.dma); called on the event loop
(`open_region`) and from any thread that closes a region. Thread-safe.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from kvdepot.common.cuda_driver import (
    CUDA_ERROR_OUT_OF_MEMORY,
    CUDA_ERROR_TOO_MANY_PEERS,
    CudaError,
)
from kvdepot.common.cuda_handles import IpcRegionSpec
from kvdepot.server import errors
from kvdepot.server.cuda.ipc_region import IpcMapping, ServedDevice, WorkerEvent

log = logging.getLogger("kvdepot.cuda")


class IpcHandleCache:
    """The mappings and worker events open in this daemon, keyed by (device uuid, handle)."""

    def __init__(self, driver: Any) -> None:
        self.driver = driver
        self._lock = threading.Lock()
        self._mappings: dict[tuple[bytes, bytes], IpcMapping] = {}
        self._events: dict[tuple[bytes, bytes], WorkerEvent] = {}

    def acquire_mapping(self, dev: ServedDevice, spec: IpcRegionSpec) -> IpcMapping:
        """The allocation `spec` names, mapped (once; later callers share the mapping).
        Raises DepotError (INVALID_ARGUMENT / FAILED_PRECONDITION) with what to do."""
        key = (dev.info.uuid, spec.mem_handle)
        with self._lock:
            m = self._mappings.get(key)
            if m is not None:
                m.refs += 1
                return m
            try:
                dev.make_current()
                base = self.driver.ipc_open_mem(spec.mem_handle)
            except CudaError as exc:
                raise _open_error(exc, dev) from None
            try:
                alloc_base, alloc_size = self.driver.address_range(base)
            except CudaError as exc:
                self._close_quietly(dev, base)
                raise errors.invalid(f"cannot size the mapped allocation: {exc}") from None
            # The handle names the allocation base, so the mapping starts there.
            size = alloc_size - (base - alloc_base)
            m = self._mappings[key] = IpcMapping(dev, spec.mem_handle, base, size)
            log.info("mapped a %d-byte allocation of %s at 0x%x", size, dev.uuid, base)
            return m

    def acquire_event(self, dev: ServedDevice, handle: bytes) -> WorkerEvent:
        """The worker's inter-process event, opened (once; later callers share it)."""
        key = (dev.info.uuid, handle)
        with self._lock:
            e = self._events.get(key)
            if e is not None:
                e.refs += 1
                return e
            try:
                dev.make_current()
                ev = self.driver.ipc_open_event(handle)
            except CudaError as exc:
                raise errors.invalid(
                    f"cannot open the worker's inter-process event on {dev.uuid}: {exc}. Create "
                    f"it with torch.cuda.Event(interprocess=True) on the KV cache's device, "
                    f"in a live process"
                ) from None
            e = self._events[key] = WorkerEvent(dev, handle, ev)
            return e

    def release(
        self,
        mapping: IpcMapping,
        event: WorkerEvent | None,
        worker_gone: Callable[[WorkerEvent], None],
    ) -> None:
        """Drops one reference to a mapping (and event); unmaps at the last. At an
        event's last reference `worker_gone(event)` runs before the event is destroyed
        (the engine drops the worker's streams). Never raises."""
        with self._lock:
            if event is not None:
                event.refs -= 1
                if event.refs == 0:
                    self._events.pop((event.device.info.uuid, event.handle), None)
                    worker_gone(event)
                    try:
                        event.device.make_current()
                        self.driver.event_destroy(event.event)
                    except CudaError as exc:
                        log.warning(
                            "destroying an IPC event on %s failed: %s", event.device.uuid, exc
                        )
            mapping.refs -= 1
            if mapping.refs == 0:
                self._mappings.pop((mapping.device.info.uuid, mapping.handle), None)
                self._close_quietly(mapping.device, mapping.base)
                log.info("unmapped a %d-byte allocation of %s", mapping.size, mapping.device.uuid)

    def _close_quietly(self, dev: ServedDevice, base: int) -> None:
        try:
            dev.make_current()
            self.driver.ipc_close_mem(base)
        except CudaError as exc:
            log.warning("cuIpcCloseMemHandle on %s failed: %s", dev.uuid, exc)

    @property
    def open_mappings(self) -> int:
        with self._lock:
            return len(self._mappings)


def _open_error(exc: CudaError, dev: ServedDevice) -> errors.DepotError:
    if exc.code in (CUDA_ERROR_OUT_OF_MEMORY, CUDA_ERROR_TOO_MANY_PEERS):
        return errors.precondition(
            f"cannot map the KV memory on {dev.uuid}: {exc} (the daemon is out of mappings or "
            f"device memory for them: fewer engines per daemon, or restart it)"
        )
    # Anything else is the handle's fault (garbage, another device's, a dead
    # exporter's, or memory that cudaIpcGetMemHandle cannot export).
    return errors.invalid(
        f"cannot open the CUDA IPC handle on {dev.uuid}: {exc}. The handle must come from "
        f"cudaIpcGetMemHandle of a cudaMalloc allocation's base on this device, in a process "
        f"that is still alive (PyTorch expandable segments and VMM allocations such as "
        f"vLLM's sleep mode cannot be exported this way)"
    )
