"""The real ctypes bindings (kvdepot.common.cuda_driver) against a fake libcuda built
from C, and a daemon process that turns CUDA on through them.
"""

from __future__ import annotations

import asyncio
import ctypes
import threading
from array import array
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvdepot.common import cuda_driver
from kvdepot.common.cuda_driver import (
    CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED,
    CudaError,
    CudaUnavailable,
)
from kvdepot.common.cuda_handles import format_uuid
from kvdepot.server.core.layout import NamespaceLayout
from kvdepot.server.core.memory_map import LayerRef, TensorView
from kvdepot.server.cuda import cuda_path, enable_cuda
from kvdepot.server.memory.copy_engine import LOAD, STORE
from kvdepot.server.state import DepotState
from kvdepot.v1 import depot_pb2 as pb
from tests.support.fake_cuda import (
    HANDLE,
    UUID1,
    FakeGpuHost,
    attested_session,
    ipc_msg,
    job,
    make_key,
)

# -- the real ctypes bindings, against a fake libcuda built from the real cuda.h ------------
#
# The fake implements each driver entry point with the prototype from cuda.h (the
# compiler checks it, and cuda.h's macros give the symbols their versioned names,
# e.g. cuMemHostRegister -> cuMemHostRegister_v2, as the real driver exports them).
# "Device memory" is host memory; calls that need a current context fail without
# one, as the real driver's do. It proves the marshalling (argument order and
# types, structs by value, the batch ABI), not the GPU.

FAKE_LIBCUDA_C = r"""
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAXN 256
#define OK return CUDA_SUCCESS
#define NEED_CTX if (!current) return CUDA_ERROR_INVALID_CONTEXT
static struct { CUdeviceptr base; size_t size; int vmm; int opened; } allocs[MAXN];
static struct { void *p; size_t n; } regs[MAXN];
static __thread CUcontext current;
static long n_batch, n_batch_copies, n_memcpy, n_waits, n_sync, n_events, n_streams, n_ctx;
static long n_own_events, n_records, n_event_syncs, n_2d, n_2d_rows;
static int init_rc;
static char CTX0;

long fake_count(const char *w) {
  long k = 0;
  if (!strcmp(w, "batch")) return n_batch;
  if (!strcmp(w, "batch_copies")) return n_batch_copies;
  if (!strcmp(w, "memcpy")) return n_memcpy;
  if (!strcmp(w, "waits")) return n_waits;
  if (!strcmp(w, "sync")) return n_sync;
  if (!strcmp(w, "events")) return n_events;
  if (!strcmp(w, "own_events")) return n_own_events;
  if (!strcmp(w, "copies_2d")) return n_2d;
  if (!strcmp(w, "rows_2d")) return n_2d_rows;
  if (!strcmp(w, "records")) return n_records;
  if (!strcmp(w, "event_syncs")) return n_event_syncs;
  if (!strcmp(w, "streams")) return n_streams;
  if (!strcmp(w, "contexts")) return n_ctx;
  if (!strcmp(w, "opened")) { for (int i = 0; i < MAXN; i++) k += allocs[i].opened; return k; }
  if (!strcmp(w, "hostregs")) { for (int i = 0; i < MAXN; i++) k += regs[i].p != 0; return k; }
  return -1;
}
void fake_set_init_rc(int rc) { init_rc = rc; }
/* The next `times` calls of cuMemcpy2DAsync ("2d") or cuStreamWaitEvent ("wait") fail. */
static int fail_2d_rc, fail_2d_times, fail_wait_rc, fail_wait_times;
void fake_fail(const char *w, int rc, int times) {
  if (!strcmp(w, "2d")) { fail_2d_rc = rc; fail_2d_times = times; }
  if (!strcmp(w, "wait")) { fail_wait_rc = rc; fail_wait_times = times; }
}
CUdeviceptr fake_alloc(size_t size, int vmm) {
  for (int i = 0; i < MAXN; i++) {
    if (allocs[i].base) continue;
    allocs[i].base = (CUdeviceptr)(size_t)calloc(1, size);
    allocs[i].size = size;
    allocs[i].vmm = vmm;
    return allocs[i].base;
  }
  return 0;
}
static int find(CUdeviceptr p) {
  for (int i = 0; i < MAXN; i++)
    if (allocs[i].base && allocs[i].base <= p && p < allocs[i].base + allocs[i].size) return i;
  return -1;
}

CUresult CUDAAPI cuInit(unsigned int f) {
  return f ? CUDA_ERROR_INVALID_VALUE : (CUresult)init_rc;
}
CUresult CUDAAPI cuDriverGetVersion(int *v) { *v = 13000; OK; }
CUresult CUDAAPI cuGetErrorName(CUresult e, const char **s) {
  switch (e) {
    case CUDA_ERROR_INVALID_VALUE: *s = "CUDA_ERROR_INVALID_VALUE"; break;
    case CUDA_ERROR_INVALID_CONTEXT: *s = "CUDA_ERROR_INVALID_CONTEXT"; break;
    case CUDA_ERROR_INVALID_HANDLE: *s = "CUDA_ERROR_INVALID_HANDLE"; break;
    case CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED:
      *s = "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED"; break;
    default: *s = "CUDA_ERROR_UNKNOWN";
  }
  OK;
}
CUresult CUDAAPI cuGetErrorString(CUresult e, const char **s) { (void)e; *s = "fake error"; OK; }
CUresult CUDAAPI cuDeviceGetCount(int *n) { *n = 1; OK; }
CUresult CUDAAPI cuDeviceGet(CUdevice *d, int o) {
  if (o != 0) return CUDA_ERROR_INVALID_DEVICE;
  *d = 0; OK;
}
CUresult CUDAAPI cuDeviceGetName(char *name, int len, CUdevice d) {
  (void)d; strncpy(name, "Fake H200", len); OK;
}
CUresult CUDAAPI cuDeviceGetUuid(CUuuid *u, CUdevice d) {
  (void)d;
  for (int i = 0; i < 16; i++) u->bytes[i] = (char)(0xa0 + i);
  OK;
}
CUresult CUDAAPI cuDeviceGetPCIBusId(char *bus_id, int len, CUdevice d) {
  (void)d; snprintf(bus_id, len, "0000:9A:00.0"); OK;  /* the driver's upper-case hex */
}
CUresult CUDAAPI cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) {
  (void)d; n_ctx++; *c = (CUcontext)&CTX0; OK;
}
CUresult CUDAAPI cuDevicePrimaryCtxRelease(CUdevice d) { (void)d; n_ctx--; OK; }
CUresult CUDAAPI cuCtxSetCurrent(CUcontext c) { current = c; OK; }
CUresult CUDAAPI cuIpcGetMemHandle(CUipcMemHandle *h, CUdeviceptr p) {
  NEED_CTX;
  int i = find(p);
  if (i < 0 || allocs[i].base != p || allocs[i].vmm) return CUDA_ERROR_INVALID_VALUE;
  memset(h, 0, sizeof *h);
  memcpy(h->reserved, "FAKEIPC", 8);
  memcpy(h->reserved + 8, &p, 8);
  OK;
}
CUresult CUDAAPI cuIpcOpenMemHandle(CUdeviceptr *out, CUipcMemHandle h, unsigned int flags) {
  CUdeviceptr p;
  NEED_CTX;
  if (flags != CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS) return CUDA_ERROR_INVALID_VALUE;
  if (memcmp(h.reserved, "FAKEIPC", 8)) return CUDA_ERROR_INVALID_HANDLE;
  memcpy(&p, h.reserved + 8, 8);
  int i = find(p);
  if (i < 0) return CUDA_ERROR_INVALID_HANDLE;
  allocs[i].opened++;
  *out = p;
  OK;
}
CUresult CUDAAPI cuIpcCloseMemHandle(CUdeviceptr p) {
  NEED_CTX;
  int i = find(p);
  if (i < 0 || !allocs[i].opened) return CUDA_ERROR_INVALID_VALUE;
  allocs[i].opened--;
  OK;
}
CUresult CUDAAPI cuIpcOpenEventHandle(CUevent *e, CUipcEventHandle h) {
  NEED_CTX;
  if (memcmp(h.reserved, "FAKEEVT", 8)) return CUDA_ERROR_INVALID_HANDLE;
  char *p = malloc(1); *p = 'I'; *e = (CUevent)p; n_events++; OK;
}
CUresult CUDAAPI cuEventCreate(CUevent *e, unsigned int flags) {
  NEED_CTX;
  if (flags != CU_EVENT_DISABLE_TIMING) return CUDA_ERROR_INVALID_VALUE;
  char *p = malloc(1); *p = 'O'; *e = (CUevent)p; n_own_events++; OK;
}
CUresult CUDAAPI cuEventRecord(CUevent e, CUstream s) {
  NEED_CTX;
  if (!e || !s || *(char *)e != 'O') return CUDA_ERROR_INVALID_HANDLE;
  n_records++; OK;
}
CUresult CUDAAPI cuEventSynchronize(CUevent e) {
  if (!e) return CUDA_ERROR_INVALID_HANDLE;
  n_event_syncs++; OK;
}
CUresult CUDAAPI cuEventDestroy(CUevent e) {
  if (*(char *)e == 'O') n_own_events--; else n_events--;
  free(e); OK;
}
CUresult CUDAAPI cuMemGetAddressRange(CUdeviceptr *b, size_t *s, CUdeviceptr p) {
  NEED_CTX;
  int i = find(p);
  if (i < 0) return CUDA_ERROR_INVALID_VALUE;
  *b = allocs[i].base; *s = allocs[i].size; OK;
}
CUresult CUDAAPI cuPointerGetAttribute(void *data, CUpointer_attribute a, CUdeviceptr p) {
  int i = find(p);
  if (i < 0) return CUDA_ERROR_INVALID_VALUE;
  switch (a) {
    case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR: *(CUdeviceptr *)data = allocs[i].base; break;
    case CU_POINTER_ATTRIBUTE_RANGE_SIZE: *(size_t *)data = allocs[i].size; break;
    case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: *(int *)data = 0; break;
    case CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE: *(int *)data = !allocs[i].vmm; break;
    default: return CUDA_ERROR_INVALID_VALUE;
  }
  OK;
}
CUresult CUDAAPI cuMemHostRegister(void *p, size_t n, unsigned int flags) {
  NEED_CTX;
  if (flags != CU_MEMHOSTREGISTER_PORTABLE || !n) return CUDA_ERROR_INVALID_VALUE;
  for (int i = 0; i < MAXN; i++)
    if (regs[i].p == p) return CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
  for (int i = 0; i < MAXN; i++)
    if (!regs[i].p) { regs[i].p = p; regs[i].n = n; OK; }
  return CUDA_ERROR_OUT_OF_MEMORY;
}
CUresult CUDAAPI cuMemHostUnregister(void *p) {
  NEED_CTX;
  for (int i = 0; i < MAXN; i++)
    if (regs[i].p == p) { regs[i].p = 0; OK; }
  return CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
}
CUresult CUDAAPI cuStreamCreate(CUstream *s, unsigned int flags) {
  NEED_CTX;
  if (flags != CU_STREAM_NON_BLOCKING) return CUDA_ERROR_INVALID_VALUE;
  *s = (CUstream)malloc(1); n_streams++; OK;
}
CUresult CUDAAPI cuStreamDestroy(CUstream s) { free(s); n_streams--; OK; }
CUresult CUDAAPI cuStreamWaitEvent(CUstream s, CUevent e, unsigned int f) {
  NEED_CTX;
  if (!s || !e || f) return CUDA_ERROR_INVALID_VALUE;
  if (fail_wait_times > 0) { fail_wait_times--; return fail_wait_rc; }
  n_waits++; OK;
}
CUresult CUDAAPI cuStreamSynchronize(CUstream s) {
  NEED_CTX;
  if (!s) return CUDA_ERROR_INVALID_VALUE;
  n_sync++; OK;
}
CUresult CUDAAPI cuMemcpyAsync(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st) {
  NEED_CTX;
  if (!st) return CUDA_ERROR_INVALID_VALUE;
  memcpy((void *)(size_t)d, (void *)(size_t)s, n);
  n_memcpy++; OK;
}
CUresult CUDAAPI cuMemcpy2DAsync(const CUDA_MEMCPY2D *p, CUstream st) {
  NEED_CTX;
  if (!st || p->srcMemoryType != CU_MEMORYTYPE_UNIFIED ||
      p->dstMemoryType != CU_MEMORYTYPE_UNIFIED || p->srcXInBytes || p->srcY ||
      p->dstXInBytes || p->dstY || p->srcHost || p->dstHost || p->srcArray || p->dstArray ||
      p->srcPitch < p->WidthInBytes || p->dstPitch < p->WidthInBytes)
    return CUDA_ERROR_INVALID_VALUE;
  if (fail_2d_times > 0) { fail_2d_times--; return fail_2d_rc; }
  for (size_t r = 0; r < p->Height; r++)
    memcpy((char *)(size_t)p->dstDevice + r * p->dstPitch,
           (const char *)(size_t)p->srcDevice + r * p->srcPitch, p->WidthInBytes);
  n_2d++; n_2d_rows += p->Height; OK;
}
CUresult CUDAAPI cuMemcpyBatchAsync(CUdeviceptr *d, CUdeviceptr *s, size_t *n, size_t count,
                                    CUmemcpyAttributes *attrs, size_t *idx, size_t nattrs,
                                    CUstream st) {
  NEED_CTX;
  if (!st || !count || nattrs != 1 || idx[0] != 0) return CUDA_ERROR_INVALID_VALUE;
  if (attrs[0].srcAccessOrder != CU_MEMCPY_SRC_ACCESS_ORDER_STREAM || attrs[0].flags)
    return CUDA_ERROR_INVALID_VALUE;
  for (size_t i = 0; i < count; i++) memcpy((void *)(size_t)d[i], (void *)(size_t)s[i], n[i]);
  n_batch++; n_batch_copies += count; OK;
}
"""


def _cuda_include() -> str | None:
    import glob
    import os
    import sys

    candidates = [os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "include")]
    candidates += sorted(glob.glob("/usr/local/cuda*/include"), reverse=True)
    for sp in sys.path:
        candidates += glob.glob(os.path.join(sp, "nvidia", "cu1*", "include"))
        candidates += glob.glob(os.path.join(sp, "nvidia", "cuda_runtime", "include"))
    for c in candidates:
        if os.path.exists(os.path.join(c, "cuda.h")):
            with open(os.path.join(c, "cuda.h"), errors="replace") as f:
                if "cuMemcpyBatchAsync_v2" in f.read():  # the CUDA 13 header
                    return c
    return None


@pytest.fixture(scope="module")
def fake_libcuda(tmp_path_factory: pytest.TempPathFactory) -> str:
    import shutil
    import subprocess

    cc = shutil.which("cc") or shutil.which("gcc")
    include = _cuda_include()
    if cc is None or include is None:
        pytest.skip("needs a C compiler and CUDA 13's cuda.h to build the fake driver")
    d = tmp_path_factory.mktemp("fakecuda")
    src, lib = d / "fake_libcuda.c", d / "libcuda.so.1"
    src.write_text(FAKE_LIBCUDA_C)
    subprocess.run(
        [
            cc,
            "-shared",
            "-fPIC",
            "-O1",
            "-Wall",
            "-Werror",
            f"-I{include}",
            "-o",
            str(lib),
            str(src),
        ],
        check=True,
        capture_output=True,
    )
    return str(lib)


def _fake_controls(path: str) -> ctypes.CDLL:
    """The fake libcuda's test controls (allocations, call counts), typed for ctypes."""
    fake = ctypes.CDLL(path)
    fake.fake_alloc.restype = ctypes.c_uint64
    fake.fake_alloc.argtypes = [ctypes.c_size_t, ctypes.c_int]
    fake.fake_count.restype = ctypes.c_long
    fake.fake_count.argtypes = [ctypes.c_char_p]
    fake.fake_fail.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int]
    return fake


def test_real_bindings_marshal_every_call_right(fake_libcuda: str) -> None:
    drv = cuda_driver.load(fake_libcuda)
    fake = _fake_controls(fake_libcuda)
    assert drv.batch_abi == 2 and drv.has_batch and drv.version() == 13000
    (dev,) = drv.devices()
    assert dev.ordinal == 0 and dev.name == "Fake H200"
    assert dev.uuid == bytes(range(0xA0, 0xB0))
    assert dev.pci_bus_id == "0000:9A:00.0"  # the NUMA placement reads it as sysfs's 9a
    assert fake.fake_count(b"contexts") == 0  # listing devices creates no context
    base = fake.fake_alloc(1 << 20, 0)
    with pytest.raises(CudaError) as exc:  # no current context yet
        drv.ipc_get_mem_handle(base)
    assert exc.value.name == "CUDA_ERROR_INVALID_CONTEXT" and "fake error" in str(exc.value)
    drv.set_current(drv.primary_context(0))
    assert drv.primary_context(0) == drv.primary_context(0) and fake.fake_count(b"contexts") == 1
    # Pointer attributes of various widths read right through the 64-bit buffer.
    inner = base + 4096
    assert drv.pointer_attribute(inner, cuda_driver.CU_POINTER_ATTRIBUTE_RANGE_START_ADDR) == base
    assert drv.pointer_attribute(inner, cuda_driver.CU_POINTER_ATTRIBUTE_RANGE_SIZE) == 1 << 20
    assert drv.pointer_attribute(inner, cuda_driver.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL) == 0
    assert (
        drv.pointer_attribute(inner, cuda_driver.CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE)
        == 1
    )
    vmm = fake.fake_alloc(4096, 1)
    assert (
        drv.pointer_attribute(vmm, cuda_driver.CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE) == 0
    )
    # IPC: the handle goes by value both ways.
    handle = drv.ipc_get_mem_handle(base)
    assert len(handle) == 64 and handle.startswith(b"FAKEIPC")
    ptr = drv.ipc_open_mem(handle)
    assert ptr == base and drv.address_range(ptr + 100) == (base, 1 << 20)
    with pytest.raises(CudaError, match="CUDA_ERROR_INVALID_HANDLE"):
        drv.ipc_open_mem(b"\x01" * 64)
    ev = drv.ipc_open_event(b"FAKEEVT\x00" + b"\x00" * 56)
    assert ev and fake.fake_count(b"events") == 1
    stream = drv.stream_create()
    drv.stream_wait_event(stream, ev)
    # Copies: one by one, and batched (the CUDA 13 ABI, one attribute record).
    host = (ctypes.c_char * 8192)()
    ctypes.memmove(base, b"\x11" * 4096 + b"\x22" * 4096, 8192)
    drv.memcpy_async(ctypes.addressof(host), base, 4096, stream)
    dsts = array("Q", [ctypes.addressof(host) + 4096, ctypes.addressof(host) + 6144])
    srcs = array("Q", [base + 4096, base + 6144])
    drv.memcpy_batch_async(dsts, srcs, array("Q", [2048, 2048]), stream)
    drv.stream_synchronize(stream)
    done = drv.event_create()
    drv.event_record(done, stream)
    drv.event_synchronize(done)
    drv.event_destroy(done)
    assert fake.fake_count(b"event_syncs") >= 1 and fake.fake_count(b"own_events") == 0
    assert host.raw == b"\x11" * 4096 + b"\x22" * 4096
    assert fake.fake_count(b"batch") == 1 and fake.fake_count(b"batch_copies") == 2
    assert fake.fake_count(b"memcpy") == 1 and fake.fake_count(b"waits") == 1
    # Host registration.
    drv.host_register(ctypes.addressof(host), 8192)
    with pytest.raises(CudaError) as exc:
        drv.host_register(ctypes.addressof(host), 8192)
    assert exc.value.code == CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
    drv.host_unregister(ctypes.addressof(host))
    with pytest.raises(CudaError, match="NOT_REGISTERED"):
        drv.host_unregister(ctypes.addressof(host))
    drv.event_destroy(ev)
    drv.ipc_close_mem(ptr)
    drv.stream_destroy(stream)
    assert fake.fake_count(b"opened") == 0 and fake.fake_count(b"events") == 0
    drv.release_contexts()
    assert fake.fake_count(b"contexts") == 0


def test_a_driver_that_fails_cuinit_reads_as_unavailable(fake_libcuda: str) -> None:
    fake = ctypes.CDLL(fake_libcuda)
    fake.fake_set_init_rc(cuda_driver.CUDA_ERROR_STUB_LIBRARY)
    try:
        with pytest.raises(CudaUnavailable, match="stub"):
            cuda_driver.load(fake_libcuda)
        fake.fake_set_init_rc(cuda_driver.CUDA_ERROR_NO_DEVICE)
        with pytest.raises(CudaUnavailable, match="no device"):
            cuda_driver.load(fake_libcuda)
    finally:
        fake.fake_set_init_rc(0)


def test_depot_state_end_to_end_through_the_real_bindings(
    fake_libcuda: str, state: DepotState, tmp_path: Path
) -> None:
    """enable_cuda + register + store + load + session end + pool pinning, with the
    real CudaDriver on the fake libcuda: every ctypes path the daemon takes."""
    drv = cuda_driver.load(fake_libcuda)
    fake = _fake_controls(fake_libcuda)
    gpus = FakeGpuHost(tmp_path / "gpu-host").add_devices(drv.devices())
    assert enable_cuda(state, state.arena, driver=drv, env={}, senders=gpus.senders)
    state.arena.start_warmup(chunk_bytes=16 << 20)
    assert state.arena.wait_warmup(30)
    assert fake.fake_count(b"hostregs") == 4  # 64 MiB in 16 MiB chunks
    nb, layers, page = 16, 32, 4096
    size = nb * layers * page
    base = fake.fake_alloc(size + 65536, 0)
    rng = np.random.default_rng(3)
    ctypes.memmove(base + 65536, rng.bytes(size), size)
    drv.set_current(drv.primary_context(0))
    handle = drv.ipc_get_mem_handle(base)
    session = attested_session(state)
    lay = NamespaceLayout("real", 1, 1, ((page,) * layers,))
    tensors = [TensorView(0, i * nb * page, nb, page, page) for i in range(layers)]
    refs = [[LayerRef(i, 0, page) for i in range(layers)]]
    reg = state.register(
        session.id,
        lay,
        0,
        [
            (
                "cuda_ipc",
                ipc_msg(
                    handle,
                    size,
                    offset=65536,
                    uuid=format_uuid(bytes(range(160, 176))),
                    event=b"FAKEEVT" + b"\x00" * 57,
                ),
            )
        ],
        tensors,
        refs,
    )
    keys = [make_key(100 + i) for i in range(4)]
    batches, waits = fake.fake_count(b"batch"), fake.fake_count(b"waits")
    copies_2d, rows_2d = fake.fake_count(b"copies_2d"), fake.fake_count(b"rows_2d")
    records, syncs = fake.fake_count(b"records"), fake.fake_count(b"event_syncs")

    async def run() -> None:
        # The GPU's jobs copy on threads of its own: with every shared (CPU) copy
        # thread held, they still run.
        gate = threading.Event()
        held = [
            asyncio.ensure_future(state.copy_queue.run(lambda: gate.wait(20)))
            for _ in range(state.copy_queue.threads)
        ]
        await asyncio.sleep(0.05)
        try:
            out = await asyncio.wait_for(
                state.run_job(job(reg, session, 1, STORE, keys, [0, 1, 2, 3])), 10
            )
            assert out.success and out.bytes == 4 * layers * page, out
            out = await asyncio.wait_for(
                state.run_job(job(reg, session, 2, LOAD, keys, [8, 9, 10, 11])), 10
            )
            assert out.success, out
        finally:
            gate.set()
            await asyncio.gather(*held)

    asyncio.run(run())
    uuid = format_uuid(bytes(range(160, 176)))
    assert reg.copy_device == (uuid, "0000:9A:00.0") and list(state.copy_queues.devices) == [uuid]
    assert state.stats()["gpu_copy_devices"] == [uuid]
    gpu = ctypes.string_at(base + 65536, size)
    for t in tensors:
        for s, d in zip([0, 1, 2, 3], [8, 9, 10, 11], strict=True):
            a, b = t.region_offset + s * page, t.region_offset + d * page
            assert gpu[a : a + page] == gpu[b : b + page]
    # vLLM's layout (layers at a constant stride, a block's pages one after another in
    # its pool row): each job is one 2-D copy per block of 32 rows, no descriptors.
    assert fake.fake_count(b"copies_2d") == copies_2d + 8
    assert fake.fake_count(b"rows_2d") == rows_2d + 2 * 4 * layers
    assert fake.fake_count(b"batch") == batches
    assert fake.fake_count(b"waits") == waits + 2  # the event, before each job
    # Each job waited on a completion event recorded behind its copies.
    assert fake.fake_count(b"records") == records + 2
    assert fake.fake_count(b"event_syncs") == syncs + 2
    engine = cuda_path(state).engine
    assert engine.issuer == "compiled" and engine.counters["issue_ns"] > 0
    # A refused 2-D copy: the job runs again from Python, and its bytes arrive.
    fake.fake_fail(b"2d", cuda_driver.CUDA_ERROR_INVALID_VALUE, 1)
    copies_2d = fake.fake_count(b"copies_2d")

    async def load_again(job_id: int, blocks: list[int]) -> Any:
        return await state.run_job(job(reg, session, job_id, LOAD, keys, blocks))

    out = asyncio.run(load_again(3, [12, 13, 14, 15]))
    assert out.success, out
    assert fake.fake_count(b"copies_2d") == copies_2d + 4  # the Python run's four
    gpu = ctypes.string_at(base + 65536, size)
    for t in tensors:
        for s, d in zip([0, 1, 2, 3], [12, 13, 14, 15], strict=True):
            a, b = t.region_offset + s * page, t.region_offset + d * page
            assert gpu[a : a + page] == gpu[b : b + page]
    # A failing event wait fails that job with the driver's words; the next one works.
    fake.fake_fail(b"wait", cuda_driver.CUDA_ERROR_INVALID_VALUE, 1)
    out = asyncio.run(load_again(4, [12, 13, 14, 15]))
    assert not out.success and "cuStreamWaitEvent" in out.error, out
    assert asyncio.run(load_again(5, [12, 13, 14, 15])).success
    assert fake.fake_count(b"opened") == 1 and fake.fake_count(b"events") == 1
    state.close_session(session.id)
    assert fake.fake_count(b"opened") == 0 and fake.fake_count(b"events") == 0
    state.close()  # copy threads, regions, then the wrapped arena close: unregister
    assert fake.fake_count(b"hostregs") == 0 and fake.fake_count(b"streams") == 0
    assert fake.fake_count(b"own_events") == 0
    gpus.close()


def test_a_daemon_process_turns_cuda_on_and_refuses_bad_handles_over_grpc(
    fake_libcuda: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A real daemon process (tests/gpu/serve_cuda.py, i.e. `kvdepot serve` with CUDA
    wired in) on the fake driver: CUDA on, the pool page-locked during warm-up, bad
    handles refused with status codes, and the pool unregistered at shutdown."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    import grpc

    from kvdepot.client import DepotClient
    from kvdepot.v1 import admin_pb2, admin_pb2_grpc

    work = tmp_path_factory.mktemp("kvdcuda")
    sock, log_path = str(work / "k.sock"), work / "daemon.log"
    serve = Path(__file__).parents[1] / "gpu" / "serve_cuda.py"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, str(serve), "serve", "--socket", sock, "--pool-size", "64MiB"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "KVDEPOT_LIBCUDA": fake_libcuda},
        )
    client = DepotClient(f"unix://{sock}").start()
    try:
        assert client.wait_connected(30), log_path.read_text()
        admin = admin_pb2_grpc.AdminStub(grpc.insecure_channel(f"unix://{sock}.admin"))
        for _ in range(300):
            if admin.GetStats(admin_pb2.GetStatsRequest(), timeout=5).warmup_complete:
                break
            time.sleep(0.05)
        text = log_path.read_text()
        assert "CUDA is on" in text and "GPU-a0a1a2a3-a4a5-a6a7-a8a9-aaabacadaeaf" in text, text
        assert "pool page-locked: 64.0 MiB of 64.0 MiB (100%" in text, text
        fake_uuid = format_uuid(bytes(range(160, 176)))
        layout = pb.NamespaceLayout(
            id="n",
            world_size=1,
            blocks_per_chunk=1,
            groups=[pb.GroupLayout(layer_page_bytes=[4096])],
        )
        for handle, code, words in [
            # This host has no NVIDIA driver entries, so the sender check refuses to
            # guess which GPU the handle names, before the driver opens it.
            (ipc_msg(b"\x01" * 64, 4096, uuid=fake_uuid), "FAILED_PRECONDITION", "driver"),
            (ipc_msg(HANDLE, 4096, uuid=UUID1), "FAILED_PRECONDITION", "not served"),
            (ipc_msg(HANDLE[:60], 4096, uuid=fake_uuid), "INVALID_ARGUMENT", "60 bytes"),
        ]:
            with pytest.raises(grpc.RpcError) as exc:
                client.stub.RegisterKV(
                    pb.RegisterKVRequest(
                        session_id=client.session_id,
                        namespace=layout,
                        rank=0,
                        regions=[pb.MemoryRegion(cuda_ipc=handle)],
                        tensors=[
                            pb.KVTensor(
                                region_index=0,
                                num_blocks=1,
                                block_stride_bytes=4096,
                                page_bytes=4096,
                            )
                        ],
                        groups=[
                            pb.GroupRefs(layers=[pb.LayerRef(tensor_index=0, page_bytes=4096)])
                        ],
                    ),
                    timeout=10,
                )
            assert exc.value.code().name == code and words in exc.value.details()
        assert admin.GetStats(admin_pb2.GetStatsRequest(), timeout=5).registrations == 0
    finally:
        client.close()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(30)
    assert rc == 0 and "pool unregistered from CUDA" in log_path.read_text()
