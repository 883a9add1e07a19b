"""Served devices and CUDA IPC regions: what the CUDA copy engine copies between.

- `ServedDevice`: a device this daemon copies for; its primary context is retained
  on first use (thread-safe).
- `CudaIpcRegion`: one worker allocation mapped with `cuIpcOpenMemHandle`, opened
  once per registration by `CudaCopyEngine.open_region` (kvdepot.server.cuda.dma)
  and closed when the registration (or its session) ends; `DepotState` never
  closes it while a copy uses it. Mappings and worker events are shared by the
  regions that name the same handle and reference-counted by the engine
  (`IpcMapping`, `WorkerEvent`), which owns them and releases them on `close()`.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvdepot.common.cuda_driver import DeviceInfo
from kvdepot.common.cuda_handles import IpcRegionSpec, format_uuid
from kvdepot.common.kinds import MemoryPath
from kvdepot.server.memory.copy_engine import MappedRegion

if TYPE_CHECKING:
    from kvdepot.server.cuda.dma import CudaCopyEngine

log = logging.getLogger("kvdepot.cuda")


class ServedDevice:
    """A device this daemon copies for; its primary context is retained on first use."""

    def __init__(self, driver: Any, info: DeviceInfo) -> None:
        self.driver = driver
        self.info = info
        self._ctx: int | None = None
        self._lock = threading.Lock()

    @property
    def uuid(self) -> str:
        return format_uuid(self.info.uuid)

    @property
    def context(self) -> int:
        if self._ctx is None:
            with self._lock:
                if self._ctx is None:
                    self._ctx = self.driver.primary_context(self.info.ordinal)
                    log.info(
                        "CUDA context ready on %s (%s, device %d in this process)",
                        self.uuid,
                        self.info.name,
                        self.info.ordinal,
                    )
        return self._ctx

    def make_current(self) -> None:
        self.driver.set_current(self.context)


@dataclass(eq=False)
class IpcMapping:
    device: ServedDevice
    handle: bytes
    base: int
    size: int
    refs: int = 1


@dataclass(eq=False)
class WorkerEvent:
    device: ServedDevice
    handle: bytes
    event: int
    refs: int = 1


class CudaIpcRegion(MappedRegion):
    """A worker's registered GPU bytes, mapped into the daemon with cuIpcOpenMemHandle.

    `address` is a device pointer (a unified address) to the registered bytes
    (allocation base + offset); `size` is the registered size. Owned by one
    registration; `close()` is idempotent and never raises.
    """

    kind = MemoryPath.CUDA_IPC

    def __init__(
        self,
        engine: CudaCopyEngine,
        spec: IpcRegionSpec,
        mapping: IpcMapping,
        event: WorkerEvent | None,
    ) -> None:
        self.engine = engine
        self.spec = spec
        self.device = mapping.device
        self._mapping: IpcMapping | None = mapping
        self._event = event
        self.size = spec.size
        self.address = mapping.base + spec.offset

    @property
    def event(self) -> int | None:
        return self._event.event if self._event is not None else None

    @property
    def worker(self) -> WorkerEvent | None:
        """The worker's event (its handle also names the worker's copy streams)."""
        return self._event

    @property
    def closed(self) -> bool:
        return self._mapping is None

    def close(self) -> None:
        mapping, event = self._mapping, self._event
        self._mapping = self._event = None
        if mapping is not None:
            self.engine.release(mapping, event)
