"""The pvm memory path against a real `kvdepot serve`: engines whose KV cache is
ordinary process memory, copied by the daemon with process_vm_readv/writev.

Engines are real processes (tests/support/engine.py --memory pvm); the daemon verifies who
registers from the kernel's credentials, so a registration naming another process
is refused, and a daemon without ptrace access says what to change.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvdepot.client import DepotClient, session_stub
from kvdepot.client.fdpass import send_fd
from kvdepot.client.pvm import describe_tensors, register_process_kv, send_identity
from kvdepot.testing.waiting import wait_for
from kvdepot.v1 import depot_pb2 as pb
from tests.support import unprivileged
from tests.support.daemon import DaemonProcess, stats
from tests.support.engine import Geometry

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[1]
ENGINE = REPO / "tests" / "support" / "engine.py"
# One rank, KV in a private anonymous mapping: only process_vm_readv/writev reach it.
PVM = ("--memory", "pvm", "--world-size", "1", "--namespace", "pvm-ns", "--num-blocks", "256")


def engine(action: str, target: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(ENGINE), action, "--target", target, *PVM, "--chunks", "40", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def report(proc: subprocess.Popen[str]) -> dict:
    line = proc.stdout.readline()  # type: ignore[union-attr]
    assert line, proc.stderr.read()  # type: ignore[union-attr]
    return json.loads(line)


@pytest.fixture
def daemon(daemon_factory) -> DaemonProcess:
    """A daemon with the pvm path on (it is off unless the operator says --pvm)."""
    return daemon_factory("--pool-size", "64MiB", "--pvm")


def pidfds(d: DaemonProcess) -> int:
    """pidfds the daemon holds (one per live pvm region)."""
    fd_dir = Path(f"/proc/{d.proc.pid}/fd")  # type: ignore[union-attr]
    count = 0
    for fd in fd_dir.iterdir():
        with contextlib.suppress(OSError):  # closed meanwhile
            count += "pidfd" in os.readlink(fd)
    return count


def test_store_in_one_process_load_in_another(daemon: DaemonProcess) -> None:
    writer = engine("store", daemon.target)
    try:
        stored = report(writer)
        assert stored["memory_path"] == "pvm"
        assert (stored["failed"], stored["stored"]) == (0, 80), stored
        assert pidfds(daemon) == 1
        reader = engine("verify", daemon.target)
        loaded = report(reader)
        assert reader.wait(30) == 0
        assert loaded["memory_path"] == "pvm"
        assert (loaded["failed"], loaded["jobs"]) == (0, 4), loaded
        assert loaded["mismatched_pages"] == 0  # every byte came back, through the pool
    finally:
        writer.communicate("\n", timeout=30)
    wait_for(lambda: stats(daemon).sessions == 0, what="both sessions to end")
    assert pidfds(daemon) == 0


def test_unmapped_memory_fails_the_job_and_marks_nothing_ready(daemon: DaemonProcess) -> None:
    proc = engine("unmap", daemon.target)
    out = report(proc)
    assert proc.wait(30) == 0
    assert out["store_before"] is True
    # A copy that comes up short is a job error: nothing stored, nothing ready.
    assert out["store_after"] is False and "moved" in out["store_error"], out
    assert out["keys_ready_after_failed_store"] == 0
    assert out["load_after"] is False and "process_vm_writev" in out["load_error"], out
    wait_for(lambda: stats(daemon).sessions == 0, what="the session to end")
    s = stats(daemon)
    assert (s.registrations, s.writing_blocks, s.inflight_jobs) == (0, 0, 0)
    assert s.ready_blocks == 4  # the two chunks stored before the hole (two groups)


def test_engine_killed_while_storing(daemon: DaemonProcess) -> None:
    victim = engine("store", daemon.target, "--loop")
    try:
        assert report(victim)["failed"] == 0
        before = stats(daemon).stores
        wait_for(lambda: stats(daemon).stores > before + 5, what="stores to flow")
    finally:
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)

    def released() -> bool:
        s = stats(daemon)
        return (s.sessions, s.registrations, s.writing_blocks, s.inflight_jobs) == (0, 0, 0, 0)

    wait_for(released, what="the daemon to release the dead engine")
    assert pidfds(daemon) == 0
    assert daemon.proc.poll() is None  # type: ignore[union-attr]
    # The daemon goes on serving: a new engine reads back the first chunks.
    reader = engine("verify", daemon.target)
    loaded = report(reader)
    assert reader.wait(30) == 0
    assert (loaded["failed"], loaded["mismatched_pages"]) == (0, 0), loaded


def _raw_session(target: str, claimed_pid: int) -> tuple[grpc.Channel, object, str, str]:
    """A Session opened by hand, claiming any pid (what a hostile client can do)."""
    ch = grpc.insecure_channel(target)
    call = pb_stub(ch).Session(pb.SessionRequest(client_name="liar", pid=claimed_pid))
    hello = next(iter(call)).hello
    return ch, call, hello.session_id, hello.fd_socket


def pb_stub(ch: grpc.Channel):

    return session_stub(ch)


def _register(ch: grpc.Channel, session_id: str, pid: int, token: str, size: int) -> None:
    geo = Geometry(world_size=1, namespace="pvm-liar", num_blocks=4, groups=[[size // 4]])
    pb_stub(ch).RegisterKV(
        pb.RegisterKVRequest(
            session_id=session_id,
            namespace=geo.layout(),
            rank=0,
            regions=[
                pb.MemoryRegion(
                    pvm=pb.ProcessMemory(pid=pid, address=0x10000, size=size, pid_token=token)
                )
            ],
            tensors=[
                pb.KVTensor(
                    region_index=0, num_blocks=4, block_stride_bytes=size // 4, page_bytes=size // 4
                )
            ],
            groups=[pb.GroupRefs(layers=[pb.LayerRef(tensor_index=0, page_bytes=size // 4)])],
        ),
        timeout=10,
    )


def test_registration_naming_another_process_is_refused(daemon: DaemonProcess) -> None:
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        # 1. An honest session, but the region names another process's pid.
        ch, call, sid, fd_socket = _raw_session(daemon.target, os.getpid())
        token = send_identity(fd_socket, sid).pid_token
        with pytest.raises(grpc.RpcError) as err:
            _register(ch, sid, other.pid, token, 4096)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "register only its own memory" in err.value.details()
        call.cancel()
        ch.close()
        # 2. A session that lies about its pid, and a region naming that pid: the
        #    socketpair behind the token was made by us, which the kernel knows.
        ch, call, sid, fd_socket = _raw_session(daemon.target, other.pid)
        token = send_identity(fd_socket, sid).pid_token
        with pytest.raises(grpc.RpcError) as err:
            _register(ch, sid, other.pid, token, 4096)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert f"pid {os.getpid()}" in err.value.details()
        # 3. A token of another session cannot be used either.
        ch2, call2, sid2, _ = _raw_session(daemon.target, os.getpid())
        with pytest.raises(grpc.RpcError) as err:
            _register(ch2, sid2, os.getpid(), send_identity(fd_socket, sid).pid_token, 4096)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "another session" in err.value.details()
        # 4. A token naming something other than a socketpair (a memfd here).
        memfd = os.memfd_create("not-a-socket")
        try:
            token = send_fd(fd_socket, sid2, memfd)
        finally:
            os.close(memfd)
        with pytest.raises(grpc.RpcError) as err:
            _register(ch2, sid2, os.getpid(), token, 4096)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "socketpair" in err.value.details()
        for c in (call, call2):
            c.cancel()
        ch.close()
        ch2.close()
    finally:
        other.kill()
        other.wait()
    wait_for(lambda: stats(daemon).sessions == 0, what="the sessions to end")
    s = stats(daemon)
    assert (s.registrations, s.ready_blocks) == (0, 0)
    assert pidfds(daemon) == 0


@pytest.fixture
def unprivileged_daemon() -> Iterator[DaemonProcess]:
    if os.geteuid() != 0:
        pytest.skip("needs root to start a daemon as another uid")
    with unprivileged.unprivileged_daemon() as d:
        yield d


def test_daemon_without_ptrace_access_says_what_to_change(
    unprivileged_daemon: DaemonProcess,
) -> None:
    import torch

    client = DepotClient(unprivileged_daemon.target, client_name="root engine").start()
    try:
        assert client.wait_connected(10)
        kv = torch.zeros(8, 4096, dtype=torch.int8)
        regions, tensors = describe_tensors([kv])
        geo = Geometry(world_size=1, namespace="pvm-denied", num_blocks=8, groups=[[4096]])
        with pytest.raises(grpc.RpcError) as err:
            register_process_kv(
                client,
                geo.layout(),
                0,
                regions,
                tensors,
                [pb.GroupRefs(layers=[pb.LayerRef(tensor_index=0, page_bytes=4096)])],
            )
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        text = err.value.details()
        for fix in ("uid (0", "CAP_SYS_PTRACE", "shareProcessNamespace"):
            assert fix in text, text
    finally:
        client.close()
    assert stats(unprivileged_daemon).registrations == 0


def test_pvm_bench_runs_and_checks_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    """The benchmark's smoke run: both paths load the stored bytes back (it raises
    when they differ); the speed ratio itself is a figure, not asserted here."""
    from kvdepot.bench import pvm_bench

    pvm_bench.main(
        [
            "--json",
            "--layers",
            "2",
            "--page-kib",
            "64",
            "--blocks",
            "4",
            "--reps",
            "1",
            "--pool-size",
            "32MiB",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert out["bytes_per_load"] == 2 * 4 * 65536
    assert out["load_gb_per_s"]["pvm"] > 0 and out["load_gb_per_s"]["shm"] > 0
    assert out["ratio_pvm_to_shm"] > 0
