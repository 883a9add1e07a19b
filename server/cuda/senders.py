"""Which GPUs a CUDA IPC sender may name: the NVIDIA device nodes it holds open.

A CUDA IPC handle is 64 bytes that any process may replay, and the daemon (a
DaemonSet given every GPU of the node) could map one for any session. So before
it maps a handle, the daemon asks who sent it and whether that process uses the
GPU the handle names:

- the sender is the session's owner, the process the kernel named on the fd
  socket (SO_PEERCRED, pinned by its start time: kvdepot.server.peer), never a
  pid in a message. A session not attested yet registers no CUDA memory;
- a process uses GPU N when it holds its device node (`/dev/nvidia<N>`) open,
  as every CUDA process does for each GPU it has a context on; and a process can
  open only the device nodes its container was given (the device plugin's
  devices cgroup rule and mounts). The daemon lists the sender's open files
  (`/proc/<pid>/fd`) and refuses a handle on a GPU the sender does not hold;
- the GPU's N, its device minor, is the driver's: `/proc/driver/nvidia/gpus/
  <PCI address>/information`, "Device Minor:" (the entry whose "Bus Location"
  is the served device's PCI address, or whose "GPU UUID" is its UUID).

`SenderGpus.check` runs on the event loop during RegisterKV (one listing of the
sender's fds, a few hundred entries for a vLLM worker; at most MAX_FDS_SCANNED).
The roots are parameters so that tests run it against a fake driver tree and
real processes. What this does not do (docs/security.md, "CUDA IPC"): a process
on the same GPU that copied another's handle may still map it (the legacy
handle is a bearer token; only VMM allocations export as file descriptors).
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from kvdepot.common.cuda_handles import HandleError, parse_uuid
from kvdepot.server.peer import Peer, start_time

DRIVER_ROOT = "/proc/driver/nvidia"
MAX_FDS_SCANNED = 65536  # a sender with more open files than this is refused, not scanned


class SenderRefused(Exception):
    """The sender may not register memory on this GPU (PERMISSION_DENIED); the
    message says why and what to do."""


class GpuUnknown(Exception):
    """The daemon cannot tell the GPU's device minor (FAILED_PRECONDITION)."""


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


class SenderGpus:
    """The sender check of the CUDA IPC path (see the module docstring).

    `driver_root`: the driver's /proc directory; `dev_root`: where the device
    nodes are named in the senders' view (their containers keep the host's
    names); `proc_root`: the daemon's /proc. Thread-safe (no shared state but a
    cache of device minors, which never change while the driver is loaded)."""

    def __init__(
        self,
        driver_root: str | Path = DRIVER_ROOT,
        dev_root: str | Path = "/dev",
        proc_root: str | Path = "/proc",
    ) -> None:
        self.driver_root = Path(driver_root)
        self.proc_root = Path(proc_root)
        self._node = re.compile(re.escape(str(Path(dev_root))) + r"/nvidia(\d+)")
        self._minors: dict[tuple[str, str], int] = {}

    def device_minor(self, pci_bus_id: str, uuid: str) -> int:
        """The minor of the GPU at `pci_bus_id` (else the one whose UUID is `uuid`).
        Raises GpuUnknown naming where it looked."""
        key = (pci_bus_id, uuid)
        minor = self._minors.get(key)
        if minor is not None:
            return minor
        pci = parse_pci(pci_bus_id)
        raw = parse_uuid(uuid)
        gpus = self.driver_root / "gpus"
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
                f"cannot list the driver's GPUs in {gpus} ({exc.strerror}): the daemon needs "
                f"the NVIDIA driver's /proc entries to tell which GPU a handle names (run it "
                f"with the NVIDIA container runtime, as the DaemonSet does)"
            ) from None
        match = [e for e in entries if pci is not None and e.pci == pci]
        match = match or [e for e in entries if e.uuid == raw]
        if not match:
            raise GpuUnknown(
                f"no GPU at PCI address {pci_bus_id or '(unknown)'} or with UUID {uuid} in "
                f"{gpus}: the daemon cannot tell which device node is this GPU's"
            )
        self._minors[key] = match[0].minor
        return match[0].minor

    def held_minors(self, pid: int, limit: int = MAX_FDS_SCANNED) -> set[int]:
        """The NVIDIA device minors `pid` holds open. Raises OSError (the process is
        gone, or hidden from the daemon) and SenderRefused past `limit` open files."""
        held: set[int] = set()
        fd_dir = self.proc_root / str(pid) / "fd"
        with os.scandir(fd_dir) as it:
            for n, entry in enumerate(it):
                if n >= limit:
                    raise SenderRefused(
                        f"pid {pid} holds more than {limit} open files; the daemon does not "
                        f"list more to find its GPUs"
                    )
                try:
                    target = os.readlink(entry.path)
                except OSError:  # closed meanwhile
                    continue
                m = self._node.fullmatch(target)
                if m:
                    held.add(int(m.group(1)))
        return held

    def check(self, sender: Peer | None, pci_bus_id: str, uuid: str) -> None:
        """Returns when `sender` holds the GPU (`pci_bus_id`, `uuid`) open. Raises
        SenderRefused (PERMISSION_DENIED) or GpuUnknown (FAILED_PRECONDITION)."""
        if sender is None:
            raise SenderRefused(
                "this session is not attested: CUDA memory is registered only by a process "
                "the kernel names (attest on the fd socket first, as kvdepot's client does)"
            )
        if not sender.visible:
            raise SenderRefused(
                f"the daemon cannot see {sender}'s process, so it cannot tell which GPUs it "
                f"uses: share the process namespace with the engines (shareProcessNamespace "
                f"or hostPID) and run the daemon as the engines' uid"
            )
        minor = self.device_minor(pci_bus_id, uuid)
        try:
            held = self.held_minors(sender.pid)
            same = start_time(sender.pid) == sender.start_time
        except (OSError, ValueError, IndexError) as exc:
            raise SenderRefused(
                f"cannot list {sender}'s open files ({exc}): the process is gone, or hidden "
                f"from the daemon (run the daemon as the engines' uid)"
            ) from None
        if not same:
            raise SenderRefused(f"{sender} exited (its pid names another process now)")
        if minor not in held:
            raise SenderRefused(
                f"{sender} does not hold GPU {uuid} (device minor {minor}) open: a CUDA IPC "
                f"handle is mapped only for a process that uses that GPU itself; register "
                f"from the worker whose CUDA context holds the KV cache"
            )
