"""Memory paths: how a registration's memory reaches the daemon, as one protocol.

A memory path (its kind is a `MemoryPath`: "shm", "cuda_ipc", "pvm") turns the
handle a client sent in RegisterKV into a region mapped into the daemon and the
copy engine that copies it:

    path.open(handle, session_id) -> (MappedRegion, CopyEngine)

Every path plugs into the state the same way (`DepotState.add_memory_path`):
shared memory (`SharedMemoryPath`, below; the state adds it itself), process
memory (kvdepot.server.pvm) and CUDA IPC (kvdepot.server.cuda.enable). `open`
runs on the event loop during RegisterKV and raises DepotError with what to do;
the region it returns belongs to the registration, which closes it. A path that
takes fds from the fd socket claims them through `PassedFds` (the state
implements it), so it reaches only what that session's own process sent.
"""

from __future__ import annotations

import os
from collections.abc import Hashable
from typing import Any, Protocol, TypeVar

from kvdepot.common.kinds import MemoryPath
from kvdepot.server import errors
from kvdepot.server.memory.copy_engine import CopyEngine
from kvdepot.server.memory.regions import MappedRegion, SharedMemoryRegion
from kvdepot.server.peer import Peer

Handle = TypeVar("Handle", contravariant=True)


class MemoryPathPlugin(Protocol[Handle]):
    """One memory path of the daemon: `kind` names it (RegisterKVResponse.memory_path);
    `open` maps one region of a registration, for the session `session_id`."""

    @property
    def kind(self) -> MemoryPath: ...

    def open(self, handle: Handle, session_id: str) -> tuple[MappedRegion, CopyEngine]: ...


class MemoryPaths(Protocol):
    """Where memory paths plug in (DepotState): what kvdepot.server.pvm and
    kvdepot.server.cuda.enable need of the state."""

    def add_memory_path(self, path: MemoryPathPlugin[Any]) -> None: ...
    def memory_path(self, kind: MemoryPath) -> MemoryPathPlugin[Any] | None: ...


class PassedFd(Protocol):
    """An fd a client sent on the fd socket, and who sent it (the kernel's word)."""

    fd: int
    peer: Peer


class PassedFds(Protocol):
    """The fd socket's fds, claimed for a session (the state implements it)."""

    def takes_fds(self) -> bool:
        """False when the daemon has no fd socket."""
        ...

    def claim_passed(self, token: str, session_id: str) -> PassedFd:
        """The fd sent with `token` by the session's process; the caller closes it.
        DepotError (counted PERMISSION_DENIED for another session's token)."""
        ...

    def deny(self, message: str, key: Hashable = "refused") -> errors.DepotError:
        """A counted PERMISSION_DENIED (raise it), logged at most so often per `key`."""
        ...


class SharedMemoryPath:
    """The "shm" path: a memfd (or any mappable fd) the client sent on the fd socket,
    mapped and sealed against shrinking; copied by the CPU engine."""

    kind = MemoryPath.SHM

    def __init__(self, fds: PassedFds, engine: CopyEngine) -> None:
        self.fds = fds
        self.engine = engine

    def open(self, handle: tuple[str, int], session_id: str) -> tuple[MappedRegion, CopyEngine]:
        """`handle`: (fd_token, size) of RegisterKV's ShmHandle."""
        token, size = handle
        fd = self.fds.claim_passed(token, session_id).fd
        try:
            return SharedMemoryRegion.from_passed_fd(fd, size), self.engine
        except (OSError, ValueError) as exc:
            raise errors.invalid(f"cannot map the passed fd: {exc}") from None
        finally:
            os.close(fd)  # the mapping holds the memory now
