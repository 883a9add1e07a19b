"""The CUDA IPC sender check (kvdepot.server.cuda.senders, kvdepot.common.nvidia_gpus) on
a fake GPU host and real processes: the driver's information files read, device minors
resolved, real device nodes told from look-alikes, a sent node checked, open nodes found
in /proc, and every way a sender fails it."""

from __future__ import annotations

import dataclasses
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from kvdepot.common.cuda_handles import parse_uuid
from kvdepot.common.nvidia_gpus import (
    GpuUnknown,
    held_node,
    nvidia_minor,
    parse_information,
    parse_pci,
)
from kvdepot.server.cuda.senders import SenderGpus, SenderRefused
from kvdepot.server.peer import Peer, start_time
from tests.support.fake_cuda import PCI0, UUID0, UUID1, FakeGpuHost, this_process

# As the 550-series driver writes /proc/driver/nvidia/gpus/<pci>/information.
INFORMATION = """Model: \t\t NVIDIA H200
IRQ:   \t\t 305
GPU UUID: \t GPU-8f5e2a1c-0b3d-4e6f-9a7b-1c2d3e4f5a6b
Video BIOS: \t 96.00.9f.00.01
Bus Type: \t PCIe
DMA Size: \t 52 bits
DMA Mask: \t 0xfffffffffffff
Bus Location: \t 0000:3b:00.0
Device Minor: \t 3
GPU Excluded:\t No
"""


def test_the_drivers_information_file_and_pci_addresses_parse() -> None:
    entry = parse_information(INFORMATION)
    assert entry is not None and entry.minor == 3
    assert entry.pci == parse_pci("00000000:3B:00.0") == parse_pci(PCI0) == (0, 0x3B, 0, 0)
    assert entry.uuid == parse_uuid(UUID0)
    assert parse_information("Model: x\n") is None
    assert parse_pci("") is None and parse_pci("3b:00") is None


def chardev(major: int, minor: int) -> os.stat_result:
    return os.stat_result(
        (stat.S_IFCHR | 0o666, 1, 5, 1, 0, 0, 0, 0, 0, 0), {"st_rdev": os.makedev(major, minor)}
    )


def test_only_a_gpu_character_device_of_the_nvidia_major_is_a_gpu_node(tmp_path: Path) -> None:
    assert nvidia_minor(chardev(195, 3)) == 3
    assert nvidia_minor(chardev(195, 255)) is None  # nvidiactl
    assert nvidia_minor(chardev(195, 254)) is None  # nvidia-modeset
    assert nvidia_minor(chardev(1, 3)) is None  # /dev/null's numbers
    assert nvidia_minor(os.stat("/dev/null")) is None
    look_alike = tmp_path / "nvidia0"  # what root in a container could make in its /dev
    look_alike.touch()
    assert nvidia_minor(os.stat(look_alike)) is None


def test_device_minors_by_pci_address_else_uuid(tmp_path: Path) -> None:
    host = FakeGpuHost(tmp_path)
    host.add(4, UUID0, PCI0)
    host.add(5, UUID1)  # no PCI address known to the daemon: found by UUID
    assert host.senders.device_minor("0000:3b:00.0", UUID0) == 4
    assert host.senders.device_minor("", UUID1) == 5
    with pytest.raises(GpuUnknown, match=r"no GPU at PCI address 0000:AA:00\.0"):
        host.senders.device_minor("0000:AA:00.0", "GPU-" + "ab" * 16)
    with pytest.raises(GpuUnknown, match="cannot list the driver's GPUs"):  # no entries
        SenderGpus(driver_root=tmp_path / "nothing").device_minor(PCI0, UUID0)


@pytest.fixture
def host(tmp_path: Path) -> FakeGpuHost:
    h = FakeGpuHost(tmp_path)
    h.add(0, UUID0, PCI0)
    h.add(1, UUID1, "0000:9A:00.0")
    return h


def holder(node: Path) -> subprocess.Popen[str]:
    """A real process holding `node` open until its stdin closes."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, sys; fd = os.open(sys.argv[1], os.O_RDONLY); print('ok', flush=True); "
            "sys.stdin.read()",
            str(node),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ok"
    return proc


def test_a_process_passes_only_for_the_gpus_it_holds(host: FakeGpuHost) -> None:
    proc = holder(host.node(1))
    try:
        sender = Peer(proc.pid, 0, 0, start_time(proc.pid))
        assert host.senders.held_minors(proc.pid) == {1}
        host.senders.check(sender, "0000:9A:00.0", UUID1)
        with pytest.raises(SenderRefused, match=r"does not hold GPU .* \(device minor 0\)"):
            host.senders.check(sender, PCI0, UUID0)
        # A pid whose start time differs is another process now.
        with pytest.raises(SenderRefused, match="exited"):
            host.senders.check(
                dataclasses.replace(sender, start_time=sender.start_time + 1),
                "0000:9A:00.0",
                UUID1,
            )
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(10)
    with pytest.raises(SenderRefused, match="cannot list"):  # it exited
        host.senders.check(sender, "0000:9A:00.0", UUID1)


def test_a_sent_node_must_be_the_gpus_own(host: FakeGpuHost, tmp_path: Path) -> None:
    """The node a client sent on the fd socket proves its GPU, and only that one;
    it needs no /proc: a sender the daemon cannot see passes with it."""
    unseen = Peer(0, 1000, 1000, 0)
    host.senders.check(unseen, PCI0, UUID0, host.held_fd(0))
    with pytest.raises(SenderRefused, match=r"sent device minor 1's node as its proof of GPU"):
        host.senders.check(unseen, PCI0, UUID0, host.held_fd(1))
    other = tmp_path / "nvidia0"
    other.touch()
    fd = os.open(other, os.O_RDONLY)
    try:
        with pytest.raises(SenderRefused, match="sent no GPU's device node"):
            host.senders.check(unseen, PCI0, UUID0, fd)
    finally:
        os.close(fd)
    # The client's side finds the node among its own open files.
    assert held_node(1, host.identify) == host.held_fd(1)
    assert held_node(7, host.identify) is None
    host.close()


def test_senders_the_daemon_cannot_name_or_see_are_refused(host: FakeGpuHost) -> None:
    host.hold(0)
    try:
        with pytest.raises(SenderRefused, match="not attested"):
            host.senders.check(None, PCI0, UUID0)
        with pytest.raises(SenderRefused, match="cannot see"):
            host.senders.check(Peer(0, 1000, 1000, 0), PCI0, UUID0)
        me = this_process()
        host.senders.check(me, PCI0, UUID0)
        with pytest.raises(SenderRefused, match="more than 1 open files"):
            host.senders.held_minors(me.pid, limit=1)
    finally:
        host.close()
