"""The daemon's process-wide limits: open files (RLIMIT_NOFILE) and mappings
(vm.max_map_count).

Every shared-memory registration holds one fd (Python's mmap keeps a duplicate of
the file's fd) and one mapping per region, and every fd in flight on the fd socket
holds one more. Without headroom one client could take the last fd, after which
the kernel silently drops the fds other engines attach (they saw "got 0 fds") and
the daemon cannot even accept a connection. `Headroom` keeps the last `reserve`
fds and mappings for everything else, and refuses new fds and registrations
before them with a message that names the limit.

Contract: `check_fds(n)` / `check_mappings(n)` raise `ResourceLow` (a
RuntimeError whose text says which limit, the figures and what to do) when
taking `n` more would eat into the reserve; they never allocate fds themselves.
"""

from __future__ import annotations

import logging
import os
import resource

log = logging.getLogger("kvdepot.resources")

MAP_COUNT_FILE = "/proc/sys/vm/max_map_count"
# Mappings kept for the interpreter, gRPC's threads and malloc arenas.
MAPPINGS_RESERVE = 1024


class ResourceLow(RuntimeError):
    """Taking more fds or mappings would eat into the reserve."""


def raise_nofile_limit() -> tuple[int, int]:
    """Raises the soft RLIMIT_NOFILE to the hard limit; returns (soft, hard) after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:  # a container may forbid it
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, hard, exc)
    return soft, hard


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd")) - 1  # less the listing's own fd


def max_map_count() -> int | None:
    try:
        with open(MAP_COUNT_FILE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def mappings() -> int:
    with open("/proc/self/maps", "rb") as f:
        return sum(1 for _ in f)


class Headroom:
    """Refuses new fds and mappings before the process runs out (see the module)."""

    def __init__(self, fd_reserve: int) -> None:
        self.fd_reserve = fd_reserve
        self.nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self.max_maps = max_map_count()

    @property
    def fds_per_client(self) -> int | None:
        """Fds one session may hold: half of those above the reserve, so that one
        greedy engine can never lock the others out (None: no limit)."""
        if self.nofile == resource.RLIM_INFINITY:
            return None
        return max(1, (self.nofile - self.fd_reserve) // 2)

    def check_fds(self, wanted: int, what: str) -> None:
        if self.nofile == resource.RLIM_INFINITY:
            return
        used = open_fds()
        if used + wanted + self.fd_reserve > self.nofile:
            raise ResourceLow(
                f"cannot take {what}: the daemon has {used} of its {self.nofile} open files "
                f"(RLIMIT_NOFILE) in use and keeps the last {self.fd_reserve} free "
                f"(--fd-reserve): unregister what is no longer needed, or raise LimitNOFILE "
                f"/ ulimit -n for the daemon"
            )

    def check_mappings(self, wanted: int, what: str) -> None:
        if self.max_maps is None:
            return
        used = mappings()
        if used + wanted + MAPPINGS_RESERVE > self.max_maps:
            raise ResourceLow(
                f"cannot map {what}: the daemon has {used} memory mappings and the kernel "
                f"allows {self.max_maps} (vm.max_map_count; {MAPPINGS_RESERVE} kept free): "
                f"unregister what is no longer needed, or raise vm.max_map_count with sysctl"
            )
