"""Names shared by the daemon and its clients: transfer directions, memory paths, the
metadata key of a call's session. Standard library only."""

from __future__ import annotations

import enum


class Direction(enum.IntEnum):
    """A transfer job's direction (the wire's kvdepot.v1.Direction values)."""

    STORE = 1  # registered memory -> pool
    LOAD = 2  # pool -> registered memory

    @property
    def label(self) -> str:
        """ "store" or "load" (metrics labels, log lines)."""
        return self.name.lower()


class MemoryPath(enum.StrEnum):
    """How a registration's bytes reach the pool (RegisterKVResponse.memory_path)."""

    SHM = "shm"  # a memfd the client passed over the fd socket, mapped by the daemon
    CUDA_IPC = "cuda_ipc"  # GPU memory opened with CUDA IPC, copied by DMA
    PVM = "pvm"  # another process's plain memory, copied with process_vm_readv/writev
    INLINE = "inline"  # no memory registered: bytes travel in Put/Get


#: The largest part of a section sent by PutParts (kvdepot.v1.Depot): a section larger
#: than this goes in parts, so that no request of any method needs a receive limit above
#: the largest legal Lookup or job (the daemon's, server/service/bounds.py).
PUT_PART_BYTES = 4 << 20

#: The gRPC metadata key naming the caller's session on every Depot call but Session:
#: the daemon reads no request before it knows there is one (server/service/gate.py).
SESSION_METADATA = "kvdepot-session"

#: The Session call's fields, as its metadata: the daemon never reads a Session request
#: (it comes before any session, so it could be any size), only these (UTF-8 bytes;
#: the pid in decimal). A Session without them opens with empty ones (display only).
HELLO_CLIENT_METADATA = "kvdepot-client-bin"
HELLO_PID_METADATA = "kvdepot-pid"
HELLO_ENGINE_METADATA = "kvdepot-engine-bin"
#: A Session call's ticket from the fd socket (kvdepot.client.fdpass.ticket_async): the
#: session opens owned by the process the kernel named there.
TICKET_METADATA = "kvdepot-ticket"
