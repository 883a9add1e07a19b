"""A fake CUDA driver whose "device memory" is host memory, a fake GPU host for the
sender check (the driver's /proc entries and the device nodes, under a folder), and
helpers to register a fake engine with a real DepotState through them (tests/cuda/).
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import os
import threading
from array import array
from pathlib import Path
from typing import Any

from kvdepot.common.cuda_driver import (
    CUDA_ERROR_INVALID_HANDLE,
    CUDA_ERROR_INVALID_VALUE,
    CudaError,
    DeviceInfo,
)
from kvdepot.common.cuda_handles import format_uuid, parse_uuid
from kvdepot.common.jobs import Job
from kvdepot.server.core.layout import NamespaceLayout
from kvdepot.server.core.memory_map import LayerRef, TensorView
from kvdepot.server.cuda.senders import SenderGpus
from kvdepot.server.peer import Peer, start_time
from kvdepot.server.state import DepotState
from kvdepot.v1 import depot_pb2 as pb

UUID0 = "GPU-8f5e2a1c-0b3d-4e6f-9a7b-1c2d3e4f5a6b"
UUID1 = "GPU-00112233-4455-6677-8899-aabbccddeeff"
PCI0 = "0000:3B:00.0"
HANDLE = bytes(range(1, 65))
EVENT = bytes(range(100, 164))


class FakeGpuHost:
    """The driver's /proc/driver/nvidia/gpus/<pci>/information files and the device
    nodes (empty regular files named nvidia<minor>: only root may make character
    devices) of a GPU host, under `root`. `identify` names an open file's GPU minor
    when it is one of these nodes (by device and inode, as the real check knows a
    node by its device number); `senders` is the daemon's sender check over them.
    `hold(minor)` opens a node in this process, as a CUDA process holds its GPUs'."""

    def __init__(self, root: Path) -> None:
        self.driver_root = root / "driver"
        self.dev_root = root / "dev"
        (self.driver_root / "gpus").mkdir(parents=True, exist_ok=True)
        self.dev_root.mkdir(parents=True, exist_ok=True)
        self.senders = SenderGpus(driver_root=self.driver_root, identify=self.identify)
        self._held: dict[int, int] = {}

    def identify(self, st: os.stat_result) -> int | None:
        for node in self.dev_root.glob("nvidia*"):
            mine = node.stat()
            if (mine.st_dev, mine.st_ino) == (st.st_dev, st.st_ino):
                return int(node.name.removeprefix("nvidia"))
        return None

    def held_fd(self, minor: int) -> int:
        """This process's fd on GPU `minor`'s node (held first if it was not)."""
        self.hold(minor)
        return self._held[minor]

    def add(self, minor: int, uuid: str, pci: str = "") -> None:
        """A GPU of the driver: its information file (as the driver writes it) and node."""
        name = pci.lower() or f"0000:{0x10 + minor:02x}:00.0"
        entry = self.driver_root / "gpus" / name
        entry.mkdir(exist_ok=True)
        (entry / "information").write_text(
            f"Model: \t\t Fake H200\nIRQ:   \t\t 42\nGPU UUID: \t {uuid.lower()}\n"
            f"Bus Type: \t PCIe\nBus Location: \t {pci.lower() or '-'}\n"
            f"Device Minor: \t {minor}\nGPU Excluded:\t No\n"
        )
        self.node(minor).touch()

    def add_devices(self, devices: list[DeviceInfo]) -> FakeGpuHost:
        """Each of a driver's `devices`, its minor its ordinal, held open here."""
        for d in devices:
            self.add(d.ordinal, format_uuid(d.uuid), d.pci_bus_id)
            self.hold(d.ordinal)
        return self

    def node(self, minor: int) -> Path:
        return self.dev_root / f"nvidia{minor}"

    def hold(self, *minors: int) -> None:
        for m in minors:
            if m not in self._held:
                self._held[m] = os.open(self.node(m), os.O_RDONLY)

    def close(self) -> None:
        for fd in self._held.values():
            os.close(fd)
        self._held.clear()


def this_process() -> Peer:
    """This process, as the fd socket's kernel check would name it."""
    pid = os.getpid()
    return Peer(pid, os.getuid(), os.getgid(), start_time(pid))


def attested_session(st: DepotState, name: str = "fake-engine") -> Any:
    """A session of `st` owned by this process (as if it attested on the fd socket)."""
    session = st.open_session(name, os.getpid(), "e0")
    st.attest(session.id, this_process())
    return session


class FakeDriver:
    """Implements the CudaDriver methods the engine and pinner use, on host memory."""

    def __init__(self, devices: list[DeviceInfo] | None = None, has_batch: bool = True) -> None:
        self.device_list = devices or [DeviceInfo(0, parse_uuid(UUID0), "Fake H200", PCI0)]
        self.has_batch = has_batch
        self.batch_abi = 2 if has_batch else 0
        self.exports: dict[bytes, Any] = {}  # handle -> ctypes buffer (the "allocation")
        self.open_counts: dict[int, int] = {}  # mapped base -> refs
        self.opened_events: dict[int, bytes] = {}
        self.own_events: set[int] = set()  # the daemon's completion events
        self.contexts: list[int] = []  # ordinals whose primary context was created
        self.current = threading.local()
        self.log: list[tuple[Any, ...]] = []
        self.registered: dict[int, int] = {}  # host ptr -> size
        self.fail_batch: CudaError | None = None
        self.fail_memcpy: CudaError | None = None
        self.fail_2d: CudaError | None = None
        self.fail_register_after: int | None = None
        self.fail_open: CudaError | None = None
        self.copy_gate: threading.Event | None = None
        # By device ordinal: a job's completion wait on that device blocks until set
        # (its DMA "runs" that long).
        self.sync_gates: dict[int, threading.Event] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    # exporting side (what the worker would do)
    def export(self, size: int) -> tuple[bytes, Any]:
        buf = (ctypes.c_char * size)()
        handle = hashlib.sha256(b"h%d" % next(self._ids)).digest() * 2
        self.exports[handle] = buf
        return handle, buf

    def devices(self) -> list[DeviceInfo]:
        return list(self.device_list)

    def version(self) -> int:
        return 13000

    def primary_context(self, ordinal: int) -> int:
        if ordinal not in self.contexts:
            self.contexts.append(ordinal)
        return 1000 + ordinal

    def set_current(self, ctx: int) -> None:
        self.current.ctx = ctx

    def _need_ctx(self) -> None:
        assert getattr(self.current, "ctx", None), "no current context on this thread"

    def ipc_open_mem(self, handle: bytes) -> int:
        self._need_ctx()
        if self.fail_open is not None:
            raise self.fail_open
        buf = self.exports.get(handle)
        if buf is None:
            raise CudaError(
                "cuIpcOpenMemHandle",
                CUDA_ERROR_INVALID_HANDLE,
                "CUDA_ERROR_INVALID_HANDLE",
                "invalid resource handle",
            )
        base = ctypes.addressof(buf)
        with self._lock:
            self.open_counts[base] = self.open_counts.get(base, 0) + 1
        self.log.append(("open", base))
        return base

    def ipc_close_mem(self, ptr: int) -> None:
        self._need_ctx()
        with self._lock:
            self.open_counts[ptr] -= 1
            if self.open_counts[ptr] == 0:
                del self.open_counts[ptr]
        self.log.append(("close", ptr))

    def address_range(self, ptr: int) -> tuple[int, int]:
        for buf in self.exports.values():
            base = ctypes.addressof(buf)
            if base <= ptr < base + ctypes.sizeof(buf):
                return base, ctypes.sizeof(buf)
        raise CudaError(
            "cuMemGetAddressRange",
            CUDA_ERROR_INVALID_VALUE,
            "CUDA_ERROR_INVALID_VALUE",
            "invalid argument",
        )

    def ipc_open_event(self, handle: bytes) -> int:
        self._need_ctx()
        ev = next(self._ids) + 5000
        self.opened_events[ev] = handle
        return ev

    def event_destroy(self, event: int) -> None:
        if event in self.own_events:
            self.own_events.remove(event)
        else:
            del self.opened_events[event]

    def event_create(self) -> int:
        self._need_ctx()
        ev = next(self._ids) + 7000
        self.own_events.add(ev)
        return ev

    def event_record(self, event: int, stream: int) -> None:
        self._need_ctx()
        assert event in self.own_events
        self.log.append(("record", stream, event))

    def event_synchronize(self, event: int) -> None:
        assert event in self.own_events
        gate = self.sync_gates.get(getattr(self.current, "ctx", 0) - 1000)
        if gate is not None:
            gate.wait(20)
        self.log.append(("done", event))

    def host_register(self, ptr: int, size: int, flags: int = 1) -> None:
        self._need_ctx()
        if self.fail_register_after is not None and len(self.registered) >= (
            self.fail_register_after
        ):
            raise CudaError("cuMemHostRegister", 2, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory")
        self.registered[ptr] = size

    def host_unregister(self, ptr: int) -> None:
        del self.registered[ptr]

    def stream_create(self) -> int:
        self._need_ctx()
        return next(self._ids) + 9000

    def stream_destroy(self, stream: int) -> None:
        self.log.append(("destroy", stream))

    def stream_wait_event(self, stream: int, event: int) -> None:
        assert event in self.opened_events
        self.log.append(("wait", stream, event))

    def stream_synchronize(self, stream: int) -> None:
        self.log.append(("sync", stream))

    def memcpy_async(self, dst: int, src: int, n: int, stream: int) -> None:
        self._need_ctx()
        if self.fail_memcpy is not None:
            raise self.fail_memcpy
        if self.copy_gate is not None:
            self.copy_gate.wait(10)
        ctypes.memmove(dst, src, n)
        self.log.append(("copy", stream, n))

    def memcpy_2d_async(
        self,
        dst: int,
        src: int,
        width: int,
        rows: int,
        dst_pitch: int,
        src_pitch: int,
        stream: int,
    ) -> None:
        self._need_ctx()
        if self.fail_2d is not None:
            raise self.fail_2d
        if self.copy_gate is not None:
            self.copy_gate.wait(10)
        assert dst_pitch >= width and src_pitch >= width
        for r in range(rows):
            ctypes.memmove(dst + r * dst_pitch, src + r * src_pitch, width)
        self.log.append(("2d", stream, rows))

    def memcpy_batch_async(self, dsts: array, srcs: array, sizes: array, stream: int) -> None:
        self._need_ctx()
        if self.fail_batch is not None:
            raise self.fail_batch
        if self.copy_gate is not None:
            self.copy_gate.wait(10)
        for d, s, n in zip(dsts, srcs, sizes, strict=True):
            ctypes.memmove(d, s, n)
        self.log.append(("batch", stream, len(sizes)))


def ipc_msg(
    handle: bytes, size: int, offset: int = 0, uuid: str = UUID0, event: bytes = EVENT
) -> pb.CudaIpcHandle:
    return pb.CudaIpcHandle(
        ipc_handle=handle, device_uuid=uuid, offset=offset, size=size, event_handle=event
    )


def make_key(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "big")).digest() + (0).to_bytes(4, "big")


def register_fake_engine(
    st: DepotState,
    drv: FakeDriver,
    nb: int = 16,
    layers: int = 8,
    page: int = 16384,
    uuid: str = UUID0,
    namespace: str = "cuda-ns",
) -> tuple[Any, Any, Any, NamespaceLayout, Any]:
    """Registers a fake engine's KV memory in a session this process owns (the
    fake GPU host's sender check needs this process to hold the device's node)."""
    handle, buf = drv.export(layers * nb * page + 4096)
    session = attested_session(st)
    lay = NamespaceLayout(namespace, 1, 1, ((page,) * layers,))
    tensors = [TensorView(0, i * nb * page, nb, page, page) for i in range(layers)]
    refs = [[LayerRef(i, 0, page) for i in range(layers)]]
    reg = st.register(
        session.id,
        lay,
        0,
        [("cuda_ipc", ipc_msg(handle, layers * nb * page, offset=4096, uuid=uuid))],
        tensors,
        refs,
    )
    return session, reg, buf, lay, tensors


def job(
    reg: Any, session: Any, jid: int, direction: int, keys: list[bytes], blocks: list[int]
) -> Job:
    return Job(
        jid,
        direction,
        keys,
        blocks,
        [len(blocks)],
        [0],
        registration_id=reg.id,
        session_id=session.id,
    )
