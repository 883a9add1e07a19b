"""The CUDA IPC path end to end, on a real GPU: engine-like processes with torch CUDA
KV tensors in vLLM's layout (32 layers x 64 KiB = 2 MiB per block) and a real
`kvdepot serve` process. Skipped as a whole without CUDA (see conftest.py).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import grpc
import pytest

from kvdepot.v1 import admin_pb2, admin_pb2_grpc
from kvdepot.v1 import depot_pb2 as pb
from tests.gpu.conftest import GPU_ENGINE


def engine(action: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(GPU_ENGINE), action, *args],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )


def admin(target: str) -> admin_pb2_grpc.AdminStub:
    return admin_pb2_grpc.AdminStub(grpc.insecure_channel(target))


def test_an_engine_stores_and_loads_every_byte_through_the_daemon(cuda_daemon) -> None:
    d = cuda_daemon("--pool-size", "2GiB")
    proc = engine("roundtrip", "--target", d.target, "--chunks", "128", "--job-chunks", "16")
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, d.log()
    rep = json.loads(out.splitlines()[-1])
    assert rep["registration"] == "cuda_ipc"
    assert rep["store_failed"] == [] and rep["load_failed"] == [], rep
    assert rep["stored_keys"] == 128 and rep["stored_bytes"] == 128 * (2 << 20)
    assert rep["compared_bytes"] == 128 * (2 << 20) and rep["mismatched_pages"] == 0, rep
    # The store waited for the engine's kernel (the inter-process event).
    assert rep["ordering_store_failed"] == [] and rep["ordering_load_failed"] == []
    assert rep["ordering_mismatched_pages"] == 0, rep
    # The engine exited: its session ended and the daemon unmapped its memory.
    d.wait_log(r"unmapped a \d+-byte allocation", timeout=20)
    st = admin(d.admin_target).GetStats(admin_pb2.GetStatsRequest(), timeout=5)
    assert st.registrations == 0 and st.warmup_complete
    # The GPU's copies ran on copy threads of its own (they stay for its next engine).
    from kvdepot.common import cuda_driver
    from kvdepot.common.cuda_handles import format_uuid
    from kvdepot.server.memory import numa

    info = cuda_driver.load().device_info(0)
    served = {format_uuid(info.uuid)}
    assert set(st.gpu_copy_devices) <= served and st.gpu_copy_devices, st.gpu_copy_devices
    assert st.gpu_copy_threads == 2
    # On the GPU's own node, as sysfs says it, when the host gives it one the daemon's
    # CPUs are on.
    topology = numa.read_topology("/")
    node = dict(zip(topology.gpu_addresses, topology.gpu_nodes, strict=True)).get(
        numa.pci_address(info.pci_bus_id), -1
    )
    if node in topology.nodes_of(os.sched_getaffinity(0)):
        assert list(st.gpu_copy_nodes) == [node], (list(st.gpu_copy_nodes), info.pci_bus_id)


def test_a_killed_engine_releases_its_mappings_in_the_daemon(cuda_daemon) -> None:
    import torch

    d = cuda_daemon("--pool-size", "1GiB")
    torch.cuda.init()
    free_before, _ = torch.cuda.mem_get_info()
    proc = engine("hold", "--target", d.target, "--num-blocks", "2048")  # 4 GiB of KV
    try:
        assert proc.stdout is not None
        rep = json.loads(proc.stdout.readline())
        assert rep["ready"] and rep["ok"], rep
        stub = admin(d.admin_target)
        engines = stub.ListEngines(admin_pb2.ListEnginesRequest(), timeout=5).engines
        mine = [e for e in engines if e.pid == rep["pid"]]
        assert mine and mine[0].registrations[0].memory_path == "cuda_ipc"
        assert mine[0].registrations[0].registered_bytes == 4 << 30
        free_holding, _ = torch.cuda.mem_get_info()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        engines = stub.ListEngines(admin_pb2.ListEnginesRequest(), timeout=5).engines
        st = stub.GetStats(admin_pb2.GetStatsRequest(), timeout=5)
        if not engines and st.registrations == 0 and "unmapped a" in d.log():
            break
        time.sleep(0.1)
    assert not engines and st.registrations == 0, d.log()
    unmapped = [int(n) for n in re.findall(r"unmapped a (\d+)-byte allocation", d.log())]
    assert unmapped and max(unmapped) >= 4 << 30, d.log()  # the engine's 4 GiB KV allocation
    # The engine's GPU memory is back (the daemon held no mapping that kept it alive).
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        free_after, _ = torch.cuda.mem_get_info()
        if free_after - free_holding > 3.5 * (1 << 30):
            break
        time.sleep(0.2)
    assert free_after - free_holding > 3.5 * (1 << 30), (free_before, free_holding, free_after)
    # The daemon still serves.
    assert stub.GetStats(admin_pb2.GetStatsRequest(), timeout=5).sessions == 0


def test_garbage_handles_are_refused_and_the_daemon_survives(cuda_daemon) -> None:
    import torch

    from kvdepot.client import DepotClient
    from kvdepot.common import cuda_driver
    from kvdepot.common.cuda_handles import format_uuid

    d = cuda_daemon("--pool-size", "256MiB")
    uuid = format_uuid(cuda_driver.load().device_info(0).uuid)
    # A context on GPU 0, as an engine has: this process then holds its device node, so
    # the daemon's sender check lets its handles through to the driver's own checks.
    torch.zeros(1, device="cuda:0")
    c = DepotClient(d.target).start()
    assert c.wait_connected(10)
    layout = pb.NamespaceLayout(
        id="bad", world_size=1, blocks_per_chunk=1, groups=[pb.GroupLayout(layer_page_bytes=[4096])]
    )
    cases = [
        (pb.CudaIpcHandle(ipc_handle=b"\x01" * 64, device_uuid=uuid, size=4096), "INVALID"),
        (pb.CudaIpcHandle(ipc_handle=b"\x01" * 63, device_uuid=uuid, size=4096), "INVALID"),
        (
            pb.CudaIpcHandle(
                ipc_handle=b"\x01" * 64,
                device_uuid="GPU-" + "0" * 8 + "-0000-0000-0000-" + "0" * 12,
                size=4096,
            ),
            "FAILED_PRECONDITION",
        ),
    ]
    for handle, code in cases:
        with pytest.raises(grpc.RpcError) as exc:
            c.stub.RegisterKV(
                pb.RegisterKVRequest(
                    session_id=c.session_id,
                    namespace=layout,
                    rank=0,
                    regions=[pb.MemoryRegion(cuda_ipc=handle)],
                    tensors=[
                        pb.KVTensor(
                            region_index=0, num_blocks=1, block_stride_bytes=4096, page_bytes=4096
                        )
                    ],
                    groups=[pb.GroupRefs(layers=[pb.LayerRef(tensor_index=0, page_bytes=4096)])],
                ),
                timeout=10,
            )
        assert code in exc.value.code().name, exc.value.details()
    st = admin(d.admin_target).GetStats(admin_pb2.GetStatsRequest(), timeout=5)
    assert st.registrations == 0
    c.close()


def test_a_handle_copied_by_a_process_without_the_gpu_is_refused(cuda_daemon) -> None:
    """The sender check on a real driver: an engine's CUDA context holds its GPU's
    device node (the check's premise; the node names are printed for the record), its
    registration sends that node (gpu_token) and passes; its handle, sent by a process
    with no CUDA context (it holds no /dev/nvidia<N>, so the daemon's reading of its
    open files finds none), is PERMISSION_DENIED naming the GPU and its minor."""
    from kvdepot.server.cuda.senders import SenderGpus

    d = cuda_daemon("--pool-size", "1GiB")
    proc = engine("hold", "--target", d.target, "--num-blocks", "64")
    try:
        assert proc.stdout is not None
        rep = json.loads(proc.stdout.readline())
        assert rep["ready"] and rep["ok"], (rep, d.log())
        print("the engine holds", rep["held_nodes"])
        from kvdepot.common import cuda_driver

        info = cuda_driver.load().device_info(0)
        minor = SenderGpus().device_minor(info.pci_bus_id, rep["device_uuid"])
        print("GPU", rep["device_uuid"], info.pci_bus_id, "is device minor", minor)
        assert f"/dev/nvidia{minor}" in rep["held_nodes"], rep
        assert rep["node_fd"] is not None, rep  # so its registration sent the node
        thief = subprocess.run(
            [
                sys.executable,
                str(GPU_ENGINE.parents[1] / "security" / "gpu_sender.py"),
                "--target",
                d.target,
                "--handle",
                rep["handle"],
                "--uuid",
                rep["device_uuid"],
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert thief.returncode == 0, thief.stderr
        out = json.loads(thief.stdout.strip().splitlines()[-1])
        assert out["code"] == "PERMISSION_DENIED", out
        assert f"does not hold GPU {rep['device_uuid']} (device minor {minor})" in out["message"]
        st = admin(d.admin_target).GetStats(admin_pb2.GetStatsRequest(), timeout=5)
        assert st.registrations == 1 and st.permission_denied >= 1  # the engine's only
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)


def test_expandable_segments_are_detected_with_the_setting_to_change() -> None:
    proc = engine("export-only", env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0
    rep = json.loads(out.splitlines()[-1])
    assert rep["exported"] is False and "expandable_segments" in rep["error"], rep
    plain = engine("export-only", env={"PYTORCH_CUDA_ALLOC_CONF": ""})
    out, _ = plain.communicate(timeout=120)
    assert json.loads(out.splitlines()[-1])["exported"] is True
