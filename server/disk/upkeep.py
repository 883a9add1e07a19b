"""`FileUpkeep`: the disk tier's file kept in order (DiskTier's base, kvdepot.server.disk.tier).

- its users: every I/O call holds the file (`users`); a retired file (removed,
  replaced, closed) is closed by its last user, so a call stuck on a hung disk
  never has its descriptor closed under it;
- its failures: a failed call marks the tier down (kvdepot.server.disk.health);
  a removed file retires with its index;
- its probes: while down, a write lets one probe through after the back-off (on
  a write thread): the space reserved again or the file created anew, then a page
  written and read back; success brings the tier up;
- its durability: `_sync` fdatasyncs the file when records were written since the
  last one began (on the write threads: one idle for SYNC_INTERVAL, one that wrote
  that long after the last sync, and the tier's close before its checkpoint).

Everything here runs under or takes the tier's lock, as DiskTier's own methods do;
the attributes are DiskTier's.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from pathlib import Path

from kvdepot.server.disk.files import TierFile, reopen
from kvdepot.server.disk.io_threads import IOThreads
from kvdepot.server.disk.record import PAGE
from kvdepot.server.disk.space import DiskSpace
from kvdepot.server.disk.stats import DiskStats
from kvdepot.server.tier_health import TierHealth

log = logging.getLogger("kvdepot.disk")

SYNC_INTERVAL = 5.0  # seconds: records written are fdatasync'd at most about this late


def why(exc: OSError) -> str:
    return f"{exc.strerror or exc}" + (f" [{os.strerror(exc.errno)}]" if exc.errno else "")


class FileUpkeep:
    directory: Path
    size: int
    health: TierHealth
    stats: DiskStats
    _lock: threading.Lock
    _file: TierFile | None
    _space: DiskSpace
    _writes: IOThreads
    _stop: threading.Event
    _probing: bool
    _unsynced: bool  # records written since the last fdatasync began
    _synced_at: float

    def _install(self, file: TierFile) -> None:  # under the lock
        raise NotImplementedError

    def _release(self, file: TierFile) -> None:  # under the lock
        file.users -= 1
        if file.retired and file.users == 0:
            file.close()

    # -- failures and probes ---------------------------------------------------------------

    def _failed(self, file: TierFile, why: str, *, gone: bool = False) -> None:
        with self._lock:
            if file is not self._file:
                return  # a late failure of a file already replaced
            self.health.failed(why)
            if gone:
                self._retire()
                self._space.flush()

    def _retire(self) -> None:  # under the lock: the file is gone, so is its index
        if self._file is not None:
            self._file.retired = True
            self._file.users += 1
            self._release(self._file)
            self._file = None
        self._space.clear()

    def _maybe_probe(self) -> None:  # under the lock
        if not self._probing and self.health.probe_due() and not self._stop.is_set():
            self._probing = True
            self._writes.submit(self._probe)

    def _probe(self) -> None:
        with self._lock:
            old = self._file
            if old is not None:
                old.users += 1
        try:
            new, failure = reopen(old, self.directory, self.size, pages()[0]), ""
        except (OSError, ValueError) as exc:
            new, failure = None, why(exc) if isinstance(exc, OSError) else str(exc)
        with self._lock:
            self._probing = False
            if old is not None:
                self._release(old)
            if failure:
                self.health.failed(failure)
                return
            if new is not None:
                self._retire()
                self._space.flush()
                self._install(new)
            self.health.succeeded()

    def _sync(self) -> None:
        """fdatasync(2) of the file when records were written since the last one began
        (a write thread: one idle for SYNC_INTERVAL, one that wrote that long after
        the last sync, and close's last one). A power cut loses at most what was
        written since, and a record lost or torn then is never served (every read
        verifies); without it a drive's volatile cache could lose records a
        checkpoint lists."""
        with self._lock:
            file = self._file
            if file is None or not self._unsynced or not self.health.up:
                return
            self._unsynced = False
            self._synced_at = time.monotonic()
            file.users += 1
        try:
            file.sync()
        except OSError as exc:
            with self._lock:
                self._unsynced = True
                # Records written since the last sync may not be on disk: a write error,
                # counted before the tier is seen down.
                self.stats.write_errors += 1
            self._failed(file, why(exc))
        else:
            with self._lock:
                self.stats.syncs += 1
        finally:
            with self._lock:
                self._release(file)


_scratch = threading.local()


def pages() -> tuple[memoryview, memoryview]:
    """This I/O thread's header and tail pages (page-aligned, reused)."""
    pages = getattr(_scratch, "pages", None)
    if pages is None:
        pages = _scratch.pages = memoryview(mmap.mmap(-1, 2 * PAGE))
    return pages[:PAGE], pages[PAGE:]
