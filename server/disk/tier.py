"""`DiskTier`: a node-local disk below the RAM pool (docs/disk-tier.md).

    tier = DiskTier(directory, size)   # nothing happens yet
    tier.open()                        # at once; the index comes back in the background
    tier.write(ns, key, view, done)    # -> WriteVerdict; done(ok) on an I/O thread
    tier.read(ns, key, dest, done)     # -> False: not on disk; else done(verified)
    tier.close()                       # writes the index checkpoint for the next open
    tier.watch(on_changes)             # records written and dropped, in order

Who calls what: `write`, `read`, `length_of`, `contains` and `snapshot` from any
thread (the daemon's event loop); they never block on the disk (a lock held for
index updates only). The bytes move on `io_threads` I/O threads; `done` runs
there and must hand its result back to its owner's thread itself. The caller
owns the memory it passes (page-aligned: a slot of the pool's mmap) and keeps it
valid, and the rows it names unchanged, until `done` is called. `done` is called
exactly once for every ACCEPTED write and every read that answered True.
`watch`'s callback runs under the tier's lock, on whichever thread changed the
records (the caller's or an I/O thread): it must only hand the list on.

Promises:
- a block is written once; writes past `max_inflight_bytes` in flight, while the
  index is rebuilt or while the disk is down are dropped and counted, never queued;
- every read checks the record's header and the payload's digest against what the
  index holds (kvdepot.server.disk.record): a torn, damaged, stale or foreign
  record is dropped and counted, and `done(False)` is all the caller sees;
- a failed write or read (ENOSPC, EIO, EROFS, the file removed) marks the tier
  down (kvdepot.server.disk.health), never raises into the caller; a probe later
  reserves the space again or creates the file anew, and the tier comes back.
  Only `open` raises: UnsafeFileError (someone else's directory or file) or
  TierBusy (another daemon has the file).
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvdepot.server.disk import record
from kvdepot.server.disk.files import TierBusy, TierFile, is_aligned, reopen
from kvdepot.server.disk.health import disk_health
from kvdepot.server.disk.record import PAGE, Header
from kvdepot.server.disk.recovery import IndexRebuild, save_checkpoint
from kvdepot.server.disk.scan import ScanProgress
from kvdepot.server.disk.space import DiskSpace, Entry, OnChanges, WriteVerdict
from kvdepot.server.disk.stats import DiskStats
from kvdepot.server.memory.private_files import UnsafeFileError

log = logging.getLogger("kvdepot.disk")

Done = Callable[[bool], None]


def _why(exc: OSError) -> str:
    return f"{exc.strerror or exc}" + (f" [{os.strerror(exc.errno)}]" if exc.errno else "")


class DiskTier:
    def __init__(
        self,
        directory: str | os.PathLike[str],
        size: int,
        *,
        max_inflight_bytes: int = 256 << 20,
        io_threads: int = 4,
    ) -> None:
        self.directory = Path(directory)
        self.size = size - size % PAGE
        self.health = disk_health(str(self.directory))
        self.stats = DiskStats()
        self.progress = ScanProgress(0)
        # The file's last page is the probe's (DiskTier._probe), never a record's.
        self._space = DiskSpace(self.size - PAGE, max_inflight_bytes)
        self._lock = threading.Lock()
        # Reads promote blocks an engine waits for: they never queue behind the
        # background writes (a write that cannot keep up is dropped by the in-flight
        # bound, never queued).
        self._reads = ThreadPoolExecutor(io_threads, thread_name_prefix="kvdepot-disk-read")
        self._writes = ThreadPoolExecutor(io_threads, thread_name_prefix="kvdepot-disk-write")
        self._file: TierFile | None = None
        self._recovering = False
        self._recovered = threading.Event()
        self._probing = False
        self._stop = threading.Event()
        self._rebuild: IndexRebuild | None = None

    # -- life ----------------------------------------------------------------------------

    def open(self) -> None:
        """Opens the file without waiting for a scan of it; raises UnsafeFileError or
        TierBusy (start-up errors), and any other failure leaves the tier down
        (logged) and retried."""
        try:
            file = TierFile.open(self.directory, self.size)
        except (UnsafeFileError, TierBusy):
            raise
        except OSError as exc:
            with self._lock:
                self.health.failed(_why(exc))
            self._recovered.set()
            return
        with self._lock:
            self._install(file)

    def close(self) -> None:
        """Stops the scan, waits for the I/O in flight (its callbacks run), writes the
        index checkpoint (when the index is whole and the disk up) and closes."""
        self._stop.set()
        if self._rebuild is not None:
            self._rebuild.join()
        self._writes.shutdown(wait=True)
        self._reads.shutdown(wait=True)
        with self._lock:
            file, self._file = self._file, None
            whole = file is not None and self.health.up and not self._recovering
            items = self._space.ready_items()
        if file is None:
            return
        try:
            if whole and file.still_there():
                save_checkpoint(file, items)
        except OSError as exc:
            log.warning("disk tier: the index checkpoint was not written (%s)", _why(exc))
        finally:
            file.close()

    def watch(self, on_changes: OnChanges) -> None:
        """From now on `on_changes(changes)` hears every record written and every one
        dropped (DiskSpace.watch; records recovered at start are not announced)."""
        with self._lock:
            self._space.watch(on_changes)

    def wait_recovered(self, timeout: float | None = None) -> bool:
        return self._recovered.wait(timeout)

    def _install(self, file: TierFile) -> None:  # under the lock
        self._file = file
        self.stats.direct_io = file.direct
        self.progress = ScanProgress(file.found_bytes - file.found_bytes % PAGE)
        if self.progress.total_bytes < PAGE:
            self.progress.source = "empty"
            self._recovered.set()
            return
        self._recovering = True
        self._recovered.clear()
        file.users += 1
        self._rebuild = IndexRebuild(
            file,
            self.progress,
            lambda work: self._adopt(file, work),
            lambda error: self._rebuilt(file, error),
            self._stop,
        )
        self._rebuild.start()

    def _release(self, file: TierFile) -> None:  # under the lock
        file.users -= 1
        if file.retired and file.users == 0:
            file.close()

    # -- queries -------------------------------------------------------------------------

    def contains(self, namespace: str, key: bytes) -> bool:
        with self._lock:
            return self._space.contains(namespace, key)

    def length_of(self, namespace: str, key: bytes) -> int | None:
        """The payload bytes of a block on disk, None when it is not there."""
        with self._lock:
            return self._space.length_of(namespace, key)

    def snapshot(self) -> dict[str, object]:
        """Counters, capacity and recovery progress (for GetStats and Prometheus)."""
        with self._lock:
            return self.stats.snapshot(self._space, self.progress, self.health, self._recovering)

    # -- writes --------------------------------------------------------------------------

    def write(
        self, namespace: str, key: bytes, payload: memoryview, done: Done | None = None
    ) -> WriteVerdict:
        """Writes the block in the background unless it is there or dropped."""
        if not is_aligned(payload):
            raise ValueError("the disk tier writes from page-aligned memory only")
        with self._lock:
            if self._file is None or not self.health.up:
                self._maybe_probe()
                self.stats.dropped_down += 1
                return WriteVerdict.TIER_DOWN
            if self._recovering:
                self.stats.dropped_recovering += 1
                return WriteVerdict.RECOVERING
            verdict, entry = self._space.begin_write(namespace, key, len(payload))
            self._space.flush()  # the records it evicted
            if entry is None:
                return verdict
            file = self._file
            file.users += 1
        self._writes.submit(self._write, file, entry, payload, done)
        return verdict

    def _write(self, file: TierFile, entry: Entry, payload: memoryview, done: Done | None) -> None:
        digest: bytes | None = None
        try:
            if not file.still_there():
                raise FileNotFoundError(2, f"{file.path} was removed")
            header, tail = _pages()
            value = record.digest(entry.namespace, entry.key, payload)
            record.encode_header(Header(entry.namespace, entry.key, entry.length, value), header)
            file.write_record(entry.offset, header, payload, tail)
            digest = value
        except OSError as exc:
            self._failed(file, _why(exc), gone=isinstance(exc, FileNotFoundError))
        except Exception:
            log.exception("disk tier write of a block failed")
        with self._lock:
            self._space.finish_write(entry, digest)
            if digest is None:
                self.stats.write_errors += 1
            else:
                self.stats.written_records += 1
                self.stats.written_bytes += entry.length
            self._space.flush()
            self._release(file)
        _call(done, digest is not None)

    # -- reads ---------------------------------------------------------------------------

    def read(self, namespace: str, key: bytes, dest: memoryview, done: Done) -> bool:
        """Reads the block into dest[:length] in the background; False: not on disk
        (or the tier is down), and `done` is not called."""
        if not is_aligned(dest):
            raise ValueError("the disk tier reads into page-aligned memory only")
        with self._lock:
            if self._file is None or not self.health.up:
                self.stats.read_misses += 1
                return False
            entry = self._space.begin_read(namespace, key)
            if entry is None:
                self.stats.read_misses += 1
                return False
            if len(dest) < entry.length:
                self._space.finish_read(entry, True)
                raise ValueError(f"{len(dest)} bytes cannot hold a {entry.length}-byte block")
            file = self._file
            file.users += 1
        self._reads.submit(self._read, file, entry, dest[: entry.length], done)
        return True

    def _read(self, file: TierFile, entry: Entry, dest: memoryview, done: Done) -> None:
        verified = failed = False
        try:
            header, tail = _pages()
            if file.read_record(entry.offset, header, dest, tail):
                found = record.decode_header(header)
                verified = (
                    found == Header(entry.namespace, entry.key, entry.length, entry.digest)
                    and record.digest(entry.namespace, entry.key, dest) == entry.digest
                )
        except OSError as exc:
            failed = True
            self._failed(file, _why(exc))
        with self._lock:
            self._space.finish_read(entry, verified)
            if verified:
                self.stats.read_records += 1
                self.stats.read_bytes += entry.length
            elif failed:
                self.stats.read_errors += 1
            else:
                self.stats.rejected += 1
            self._space.flush()
            self._release(file)
        if not verified and not failed:
            log.warning(
                "disk tier: the record of a block of namespace %s did not verify (torn or "
                "damaged on disk): dropped, never served",
                entry.namespace,
            )
        _call(done, verified)

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
            new, failure = reopen(old, self.directory, self.size, _pages()[0]), ""
        except (OSError, ValueError) as exc:
            new, failure = None, _why(exc) if isinstance(exc, OSError) else str(exc)
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

    # -- the index rebuild's hand-over (its thread) ----------------------------------------

    def _adopt(self, file: TierFile, work: Callable[[DiskSpace], tuple[int, int]]) -> None:
        with self._lock:
            if file is self._file:
                kept, dropped = work(self._space)
                self.stats.recovered += kept
                self.stats.recovery_dropped += dropped

    def _rebuilt(self, file: TierFile, error: str | None) -> None:
        if error is not None:
            self._failed(file, error)
        with self._lock:
            self._recovering = False
            self._release(file)
            recovered, dropped = self.stats.recovered, self.stats.recovery_dropped
        self._recovered.set()
        log.info(
            "disk tier %s: index back (from its %s), %d records kept, %d dropped (duplicates "
            "or overlaps)",
            self.directory,
            self.progress.source,
            recovered,
            dropped,
        )


_scratch = threading.local()


def _pages() -> tuple[memoryview, memoryview]:
    """This I/O thread's header and tail pages (page-aligned, reused)."""
    pages = getattr(_scratch, "pages", None)
    if pages is None:
        pages = _scratch.pages = memoryview(mmap.mmap(-1, 2 * PAGE))
    return pages[:PAGE], pages[PAGE:]


def _call(done: Done | None, ok: bool) -> None:
    if done is None:
        return
    try:
        done(ok)
    except Exception:
        log.exception("a disk tier completion callback failed")
