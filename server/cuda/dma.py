"""The CUDA copy engine: CopyPlan runs -> DMA between GPU pages and the pool.

Three layers, the first two pure Python and tested on CPU:

- `plan_dma` turns a plan's `(region, region_offset, pool_offset, nbytes)` runs
  plus the regions' device addresses and the pool's host address into a job's DMA:
  one 2-D copy per block where the pages form equal strided chains (vLLM's layout),
  else descriptors (parallel `dst`/`src`/`size` arrays) cut into batches of at most
  `max_batch` copies for `cuMemcpyBatchAsync`. Nothing spans a page-locking chunk
  boundary of the pool (each chunk is its own `cuMemHostRegister` range, and one
  DMA should not span two).
- `CudaIpcRegion` is one worker allocation mapped with `cuIpcOpenMemHandle`: opened
  once per registration by `CudaCopyEngine.open_region`, closed when the
  registration (or its session) ends; `DepotState` never closes it while a copy
  uses it.
- `CudaCopyEngine.copy` executes the descriptors on the daemon's stream for the
  worker and direction, after making the stream wait on the worker's inter-process
  event (recorded by the worker before it sends each job), and returns only once an
  event recorded behind the job's DMA has completed: a store's bytes are in the
  pool and a load's bytes are in GPU memory when the job is answered. Copy threads
  share that stream, so a job's DMA queues right behind the one before it while
  that one's thread waits: the link never idles between a worker's jobs, and its
  jobs do not split the link's bandwidth between streams. The driver calls of a
  job are one call of the compiled issuer (`_dma.c`) where it was built, so that
  the copy thread gives the GIL up once per job.

The engine talks to the GPU only through a `CudaDriver`-like object (see
`kvdepot.common.cuda_driver`), which the CPU tests replace with a fake that
copies host memory.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvdepot.common.cuda_driver import (
    CUDA_ERROR_NOT_SUPPORTED,
    CUDA_ERROR_OUT_OF_MEMORY,
    CUDA_ERROR_TOO_MANY_PEERS,
    RUN_JOB_ENTRY_POINTS,
    CudaError,
    DeviceInfo,
)
from kvdepot.common.cuda_handles import HandleError, IpcRegionSpec, decode, format_uuid
from kvdepot.common.kinds import MemoryPath
from kvdepot.server import errors
from kvdepot.server.core.planner import CopyPlan, stride_period
from kvdepot.server.memory.copy_engine import (
    LOAD,
    STORE,
    CopyEngine,
    MappedRegion,
    PreparedCopy,
    check_runs,
    no_copy,
)

try:  # built from _dma.c when the install had a C compiler (pyproject.toml)
    from kvdepot.server.cuda._dma import run_job
except ImportError:  # pragma: no cover - the daemon then issues from Python
    run_job = None

log = logging.getLogger("kvdepot.cuda")

_NONE = array("Q")

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


@dataclass(slots=True)
class StridedCopies:
    """2-D copies of one shape (cuMemcpy2DAsync): copy i moves `rows` rows of
    `widths[i]` bytes, row r from `srcs[i] + r * src_pitch` to `dsts[i] + r * dst_pitch`."""

    dsts: array
    srcs: array
    widths: array
    rows: int
    dst_pitch: int
    src_pitch: int
    nbytes: int

    def descriptors(self) -> list[tuple[int, int, int]]:
        """The rows as (dst, src, size) triples, for tests and the one-by-one fallback."""
        return [
            (d + r * self.dst_pitch, s + r * self.src_pitch, w)
            for d, s, w in zip(self.dsts, self.srcs, self.widths, strict=True)
            for r in range(self.rows)
        ]


@dataclass(slots=True)
class DmaPlan:
    """A job's DMA: descriptor batches, or one set of strided copies that covers it."""

    batches: list[DmaBatch]
    strided: StridedCopies | None = None


# A strided copy is one driver call; below this many rows its rows cost less as
# descriptors of a batch.
MIN_STRIDED_ROWS = 4
# cuMemcpy2DAsync refuses pitches over CU_DEVICE_ATTRIBUTE_MAX_PITCH (2^31 - 1 on
# current GPUs): a KV cache whose layers are more than 2 GiB apart goes as descriptors.
MAX_PITCH = (1 << 31) - 1


def plan_dma(
    direction: int,
    runs: CopyPlan | Sequence[tuple[int, int, int, int]],
    region_addresses: Sequence[int],
    pool_address: int,
    *,
    max_batch: int = DEFAULT_MAX_BATCH,
    host_split: int = 0,
    strided: bool = True,
) -> DmaPlan:
    """Turns planner runs (a CopyPlan, or its `runs`) into a job's DMA.

    STORE copies `region_addresses[r] + region_offset` -> `pool_address + pool_offset`;
    LOAD the reverse. With `host_split` > 0 a run that crosses a multiple of
    `host_split` in pool offsets is cut there, and no copy spans such a boundary.
    Raises ValueError on a run that names no region or moves no bytes (the planner
    never makes one).

    With `strided`, a job whose pages form equal chains (vLLM's layout: layer l's
    page of block b at a constant layer stride on the GPU, and block b's pages one
    after another in its pool row) becomes one 2-D copy per chain: 16 driver calls
    for a 16-block job of 32 layers instead of 512 descriptors, which the driver
    takes about a microsecond each to queue. Otherwise, and without `strided`,
    descriptor batches of at most `max_batch` copies, in the runs' order (one
    descriptor per run, cut at `host_split`).

    Runs on the event loop for every job: `CopyPlan.address_columns` and
    `stride_period` do the per-run work in one call each.
    """
    if direction not in (STORE, LOAD):
        raise ValueError(f"unknown direction {direction}")
    if max_batch < 1:
        raise ValueError("max_batch must be at least 1")
    if host_split < 0:
        raise ValueError("host_split must not be negative")
    plan = runs if isinstance(runs, CopyPlan) else CopyPlan(runs)
    if not len(plan):
        return DmaPlan([])
    dev, host, n = plan.address_columns(region_addresses, pool_address, host_split)
    srcs, dsts = (dev, host) if direction == STORE else (host, dev)
    if strided:
        copies = _strided(dsts, srcs, n, dev, host, pool_address, host_split, plan.nbytes)
        if copies is not None:
            return DmaPlan([], copies)
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
    return DmaPlan(batches)


def _strided(
    dsts: np.ndarray,
    srcs: np.ndarray,
    sizes: np.ndarray,
    dev: np.ndarray,
    host: np.ndarray,
    pool_address: int,
    host_split: int,
    nbytes: int,
) -> StridedCopies | None:
    """The columns as strided copies, when they have a period whose chains each
    stay inside one page-locked piece of the pool and whose pitches the driver
    takes; else None."""
    p = stride_period(dev, host, sizes, MIN_STRIDED_ROWS, pool_address, host_split)
    if not p:
        return None
    dst_pitch, src_pitch = int(dsts[p] - dsts[0]), int(srcs[p] - srcs[0])
    if max(dst_pitch, src_pitch) > MAX_PITCH:
        return None
    return StridedCopies(
        _words(dsts[:p]),
        _words(srcs[:p]),
        _words(sizes[:p]),
        len(sizes) // p,
        dst_pitch,
        src_pitch,
        nbytes,
    )


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
    def worker(self) -> _Event | None:
        """The worker's event (its handle also names the worker's copy streams)."""
        return self._event

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

    Thread-safe. Jobs go on one stream per worker and direction (per device and
    direction for a worker that sent no event), and each copy thread waits on its
    own completion event, recorded behind its job. A prepared copy blocks until its
    DMA has completed (also when a call fails), so the caller may close regions or
    hand pool slots on right after.
    """

    def __init__(
        self,
        driver: Any,
        devices: Sequence[DeviceInfo],
        *,
        max_batch: int = DEFAULT_MAX_BATCH,
        use_batch: bool = True,
        use_strided: bool = True,
        host_split: Callable[[], int] | int = 0,
    ) -> None:
        self.driver = driver
        self.devices = {d.uuid: ServedDevice(driver, d) for d in devices}
        self.max_batch = max_batch
        self.use_batch = use_batch and bool(getattr(driver, "has_batch", False))
        self.use_strided = use_strided
        # The driver's entry points for the compiled issuer (`_dma.c`); None: every
        # call from Python (no extension, or a driver object without them).
        entry_points = getattr(driver, "entry_points", None)
        self._entry_points = entry_points() if run_job is not None and entry_points else None
        # The pool's page-locking chunk size, or a callable that says it (it is
        # known only once the first chunk is pinned); 0: no splitting.
        self.host_split_source = host_split
        self._lock = threading.Lock()
        self._mappings: dict[tuple[bytes, bytes], _Mapping] = {}
        self._events: dict[tuple[bytes, bytes], _Event] = {}
        self._local = threading.local()
        # One stream per worker and direction, so that a worker's jobs run in order
        # and other workers' beside them: (device uuid, direction, the worker's event
        # handle, b"" for workers that sent none) -> stream. A worker's go with its event.
        self._streams: dict[tuple[bytes, int, bytes], int] = {}
        # Each copy thread's completion event per device, for close().
        self._done_events: list[tuple[ServedDevice, int]] = []
        self._refusals_logged: set[str] = set()
        self.counters = {
            "copies": 0,
            "batches": 0,
            "descriptors": 0,
            "strided": 0,
            "loop_fallbacks": 0,
            # Where the copy threads' time goes (ns, summed over copies): queueing the
            # DMA (the worker's event wait and the copy calls), then waiting for it.
            "issue_ns": 0,
            "wait_ns": 0,
        }

    @property
    def issuer(self) -> str:
        """How jobs reach the driver: "compiled" (`_dma.c`, the GIL given up once per
        job) or "python" (one call at a time)."""
        return "compiled" if self._entry_points is not None else "python"

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
                    uuid = event.device.info.uuid
                    self._events.pop((uuid, event.handle), None)
                    mine = [k for k in self._streams if k[0] == uuid and k[2] == event.handle]
                    self._destroy_streams(event.device, [self._streams.pop(k) for k in mine])
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

    def _stream(self, dev: ServedDevice, direction: int, worker: _Event | None) -> int:
        """The stream for a worker's jobs in one direction (created on first use)."""
        key = (dev.info.uuid, direction, worker.handle if worker is not None else b"")
        with self._lock:
            s = self._streams.get(key)
            if s is None:
                dev.make_current()
                s = self._streams[key] = self.driver.stream_create()
            return s

    def _done_event(self, dev: ServedDevice) -> int:
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

    def _destroy_streams(self, dev: ServedDevice, streams: list[int]) -> None:
        """Streams with no job left (work still queued would finish first anyway)."""
        for s in streams:
            try:
                dev.make_current()
                self.driver.stream_destroy(s)
            except CudaError as exc:
                log.warning("destroying a copy stream on %s failed: %s", dev.uuid, exc)

    def prepare(
        self,
        direction: int,
        regions: Sequence[MappedRegion],
        pool_address: int,
        plan: CopyPlan,
        pool_size: int | None = None,
    ) -> PreparedCopy:
        """Checks the regions and plans the DMA (on the event loop); the copy thread
        then only makes driver calls, which release the GIL."""
        if direction not in (STORE, LOAD):
            raise ValueError(f"unknown direction {direction}")
        if not len(plan):
            return no_copy
        check_runs(regions, plan, pool_size)
        cregions: list[CudaIpcRegion] = []
        for r in regions:
            if not isinstance(r, CudaIpcRegion) or r.closed:
                raise ValueError("the CUDA copy engine copies only open cuda_ipc regions")
            cregions.append(r)
        dev = cregions[0].device
        if any(r.device is not dev for r in cregions):
            raise ValueError("one registration's regions must all be on one device")
        dma = plan_dma(
            direction,
            plan,
            [r.address for r in cregions],
            pool_address,
            max_batch=self.max_batch,
            host_split=self.host_split(),
            strided=self.use_strided,
        )
        workers = list({r.worker: None for r in cregions if r.worker is not None})
        return functools.partial(self._dma, dev, direction, workers, dma)

    def _dma(self, dev: ServedDevice, direction: int, workers: list[_Event], dma: DmaPlan) -> None:
        """Issues `dma` on the worker's stream and waits for it (a copy thread)."""
        stream = self._stream(dev, direction, workers[0] if workers else None)
        c = self.counters
        c["copies"] += 1
        c["batches"] += len(dma.batches)
        c["descriptors"] += sum(len(b) for b in dma.batches)
        if dma.strided is not None:
            c["strided"] += len(dma.strided.widths)
        if (
            self._entry_points is not None
            and (self.use_batch or not dma.batches)
            and (self.use_strided or dma.strided is None)
            and self._dma_compiled(dev, stream, workers, dma)
        ):
            return
        self._dma_python(dev, stream, workers, dma)

    def _dma_compiled(
        self, dev: ServedDevice, stream: int, workers: list[_Event], dma: DmaPlan
    ) -> bool:
        """The job in one call of `_dma.run_job` (the GIL given up once). False when a
        copy call was refused: everything queued has finished, and the caller runs the
        job again from Python, which falls back to other calls. Raises CudaError for
        the other calls' failures."""
        assert self._entry_points is not None and run_job is not None
        fns, abi, attrs, attr_idx = self._entry_points
        s = dma.strided
        step, code, issue_ns, wait_ns = run_job(
            fns,
            abi,
            dev.context,
            stream,
            self._done_event(dev),
            array("Q", [w.event for w in workers]),
            s.dsts if s is not None else _NONE,
            s.srcs if s is not None else _NONE,
            s.widths if s is not None else _NONE,
            s.rows if s is not None else 0,
            s.dst_pitch if s is not None else 0,
            s.src_pitch if s is not None else 0,
            [(b.dsts, b.srcs, b.sizes) for b in dma.batches],
            attrs,
            attr_idx,
        )
        self.counters["issue_ns"] += issue_ns
        self.counters["wait_ns"] += wait_ns
        if step == 0:
            return True
        call = RUN_JOB_ENTRY_POINTS[step - 1]
        if call in ("cuMemcpy2DAsync", "cuMemcpyBatchAsync"):
            log.debug("%s refused a job's copies (%d); running it from Python", call, code)
            return False
        raise self.driver.error(call, code)

    def _dma_python(
        self, dev: ServedDevice, stream: int, workers: list[_Event], dma: DmaPlan
    ) -> None:
        """The job's driver calls one by one from Python (drivers without the
        compiled issuer, tests' fakes, and the fallbacks when a copy call fails)."""
        drv = self.driver
        dev.make_current()
        t0 = time.perf_counter_ns()
        t1 = t0
        try:
            # A store must not read GPU pages before the worker's work that wrote them is
            # done, and a load must not overwrite pages the worker's queued kernels still
            # read: the worker records this event on its stream before sending any job.
            for w in workers:
                drv.stream_wait_event(stream, w.event)
            if dma.strided is not None:
                self._issue_strided(dma.strided, stream)
            for batch in dma.batches:
                self._issue(batch, stream)
            t1 = time.perf_counter_ns()
        finally:
            # Never leave DMA in flight past this call, even after an error: the
            # caller answers the job and may unmap regions or reuse slots next.
            self._wait_behind(dev, stream)
        self.counters["issue_ns"] += t1 - t0
        self.counters["wait_ns"] += time.perf_counter_ns() - t1

    def _wait_behind(self, dev: ServedDevice, stream: int) -> None:
        """Blocks until the work queued on `stream` so far is done, but not the jobs
        other threads queue after it (an event recorded here, waited on)."""
        try:
            done = self._done_event(dev)
            self.driver.event_record(done, stream)
        except CudaError:
            self.driver.stream_synchronize(stream)
            raise
        self.driver.event_synchronize(done)

    def _issue_strided(self, copies: StridedCopies, stream: int) -> None:
        drv = self.driver
        if self.use_strided:
            try:
                for d, s, w in zip(copies.dsts, copies.srcs, copies.widths, strict=True):
                    drv.memcpy_2d_async(
                        d, s, w, copies.rows, copies.dst_pitch, copies.src_pitch, stream
                    )
                return
            except CudaError as exc:
                # A pitch over the device's limit, say. Copies queued before the
                # failure run again below: the same bytes, in stream order.
                if self._refused("cuMemcpy2DAsync", exc, "copying these pages as descriptors"):
                    self.use_strided = False
        batch = DmaBatch(nbytes=copies.nbytes)
        for d, s, w in copies.descriptors():
            batch.dsts.append(d)
            batch.srcs.append(s)
            batch.sizes.append(w)
        self._issue(batch, stream)

    def _issue(self, batch: DmaBatch, stream: int) -> None:
        drv = self.driver
        n = len(batch)
        if n > 1 and self.use_batch:
            try:
                drv.memcpy_batch_async(batch.dsts, batch.srcs, batch.sizes, stream)
                return
            except CudaError as exc:
                if self._refused("cuMemcpyBatchAsync", exc, "one run per cuMemcpyAsync"):
                    self.use_batch = False
        for dst, src, size in zip(batch.dsts, batch.srcs, batch.sizes, strict=True):
            drv.memcpy_async(dst, src, size, stream)

    def _refused(self, call: str, exc: CudaError, instead: str) -> bool:
        """Counts a refused copy call's fallback and logs it (once per call). True when
        the driver lacks the call altogether: the caller stops using it."""
        if call not in self._refusals_logged:
            self._refusals_logged.add(call)
            log.warning("%s failed (%s); %s instead", call, exc, instead)
        self.counters["loop_fallbacks"] += 1
        return exc.code == CUDA_ERROR_NOT_SUPPORTED

    def close(self) -> None:
        """Destroys the engine's streams and completion events. Regions are closed by
        their registrations (a worker's streams go with its last region)."""
        c = self.counters
        if c["copies"]:
            log.info(
                "CUDA copies: %d jobs, %d strided copies, %d DMA descriptors in %d batches; "
                "per job the copy thread spent %.3f ms queueing the DMA and %.3f ms waiting "
                "for it",
                c["copies"],
                c["strided"],
                c["descriptors"],
                c["batches"],
                c["issue_ns"] / c["copies"] / 1e6,
                c["wait_ns"] / c["copies"] / 1e6,
            )
        with self._lock:
            streams, self._streams = self._streams, {}
            done, self._done_events = self._done_events, []
        for (uuid, _, _), s in streams.items():
            self._destroy_streams(self.devices[uuid], [s])
        for dev, ev in done:
            try:
                dev.make_current()
                self.driver.event_destroy(ev)
            except CudaError as exc:
                log.warning("destroying a completion event on %s failed: %s", dev.uuid, exc)


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
