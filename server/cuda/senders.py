"""Which GPUs a CUDA IPC sender may name: those whose device nodes it holds open.

A CUDA IPC handle is 64 bytes that any process may replay, and the daemon (a
DaemonSet given every GPU of the node) could map one for any session. So before
it maps a handle, the daemon asks who sent it and whether that process uses the
GPU the handle names:

- the sender is the session's owner, the process the kernel named on the fd
  socket (SO_PEERCRED, pinned by its start time: kvdepot.server.peer), never a
  pid in a message. A session not attested yet registers no CUDA memory;
- a process uses GPU N when it holds its device node (/dev/nvidia<N>, a
  character device of major 195) open, as every CUDA process does for each GPU
  it has a context on; a process can open only the nodes its container was given
  (kvdepot.common.nvidia_gpus). The proof, in order of preference:
  1. the node itself, sent by the session's process over the fd socket
     (CudaIpcHandle.gpu_token; kvdepot's client sends it): the daemon checks the
     received file is that GPU's node. Needs nothing of /proc;
  2. without one (an older or raw client), the sender's open files
     (/proc/<pid>/fd), which the daemon can read only as the engines' uid.
- the GPU's N is the driver's: /proc/driver/nvidia/gpus/<PCI address>/information.

`SenderGpus.check` runs on the event loop during RegisterKV. The roots and the
node identity are parameters so that tests run it against a fake driver tree
and real processes. What this does not do (docs/security.md, "CUDA IPC"): a
process that uses the same GPU and copied another's handle may still map it (the
legacy handle is a bearer token there; only VMM allocations export as fds).
"""

from __future__ import annotations

import os
from pathlib import Path

from kvdepot.common.nvidia_gpus import (
    DRIVER_ROOT,
    GpuUnknown,
    NodeIdentity,
    device_minor,
    nvidia_minor,
)
from kvdepot.server.peer import Peer, start_time

MAX_FDS_SCANNED = 65536  # a sender with more open files than this is refused, not scanned

__all__ = ["GpuUnknown", "SenderGpus", "SenderRefused"]


class SenderRefused(Exception):
    """The sender may not register memory on this GPU (PERMISSION_DENIED); the
    message says why and what to do."""


class SenderGpus:
    """The sender check of the CUDA IPC path (see the module docstring).

    `driver_root`: the driver's /proc directory; `proc_root`: the daemon's /proc;
    `identify`: an open file's status -> its GPU minor (real device nodes by
    default). Thread-safe (its only state is a cache of device minors, which do not
    change while the driver is loaded)."""

    def __init__(
        self,
        driver_root: str | Path = DRIVER_ROOT,
        proc_root: str | Path = "/proc",
        identify: NodeIdentity = nvidia_minor,
    ) -> None:
        self.driver_root = Path(driver_root)
        self.proc_root = Path(proc_root)
        self.identify = identify
        self._minors: dict[tuple[str, str], int] = {}

    def device_minor(self, pci_bus_id: str, uuid: str) -> int:
        """The served GPU's minor (cached). Raises GpuUnknown."""
        key = (pci_bus_id, uuid)
        if key not in self._minors:
            self._minors[key] = device_minor(pci_bus_id, uuid, self.driver_root)
        return self._minors[key]

    def held_minors(self, pid: int, limit: int = MAX_FDS_SCANNED) -> set[int]:
        """The GPU minors `pid` holds open. Raises OSError (the process is gone, or
        hidden from the daemon) and SenderRefused past `limit` open files."""
        held: set[int] = set()
        with os.scandir(self.proc_root / str(pid) / "fd") as it:
            for n, entry in enumerate(it):
                if n >= limit:
                    raise SenderRefused(
                        f"pid {pid} holds more than {limit} open files; the daemon does not "
                        f"list more to find its GPUs"
                    )
                try:
                    minor = self.identify(os.stat(entry.path))  # the open file itself
                except OSError:  # closed meanwhile
                    continue
                if minor is not None:
                    held.add(minor)
        return held

    def check(
        self, sender: Peer | None, pci_bus_id: str, uuid: str, node_fd: int | None = None
    ) -> None:
        """Returns when `sender` uses the GPU (`pci_bus_id`, `uuid`): `node_fd` (a file
        it sent on the fd socket) is that GPU's device node, or, without one, the
        sender holds the node open now. Raises SenderRefused (PERMISSION_DENIED) or
        GpuUnknown (FAILED_PRECONDITION)."""
        if sender is None:
            raise SenderRefused(
                "this session is not attested: CUDA memory is registered only by a process "
                "the kernel names (attest on the fd socket first, as kvdepot's client does)"
            )
        minor = self.device_minor(pci_bus_id, uuid)
        if node_fd is not None:
            sent = self.identify(os.fstat(node_fd))
            if sent != minor:
                what = "no GPU's device node" if sent is None else f"device minor {sent}'s node"
                raise SenderRefused(
                    f"{sender} sent {what} as its proof of GPU {uuid} (device minor {minor}): "
                    f"send the /dev/nvidia{minor} it holds open (kvdepot's client does)"
                )
            return
        if not sender.visible:
            raise SenderRefused(
                f"the daemon cannot see {sender}'s process, so it cannot tell which GPUs it "
                f"uses: send the GPU's device node on the fd socket (gpu_token; kvdepot's "
                f"client does)"
            )
        try:
            held = self.held_minors(sender.pid)
            same = start_time(sender.pid) == sender.start_time
        except (OSError, ValueError, IndexError) as exc:
            raise SenderRefused(
                f"cannot list {sender}'s open files ({exc}): send the GPU's device node on "
                f"the fd socket instead (gpu_token; kvdepot's client does)"
            ) from None
        if not same:
            raise SenderRefused(f"{sender} exited (its pid names another process now)")
        if minor not in held:
            raise SenderRefused(
                f"{sender} does not hold GPU {uuid} (device minor {minor}) open: a CUDA IPC "
                f"handle is mapped only for a process that uses that GPU itself; register "
                f"from the worker whose CUDA context holds the KV cache"
            )
