"""Enabling CUDA: unavailable here and why, the CPU path kept, device selection, and
contexts only for the devices served.
"""

from __future__ import annotations

import logging

import pytest

from kvdepot.common import cuda_driver
from kvdepot.common.cuda_driver import CudaUnavailable, DeviceInfo
from kvdepot.common.cuda_handles import parse_uuid
from kvdepot.common.kinds import MemoryPath
from kvdepot.server import errors
from kvdepot.server.core.layout import NamespaceLayout
from kvdepot.server.core.memory_map import LayerRef, TensorView
from kvdepot.server.cuda import cuda_available, cuda_path, enable_cuda, unavailable_reason
from kvdepot.server.cuda.enable import select_devices
from kvdepot.server.memory.copy_engine import CpuCopyEngine
from kvdepot.server.state import DepotState
from tests.support.fake_cuda import HANDLE, UUID0, UUID1, FakeDriver, ipc_msg

# -- enabling CUDA --------------------------------------------------------------------------


def test_cuda_is_unavailable_here_and_says_why() -> None:
    # This suite runs on CPU machines; on a GPU host this test has nothing to prove.
    if cuda_available():
        pytest.skip("a CUDA driver and device are present")
    reason = unavailable_reason()
    assert reason and ("libcuda" in reason or "device" in reason)
    with pytest.raises(CudaUnavailable):
        cuda_driver.load()
    with pytest.raises(CudaUnavailable, match="no CUDA driver library"):
        cuda_driver.load("/nonexistent/libcuda.so.1")


def test_enabling_cuda_without_cuda_leaves_the_cpu_path(
    state: DepotState, caplog: pytest.LogCaptureFixture
) -> None:
    if cuda_available():
        pytest.skip("a CUDA driver and device are present")
    with caplog.at_level(logging.INFO, logger="kvdepot.cuda"):
        assert enable_cuda(state, state.arena) is False
    assert "CUDA is off" in caplog.text
    assert cuda_path(state) is None
    session = state.open_session("x", 1, "")
    lay = NamespaceLayout("ns", 1, 1, ((4096,),))
    with pytest.raises(errors.DepotError) as exc:
        state.register(
            session.id,
            lay,
            0,
            [("cuda_ipc", ipc_msg(HANDLE, 4096))],
            [TensorView(0, 0, 1, 4096, 4096)],
            [[LayerRef(0, 0, 4096)]],
        )
    assert exc.value.code.name == "INVALID_ARGUMENT" and "not available" in exc.value.message
    # The shared-memory path is still served, by its CPU engine.
    shm = state.memory_path(MemoryPath.SHM)
    assert shm is not None and isinstance(shm.engine, CpuCopyEngine)


def test_device_selection() -> None:
    devs = [DeviceInfo(0, parse_uuid(UUID0), "a"), DeviceInfo(1, parse_uuid(UUID1), "b")]
    assert select_devices(devs, None) == devs and select_devices(devs, "all") == devs
    assert select_devices(devs, "none") == []
    assert select_devices(devs, "1") == [devs[1]]
    assert select_devices(devs, UUID1.upper() + ", 0, " + UUID0[4:]) == [devs[1], devs[0]]
    with pytest.raises(ValueError, match="no visible device matches '7'"):
        select_devices(devs, "7")
    with pytest.raises(ValueError, match="neither a device UUID"):
        select_devices(devs, "GPU-zz")


def test_only_served_devices_get_a_context(state: DepotState) -> None:
    devs = [DeviceInfo(0, parse_uuid(UUID0), "a"), DeviceInfo(1, parse_uuid(UUID1), "b")]
    drv = FakeDriver(devs)
    assert enable_cuda(state, state.arena, driver=drv, env={"KVDEPOT_CUDA_DEVICES": UUID1})
    assert drv.contexts == [1]  # the pinning context, on the served device only
    handle, _ = drv.export(8192)
    with pytest.raises(errors.DepotError) as exc:
        state.register(
            state.open_session("x", 1, "").id,
            NamespaceLayout("n", 1, 1, ((8192,),)),
            0,
            [("cuda_ipc", ipc_msg(handle, 8192))],
            [TensorView(0, 0, 1, 8192, 8192)],
            [[LayerRef(0, 0, 8192)]],
        )
    assert exc.value.code.name == "FAILED_PRECONDITION"
    assert drv.contexts == [1]
    assert enable_cuda(state, state.arena, driver=drv, env={})  # once per pool
    assert len(drv.contexts) == 1


@pytest.mark.parametrize("spec", ["none", "5", "GPU-nonsense"])
def test_cuda_stays_off_when_no_device_is_selected(spec: str) -> None:
    from types import SimpleNamespace

    added: list[object] = []
    st = SimpleNamespace(
        memory_path=lambda kind: None, add_memory_path=lambda kind, opener: added.append(kind)
    )
    arena = SimpleNamespace(address=0, size=1 << 20, warmup_done_bytes=0)
    drv = FakeDriver([DeviceInfo(0, parse_uuid(UUID0), "a")])
    assert not enable_cuda(st, arena, driver=drv, env={"KVDEPOT_CUDA_DEVICES": spec})
    assert added == [] and drv.contexts == []
