"""NVIDIA GPUs as the kernel names them: device minors and device nodes.

The driver lists its GPUs under /proc/driver/nvidia/gpus/<PCI address>/information
("Device Minor:", "Bus Location:", "GPU UUID:"); GPU N's device node is
/dev/nvidia<N>, a character device of major 195. A CUDA process holds the node
of each GPU it has a context on, and can open only the nodes its container was
given, so an open file of that node is a process's proof that it uses the GPU.
Both ends use this: the client finds the node of its KV cache's GPU among its own
open files and sends it over the fd socket; the daemon checks what it received
(kvdepot.server.cuda.senders). Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvdepot.common.cuda_handles import HandleError, parse_uuid

DRIVER_ROOT = "/proc/driver/nvidia"
NVIDIA_MAJOR = 195  # the driver's character device major (NV_MAJOR_DEVICE_NUMBER)
FIRST_CONTROL_MINOR = 254  # 254: nvidia-modeset, 255: nvidiactl; GPUs are below

# An open file's status -> the GPU minor of the device node it is, or None.
NodeIdentity = Callable[[os.stat_result], "int | None"]


def nvidia_minor(st: os.stat_result) -> int | None:
    """The GPU minor of a real NVIDIA device node (a character device of major 195
    below the control minors), else None: a regular file named /dev/nvidia0 is not one."""
    if not stat.S_ISCHR(st.st_mode) or os.major(st.st_rdev) != NVIDIA_MAJOR:
        return None
    minor = os.minor(st.st_rdev)
    return minor if minor < FIRST_CONTROL_MINOR else None


@dataclass(frozen=True)
class GpuEntry:
    """One GPU as the driver lists it under /proc/driver/nvidia/gpus."""

    minor: int
    pci: tuple[int, ...] | None
    uuid: bytes | None


def parse_pci(text: str) -> tuple[int, ...] | None:
    """ "0000:3B:00.0" or "00000000:3b:00.0" -> (domain, bus, device, function)."""
    parts = re.fullmatch(r"\s*([0-9a-fA-F]+):([0-9a-fA-F]+):([0-9a-fA-F]+)\.([0-7])\s*", text)
    return tuple(int(p, 16) for p in parts.groups()) if parts else None


def parse_information(text: str) -> GpuEntry | None:
    """The driver's `information` file of one GPU -> its entry (None: no minor)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep:
            fields[name.strip()] = value.strip()
    try:
        minor = int(fields["Device Minor"])
    except (KeyError, ValueError):
        return None
    uuid = None
    with contextlib.suppress(HandleError):
        uuid = parse_uuid(fields.get("GPU UUID", ""))
    return GpuEntry(minor, parse_pci(fields.get("Bus Location", "")), uuid)


class GpuUnknown(Exception):
    """The driver's entries do not say which device minor a GPU is."""


def device_minor(pci_bus_id: str, uuid: str, driver_root: str | Path = DRIVER_ROOT) -> int:
    """The minor of the GPU at `pci_bus_id` (else the one whose UUID is `uuid`), from
    the driver's entries under `driver_root`. Raises GpuUnknown naming where it looked."""
    pci = parse_pci(pci_bus_id)
    try:
        raw: bytes | None = parse_uuid(uuid)
    except HandleError:
        raw = None
    gpus = Path(driver_root) / "gpus"
    entries = []
    try:
        for entry in sorted(gpus.iterdir()):
            try:
                found = parse_information((entry / "information").read_text())
            except OSError:
                continue
            if found is not None:
                entries.append(found)
    except OSError as exc:
        raise GpuUnknown(
            f"cannot list the driver's GPUs in {gpus} ({exc.strerror}): the NVIDIA driver's "
            f"/proc entries say which device node is which GPU (the NVIDIA container runtime "
            f"mounts them)"
        ) from None
    match = [e for e in entries if pci is not None and e.pci == pci]
    match = match or [e for e in entries if raw is not None and e.uuid == raw]
    if not match:
        raise GpuUnknown(
            f"no GPU at PCI address {pci_bus_id or '(unknown)'} or with UUID {uuid} in {gpus}"
        )
    return match[0].minor


def held_node(
    minor: int, identify: NodeIdentity = nvidia_minor, fd_dir: str = "/proc/self/fd"
) -> int | None:
    """An fd of this process (fd_dir: /proc/self/fd) open on GPU `minor`'s device node,
    or None. The fd stays this process's (the caller sends it, never closes it)."""
    for name in os.listdir(fd_dir):
        with contextlib.suppress(OSError, ValueError):
            if identify(os.stat(os.path.join(fd_dir, name))) == minor:
                return int(name)
    return None
