"""The CUDA copy engine: CopyPlan runs -> DMA between GPU pages and the pool.

Over the sans-I/O planner (`plan_dma`, kvdepot.server.cuda.dma_plan, which turns
a job's runs into 2-D copies or descriptor batches) and the mapped regions
(`CudaIpcRegion`, kvdepot.server.cuda.ipc_region):

- `CudaCopyEngine.open_region` maps a worker allocation with `cuIpcOpenMemHandle`
  once per registration, sharing mappings and worker events between the regions
  that name the same handle (released when the last such region closes).
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

Its parts: `IpcHandleCache` (kvdepot.server.cuda.ipc_handles) owns the open
mappings and worker events, `CopyStreams` (kvdepot.server.cuda.copy_streams) the
streams and each copy thread's completion events; the engine issues the DMA.

The engine talks to the GPU only through a `CudaDriver`-like object (see
`kvdepot.common.cuda_driver`), which the CPU tests replace with a fake that
copies host memory.
"""

from __future__ import annotations

import functools
import logging
import time
from array import array
from collections.abc import Callable, Sequence
from typing import Any

from kvdepot.common.cuda_driver import (
    CUDA_ERROR_NOT_SUPPORTED,
    RUN_JOB_ENTRY_POINTS,
    CudaError,
    DeviceInfo,
)
from kvdepot.common.cuda_handles import HandleError, decode
from kvdepot.server import errors
from kvdepot.server.core.planner import CopyPlan
from kvdepot.server.cuda.copy_streams import CopyStreams
from kvdepot.server.cuda.dma_plan import (
    DEFAULT_MAX_BATCH,
    DmaBatch,
    DmaPlan,
    StridedCopies,
    plan_dma,
)
from kvdepot.server.cuda.ipc_handles import IpcHandleCache
from kvdepot.server.cuda.ipc_region import CudaIpcRegion, IpcMapping, ServedDevice, WorkerEvent
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
        self.handles = IpcHandleCache(driver)  # mappings and worker events, shared
        self.streams = CopyStreams(driver)  # one per worker and direction; done events
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

    def copy_device(self, regions: Sequence[MappedRegion]) -> tuple[str, str] | None:
        """The GPU the registration's memory is on (UUID, PCI address): its DMA gets copy
        threads of its own on its node, so no GPU's jobs wait behind another's (one
        rank's regions are on one GPU)."""
        for region in regions:
            if isinstance(region, CudaIpcRegion):
                return region.device.uuid, region.device.info.pci_bus_id
        return None

    def open_region(
        self, handle: object, admit: Callable[[ServedDevice], None] | None = None
    ) -> tuple[MappedRegion, CopyEngine]:
        """Opens a "cuda_ipc" region (the state's opener for it is a CudaPath).

        Validates the handle, finds the device by UUID among the served ones, runs
        `admit(device)` (the CudaPath's sender check, which raises to refuse), maps
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
        if admit is not None:
            admit(dev)
        mapping = self.handles.acquire_mapping(dev, spec)
        event = None
        try:
            if spec.end > mapping.size:
                raise errors.invalid(
                    f"cuda_ipc handle: offset {spec.offset} + size {spec.size} = {spec.end} "
                    f"bytes exceeds the allocation, which has {mapping.size} bytes: register "
                    f"bytes inside the allocation whose base the handle names"
                )
            if spec.event_handle is not None:
                event = self.handles.acquire_event(dev, spec.event_handle)
        except BaseException:
            self.release(mapping, None)
            raise
        return CudaIpcRegion(self, spec, mapping, event), self

    def release(self, mapping: IpcMapping, event: WorkerEvent | None) -> None:
        """Drops one reference to a mapping (and event); unmaps at the last, and a
        worker's streams go with its event. Never raises."""
        self.handles.release(mapping, event, self.streams.drop_worker)

    @property
    def open_mappings(self) -> int:
        return self.handles.open_mappings

    # -- copies ----------------------------------------------------------------------------

    def host_split(self) -> int:
        hs = self.host_split_source
        return hs() if callable(hs) else hs

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

    def _dma(
        self, dev: ServedDevice, direction: int, workers: list[WorkerEvent], dma: DmaPlan
    ) -> None:
        """Issues `dma` on the worker's stream and waits for it (a copy thread)."""
        stream = self.streams.stream(dev, direction, workers[0] if workers else None)
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
        self, dev: ServedDevice, stream: int, workers: list[WorkerEvent], dma: DmaPlan
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
            self.streams.done_event(dev),
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
        self, dev: ServedDevice, stream: int, workers: list[WorkerEvent], dma: DmaPlan
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
            self.streams.wait_behind(dev, stream)
        self.counters["issue_ns"] += t1 - t0
        self.counters["wait_ns"] += time.perf_counter_ns() - t1

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
        self.streams.close(self.devices)
