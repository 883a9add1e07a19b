"""CUDA IPC bound to its sender (docs/security.md, "CUDA IPC: a handle on the sender's
GPUs only").

A real `kvdepot serve` on a fake GPU host (tests/security/fake_gpu_serve.py: the fake
CUDA driver, two GPUs with minors 0 and 1, a fake driver tree and device nodes), and
real client processes that hold device nodes open as CUDA processes do: a process
sending a handle on a GPU it does not hold is refused, the same process is let
through on its own GPU, and the owner's registration beside it stores the GPU's bytes
into the pool exactly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvdepot.client.cuda_ipc import gpu_node_token
from kvdepot.common.jobs import Job
from kvdepot.server.memory.copy_engine import STORE
from tests.security.fake_gpu_serve import GPUS, HOST_ENV, contents, handle_of
from tests.security.gpu_sender import PAGE, register_gpu
from tests.support.daemon import DaemonProcess, connect, stats
from tests.support.fake_cuda import UUID0, UUID1, FakeGpuHost, make_key

pytestmark = pytest.mark.timeout(180)

HERE = Path(__file__).resolve().parent


@pytest.fixture
def gpu_daemon(daemon_factory, tmp_path: Path) -> Iterator[tuple[DaemonProcess, FakeGpuHost]]:
    host = FakeGpuHost(tmp_path / "gpu-host")
    for minor, uuid, pci in GPUS:
        host.add(minor, uuid, pci)
    d = daemon_factory(
        "--pool-size",
        "64MiB",
        env={HOST_ENV: str(tmp_path / "gpu-host")},
        command=[sys.executable, str(HERE / "fake_gpu_serve.py")],
    )
    yield d, host
    host.close()


def send(
    d: DaemonProcess, minor: int, uuid: str, hold: list[Path], node: Path | None = None
) -> dict[str, str]:
    """Another process registers GPU `minor`'s handle, naming `uuid`, holding `hold`
    (and sending `node` as its proof of the GPU)."""
    args = [sys.executable, str(HERE / "gpu_sender.py"), "--target", d.target]
    args += ["--handle", handle_of(minor).hex(), "--uuid", uuid]
    for path in hold:
        args += ["--hold", str(path)]
    if node is not None:
        args += ["--send-node", str(node)]
    out = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_handle_on_a_gpu_the_sender_does_not_hold_is_refused(gpu_daemon) -> None:
    d, host = gpu_daemon
    before = stats(d).permission_denied
    # GPU 0's handle, from a process whose container has GPU 1 only, then none.
    for hold in ([host.node(1)], []):
        out = send(d, 0, UUID0, hold)
        assert out["code"] == "PERMISSION_DENIED", out
        assert f"does not hold GPU {UUID0} (device minor 0) open" in out["message"], out
    # Its own GPU's node sent as the proof of GPU 0, and a look-alike file.
    out = send(d, 0, UUID0, [], node=host.node(1))
    assert out["code"] == "PERMISSION_DENIED", out
    assert "sent device minor 1's node as its proof of GPU" in out["message"], out
    look_alike = host.dev_root.parent / "nvidia0"
    look_alike.touch()
    out = send(d, 0, UUID0, [], node=look_alike)
    assert out["code"] == "PERMISSION_DENIED" and "sent no GPU's device node" in out["message"]
    assert stats(d).permission_denied == before + 4
    assert stats(d).registrations == 0
    # The same process is let through on the GPU it holds, proven either way: the
    # refusals are the GPU's.
    assert send(d, 1, UUID1, [host.node(1)])["code"] == "OK"
    assert send(d, 1, UUID1, [], node=host.node(1))["code"] == "OK"
    assert "does not hold GPU" in (d.workdir / "daemon.log").read_text()

    # Beside it, the owner of GPU 0 (this process, holding its node) registers with
    # the client library's proof (its node over the fd socket) and stores: the pool
    # holds the GPU's bytes exactly.
    host.hold(0)
    client = connect(d, "gpu-0 owner")
    try:
        token = gpu_node_token(
            client,
            UUID0,
            GPUS[0][2],
            client.session_id,
            driver_root=str(host.driver_root),
            identify=host.identify,
        )
        assert token
        reg = register_gpu(client, handle_of(0), UUID0, "owner", token).registration_id
        keys, blocks = [make_key(i) for i in range(3)], [2, 7, 15]
        stream = client.transfer_stream(job_lane=False)
        stream.submit(Job(1, STORE, keys, blocks, [len(blocks)], [0], registration_id=reg))
        assert stream.wait([1], timeout=30)
        (result,) = stream.poll()
        assert result.success, result.error
        gpu = contents(0)
        for key, block in zip(keys, blocks, strict=True):
            got = client.get("owner", key, 0)
            assert got == gpu[block * PAGE : (block + 1) * PAGE]
        stream.close()
    finally:
        client.close()


def test_an_unattested_session_registers_no_cuda_memory(gpu_daemon) -> None:
    """A raw Session that never attests (nothing names its process) is refused, even
    from a process holding every GPU."""
    from kvdepot.client import session_stub
    from kvdepot.v1 import depot_pb2 as pb

    d, host = gpu_daemon
    host.hold(0, 1)
    ch = d.channel()
    call = session_stub(ch).Session(pb.SessionRequest(client_name="raw", pid=os.getpid()))
    hello = next(iter(call)).hello
    try:
        with pytest.raises(Exception) as exc:
            session_stub(ch).RegisterKV(
                pb.RegisterKVRequest(
                    session_id=hello.session_id,
                    namespace=pb.NamespaceLayout(
                        id="raw",
                        world_size=1,
                        blocks_per_chunk=1,
                        groups=[pb.GroupLayout(layer_page_bytes=[PAGE])],
                    ),
                    rank=0,
                    regions=[
                        pb.MemoryRegion(
                            cuda_ipc=pb.CudaIpcHandle(
                                ipc_handle=handle_of(0), device_uuid=UUID0, size=PAGE
                            )
                        )
                    ],
                    tensors=[
                        pb.KVTensor(
                            region_index=0, num_blocks=1, block_stride_bytes=PAGE, page_bytes=PAGE
                        )
                    ],
                    groups=[pb.GroupRefs(layers=[pb.LayerRef(tensor_index=0, page_bytes=PAGE)])],
                ),
                timeout=10,
            )
        assert exc.value.code().name == "PERMISSION_DENIED"
        assert "not attested" in exc.value.details()
    finally:
        call.cancel()
        ch.close()
    assert stats(d).registrations == 0
