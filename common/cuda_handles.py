"""CUDA IPC memory handles on the wire: decoding and validation.

Pure Python (no CUDA, no torch, no protobuf): both the daemon (decoding what a
worker sent) and the client (checking what it sends; kvdepot.client.cuda_ipc builds
the message) use it, and it is tested on CPU.

The wire message is `kvdepot.v1.CudaIpcHandle`:
- `ipc_handle`: the raw 64-byte `cudaIpcMemHandle_t` (== `CUipcMemHandle`) of the
  *allocation base*, as `cudaIpcGetMemHandle`/`cuIpcGetMemHandle` return it;
- `offset`, `size`: the registered bytes, relative to that base;
- `device_uuid`: the device in canonical "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"
  form, never an index (`CUDA_VISIBLE_DEVICES` differs between processes);
- `event_handle`: empty, or the 64-byte `cudaIpcEventHandle_t` of an
  inter-process event the worker records before each store.

Memory that `cudaIpcGetMemHandle` cannot export (PyTorch's expandable segments,
VMM/cuMem allocations such as vLLM's sleep mode) is reported with a message that
names the setting to change (`unexportable_message`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t) == sizeof(CUipcMemHandle)
EVENT_HANDLE_BYTES = 64  # sizeof(cudaIpcEventHandle_t)
UUID_BYTES = 16
MAX_REGION_BYTES = 1 << 48  # larger than any GPU's memory; catches garbage sizes early
_U64 = (1 << 64) - 1

# PyTorch's storage._share_cuda_() handle: a version byte, a type byte, then the
# payload ('c': a cudaIpcMemHandle_t of the segment base; 'e': an expandable
# segment, exported through POSIX fds, which cudaIpcOpenMemHandle cannot open).
TORCH_SHAREABLE_CUDA_MALLOC = ord("c")
TORCH_SHAREABLE_EXPANDABLE_SEGMENT = ord("e")

_UUID_RE = re.compile(
    r"^(?:(gpu|mig)-)?([0-9a-f]{8})-?([0-9a-f]{4})-?([0-9a-f]{4})-?([0-9a-f]{4})-?([0-9a-f]{12})$"
)


class HandleError(ValueError):
    """A CUDA IPC handle message is malformed (maps to INVALID_ARGUMENT)."""


class UnexportableMemory(RuntimeError):
    """KV memory that cudaIpcGetMemHandle cannot export; the message says what to change."""


def parse_uuid(text: str) -> bytes:
    """'GPU-8f5e…' (or bare hex, dashes optional, any case) -> the 16 raw bytes.

    "MIG-" prefixes are accepted too; devices are matched on the 16 bytes alone.
    """
    m = _UUID_RE.match(text.strip().lower())
    if m is None:
        raise HandleError(
            f"device_uuid {text!r} is not a device UUID: send the canonical form "
            f"'GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx' (nvidia-smi -L, or "
            f"torch.cuda.get_device_properties(d).uuid), never a device index"
        )
    return bytes.fromhex("".join(m.groups()[1:]))


def format_uuid(raw: bytes, prefix: str = "GPU") -> str:
    """16 raw bytes -> 'GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx' (nvidia-smi's form)."""
    if len(raw) != UUID_BYTES:
        raise HandleError(f"a device UUID has {UUID_BYTES} bytes, got {len(raw)}")
    h = raw.hex()
    return f"{prefix}-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


@dataclass(frozen=True, slots=True)
class IpcRegionSpec:
    """A validated CUDA IPC registration: what the daemon opens and maps."""

    mem_handle: bytes  # 64 bytes, the allocation base's cudaIpcMemHandle_t
    device_uuid: bytes  # 16 raw bytes
    offset: int  # registered bytes start here, relative to the allocation base
    size: int  # registered bytes
    event_handle: bytes | None  # 64 bytes, or None: no cross-process ordering

    @property
    def device(self) -> str:
        return format_uuid(self.device_uuid)

    @property
    def end(self) -> int:
        return self.offset + self.size


def validate(
    mem_handle: bytes, device_uuid: str, offset: int, size: int, event_handle: bytes = b""
) -> IpcRegionSpec:
    """Checks every field; raises HandleError with what is wrong and what to send."""
    mem_handle = bytes(mem_handle)
    if len(mem_handle) != IPC_HANDLE_BYTES:
        hint = ""
        if len(mem_handle) == IPC_HANDLE_BYTES + 2:
            hint = (
                " (this looks like PyTorch's storage._share_cuda_() string: its first two "
                "bytes are a version and a type; send the 64 bytes after them, or use "
                "kvdepot.client.cuda_ipc, which does)"
            )
        raise HandleError(
            f"ipc_handle has {len(mem_handle)} bytes; a cudaIpcMemHandle_t has "
            f"{IPC_HANDLE_BYTES}: send the raw handle of the allocation base from "
            f"cudaIpcGetMemHandle{hint}"
        )
    if not any(mem_handle):
        raise HandleError("ipc_handle is all zeros: it was never filled in by cudaIpcGetMemHandle")
    raw_uuid = parse_uuid(device_uuid) if device_uuid else b""
    if not raw_uuid:
        raise HandleError(
            "device_uuid is empty: name the GPU the memory lives on by UUID "
            "('GPU-xxxxxxxx-…'), never by index"
        )
    if offset < 0 or size < 0 or offset > _U64 or size > _U64:
        raise HandleError(f"offset {offset} and size {size} must be unsigned 64-bit numbers")
    if size == 0:
        raise HandleError("size is 0: register the bytes that hold the KV tensors")
    if offset + size > _U64:
        raise HandleError(
            f"offset {offset} + size {size} overflows 64 bits: offset and size are byte "
            f"counts from the allocation base"
        )
    if offset + size > MAX_REGION_BYTES:
        raise HandleError(
            f"offset {offset} + size {size} = {offset + size} bytes is beyond any GPU "
            f"allocation (limit {MAX_REGION_BYTES}): send byte offsets from the allocation base"
        )
    event = bytes(event_handle) if event_handle else None
    if event is not None and len(event) != EVENT_HANDLE_BYTES:
        raise HandleError(
            f"event_handle has {len(event)} bytes; a cudaIpcEventHandle_t has "
            f"{EVENT_HANDLE_BYTES} (torch.cuda.Event(interprocess=True).ipc_handle()), or "
            f"send none"
        )
    return IpcRegionSpec(mem_handle, raw_uuid, int(offset), int(size), event)


def decode(msg: object) -> IpcRegionSpec:
    """A `kvdepot.v1.CudaIpcHandle` message -> a validated IpcRegionSpec."""
    return validate(
        # a CudaIpcHandle message: common may not import kvdepot.v1 (its type)
        msg.ipc_handle,  # type: ignore[attr-defined]
        msg.device_uuid,  # type: ignore[attr-defined]
        msg.offset,  # type: ignore[attr-defined]
        msg.size,  # type: ignore[attr-defined]
        msg.event_handle,  # type: ignore[attr-defined]
    )


def raw_handle_from_torch(shared: bytes) -> bytes:
    """The 64-byte cudaIpcMemHandle_t inside PyTorch's `storage._share_cuda_()` handle.

    Accepts the raw 64 bytes as-is (older PyTorch). Raises UnexportableMemory for an
    expandable segment and HandleError for anything else it does not know.
    """
    shared = bytes(shared)
    if len(shared) == IPC_HANDLE_BYTES:
        return shared
    if len(shared) >= 2 and shared[1] == TORCH_SHAREABLE_EXPANDABLE_SEGMENT:
        raise UnexportableMemory(unexportable_message({}, expandable_segments=True))
    if len(shared) == IPC_HANDLE_BYTES + 2 and shared[1] == TORCH_SHAREABLE_CUDA_MALLOC:
        return shared[2:]
    raise HandleError(
        f"unknown PyTorch shareable handle ({len(shared)} bytes, type byte "
        f"{shared[1:2]!r}): this PyTorch is not supported by kvdepot's CUDA IPC path"
    )


# -- memory that cudaIpcGetMemHandle cannot export ----------------------------------

ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def expandable_segments_enabled(env: Mapping[str, str]) -> bool:
    """True when PyTorch's allocator config turns on expandable segments.

    The config is a comma-separated list of `key:value` options, e.g.
    "expandable_segments:True,max_split_size_mb:512". PyTorch reads
    PYTORCH_CUDA_ALLOC_CONF, and since 2.9 also the device-neutral PYTORCH_ALLOC_CONF.
    """
    for var in ALLOC_CONF_VARS:
        for option in env.get(var, "").split(","):
            key, _, value = option.partition(":")
            if key.strip() == "expandable_segments" and value.strip().lower() in (
                "true",
                "1",
                "yes",
                "on",
            ):
                return True
    return False


def unexportable_message(
    env: Mapping[str, str], *, expandable_segments: bool | None = None, where: str = ""
) -> str:
    """Says why KV memory cannot be shared by CUDA IPC and which setting to change.

    `cudaIpcGetMemHandle` exports only memory from plain `cudaMalloc`. PyTorch's
    expandable segments and vLLM's sleep mode (CuMemAllocator) allocate with the
    VMM API (`cuMemCreate`/`cuMemMap`), which it cannot export.
    """
    if expandable_segments is None:
        expandable_segments = expandable_segments_enabled(env)
    at = f" ({where})" if where else ""
    if expandable_segments:
        var = next(
            (v for v in ALLOC_CONF_VARS if "expandable_segments" in env.get(v, "")),
            ALLOC_CONF_VARS[0],
        )
        return (
            f"the KV cache{at} lives in a PyTorch expandable segment, which cudaIpcGetMemHandle "
            f"cannot export: remove expandable_segments:True from {var} (or set "
            f"expandable_segments:False) for the vLLM workers, or use the shared-memory path"
        )
    return (
        f"the KV cache{at} was allocated with the CUDA VMM API (cuMemCreate/cuMemMap), which "
        f"cudaIpcGetMemHandle cannot export. Typical causes: vLLM's sleep mode "
        f"(--enable-sleep-mode / enable_sleep_mode=True: turn it off for engines that "
        f"offload to kvdepot) or PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (remove it)"
    )
