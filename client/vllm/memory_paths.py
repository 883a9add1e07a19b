"""How one rank's KV memory reaches the daemon: choosing a memory path, registering it.

Paths, cheapest first (what `kvdepot_memory_path = "auto"` picks):
- shm: the KV tensors live in one memfd (`SharedKVBuffer`); the fd is passed to
  the daemon, which maps it and copies pages itself. Plain CPU memory (a real CPU
  engine's `torch.zeros` KV cache) is first moved into a memfd in place
  (`SharedKVBuffer.adopt`): this runs while the worker is built, inside vLLM's
  `register_kv_caches`, before anything writes the cache.
- cuda_ipc: CUDA tensors exported with `kvdepot.client.cuda_ipc` (one IPC handle
  per allocation, an inter-process event recorded before every job).
- pvm: plain CPU memory that cannot be moved (or "pvm" asked for); the daemon
  copies it in place with process_vm_readv/process_vm_writev (`kvdepot.client.pvm`). It
  needs ptrace access; whether the daemon has it is known only when it answers
  the registration, so a refusal turns the plan into `inline` (see
  `inline_fallback`), with the daemon's reason in the log.
- inline: pages carried in Put/Get messages by a background thread (slow).

An explicit setting ("shm", "pvm", "inline") is a preference: when it cannot be
met the plan says why and the log says it at ERROR level.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from vllm.v1.kv_offload.base import CanonicalKVCaches

from kvdepot.client import pvm
from kvdepot.client.shm import AdoptError, SharedKVBuffer
from kvdepot.common.kinds import MemoryPath
from kvdepot.v1 import depot_pb2

if TYPE_CHECKING:
    import torch

    from kvdepot.client import DepotClient

log = logging.getLogger("kvdepot.vllm.worker")


@dataclass
class MemoryPlan:
    """How this rank's KV memory is described to the daemon."""

    path: MemoryPath
    reason: str
    requested: str = "auto"  # the kvdepot_memory_path setting
    shm: SharedKVBuffer | None = None
    # The CUDA IPC export (kvdepot.client.cuda_ipc.CudaKVExport), kept alive while
    # registered: it owns the inter-process event.
    cuda_export: Any = None
    # pvm: (address, size) ranges of this process's memory.
    pvm_regions: list[tuple[int, int]] = field(default_factory=list)
    tensors: list[depot_pb2.KVTensor] = field(default_factory=list)
    groups: list[depot_pb2.GroupRefs] = field(default_factory=list)

    @property
    def unmet(self) -> bool:
        """An explicit setting that this plan does not honour."""
        return self.requested not in ("auto", self.path.value)


def _span(t: torch.Tensor) -> int:
    """Bytes from the first to the end of the last page of a (blocks, page) view."""
    elem = t.element_size()
    return ((t.shape[0] - 1) * t.stride(0) + t.shape[1]) * elem


def _group_refs(
    kv_caches: CanonicalKVCaches, layer_pages: list[list[int]] | None
) -> list[depot_pb2.GroupRefs]:
    """Where each layer's page lives; `layer_pages`: the pages the namespace has, when
    they are not vLLM's (a canonical namespace's unit pages, the first at offset 0). A
    group of no layers here (a pipeline stage that holds none of its) is left out, as
    the namespace's layout leaves it out (`namespace_layout`)."""
    return [
        depot_pb2.GroupRefs(
            layers=[
                depot_pb2.LayerRef(
                    tensor_index=ref.tensor_idx,
                    page_offset=0,
                    page_bytes=ref.page_size_bytes if layer_pages is None else layer_pages[g][i],
                )
                for i, ref in enumerate(refs)
            ]
        )
        for g, refs in enumerate(kv_caches.group_data_refs)
        if refs
    ]


def _shm_plan(tensors: list[torch.Tensor], groups: list) -> MemoryPlan | str:
    """The shm plan, or why the tensors are not in one live SharedKVBuffer."""
    buffer: SharedKVBuffer | None = None
    kv = []
    for t in tensors:
        found = SharedKVBuffer.containing(t.data_ptr(), _span(t))
        if found is None:
            return (
                "the KV tensors are not in a memfd (allocate them with "
                "kvdepot.client.shm.SharedKVBuffer to use the shm path)"
            )
        buf, offset = found
        if buffer is None:
            buffer = buf
        elif buf is not buffer:
            return "the KV tensors span several memfds; one is supported"
        kv.append(
            depot_pb2.KVTensor(
                region_index=0,
                region_offset=offset,
                num_blocks=t.shape[0],
                block_stride_bytes=t.stride(0) * t.element_size(),
                page_bytes=t.shape[1] * t.element_size(),
            )
        )
    return MemoryPlan(
        MemoryPath.SHM, "memfd-backed KV tensors", shm=buffer, tensors=kv, groups=groups
    )


def _adopted_shm_plan(tensors: list[torch.Tensor], groups: list) -> MemoryPlan | str:
    """The shm plan after moving plain CPU KV memory into a memfd in place
    (`SharedKVBuffer.adopt`), or why it cannot be moved."""
    try:
        regions, _ = pvm.describe_tensors(tensors)
    except ValueError as exc:
        return str(exc)
    if len(regions) != 1:
        return f"the KV tensors are {len(regions)} separate allocations; one can be moved"
    (address, size) = regions[0]
    began = time.perf_counter()
    try:
        buffer = SharedKVBuffer.adopt(address, size)  # the plan keeps it alive
    except AdoptError as exc:
        return f"the KV memory cannot be moved into a memfd: {exc}"
    found = _shm_plan(tensors, groups)
    if isinstance(found, MemoryPlan) and found.shm is buffer:
        found.reason = (
            f"plain CPU memory moved into a memfd in place: {size / 2**30:.2f} GiB in "
            f"{time.perf_counter() - began:.2f} s"
        )
    return found


def _pvm_plan(tensors: list[torch.Tensor], groups: list) -> MemoryPlan | str:
    """The pvm plan, or why this host cannot use it."""
    reason = pvm.unusable_reason()
    if reason is not None:
        return reason
    try:
        regions, kv = pvm.describe_tensors(tensors)
    except ValueError as exc:
        return str(exc)
    return MemoryPlan(
        MemoryPath.PVM,
        "plain CPU memory: the daemon copies it with process_vm_readv/process_vm_writev",
        pvm_regions=regions,
        tensors=kv,
        groups=groups,
    )


def describe_memory(
    kv_caches: CanonicalKVCaches, memory_path: str, layer_pages: list[list[int]] | None = None
) -> MemoryPlan:
    """Finds the cheapest path the daemon can reach these tensors by (`layer_pages`: the
    namespace's pages where they are not vLLM's, `_group_refs`).

    shm needs every tensor inside ONE live SharedKVBuffer (a memfd this process
    made); vLLM 0.33 gives views of a single backing allocation, so that holds
    whenever the KV allocation itself came from a SharedKVBuffer.
    """
    plan = _choose(kv_caches, memory_path, layer_pages)
    return replace(plan, requested=memory_path)


def _choose(
    kv_caches: CanonicalKVCaches, memory_path: str, layer_pages: list[list[int]] | None
) -> MemoryPlan:
    tensors = [t.tensor for t in kv_caches.tensors]
    groups = _group_refs(kv_caches, layer_pages)
    if memory_path == MemoryPath.INLINE:
        return MemoryPlan(MemoryPath.INLINE, "kvdepot_memory_path is 'inline'")
    if not tensors:
        return MemoryPlan(MemoryPath.INLINE, "no KV tensors to register")

    if all(t.is_cuda for t in tensors):
        try:
            from kvdepot.client.cuda_ipc import export_kv_tensors

            export = export_kv_tensors(tensors)
        except Exception as exc:  # UnexportableMemory, no driver, ...: still serve
            return MemoryPlan(MemoryPath.INLINE, f"the CUDA KV memory cannot be exported: {exc}")
        return MemoryPlan(
            MemoryPath.CUDA_IPC,
            "CUDA IPC",
            cuda_export=export,
            tensors=list(export.tensors),
            groups=groups,
        )

    if any(t.device.type != "cpu" for t in tensors):
        return MemoryPlan(MemoryPath.INLINE, "the KV tensors are on a device kvdepot cannot map")

    if memory_path == MemoryPath.PVM:
        found = _pvm_plan(tensors, groups)
        return found if isinstance(found, MemoryPlan) else MemoryPlan(MemoryPath.INLINE, found)
    shm = _shm_plan(tensors, groups)
    if isinstance(shm, MemoryPlan):
        return shm
    shm = _adopted_shm_plan(tensors, groups)
    if isinstance(shm, MemoryPlan):
        return shm
    found = _pvm_plan(tensors, groups)
    if isinstance(found, MemoryPlan):
        found.reason += f" (not the shm path: {shm})"  # the log says why not the faster one
        return found
    return MemoryPlan(MemoryPath.INLINE, f"{shm}; the pvm path is out too: {found}")


def inline_fallback(plan: MemoryPlan, reason: str) -> MemoryPlan:
    """The plan after the daemon refused `plan`'s memory (pvm without ptrace access)."""
    return MemoryPlan(MemoryPath.INLINE, reason, requested=plan.requested)


def log_choice(plan: MemoryPlan, rank: int) -> None:
    """Says which path this rank uses, and why, at a level that matches the surprise."""
    if plan.path is MemoryPath.INLINE:
        level = (
            logging.ERROR
            if plan.unmet
            else (logging.INFO if plan.requested == "inline" else logging.WARNING)
        )
        log.log(
            level,
            "kvdepot: rank %d moves KV pages inline through gRPC (slow): %s",
            rank,
            plan.reason,
        )
        return
    level = logging.ERROR if plan.unmet else logging.INFO
    log.log(
        level,
        "kvdepot: rank %d uses the %s memory path (%s)%s",
        rank,
        plan.path.value,
        plan.reason,
        f"; kvdepot_memory_path asked for {plan.requested!r}" if plan.unmet else "",
    )


def register(
    client: DepotClient,
    plan: MemoryPlan,
    layout: depot_pb2.NamespaceLayout,
    rank: int,
    timeout: float,
    units: int = 1,
) -> tuple[depot_pb2.RegisterKVResponse, str]:
    """Registers `plan`'s memory in `layout` as ranks [rank, rank + units) (a canonical
    namespace's units); returns the response and a note for the log. Raises
    DepotUnavailable, FdPassError or grpc.RpcError."""
    if plan.path is MemoryPath.CUDA_IPC:
        from kvdepot.client.cuda_ipc import register_cuda_kv

        resp = register_cuda_kv(
            client, layout, rank, plan.cuda_export, plan.groups, timeout=timeout, units=units
        )
        return resp, ""
    if plan.path is MemoryPath.PVM:
        return pvm.register_process_kv(
            client,
            layout,
            rank,
            plan.pvm_regions,
            plan.tensors,
            plan.groups,
            timeout=timeout,
            units=units,
        )
    resp = client.register_kv(
        layout,
        rank=rank,
        shm=plan.shm,
        tensors=plan.tensors,
        groups=plan.groups if plan.tensors else [],
        timeout=timeout,
        units=units,
    )
    return resp, ""
