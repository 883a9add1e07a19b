"""The CUDA copy engine: CopyPlan runs -> batched DMA between GPU pages and the pool.

Three layers, the first two pure Python and tested on CPU:

- `plan_descriptors` turns a plan's `(region, region_offset, pool_offset, nbytes)`
  runs plus the regions' device addresses and the pool's host address into DMA
  descriptors (parallel `dst`/`src`/`size` arrays), cut into batches of at most
  `max_batch` copies for `cuMemcpyBatchAsync`, and split where a run crosses a
  page-locking chunk boundary of the pool (each chunk is its own
  `cuMemHostRegister` range, and one DMA should not span two).
- `CudaIpcRegion` is one worker allocation mapped with `cuIpcOpenMemHandle`: opened
  once per registration by `CudaCopyEngine.open_region`, closed when the
  registration (or its session) ends; `DepotState` never closes it while a copy
  uses it.
- `CudaCopyEngine.copy` executes the descriptors on the daemon's own stream for
  the device (one per copy thread and device, so concurrent jobs do not wait on
  each other), after making the stream wait on the worker's inter-process event
  (recorded by the worker before it sends each job), and returns only after the
  stream has synchronised: a store's
  bytes are in the pool and a load's bytes are in GPU memory when the job is
  answered.

The engine talks to the GPU only through a `CudaDriver`-like object (see
`kvdepot.server.cuda.driver`), which the CPU tests replace with a fake that
copies host memory.
"""

from __future__ import annotations

import functools
import logging
import threading
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvdepot.common.kinds import MemoryPath
from kvdepot.server import errors
from kvdepot.server.core.planner import CopyPlan
from kvdepot.server.cuda.driver import (
    CUDA_ERROR_NOT_SUPPORTED,
    CUDA_ERROR_OUT_OF_MEMORY,
    CUDA_ERROR_TOO_MANY_PEERS,
    CudaError,
    DeviceInfo,
)
from kvdepot.server.cuda.handles import HandleError, IpcRegionSpec, decode, format_uuid
from kvdepot.server.memory.copy_engine import (
    LOAD,
    STORE,
    CopyEngine,
    MappedRegion,
    PreparedCopy,
    no_copy,
)

log = logging.getLogger("kvdepot.cuda")

DEFAULT_MAX_BATCH = 1024  # copies per cuMemcpyBatchAsync call


@dataclass(slots=True)
class DmaBatch:
    """Parallel arrays of one batched DMA call (typecode 'Q': 64-bit unsigned)."""

    dsts: array = field(default_factory=lambda: array("Q"))
    srcs: array = field(default_factory=lambda: array("Q"))
    sizes: array = field(default_factory=lambda: array("Q"))
    nbytes: int = 0

    def __len__(self) -> int:
        return len(self.sizes)

    def descriptors(self) -> list[tuple[int, int, int]]:
        """(dst, src, size) triples, for tests and logs."""
        return list(zip(self.dsts, self.srcs, self.sizes, strict=True))


def plan_descriptors(
    direction: int,
    runs: CopyPlan | Sequence[tuple[int, int, int, int]],
    region_addresses: Sequence[int],
    pool_address: int,
    *,
    max_batch: int = DEFAULT_MAX_BATCH,
    host_split: int = 0,
) -> list[DmaBatch]:
    """Turns planner runs (a CopyPlan, or its `runs`) into DMA batches.

    STORE copies `region_addresses[r] + region_offset` -> `pool_address + pool_offset`;
    LOAD the reverse. With `host_split` > 0 a run that crosses a multiple of
    `host_split` in pool offsets is cut there. Batches hold at most `max_batch`
    copies and keep the runs' order. Raises ValueError on a run that names no
    region or moves no bytes (the planner never makes one).

    Runs on the event loop for every job (2048 runs for 64 vLLM blocks of 32
    layers): `CopyPlan.address_columns` does the per-run work in one call.
    """
    if direction not in (STORE, LOAD):
        raise ValueError(f"unknown direction {direction}")
    if max_batch < 1:
        raise ValueError("max_batch must be at least 1")
    if host_split < 0:
        raise ValueError("host_split must not be negative")
    plan = runs if isinstance(runs, CopyPlan) else CopyPlan(runs)
    if not len(plan):
        return []
    dev, host, n = plan.address_columns(region_addresses, pool_address, host_split)
    srcs, dsts = (dev, host) if direction == STORE else (host, dev)
    batches = []
    for i in range(0, len(n), max_batch):
        part = n[i : i + max_batch]
        batches.append(
            DmaBatch(
                _words(dsts[i : i + max_batch]),
                _words(srcs[i : i + max_batch]),
                _words(part),
                # One batch holds the plan's bytes (a cut keeps them): no sum, whose
                # numpy reduction would release the GIL on the event loop.
                plan.nbytes if len(part) == len(n) else int(part.sum()),
            )
        )
    return batches


def _words(values: np.ndarray) -> array:
    """A uint64 column as array('Q') (what the driver binding takes), by one memcpy."""
    out = array("Q")
    out.frombytes(np.ascontiguousarray(values, dtype=np.uint64).tobytes())
    return out


# -- served devices and IPC mappings ------------------------------------------------


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

    @property
    def has_context(self) -> bool:
        return self._ctx is not None

    def make_current(self) -> None:
        self.driver.set_current(self.context)


@dataclass(eq=False)
class _Mapping:
    device: ServedDevice
    handle: bytes
    base: int
    size: int
    refs: int = 1


@dataclass(eq=False)
class _Event:
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
        mapping: _Mapping,
        event: _Event | None,
    ) -> None:
        self.engine = engine
        self.spec = spec
        self.device = mapping.device
        self._mapping: _Mapping | None = mapping
        self._event = event
        self.size = spec.size
        self.address = mapping.base + spec.offset

    @property
    def event(self) -> int | None:
        return self._event.event if self._event is not None else None

    @property
    def closed(self) -> bool:
        return self._mapping is None

    def close(self) -> None:
        mapping, event = self._mapping, self._event
        self._mapping = self._event = None
        if mapping is not None:
            self.engine._release(mapping, event)


# -- the engine ------------------------------------------------------------------------


class CudaCopyEngine(CopyEngine):
    """Copies plans between CUDA IPC regions and the pool by (batched) DMA.

    Thread-safe: every copy thread gets its own stream per device. A prepared
    copy blocks until its DMA has completed (the stream is synchronised even when a call
    fails), so the caller may close regions or hand pool slots on right after.
    """

    def __init__(
        self,
        driver: Any,
        devices: Sequence[DeviceInfo],
        *,
        max_batch: int = DEFAULT_MAX_BATCH,
        use_batch: bool = True,
        host_split: Callable[[], int] | int = 0,
    ) -> None:
        self.driver = driver
        self.devices = {d.uuid: ServedDevice(driver, d) for d in devices}
        self.max_batch = max_batch
        self.use_batch = use_batch and bool(getattr(driver, "has_batch", False))
        # The pool's page-locking chunk size, or a callable that says it (it is
        # known only once the first chunk is pinned); 0: no splitting.
        self.host_split_source = host_split
        self._lock = threading.Lock()
        self._mappings: dict[tuple[bytes, bytes], _Mapping] = {}
        self._events: dict[tuple[bytes, bytes], _Event] = {}
        self._local = threading.local()
        self._streams: list[tuple[ServedDevice, int]] = []
        self._batch_failures_logged = False
        self.counters = {"copies": 0, "batches": 0, "descriptors": 0, "loop_fallbacks": 0}

    # -- registration ------------------------------------------------------------------

    def open_region(
        self, handle: object, session: object = None
    ) -> tuple[MappedRegion, CopyEngine]:
        """Opens a "cuda_ipc" region (the state's opener for it is a CudaPath).

        Validates the handle, finds the device by UUID among the served ones, maps
        the allocation (once per handle; later registrations share the mapping),
        checks offset + size against the allocation, and opens the event.
        Raises DepotError (INVALID_ARGUMENT / FAILED_PRECONDITION) with what to do.
        """
        try:
            spec = decode(handle)
        except HandleError as exc:
            raise errors.invalid(f"cuda_ipc handle: {exc}") from None
        dev = self.devices.get(spec.device_uuid)
        if dev is None:
            served = ", ".join(d.uuid for d in self.devices.values()) or "none"
            raise errors.precondition(
                f"device {spec.device} is not served by this daemon (it serves: {served}): run "
                f"the daemon on the node whose GPU holds the KV cache, with that GPU visible "
                f"(CUDA_VISIBLE_DEVICES) and allowed (KVDEPOT_CUDA_DEVICES)"
            )
        mapping = self._acquire_mapping(dev, spec)
        event = None
        try:
            if spec.end > mapping.size:
                raise errors.invalid(
                    f"cuda_ipc handle: offset {spec.offset} + size {spec.size} = {spec.end} "
                    f"bytes exceeds the allocation, which has {mapping.size} bytes: register "
                    f"bytes inside the allocation whose base the handle names"
                )
            if spec.event_handle is not None:
                event = self._acquire_event(dev, spec.event_handle)
        except BaseException:
            self._release(mapping, None)
            raise
        return CudaIpcRegion(self, spec, mapping, event), self

    def _acquire_mapping(self, dev: ServedDevice, spec: IpcRegionSpec) -> _Mapping:
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
            m = self._mappings[key] = _Mapping(dev, spec.mem_handle, base, size)
            log.info("mapped a %d-byte allocation of %s at 0x%x", size, dev.uuid, base)
            return m

    def _acquire_event(self, dev: ServedDevice, handle: bytes) -> _Event:
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
            e = self._events[key] = _Event(dev, handle, ev)
            return e

    def _release(self, mapping: _Mapping, event: _Event | None) -> None:
        """Drops one reference to a mapping (and event); unmaps at the last. Never raises."""
        with self._lock:
            if event is not None:
                event.refs -= 1
                if event.refs == 0:
                    self._events.pop((event.device.info.uuid, event.handle), None)
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

    # -- copies ----------------------------------------------------------------------------

    def host_split(self) -> int:
        hs = self.host_split_source
        return hs() if callable(hs) else hs

    def _stream(self, dev: ServedDevice) -> int:
        streams: dict[bytes, int] | None = getattr(self._local, "streams", None)
        if streams is None:
            streams = self._local.streams = {}
        s = streams.get(dev.info.uuid)
        if s is None:
            s = streams[dev.info.uuid] = self.driver.stream_create()
            with self._lock:
                self._streams.append((dev, s))
        return s

    def prepare(
        self, direction: int, regions: Sequence[MappedRegion], pool_address: int, plan: CopyPlan
    ) -> PreparedCopy:
        """Checks the regions and builds the DMA batches (on the event loop); the
        copy thread then only makes driver calls, which release the GIL."""
        if direction not in (STORE, LOAD):
            raise ValueError(f"unknown direction {direction}")
        if not len(plan):
            return no_copy
        cregions: list[CudaIpcRegion] = []
        for r in regions:
            if not isinstance(r, CudaIpcRegion) or r.closed:
                raise ValueError("the CUDA copy engine copies only open cuda_ipc regions")
            cregions.append(r)
        dev = cregions[0].device
        if any(r.device is not dev for r in cregions):
            raise ValueError("one registration's regions must all be on one device")
        batches = plan_descriptors(
            direction,
            plan,
            [r.address for r in cregions],
            pool_address,
            max_batch=self.max_batch,
            host_split=self.host_split(),
        )
        events = list({r.event for r in cregions if r.event is not None})
        return functools.partial(self._dma, dev, events, batches)

    def _dma(self, dev: ServedDevice, events: list[int], batches: list[DmaBatch]) -> None:
        """Issues `batches` on this thread's stream and waits for them (a copy thread)."""
        drv = self.driver
        dev.make_current()
        stream = self._stream(dev)
        try:
            # A store must not read GPU pages before the worker's work that wrote them is
            # done, and a load must not overwrite pages the worker's queued kernels still
            # read: the worker records this event on its stream before sending any job.
            for ev in events:
                drv.stream_wait_event(stream, ev)
            for batch in batches:
                self._issue(batch, stream)
        finally:
            # Never leave DMA in flight past this call, even after an error: the
            # caller answers the job and may unmap regions or reuse slots next.
            drv.stream_synchronize(stream)
        self.counters["copies"] += 1

    def _issue(self, batch: DmaBatch, stream: int) -> None:
        drv = self.driver
        n = len(batch)
        self.counters["descriptors"] += n
        if n > 1 and self.use_batch:
            try:
                drv.memcpy_batch_async(batch.dsts, batch.srcs, batch.sizes, stream)
                self.counters["batches"] += 1
                return
            except CudaError as exc:
                if exc.code == CUDA_ERROR_NOT_SUPPORTED:
                    self.use_batch = False
                if not self._batch_failures_logged:
                    self._batch_failures_logged = True
                    log.warning(
                        "cuMemcpyBatchAsync failed (%s); copying one run per cuMemcpyAsync instead",
                        exc,
                    )
                self.counters["loop_fallbacks"] += 1
        for dst, src, size in zip(batch.dsts, batch.srcs, batch.sizes, strict=True):
            drv.memcpy_async(dst, src, size, stream)

    def close(self) -> None:
        """Destroys the engine's streams. Regions are closed by their registrations."""
        with self._lock:
            streams, self._streams = self._streams, []
        for dev, s in streams:
            try:
                dev.make_current()
                self.driver.stream_destroy(s)
            except CudaError as exc:
                log.warning("destroying a copy stream on %s failed: %s", dev.uuid, exc)


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
