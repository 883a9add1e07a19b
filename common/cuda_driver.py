"""ctypes bindings to the CUDA driver API (libcuda.so.1), loaded lazily.

Both sides make these calls, so they are declared once, here: the daemon opens IPC
handles and copies (kvdepot.server.cuda), a worker finds and exports the allocation
that holds its KV cache (kvdepot.client.cuda_ipc).

Why the driver API and not libcudart: the driver library comes with the GPU
driver itself, so the daemon needs neither torch nor a CUDA toolkit of a
matching version, and a runtime/driver version mismatch cannot occur. The
runtime's IPC handles are the driver's (`cudaIpcMemHandle_t` is byte for byte
`CUipcMemHandle`, likewise for events), and `cudaMemcpyAsync`/`cudaHostRegister`
are thin wrappers of `cuMemcpyAsync`/`cuMemHostRegister`.

Contexts: the daemon uses each device's *primary* context (the one the CUDA
runtime and PyTorch use too), retained lazily by `primary_context(ordinal)`.
Listing devices and reading their UUIDs (`devices()`) creates no context, so a
daemon never creates one on a device it does not serve. The current context is
per thread: callers make it current (`set_current`) before device work.

Nothing here runs at import time: `load()` opens the library on first use, and
`cuda_available()` answers False (with `unavailable_reason()`) on hosts with no
driver or no device, without raising.
"""

from __future__ import annotations

import ctypes
import os
import threading
from array import array
from ctypes import (
    POINTER,
    Structure,
    byref,
    c_char,
    c_char_p,
    c_int,
    c_size_t,
    c_uint,
    c_uint64,
    c_void_p,
)
from dataclasses import dataclass
from typing import Any

LIBCUDA_ENV = "KVDEPOT_LIBCUDA"  # override the library path (tests, odd installs)
LIBCUDA_DEFAULT = "libcuda.so.1"  # never the unversioned "libcuda.so": that is often a stub

# CUresult codes the callers tell apart.
CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_NOT_INITIALIZED = 3
CUDA_ERROR_STUB_LIBRARY = 34
CUDA_ERROR_NO_DEVICE = 100
CUDA_ERROR_MAP_FAILED = 205
CUDA_ERROR_ALREADY_MAPPED = 208
CUDA_ERROR_INVALID_HANDLE = 400
CUDA_ERROR_TOO_MANY_PEERS = 711
CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712
CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713
CUDA_ERROR_NOT_SUPPORTED = 801

CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 0x1  # the only flag cuIpcOpenMemHandle accepts
CU_MEMHOSTREGISTER_PORTABLE = 0x1  # pinned for every context, not only the registering one
CU_STREAM_NON_BLOCKING = 0x1  # no implicit sync with the legacy NULL stream
CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 0x1
CU_MEMORYTYPE_UNIFIED = 0x4  # a pointer in the unified address space, host or device
CU_EVENT_DISABLE_TIMING = 0x2  # a marker to wait on, not a clock: the cheapest kind

CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 10
CU_POINTER_ATTRIBUTE_RANGE_START_ADDR = 11
CU_POINTER_ATTRIBUTE_RANGE_SIZE = 12

CUdeviceptr = c_uint64
CUcontext = c_void_p
CUstream = c_void_p
CUevent = c_void_p


class CUipcMemHandle(Structure):
    _fields_ = [("reserved", c_char * 64)]


class CUipcEventHandle(Structure):
    _fields_ = [("reserved", c_char * 64)]


class CUuuid(Structure):
    _fields_ = [("bytes", c_char * 16)]


class CUDA_MEMCPY2D(Structure):  # cuda.h's name
    _fields_ = [
        ("srcXInBytes", c_size_t),
        ("srcY", c_size_t),
        ("srcMemoryType", c_int),
        ("srcHost", c_void_p),
        ("srcDevice", CUdeviceptr),
        ("srcArray", c_void_p),
        ("srcPitch", c_size_t),
        ("dstXInBytes", c_size_t),
        ("dstY", c_size_t),
        ("dstMemoryType", c_int),
        ("dstHost", c_void_p),
        ("dstDevice", CUdeviceptr),
        ("dstArray", c_void_p),
        ("dstPitch", c_size_t),
        ("WidthInBytes", c_size_t),
        ("Height", c_size_t),
    ]


class CUmemLocation(Structure):
    _fields_ = [("type", c_int), ("id", c_int)]


class CUmemcpyAttributes(Structure):
    _fields_ = [
        ("srcAccessOrder", c_int),
        ("srcLocHint", CUmemLocation),
        ("dstLocHint", CUmemLocation),
        ("flags", c_uint),
    ]


_P = POINTER
# name -> (symbols to try, newest ABI first; argtypes). All return CUresult (int).
_PROTOTYPES: dict[str, tuple[tuple[str, ...], list[Any]]] = {
    "cuInit": (("cuInit",), [c_uint]),
    "cuDriverGetVersion": (("cuDriverGetVersion",), [_P(c_int)]),
    "cuGetErrorName": (("cuGetErrorName",), [c_int, _P(c_char_p)]),
    "cuGetErrorString": (("cuGetErrorString",), [c_int, _P(c_char_p)]),
    "cuDeviceGetCount": (("cuDeviceGetCount",), [_P(c_int)]),
    "cuDeviceGet": (("cuDeviceGet",), [_P(c_int), c_int]),
    "cuDeviceGetName": (("cuDeviceGetName",), [c_char_p, c_int, c_int]),
    "cuDeviceGetUuid": (("cuDeviceGetUuid_v2", "cuDeviceGetUuid"), [_P(CUuuid), c_int]),
    "cuDeviceGetPCIBusId": (("cuDeviceGetPCIBusId",), [c_char_p, c_int, c_int]),
    "cuDevicePrimaryCtxRetain": (("cuDevicePrimaryCtxRetain",), [_P(CUcontext), c_int]),
    "cuDevicePrimaryCtxRelease": (
        ("cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease"),
        [c_int],
    ),
    "cuCtxSetCurrent": (("cuCtxSetCurrent",), [CUcontext]),
    "cuIpcGetMemHandle": (("cuIpcGetMemHandle",), [_P(CUipcMemHandle), CUdeviceptr]),
    "cuIpcOpenMemHandle": (
        ("cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle"),
        [_P(CUdeviceptr), CUipcMemHandle, c_uint],
    ),
    "cuIpcCloseMemHandle": (("cuIpcCloseMemHandle",), [CUdeviceptr]),
    "cuIpcOpenEventHandle": (("cuIpcOpenEventHandle",), [_P(CUevent), CUipcEventHandle]),
    "cuEventDestroy": (("cuEventDestroy_v2", "cuEventDestroy"), [CUevent]),
    "cuMemGetAddressRange": (
        ("cuMemGetAddressRange_v2",),
        [_P(CUdeviceptr), _P(c_size_t), CUdeviceptr],
    ),
    "cuPointerGetAttribute": (("cuPointerGetAttribute",), [c_void_p, c_int, CUdeviceptr]),
    "cuMemHostRegister": (("cuMemHostRegister_v2",), [c_void_p, c_size_t, c_uint]),
    "cuMemHostUnregister": (("cuMemHostUnregister",), [c_void_p]),
    "cuStreamCreate": (("cuStreamCreate",), [_P(CUstream), c_uint]),
    "cuStreamDestroy": (("cuStreamDestroy_v2", "cuStreamDestroy"), [CUstream]),
    "cuStreamWaitEvent": (("cuStreamWaitEvent",), [CUstream, CUevent, c_uint]),
    "cuStreamSynchronize": (("cuStreamSynchronize",), [CUstream]),
    "cuEventCreate": (("cuEventCreate",), [_P(CUevent), c_uint]),
    "cuEventRecord": (("cuEventRecord",), [CUevent, CUstream]),
    "cuEventSynchronize": (("cuEventSynchronize",), [CUevent]),
    "cuMemcpyAsync": (("cuMemcpyAsync",), [CUdeviceptr, CUdeviceptr, c_size_t, CUstream]),
    "cuMemcpy2DAsync": (("cuMemcpy2DAsync_v2",), [_P(CUDA_MEMCPY2D), CUstream]),
}

# cuMemcpyBatchAsync (driver >= 12.8) has two ABIs: CUDA 13.0's "_v2" without the
# failIdx out-parameter, and 12.8's unversioned symbol with it (before the stream).
_BATCH_V2 = (
    "cuMemcpyBatchAsync_v2",
    [
        _P(CUdeviceptr),
        _P(CUdeviceptr),
        _P(c_size_t),
        c_size_t,
        _P(CUmemcpyAttributes),
        _P(c_size_t),
        c_size_t,
        CUstream,
    ],
)
_BATCH_V1 = (
    "cuMemcpyBatchAsync",
    [
        _P(CUdeviceptr),
        _P(CUdeviceptr),
        _P(c_size_t),
        c_size_t,
        _P(CUmemcpyAttributes),
        _P(c_size_t),
        c_size_t,
        _P(c_size_t),
        CUstream,
    ],
)

# The driver calls `kvdepot.server.cuda._dma.run_job` makes, in the order it takes
# their addresses; its failing step k (1-based) names entry point k - 1.
RUN_JOB_ENTRY_POINTS = (
    "cuCtxSetCurrent",
    "cuStreamWaitEvent",
    "cuMemcpy2DAsync",
    "cuMemcpyBatchAsync",
    "cuEventRecord",
    "cuEventSynchronize",
    "cuStreamSynchronize",
)

assert ctypes.sizeof(c_size_t) == 8 and ctypes.sizeof(CUdeviceptr) == 8, "64-bit hosts only"


class CudaError(RuntimeError):
    """A CUDA driver call failed. `code` is the CUresult, `name` e.g. CUDA_ERROR_MAP_FAILED."""

    def __init__(self, call: str, code: int, name: str, text: str) -> None:
        super().__init__(f"{call} failed: {name} ({code}): {text}")
        self.call = call
        self.code = code
        self.name = name


class CudaUnavailable(RuntimeError):
    """No usable CUDA driver or device on this host (the message says which)."""


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    ordinal: int  # in this process (after CUDA_VISIBLE_DEVICES)
    uuid: bytes  # 16 raw bytes: the identity that is the same in every process
    name: str
    pci_bus_id: str = ""  # as the driver writes it ("0000:3B:00.0"): where it sits on the host


class CudaDriver:
    """The driver calls kvdepot uses, as Python methods that raise CudaError.

    Thread-safe as the driver is; the current context is per thread.
    """

    def __init__(self, lib: ctypes.CDLL, path: str) -> None:
        self.path = path
        self._lib = lib
        self._fn: dict[str, Any] = {}
        missing = []
        for name, (symbols, argtypes) in _PROTOTYPES.items():
            fn = _resolve(lib, symbols)
            if fn is None:
                missing.append(symbols[0])
                continue
            fn.argtypes = argtypes
            fn.restype = c_int
            self._fn[name] = fn
        if missing:
            raise CudaUnavailable(f"{path} lacks {', '.join(missing)}: the driver is too old")
        self.batch_abi = 0  # 2: CUDA 13 ABI, 1: CUDA 12.8 ABI, 0: no batch API
        for abi, (symbol, argtypes) in ((2, _BATCH_V2), (1, _BATCH_V1)):
            fn = _resolve(lib, (symbol,))
            if fn is not None:
                fn.argtypes = argtypes
                fn.restype = c_int
                self._fn["cuMemcpyBatchAsync"] = fn
                self.batch_abi = abi
                break
        self._ctx_lock = threading.Lock()
        self._contexts: dict[int, int] = {}
        # One attribute record for a whole batch: sources are read in stream order
        # (after the event wait). Location hints stay zero: they only matter for
        # managed or pageable memory, and the batch API ignores them otherwise.
        self._batch_attrs = CUmemcpyAttributes(srcAccessOrder=CU_MEMCPY_SRC_ACCESS_ORDER_STREAM)
        self._batch_attr_idx = (c_size_t * 1)(0)

    # -- plumbing ------------------------------------------------------------------

    def _call(self, name: str, *args: Any) -> None:
        rc = self._fn[name](*args)
        if rc != CUDA_SUCCESS:
            raise self.error(name, rc)

    def error(self, call: str, code: int) -> CudaError:
        name, text = c_char_p(), c_char_p()
        self._fn["cuGetErrorName"](code, byref(name))
        self._fn["cuGetErrorString"](code, byref(text))
        return CudaError(
            call,
            code,
            (name.value or b"CUDA_ERROR_UNKNOWN").decode(),
            (text.value or b"unknown error").decode(),
        )

    @property
    def has_batch(self) -> bool:
        return self.batch_abi != 0

    def init(self) -> None:
        self._call("cuInit", 0)

    def version(self) -> int:
        v = c_int()
        self._call("cuDriverGetVersion", byref(v))
        return v.value

    # -- devices and contexts -------------------------------------------------------

    def device_count(self) -> int:
        n = c_int()
        self._call("cuDeviceGetCount", byref(n))
        return n.value

    def device_info(self, ordinal: int) -> DeviceInfo:
        """UUID, name and PCI address of a device, without creating a context on it."""
        dev = c_int()
        self._call("cuDeviceGet", byref(dev), ordinal)
        uuid = CUuuid()
        self._call("cuDeviceGetUuid", byref(uuid), dev)
        name = ctypes.create_string_buffer(256)
        self._call("cuDeviceGetName", name, 256, dev)
        bus_id = ctypes.create_string_buffer(32)  # 13 bytes suffice ("0000:3B:00.0")
        self._call("cuDeviceGetPCIBusId", bus_id, 32, dev)
        return DeviceInfo(
            ordinal,
            bytes(uuid.bytes[:16]),
            name.value.decode(errors="replace"),
            bus_id.value.decode(errors="replace"),
        )

    def devices(self) -> list[DeviceInfo]:
        return [self.device_info(i) for i in range(self.device_count())]

    def primary_context(self, ordinal: int) -> int:
        """Retains the device's primary context once (creating it on first use)."""
        with self._ctx_lock:
            ctx = self._contexts.get(ordinal)
            if ctx is None:
                dev = c_int()
                self._call("cuDeviceGet", byref(dev), ordinal)
                handle = CUcontext()
                self._call("cuDevicePrimaryCtxRetain", byref(handle), dev)
                ctx = self._contexts[ordinal] = int(handle.value or 0)
            return ctx

    def set_current(self, ctx: int) -> None:
        self._call("cuCtxSetCurrent", CUcontext(ctx))

    def release_contexts(self) -> None:
        with self._ctx_lock:
            for ordinal in self._contexts:
                dev = c_int()
                if self._fn["cuDeviceGet"](byref(dev), ordinal) == CUDA_SUCCESS:
                    self._fn["cuDevicePrimaryCtxRelease"](dev)
            self._contexts.clear()

    # -- IPC --------------------------------------------------------------------------

    def ipc_get_mem_handle(self, base: int) -> bytes:
        h = CUipcMemHandle()
        self._call("cuIpcGetMemHandle", byref(h), CUdeviceptr(base))
        return ctypes.string_at(ctypes.addressof(h), 64)

    def ipc_open_mem(self, handle: bytes) -> int:
        """Maps another process's allocation into the current context; returns its base."""
        h = CUipcMemHandle.from_buffer_copy(handle)
        ptr = CUdeviceptr()
        self._call("cuIpcOpenMemHandle", byref(ptr), h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
        return int(ptr.value)

    def ipc_close_mem(self, ptr: int) -> None:
        self._call("cuIpcCloseMemHandle", CUdeviceptr(ptr))

    def ipc_open_event(self, handle: bytes) -> int:
        h = CUipcEventHandle.from_buffer_copy(handle)
        ev = CUevent()
        self._call("cuIpcOpenEventHandle", byref(ev), h)
        return int(ev.value or 0)

    def event_destroy(self, event: int) -> None:
        self._call("cuEventDestroy", CUevent(event))

    def address_range(self, ptr: int) -> tuple[int, int]:
        """(base, size) of the allocation that holds device pointer `ptr`."""
        base, size = CUdeviceptr(), c_size_t()
        self._call("cuMemGetAddressRange", byref(base), byref(size), CUdeviceptr(ptr))
        return int(base.value), int(size.value)

    def pointer_attribute(self, ptr: int, attribute: int) -> int:
        """An integer pointer attribute (CU_POINTER_ATTRIBUTE_*) of a device pointer."""
        # Attributes are 1 to 8 bytes wide (bool, int, CUdeviceptr, size_t): a zeroed
        # 64-bit buffer reads every one of them right on a little-endian host.
        out = c_uint64(0)
        self._call("cuPointerGetAttribute", byref(out), attribute, CUdeviceptr(ptr))
        return int(out.value)

    # -- host memory --------------------------------------------------------------------

    def host_register(self, ptr: int, size: int, flags: int = CU_MEMHOSTREGISTER_PORTABLE) -> None:
        self._call("cuMemHostRegister", c_void_p(ptr), size, flags)

    def host_unregister(self, ptr: int) -> None:
        self._call("cuMemHostUnregister", c_void_p(ptr))

    # -- streams, events, copies ---------------------------------------------------------

    def stream_create(self) -> int:
        s = CUstream()
        self._call("cuStreamCreate", byref(s), CU_STREAM_NON_BLOCKING)
        return int(s.value or 0)

    def stream_destroy(self, stream: int) -> None:
        self._call("cuStreamDestroy", CUstream(stream))

    def stream_wait_event(self, stream: int, event: int) -> None:
        self._call("cuStreamWaitEvent", CUstream(stream), CUevent(event), 0)

    def stream_synchronize(self, stream: int) -> None:
        self._call("cuStreamSynchronize", CUstream(stream))

    def event_create(self) -> int:
        """A daemon-side event (no timing) for waiting on one job's work in a stream."""
        ev = CUevent()
        self._call("cuEventCreate", byref(ev), CU_EVENT_DISABLE_TIMING)
        return int(ev.value or 0)

    def event_record(self, event: int, stream: int) -> None:
        self._call("cuEventRecord", CUevent(event), CUstream(stream))

    def event_synchronize(self, event: int) -> None:
        """Blocks (without the GIL) until the work before the event's record is done."""
        self._call("cuEventSynchronize", CUevent(event))

    def entry_points(self) -> tuple[array, int, int, int]:
        """What `kvdepot.server.cuda._dma.run_job` calls: the addresses of cuCtxSetCurrent,
        cuStreamWaitEvent, cuMemcpy2DAsync, cuMemcpyBatchAsync (0 without it),
        cuEventRecord, cuEventSynchronize and cuStreamSynchronize; the batch ABI; and
        the addresses of the batch attribute record and its index (this object keeps
        them alive)."""
        fns = array(
            "Q",
            [
                (ctypes.cast(self._fn[n], c_void_p).value or 0) if n in self._fn else 0
                for n in RUN_JOB_ENTRY_POINTS
            ],
        )
        return (
            fns,
            self.batch_abi,
            ctypes.addressof(self._batch_attrs),
            ctypes.addressof(self._batch_attr_idx),
        )

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """One copy in stream order; pointers are unified addresses (host or device)."""
        self._call("cuMemcpyAsync", CUdeviceptr(dst), CUdeviceptr(src), nbytes, CUstream(stream))

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
        """`rows` copies of `width` bytes in one call: row r goes from `src + r *
        src_pitch` to `dst + r * dst_pitch` (unified addresses, host or device; each
        side one allocation or one page-locked range)."""
        p = CUDA_MEMCPY2D(
            srcMemoryType=CU_MEMORYTYPE_UNIFIED,
            srcDevice=src,
            srcPitch=src_pitch,
            dstMemoryType=CU_MEMORYTYPE_UNIFIED,
            dstDevice=dst,
            dstPitch=dst_pitch,
            WidthInBytes=width,
            Height=rows,
        )
        self._call("cuMemcpy2DAsync", byref(p), CUstream(stream))

    def memcpy_batch_async(self, dsts: array, srcs: array, sizes: array, stream: int) -> None:
        """Many copies in one call (cuMemcpyBatchAsync); arrays of typecode 'Q', equal length.

        The batch runs in stream order as a whole; copies inside it in any order.
        """
        n = len(sizes)
        if not (len(dsts) == len(srcs) == n) or n == 0:
            raise ValueError("dsts, srcs and sizes must be non-empty and of equal length")
        fn = self._fn.get("cuMemcpyBatchAsync")
        if fn is None:
            raise CudaError(
                "cuMemcpyBatchAsync",
                CUDA_ERROR_NOT_SUPPORTED,
                "CUDA_ERROR_NOT_SUPPORTED",
                "the driver has no batch copy API",
            )
        d = (CUdeviceptr * n).from_buffer(dsts)
        s = (CUdeviceptr * n).from_buffer(srcs)
        z = (c_size_t * n).from_buffer(sizes)
        attrs = byref(self._batch_attrs)
        if self.batch_abi == 2:
            rc = fn(d, s, z, n, attrs, self._batch_attr_idx, 1, CUstream(stream))
        else:
            fail = c_size_t(0)
            rc = fn(d, s, z, n, attrs, self._batch_attr_idx, 1, byref(fail), CUstream(stream))
        if rc != CUDA_SUCCESS:
            raise self.error("cuMemcpyBatchAsync", rc)


def _resolve(lib: ctypes.CDLL, symbols: tuple[str, ...]) -> Any:
    for sym in symbols:
        try:
            return getattr(lib, sym)
        except AttributeError:
            continue
    return None


_lock = threading.Lock()
_driver: CudaDriver | None = None
_reason: str | None = None


def load(path: str | None = None) -> CudaDriver:
    """The process's driver bindings, initialised (cuInit) on first use.

    Raises CudaUnavailable with the reason when there is no driver library, it is
    a stub, or it has no device. The outcome is cached (pass `path` to retry
    with another library, for tests).
    """
    global _driver, _reason
    with _lock:
        if path is None and _driver is not None:
            return _driver
        if path is None and _reason is not None:
            raise CudaUnavailable(_reason)
        lib_path = path or os.environ.get(LIBCUDA_ENV) or LIBCUDA_DEFAULT
        try:
            drv = _open(lib_path)
        except CudaUnavailable as exc:
            if path is None:
                _reason = str(exc)
            raise
        if path is None:
            _driver = drv
        return drv


def _open(lib_path: str) -> CudaDriver:
    try:
        lib = ctypes.CDLL(lib_path)
    except OSError as exc:
        raise CudaUnavailable(f"no CUDA driver library ({lib_path}): {exc}") from None
    drv = CudaDriver(lib, lib_path)
    rc = drv._fn["cuInit"](0)
    if rc == CUDA_ERROR_STUB_LIBRARY:
        raise CudaUnavailable(f"{lib_path} is the toolkit's stub, not a driver")
    if rc == CUDA_ERROR_NO_DEVICE:
        raise CudaUnavailable("the CUDA driver reports no device (CUDA_VISIBLE_DEVICES?)")
    if rc != CUDA_SUCCESS:
        raise CudaUnavailable(f"cuInit failed: {drv.error('cuInit', rc)}")
    if drv.device_count() == 0:
        raise CudaUnavailable("the CUDA driver reports no device (CUDA_VISIBLE_DEVICES?)")
    return drv


def cuda_available() -> bool:
    """True when the driver loads and has at least one device. Never raises."""
    try:
        load()
    except Exception:
        return False
    return True


def unavailable_reason() -> str | None:
    """Why cuda_available() is False, in words; None when it is True."""
    try:
        load()
    except Exception as exc:
        return str(exc)
    return None
