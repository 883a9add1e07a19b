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
- every read checks the record's header and the payload's tag (keyed with the
  directory's record key, bound to the record's offset) against what the index
  holds (kvdepot.server.disk.record): a torn, damaged, stale, foreign, moved or
  forged record is dropped and counted, and `done(False)` is all the caller sees;
- a failed write or read (ENOSPC, EIO, EROFS, the file removed) marks the tier
  down (kvdepot.server.disk.health), never raises into the caller; a probe later
  reserves the space again or creates the file anew, and the tier comes back.
  Only `open` raises: UnsafeFileError (someone else's directory or file) or
  TierBusy (another daemon has the file).
"""

from __future__ import annotations

import errno
import hmac
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from kvdepot.server.disk import record
from kvdepot.server.disk.files import TierBusy, TierFile, is_aligned
from kvdepot.server.disk.health import disk_health
from kvdepot.server.disk.io_threads import IOThreads
from kvdepot.server.disk.record import PAGE, Header
from kvdepot.server.disk.recovery import IndexRebuild, save_checkpoint
from kvdepot.server.disk.scan import ScanProgress
from kvdepot.server.disk.space import DiskSpace, Entry, OnChanges, WriteVerdict
from kvdepot.server.disk.stats import DiskStats
from kvdepot.server.disk.upkeep import SYNC_INTERVAL, FileUpkeep, pages, why
from kvdepot.server.memory.private_files import UnsafeFileError

log = logging.getLogger("kvdepot.disk")

Done = Callable[[bool], None]

CLOSE_WAIT = 5.0  # seconds close waits for I/O in flight (a frozen disk never ends it)


class DiskTier(FileUpkeep):
    def __init__(
        self,
        directory: str | os.PathLike[str],
        size: int,
        *,
        max_inflight_bytes: int = 256 << 20,
        io_threads: int = 4,
        write_thread_setup: Callable[[], None] | None = None,
        held_fleet_keys: frozenset[bytes] = frozenset(),
    ) -> None:
        """`write_thread_setup` runs first on each write thread (DiskLink lowers their
        CPU and I/O priority there: writes behind are background work).
        `held_fleet_keys`: the fleet key ids this node holds; a record of a row
        another key admitted is not brought back at open."""
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
        self._reads = IOThreads(io_threads, "kvdepot-disk-read")
        self._writes = IOThreads(
            io_threads, "kvdepot-disk-write", write_thread_setup, (SYNC_INTERVAL, self._sync)
        )
        self._unsynced = False  # records written since the last fdatasync began
        self._synced_at = time.monotonic()
        self._file: TierFile | None = None
        self._recovering = False
        self._recovered = threading.Event()
        self._probing = False
        self._stop = threading.Event()
        self._rebuild: IndexRebuild | None = None
        self._held_fleet_keys = held_fleet_keys

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
                self.health.failed(why(exc))
            self._recovered.set()
            return
        with self._lock:
            self._install(file)

    def close(self) -> None:
        """Stops the scan, waits for the I/O in flight (its callbacks run; at most
        CLOSE_WAIT seconds: a frozen or hung disk is left behind, logged), fdatasyncs
        the file and writes the index checkpoint (when the index is whole and the
        disk up and synced: the checkpoint lists only records that are on the disk)."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._rebuild is not None:
            self._rebuild.join(CLOSE_WAIT)
        with self._lock:  # the last sync, whatever a periodic one still does
            self._unsynced = self._unsynced or self.stats.written_records > 0
        self._writes.submit(self._sync)  # queued after the writes
        self._writes.shutdown()
        self._reads.shutdown()
        idle = self._writes.wait_idle(CLOSE_WAIT) and self._reads.wait_idle(CLOSE_WAIT)
        with self._lock:
            file, self._file = self._file, None
            whole = idle and file is not None and self.health.up and not self._recovering
            whole = whole and not self._unsynced
            items = self._space.ready_items()
            if file is not None:
                file.retired = True  # closed by its last user: a hung call keeps it open
                file.users += 1
        if not idle:
            log.warning(
                "disk tier %s: disk I/O still blocked after %.0f s (a frozen or hung file "
                "system): closed without it and without an index checkpoint (the next start "
                "scans the records)",
                self.directory,
                CLOSE_WAIT,
            )
        if file is None:
            return
        try:
            if whole and file.still_there():
                save_checkpoint(file, items)
        except OSError as exc:
            log.warning("disk tier: the index checkpoint was not written (%s)", why(exc))
        finally:
            with self._lock:
                self._release(file)

    def watch(self, on_changes: OnChanges) -> None:
        """From now on `on_changes(changes)` hears every record written, every one the
        index rebuild brings back (in its batches, as they become readable) and every
        one dropped (DiskSpace.watch)."""
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
            self._held_fleet_keys,
        )
        self._rebuild.start()

    # -- queries -------------------------------------------------------------------------

    def contains(self, namespace: str, key: bytes) -> bool:
        with self._lock:
            return self._space.contains(namespace, key)

    def keys_of(self, namespace: str, limit: int) -> list[bytes]:
        """The keys of a namespace's records on disk, most recently used first, at
        most `limit`."""
        with self._lock:
            return self._space.keys_of(namespace, limit)

    def touch(self, namespace: str, keys: Sequence[bytes]) -> int:
        """Makes the records of `keys` the most recently used, the first the youngest."""
        with self._lock:
            return self._space.touch(namespace, keys)

    def length_of(self, namespace: str, key: bytes) -> int | None:
        """The payload bytes of a block on disk, None when it is not there."""
        with self._lock:
            return self._space.length_of(namespace, key)

    def record_of(self, namespace: str, key: bytes) -> tuple[int, bytes] | None:
        """(payload bytes, the fleet key id that admitted the row or b"") of a block
        on disk, None when it is not there."""
        with self._lock:
            return self._space.record_of(namespace, key)

    def chunk_event_of(self, namespace: str, key: bytes) -> bytes:
        """The chunk event a block's record holds (b"": none, or not on disk)."""
        with self._lock:
            return self._space.chunk_event_of(namespace, key)

    def snapshot(self) -> dict[str, object]:
        """Counters, capacity and recovery progress (for GetStats and Prometheus)."""
        with self._lock:
            return self.stats.snapshot(self._space, self.progress, self.health, self._recovering)

    # -- writes --------------------------------------------------------------------------

    def write(
        self,
        namespace: str,
        key: bytes,
        payload: memoryview,
        done: Done | None = None,
        admitted_by: bytes = b"",
        chunk_event: bytes = b"",
    ) -> WriteVerdict:
        """Writes the block in the background unless it is there or dropped;
        `admitted_by`: the fleet key id that admitted the row (b"": this node's);
        `chunk_event`: the row's, kept in the record when it fits (record.fitting_event)."""
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
            event = record.fitting_event(namespace, key, chunk_event)
            verdict, entry = self._space.begin_write(
                namespace, key, len(payload), admitted_by, event
            )
            self._space.flush()  # the records it evicted
            if entry is None:
                return verdict
            file = self._file
            file.users += 1
        self._writes.submit(self._write, file, entry, payload, done)
        return verdict

    def _write(self, file: TierFile, entry: Entry, payload: memoryview, done: Done | None) -> None:
        digest: bytes | None = None
        failure: tuple[str, bool] | None = None  # (why, gone): the tier goes down
        try:
            if not file.still_there():
                raise FileNotFoundError(2, f"{file.path} was removed")
            header, tail = pages()
            key, offset = file.key, entry.offset
            value = key.payload_tag(entry.namespace, entry.key, offset, payload)
            made = Header(
                entry.namespace,
                entry.key,
                entry.length,
                value,
                entry.admitted_by,
                entry.chunk_event,
            )
            record.encode_header(made, header, offset, key)
            file.write_record(offset, header, payload, tail)
            digest = value
        except OSError as exc:
            # A read-only file system is let go of as a removed file is: its repair
            # (unmount, fsck, mount) needs the file closed; the probe opens it again.
            gone = isinstance(exc, FileNotFoundError) or exc.errno == errno.EROFS
            failure = (why(exc), gone)
        except Exception:
            log.exception("disk tier write of a block failed")
        with self._lock:
            self._space.finish_write(entry, digest)
            if digest is None:
                self.stats.write_errors += 1
            else:
                self.stats.written_records += 1
                self.stats.written_bytes += entry.length
                self._unsynced = True
            self._space.flush()
            self._release(file)
            sync_due = time.monotonic() - self._synced_at >= SYNC_INTERVAL
        if failure is not None:  # after the count: a tier seen down has its error counted
            self._failed(file, failure[0], gone=failure[1])
        _call(done, digest is not None)
        if sync_due:  # a busy tier's threads are never idle: sync here
            self._sync()

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
        verified = False
        failure: str | None = None  # the tier goes down
        try:
            header, tail = pages()
            if file.read_record(entry.offset, header, dest, tail):
                key, offset = file.key, entry.offset
                found = record.decode_header(header, offset, key)
                verified = found == Header(
                    entry.namespace,
                    entry.key,
                    entry.length,
                    entry.digest,  # type: ignore[arg-type]  # indexed: written, so it has one
                    entry.admitted_by,
                    entry.chunk_event,
                ) and hmac.compare_digest(
                    key.payload_tag(entry.namespace, entry.key, offset, dest), entry.digest or b""
                )
        except OSError as exc:
            failure = why(exc)
        with self._lock:
            self._space.finish_read(entry, verified)
            if verified:
                self.stats.read_records += 1
                self.stats.read_bytes += entry.length
            elif failure is not None:
                self.stats.read_errors += 1
            else:
                self.stats.rejected += 1
            self._space.flush()
            self._release(file)
        if failure is not None:  # after the count: a tier seen down has its error counted
            self._failed(file, failure)
        elif not verified:
            log.warning(
                "disk tier: the record of a block of namespace %s did not verify (torn or "
                "damaged on disk): dropped, never served",
                entry.namespace,
            )
        _call(done, verified)

    # -- the index rebuild's hand-over (its thread) ----------------------------------------

    def _adopt(self, file: TierFile, work: Callable[[DiskSpace], tuple[int, int]]) -> None:
        with self._lock:
            if file is self._file:
                kept, dropped = work(self._space)
                self.stats.recovered += kept
                self.stats.recovery_dropped += dropped
                self._space.flush()  # the batch's records, announced (DiskLink)

    def _rebuilt(self, file: TierFile, error: str | None) -> None:
        if error is not None:
            self._failed(file, error)
        with self._lock:
            recovered, dropped = self.stats.recovered, self.stats.recovery_dropped
        self._report_rebuild(recovered, dropped)
        # Announced after the report: whoever sees the rebuild complete finds its account
        # in the log (an operator's `kvdepot status`, a test reading the log).
        with self._lock:
            self._recovering = False
            self._release(file)
        self._recovered.set()

    def _report_rebuild(self, recovered: int, dropped: int) -> None:
        progress = self.progress
        log.info(
            "disk tier %s: index back (from its %s), %d records kept, %d dropped (duplicates "
            "or overlaps)",
            self.directory,
            progress.source,
            recovered,
            dropped,
        )
        if progress.old_format:
            log.warning(
                "disk tier %s: %d record headers of an older format (before version %d) were "
                "not adopted: their digests were not keyed, so anyone could have forged them; "
                "the disk is a cache, so they cost a recompute",
                self.directory,
                progress.old_format,
                record.READ_VERSIONS[0],
            )
        if progress.unheld:
            log.warning(
                "disk tier %s: %d records of rows fetched from the fleet were dropped: the "
                "fleet key that admitted them is no longer in the key file (rotated out)",
                self.directory,
                progress.unheld,
            )
        if progress.refused:
            log.warning(
                "disk tier %s: %d pages that look like record headers did not authenticate "
                "with this directory's record key and were not adopted (a client's bytes in "
                "freed space imitating a header, a damaged header, or records written under "
                "another key)",
                self.directory,
                progress.refused,
            )


def _call(done: Done | None, ok: bool) -> None:
    if done is None:
        return
    try:
        done(ok)
    except Exception:
        log.exception("a disk tier completion callback failed")
