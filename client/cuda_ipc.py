"""The worker side of the CUDA IPC path: export KV tensors to the daemon, order jobs.

A vLLM worker hands the daemon its KV memory once:

    export = export_kv_tensors(kv_caches.tensors)        # CUDA tensors, int8 (blocks, page)
    resp = register_cuda_kv(client, layout, rank, export, groups)
    ...
    export.record()                                      # before *every* submitted job
    stream.submit(Job(..., registration_id=resp.registration_id))

`export_kv_tensors` finds the allocation that holds each tensor (the driver's
pointer attributes: base and size of the cudaMalloc allocation, which is what
PyTorch's caching allocator hands out), exports the base with
`cuIpcGetMemHandle`, and describes every tensor as (region, byte offset, blocks,
block stride, page bytes). All of vLLM 0.33's KV tensors are views of one
allocation, so this is normally one region. The device is named by UUID.

Ordering: `export.record()` records an inter-process event
(`torch.cuda.Event(interprocess=True)`) on the current stream. The daemon's copy
stream waits on it before it touches GPU pages, so a store never reads blocks
before the forward pass that wrote them has finished. Record it after the work
the job depends on was enqueued and before the job is sent. A load is answered
only after its copy completed, so the result itself orders a load.

Proof of the GPU: the daemon maps a handle only for the session's own process, and
only on a GPU that process uses (kvdepot.server.cuda.senders). `register_cuda_kv`
sends the GPU's device node (the /dev/nvidia<minor> fd that the worker's CUDA
context holds open) over the fd socket and names it in `CudaIpcHandle.gpu_token`;
where it cannot (no NVIDIA driver entries in /proc here), it logs why and
registers without one, and the daemon reads the worker's open files instead.

Ownership: the worker keeps the KV memory and the `CudaKVExport` (its event)
alive while registered, and unregisters (or closes its session) before freeing
the memory. Memory that CUDA IPC cannot export (PyTorch expandable segments,
vLLM sleep mode) raises `UnexportableMemory` with the setting to change.

Imports without CUDA or torch: both are loaded when a function is called.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvdepot.client.fdpass import FdPassError, send_fd
from kvdepot.common.cuda_handles import (
    IpcRegionSpec,
    UnexportableMemory,
    format_uuid,
    unexportable_message,
    validate,
)
from kvdepot.common.nvidia_gpus import (
    DRIVER_ROOT,
    GpuUnknown,
    NodeIdentity,
    device_minor,
    held_node,
    nvidia_minor,
)
from kvdepot.v1 import depot_pb2

if TYPE_CHECKING:
    import torch

    from kvdepot.client.depot_client import DepotClient

log = logging.getLogger("kvdepot.client")

__all__ = [
    "CudaKVExport",
    "TensorPlacement",
    "UnexportableMemory",
    "export_kv_tensors",
    "register_cuda_kv",
]


@dataclass(frozen=True)
class TensorPlacement:
    """Where one KV tensor lives: which allocation, and its geometry in bytes."""

    ptr: int
    num_blocks: int
    block_stride: int
    page_bytes: int

    @property
    def end(self) -> int:
        return self.ptr + (self.num_blocks - 1) * self.block_stride + self.page_bytes


def tensor_placement(t: torch.Tensor) -> TensorPlacement:
    """A canonical KV tensor's geometry; raises ValueError for a shape that is not one."""
    if t.dim() != 2:
        raise ValueError(
            f"a canonical KV tensor is 2-D (num_blocks, page_bytes); got shape {tuple(t.shape)}"
        )
    if t.shape[0] < 1 or t.shape[1] < 1:
        raise ValueError(f"empty KV tensor of shape {tuple(t.shape)}")
    if t.stride(1) != 1:
        raise ValueError("a KV tensor's page must be contiguous (stride(1) == 1)")
    esize = t.element_size()
    stride = t.stride(0) * esize
    page = t.shape[1] * esize
    if stride < page:
        raise ValueError(f"block stride {stride} is smaller than the page ({page} bytes)")
    return TensorPlacement(t.data_ptr(), int(t.shape[0]), stride, page)


def group_regions(
    placements: Sequence[TensorPlacement], allocations: Sequence[tuple[int, int]]
) -> tuple[list[tuple[int, int, int]], list[depot_pb2.KVTensor]]:
    """Pure arithmetic: tensors + their (allocation base, allocation size) -> regions.

    Returns one (allocation base, offset, size) per distinct allocation, in order of
    first use (the registered bytes span that allocation's tensors, from the lowest
    start to the highest end), and one KVTensor per tensor with offsets relative to
    its region.
    """
    if len(placements) != len(allocations):
        raise ValueError("one allocation per tensor")
    order: list[int] = []
    spans: dict[int, list[int]] = {}  # base -> [alloc_size, lo, hi]
    for p, (base, size) in zip(placements, allocations, strict=True):
        if not (base <= p.ptr and p.end <= base + size):
            raise ValueError(
                f"tensor bytes [{p.ptr:#x}, {p.end:#x}) leave their allocation "
                f"[{base:#x}, {base + size:#x})"
            )
        span = spans.get(base)
        if span is None:
            spans[base] = [size, p.ptr, p.end]
            order.append(base)
        else:
            span[1] = min(span[1], p.ptr)
            span[2] = max(span[2], p.end)
    regions = [(base, spans[base][1] - base, spans[base][2] - spans[base][1]) for base in order]
    index = {base: i for i, base in enumerate(order)}
    tensors = [
        depot_pb2.KVTensor(
            region_index=index[base],
            region_offset=p.ptr - spans[base][1],
            num_blocks=p.num_blocks,
            block_stride_bytes=p.block_stride,
            page_bytes=p.page_bytes,
        )
        for p, (base, _) in zip(placements, allocations, strict=True)
    ]
    return regions, tensors


@dataclass
class CudaKVExport:
    """A worker's exported KV memory: the RegisterKV regions and tensors, and its event.

    Keep it alive while the registration lives (it owns the inter-process event).
    """

    regions: list[depot_pb2.MemoryRegion]
    tensors: list[depot_pb2.KVTensor]
    device: Any  # torch.device
    device_uuid: str
    pci_bus_id: str = ""  # the driver's, "0000:3B:00.0": finds the GPU's device node
    event: Any = None  # torch.cuda.Event(interprocess=True), or None
    registered_bytes: int = 0
    _keep: list[Any] = field(default_factory=list, repr=False)

    def record(self, stream: Any = None) -> None:
        """Records the event on `stream` (default: the device's current stream).

        Call before sending each job: the daemon's copy waits for what is enqueued
        before this point on that stream.
        """
        if self.event is None:
            return
        import torch

        self.event.record(stream if stream is not None else torch.cuda.current_stream(self.device))


def encode_handle(spec: IpcRegionSpec) -> depot_pb2.CudaIpcHandle:
    """A checked region (kvdepot.common.cuda_handles.validate) -> its wire message."""
    return depot_pb2.CudaIpcHandle(
        ipc_handle=spec.mem_handle,
        device_uuid=spec.device,
        offset=spec.offset,
        size=spec.size,
        event_handle=spec.event_handle or b"",
    )


def export_kv_tensors(
    kv_tensors: Sequence[torch.Tensor],
    *,
    with_event: bool = True,
    env: dict[str, str] | None = None,
) -> CudaKVExport:
    """Exports CUDA KV tensors (vLLM's canonical int8 (num_blocks, page_bytes) views).

    Raises ValueError for tensors that are not on one CUDA device or not canonical,
    and UnexportableMemory for memory cudaIpcGetMemHandle cannot export.
    """
    import torch

    from kvdepot.common import cuda_driver

    if not kv_tensors:
        raise ValueError("no KV tensors to export")
    devices = {t.device for t in kv_tensors}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        raise ValueError(
            f"KV tensors must all live on one CUDA device (one registration per rank); got "
            f"{sorted(str(d) for d in devices)}"
        )
    device = next(iter(devices))
    placements = [tensor_placement(t) for t in kv_tensors]
    drv = cuda_driver.load()
    env = dict(os.environ) if env is None else env
    with torch.cuda.device(device):
        # Make the device's primary context (PyTorch's own) current for the driver
        # calls below, also on a thread where PyTorch has not touched CUDA yet.
        drv.set_current(drv.primary_context(device.index))
        allocations: list[tuple[int, int]] = []
        capable: dict[int, bool] = {}
        for p in placements:
            base = drv.pointer_attribute(p.ptr, cuda_driver.CU_POINTER_ATTRIBUTE_RANGE_START_ADDR)
            size = drv.pointer_attribute(p.ptr, cuda_driver.CU_POINTER_ATTRIBUTE_RANGE_SIZE)
            allocations.append((base, size))
            if base not in capable:
                capable[base] = bool(
                    drv.pointer_attribute(
                        base, cuda_driver.CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE
                    )
                )
        if not all(capable.values()):
            raise UnexportableMemory(unexportable_message(env, where=f"on {device}"))
        ordinal = drv.pointer_attribute(
            placements[0].ptr, cuda_driver.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
        )
        info = drv.device_info(ordinal)
        uuid = format_uuid(info.uuid)
        spans, tensors = group_regions(placements, allocations)
        event = event_handle = None
        if with_event:
            event = torch.cuda.Event(enable_timing=False, blocking=False, interprocess=True)
            event.record(torch.cuda.current_stream(device))  # creates it on this device
            event_handle = bytes(event.ipc_handle())
        regions = []
        for base, offset, size in spans:
            spec = validate(drv.ipc_get_mem_handle(base), uuid, offset, size, event_handle or b"")
            regions.append(depot_pb2.MemoryRegion(cuda_ipc=encode_handle(spec)))
    return CudaKVExport(
        regions=regions,
        tensors=tensors,
        device=device,
        device_uuid=uuid,
        pci_bus_id=info.pci_bus_id,
        event=event,
        registered_bytes=sum(s for _, _, s in spans),
        _keep=list(kv_tensors),
    )


def register_cuda_kv(
    client: DepotClient,
    layout: depot_pb2.NamespaceLayout,
    rank: int,
    export: CudaKVExport,
    groups: Sequence[depot_pb2.GroupRefs],
    timeout: float = 30.0,
    units: int = 1,
) -> depot_pb2.RegisterKVResponse:
    """Registers exported CUDA KV memory (RegisterKV with cuda_ipc regions) as ranks
    [rank, rank + units) (RegisterKVRequest.unit_count), each region with this
    process's proof of the GPU (`gpu_node_token`).

    `groups[g].layers[i].tensor_index` indexes the tensors in the order they were
    given to `export_kv_tensors`. Call again after a daemon restart (new session).
    """
    session_id = client.session_id
    regions = []
    for r in export.regions:
        region = depot_pb2.MemoryRegion()
        region.CopyFrom(r)
        region.cuda_ipc.gpu_token = gpu_node_token(
            client, export.device_uuid, export.pci_bus_id, session_id
        )
        regions.append(region)
    return client.register_memory(
        layout,
        rank,
        regions,
        export.tensors,
        groups,
        timeout=timeout,
        session_id=session_id,
        units=units,
    )


def gpu_node_token(
    client: DepotClient,
    device_uuid: str,
    pci_bus_id: str,
    session_id: str,
    *,
    driver_root: str = DRIVER_ROOT,
    identify: NodeIdentity = nvidia_minor,
    timeout: float = 5.0,
) -> str:
    """Sends the GPU's device node, as this process holds it open, to the daemon's fd
    socket for `session_id`; returns its fd_token (CudaIpcHandle.gpu_token). Returns
    "" where it cannot, saying why in the log (the daemon then reads this process's
    open files instead). `driver_root` and `identify` are for tests (a fake GPU host).
    """
    hello = client.hello
    try:
        if hello is None or not hello.fd_socket:
            raise FdPassError("the daemon has no fd socket")
        minor = device_minor(pci_bus_id, device_uuid, driver_root)
        fd = held_node(minor, identify)
        if fd is None:
            raise FdPassError(f"this process holds no /dev/nvidia{minor} open")
        return send_fd(hello.fd_socket, session_id, fd, timeout=timeout)
    except (GpuUnknown, FdPassError, OSError) as exc:
        log.warning(
            "kvdepot: cannot send GPU %s's device node to the daemon (%s); it reads this "
            "process's open files instead",
            device_uuid,
            exc,
        )
        return ""
