"""Turning the CUDA data path on in a daemon, when the host has a driver and a device.

    enable_cuda(state, arena)                      # before the arena's warm-up starts
    arena.start_warmup(...)                        # page-locks each chunk it faults

`enable_cuda` adds the "cuda_ipc" memory path to the state (a `CudaPath`, through
`state.add_memory_path`, as every memory path plugs in: kvdepot.server.memory.paths),
hooks page-locking into the arena's warm-up (`arena.add_warmup_hook`) and its
cleanup into the arena's close (`arena.on_close`), and says in the log what it
did. On a host without CUDA it logs why and returns False: the daemon stays on the
shared-memory (CPU) path, and a cuda_ipc registration is refused with a message
that says so.

Who may register: `CudaPath.open` maps a handle only for the session's owner and
only on a GPU that process uses (its device node, sent or held open:
kvdepot.server.cuda.senders), before the driver sees the handle.

Which devices are served: every device this process sees, or those named in
KVDEPOT_CUDA_DEVICES (comma-separated UUIDs or ordinals; "none" turns CUDA off).
A CUDA context is created only on a served device: on the first one at start-up
(it page-locks the pool), on the others when a worker on them registers.

Shutdown: the arena's close hook unregisters the pool's chunks and destroys the
copy streams before the arena is unmapped (DepotState.close closes the copy
threads and every region first, so no copy runs by then).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from kvdepot.common import cuda_driver
from kvdepot.common.cuda_handles import HandleError, format_uuid, parse_uuid
from kvdepot.common.kinds import MemoryPath
from kvdepot.server import errors
from kvdepot.server.cuda.pinning import PoolPinner
from kvdepot.server.cuda.senders import GpuUnknown, SenderGpus, SenderRefused
from kvdepot.server.memory.paths import MemoryPaths, PassedFds
from kvdepot.server.peer import Peer
from kvdepot.server.sizes import format_size

if TYPE_CHECKING:  # annotations only: this module loads with the standard library alone
    from kvdepot.server.cuda.dma import CudaCopyEngine
    from kvdepot.server.cuda.ipc_region import ServedDevice
    from kvdepot.server.memory.arena import Arena
    from kvdepot.server.memory.copy_engine import CopyEngine
    from kvdepot.server.memory.regions import MappedRegion

log = logging.getLogger("kvdepot.cuda")

DEVICES_ENV = "KVDEPOT_CUDA_DEVICES"
FOLLOW_CHUNK_BYTES = 256 << 20  # page-locking pieces when following a running warm-up


class OwnedSession(Protocol):
    @property
    def owner(self) -> Peer | None: ...


class CudaHost(MemoryPaths, PassedFds, Protocol):
    """What the CUDA path needs of the state (DepotState): a place to plug in, each
    session's owner (the process the fd socket named), the fd socket's fds (a
    sender's GPU device node) and counted refusals."""

    def session(self, session_id: str) -> OwnedSession: ...


class CudaPath:
    """The CUDA IPC memory path of one daemon (a kvdepot.server.memory.paths
    MemoryPathPlugin): its copy engine and the pool's page-locking."""

    kind = MemoryPath.CUDA_IPC

    def __init__(
        self, engine: CudaCopyEngine, pinner: PoolPinner, host: CudaHost, senders: SenderGpus
    ) -> None:
        self.engine = engine
        self.pinner = pinner
        self.host = host
        self.senders = senders

    def open(self, handle: object, session_id: str) -> tuple[MappedRegion, CopyEngine]:
        """`handle`: RegisterKV's CudaIpcHandle. Mapped only for the session's owner,
        and only on a GPU that process holds open (kvdepot.server.cuda.senders):
        PERMISSION_DENIED, counted and logged, otherwise."""
        owner = self.host.session(session_id).owner
        token = getattr(handle, "gpu_token", "")

        def admit(dev: ServedDevice) -> None:
            node = self.host.claim_passed(token, session_id) if token else None
            try:
                self.senders.check(
                    owner, dev.info.pci_bus_id, dev.uuid, node.fd if node is not None else None
                )
            except SenderRefused as exc:
                raise self.host.deny(f"cuda_ipc: {exc}", owner or "unattested") from None
            except GpuUnknown as exc:
                raise errors.precondition(f"cuda_ipc: {exc}") from None
            finally:
                if node is not None:
                    os.close(node.fd)

        return self.engine.open_region(handle, admit)

    def page_locking_fields(self) -> dict[str, object]:
        """GetStats' page-locking fields (admin.proto: page_locking and after)."""
        return {
            "page_locking": True,
            "page_locked_bytes": self.pinner.pinned_bytes,
            "page_locking_error": self.pinner.failed or "",
        }

    def close(self) -> None:
        # Unregister while the mapping still exists (an arena close hook).
        self.pinner.close()
        self.engine.close()


def cuda_path(state: MemoryPaths) -> CudaPath | None:
    """The CUDA path serving `state`, or None when CUDA is off (tests, stats)."""
    path = state.memory_path(MemoryPath.CUDA_IPC)
    return path if isinstance(path, CudaPath) else None


def select_devices(devices: Sequence[Any], spec: str | None) -> list[Any]:
    """The devices to serve: all of `devices` for an empty spec or "all"; none for "none".

    Otherwise `spec` lists UUIDs ("GPU-…", any case, dashes optional) or ordinals,
    comma-separated. Raises ValueError naming an entry that matches no device.
    """
    text = (spec or "").strip()
    if text.lower() in ("", "all"):
        return list(devices)
    if text.lower() in ("none", "off"):
        return []
    chosen: list[Any] = []
    for item in (i.strip() for i in text.split(",")):
        if not item:
            continue
        if item.isdigit():
            match = [d for d in devices if d.ordinal == int(item)]
        else:
            try:
                raw = parse_uuid(item)
            except HandleError:
                raise ValueError(
                    f"{DEVICES_ENV}: {item!r} is neither a device UUID nor an ordinal"
                ) from None
            match = [d for d in devices if d.uuid == raw]
        if not match:
            seen = ", ".join(f"{d.ordinal}={format_uuid(d.uuid)}" for d in devices) or "none"
            raise ValueError(f"{DEVICES_ENV}: no visible device matches {item!r} (visible: {seen})")
        for d in match:
            if d not in chosen:
                chosen.append(d)
    return chosen


def enable_cuda(
    state: CudaHost,
    arena: Arena,
    *,
    driver: Any = None,
    env: dict[str, str] | None = None,
    max_batch: int | None = None,
    senders: SenderGpus | None = None,
) -> bool:
    """Serves cuda_ipc registrations and page-locks the pool when CUDA is usable.

    Returns True when CUDA is on. Never raises: a host without CUDA, or a driver
    error, is logged and leaves the daemon on the CPU path (returns False).
    `driver`, `env` and `senders` are for tests (a fake driver; a fixed
    environment; the sender check over a fake driver tree).
    """
    from kvdepot.server.cuda.dma import DEFAULT_MAX_BATCH, CudaCopyEngine
    from kvdepot.server.cuda.pinning import PoolPinner

    env = dict(os.environ) if env is None else env
    if cuda_path(state) is not None:
        log.info("CUDA is on already for this pool")
        return True
    try:
        if driver is None:
            reason = cuda_driver.unavailable_reason()
            if reason is not None:
                log.info("CUDA is off: %s. Serving shared-memory (CPU) registrations only", reason)
                return False
            driver = cuda_driver.load()
        visible = driver.devices()
        try:
            served = select_devices(visible, env.get(DEVICES_ENV))
        except ValueError as exc:
            log.error("CUDA is off: %s", exc)
            return False
        if not served:
            log.info(
                "CUDA is off: %s=%s. Serving shared-memory (CPU) registrations only",
                DEVICES_ENV,
                env.get(DEVICES_ENV),
            )
            return False
        engine = CudaCopyEngine(driver, served, max_batch=max_batch or DEFAULT_MAX_BATCH)
        first = engine.devices[served[0].uuid]
        pinner = PoolPinner(driver, first, arena.address, arena.size)
        engine.host_split_source = lambda: pinner.split_bytes
        first.make_current()  # creates the context that page-locks the pool, now
    except Exception as exc:
        log.warning(
            "CUDA is off: setting it up failed (%s). Serving shared-memory (CPU) "
            "registrations only",
            exc,
        )
        return False

    path = CudaPath(engine, pinner, state, senders or SenderGpus())
    state.add_memory_path(path)
    arena.on_close(path.close)
    if arena.warmup_started:
        # The warm-up started before we were enabled, so the hook would miss chunks:
        # page-lock what is faulted already, then follow it.
        _follow_warmup(arena, pinner)
    else:
        arena.add_warmup_hook(pinner.after_chunk)
    version = driver.version() if hasattr(driver, "version") else 0
    log.info(
        "CUDA is on (driver %d.%d): serving cuda_ipc registrations on %d device(s): %s; "
        "copies by %s (one 2-D copy per block where the layers lie at a constant "
        "stride), on a stream per worker and direction, issued %s; the %s pool is "
        "page-locked in the background (cuMemHostRegister, from %s's context)",
        version // 1000,
        (version % 1000) // 10,
        len(served),
        ", ".join(f"{format_uuid(d.uuid)} ({d.name})" for d in served),
        "cuMemcpyBatchAsync batches" if engine.use_batch else "one cuMemcpyAsync per run",
        "by the compiled issuer (the GIL given up once per job)"
        if engine.issuer == "compiled"
        else "from Python (kvdepot.server.cuda._dma was not built)",
        format_size(arena.size),
        first.uuid,
    )
    return True


def _follow_warmup(arena: Arena, pinner: PoolPinner, chunk: int = FOLLOW_CHUNK_BYTES) -> None:
    """Page-locks the arena in `chunk`-sized pieces as its warm-up passes them."""

    def run() -> None:
        done = 0
        while not pinner.closed and pinner.failed is None and done < arena.size:
            ready = arena.size if arena.warmup_complete else arena.warmup_done_bytes
            if ready - done < chunk and ready < arena.size:
                time.sleep(0.05)
                continue
            n = min(chunk, arena.size - done)
            pinner.after_chunk(done, n)
            done += n

    threading.Thread(target=run, name="kvdepot-pin", daemon=True).start()
