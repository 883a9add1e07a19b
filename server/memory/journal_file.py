"""The crash journal beside the pool file, and crash recovery from it.

Records and replay are in kvdepot.server.core.journal. Here:

- `Journal` appends a record for each READY and each removal, from the event
  bus's listener, so the record is written (write(2) to the file: on tmpfs that
  is the page cache, which survives the process) before a Watch stream, a job's
  result or a Lookup can tell anyone of the change. Checksums are computed on
  one background thread after a row turns READY, with the row held against
  eviction meanwhile (BlockIndex.begin_read); past SEAL_BACKLOG_BYTES waiting, a
  row goes unsealed (counted): a crash right then costs that row, never
  correctness. The file is compacted at start, at clean shutdown, and when it
  grows past COMPACT_FACTOR times its live size (in slices, on the event loop,
  with new records written to both files meanwhile).
- `Recovery` re-creates the rows of a daemon that was killed: every live row
  with a checksum is claimed in the allocator at start (invisible), then a
  thread reads each row from the pool and checks it; rows that match become
  READY and are announced like stores, the rest are freed and counted. The
  daemon serves from the start; GetStats shows the progress.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import zlib
from collections import deque
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kvdepot.server.core import journal as rec
from kvdepot.server.core.allocator import Extent, OutOfSpace
from kvdepot.server.core.index import BlockIndex, IndexEvent, Slot
from kvdepot.server.core.journal import JournalError, JournalState, Row
from kvdepot.server.core.kinds import EventKind
from kvdepot.server.core.layout import LayoutError
from kvdepot.server.memory import private_files
from kvdepot.server.memory.arena import Arena

log = logging.getLogger("kvdepot.journal")

SEAL_BACKLOG_BYTES = 256 << 20  # rows waiting for their checksum, at most
COMPACT_FACTOR = 4  # compact when the file is this many times its live records
COMPACT_MIN_BYTES = 16 << 20
COMPACT_SLICE = 5000  # records written per event-loop turn while compacting
_RECORD_GUESS = 96  # bytes of one READY record with its key, for the growth rule


def journal_path(pool_file: str) -> str:
    return pool_file + rec.SUFFIX


def read(pool_file: str) -> tuple[JournalState | None, str]:
    """The journal beside `pool_file` replayed, or (None, why not)."""
    path = journal_path(pool_file)
    try:
        data = private_files.read_private(path, "the journal")
    except FileNotFoundError:
        return None, f"no journal at {path}"
    except private_files.UnsafeFileError:
        raise  # someone else's file or a symlink: refused, not read (exit 2)
    except OSError as exc:
        return None, f"cannot read the journal {path}: {exc}"
    try:
        state = rec.replay(data)
    except JournalError as exc:
        return None, f"the journal {path} is unusable: {exc}"
    except Exception as exc:  # a replay bug must not become a restart loop
        log.exception("replaying the journal %s failed", path)
        return None, f"the journal {path} could not be replayed: {exc!r}"
    if state.stopped:
        log.warning(
            "the journal %s is damaged after %d record(s) (%d byte(s) ignored): %s; "
            "recovering only what comes before",
            path,
            state.records,
            state.torn_bytes,
            state.stopped,
        )
    return state, ""


def row_bytes(index: BlockIndex, namespace_id: str, key: bytes) -> int:
    """Bytes of the row the checksum covers (the layout's, not the extent's)."""
    lay = index.namespaces[namespace_id].layout
    return lay.slot_bytes(lay.key_group(key))


def row_crc(arena: Arena, offset: int, nbytes: int) -> int:
    view = arena.view(offset, nbytes)
    try:
        return zlib.crc32(view)  # releases the GIL for large buffers
    finally:
        view.release()


class Journal:
    """Appends records for the index's changes; seals rows; compacts itself."""

    def __init__(self, pool_file: str, index: BlockIndex, arena: Arena, boot_id: str) -> None:
        self.path = journal_path(pool_file)
        self.index = index
        self.arena = arena
        self.boot_id = boot_id
        self.live: dict[tuple[str, bytes], Row] = {}
        self._ns: dict[str, int] = {}
        self._next_ns = 0  # numbers are never reused (see drop_namespace)
        self._fd = -1
        self._mirror: int | None = None  # the compacted file being written, if any
        self._bytes = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._to_seal: deque[tuple[str, bytes]] = deque()
        self._seal_scheduled = False
        self._sealer = ThreadPoolExecutor(1, thread_name_prefix="kvdepot-seal")
        self.seal_backlog = 0  # bytes of rows being checksummed
        self.unsealed = 0  # rows left without a checksum (backlog full)
        self._compacting = False
        self._closed = False

    # -- writing -----------------------------------------------------------------------

    def start(self, rows: Iterable[tuple[str, bytes, Row]]) -> None:
        """Writes a fresh journal listing the index's layouts and `rows` (oldest
        first) and replaces the old one; appends go to it from now on."""
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        for ident, row in ((r[:2], r[2]) for r in rows):
            self.live[ident] = row
        tmp, fd = self._write_compacted()
        try:
            os.replace(tmp, self.path)
        except OSError:
            os.close(fd)
            os.unlink(tmp)
            raise
        self._fd = fd

    def _write_compacted(self) -> tuple[str, int]:
        """The whole journal from `live`, in a temporary file: (path, fd)."""
        tmp = f"{self.path}.{os.getpid()}.tmp"
        fd = _create(tmp)
        parts = [rec.header(self.arena.size, self.index.allocator.granularity, self.boot_id)]
        parts += self._layout_records()
        for (ns, key), row in self.live.items():
            parts.append(rec.listed(self._ns[ns], key, row))
        data = b"".join(parts)
        _write_all(fd, data)
        self._bytes = len(data)
        return tmp, fd

    def _layout_records(self) -> list[bytes]:
        out = []
        for ns_id, ns in self.index.namespaces.items():
            if ns_id not in self._ns:
                self._ns[ns_id] = self._new_ns_number()
            out.append(rec.layout(self._ns[ns_id], ns.layout))
        return out

    def _append(self, data: bytes) -> None:
        if self._fd < 0:
            return
        _write_all(self._fd, data)
        if self._mirror is not None:
            _write_all(self._mirror, data)
        self._bytes += len(data)

    def _ns_index(self, namespace_id: str) -> int:
        i = self._ns.get(namespace_id)
        if i is None:
            i = self._ns[namespace_id] = self._new_ns_number()
            self._append(rec.layout(i, self.index.namespaces[namespace_id].layout))
        return i

    def on_event(self, event: IndexEvent) -> None:
        """The event bus listener: runs while the index changes, before anyone can
        hear of it. Only writes and queues; never changes the index."""
        ns = self.index.namespaces.get(event.namespace)
        if ns is None or self._fd < 0:
            return
        if event.kind is EventKind.STORED:
            for key in event.keys:
                slot = ns.slots.get(key)
                if slot is None or slot.admitted_by:
                    # A row a fleet key admitted is not kept past a restart (fetched
                    # again, it is checked under the keys held then): never listed,
                    # so never recovered (and its removal needs no FREED record).
                    continue
                ident = (event.namespace, key)
                known = self.live.get(ident)
                if known is not None and known.offset == slot.extent.offset:
                    continue  # a recovered row being announced: listed already
                i = self._ns_index(event.namespace)
                row = Row(slot.extent.offset, slot.extent.size, chunk_event=slot.chunk_event)
                self._append(rec.listed(i, key, row))
                self.live.pop(ident, None)
                self.live[ident] = row
                self._to_seal.append(ident)
            self._schedule_seal()
        else:
            for key in event.keys:
                if self.live.pop((event.namespace, key), None) is not None:
                    self._append(rec.freed(self._ns[event.namespace], key))

    def _new_ns_number(self) -> int:
        self._next_ns += 1
        return self._next_ns - 1

    def drop_namespace(self, namespace_id: str) -> None:
        """The index forgot a namespace that holds no rows: compactions no longer
        write its layout, and a later declaration gets a new number."""
        self._ns.pop(namespace_id, None)

    def forget(self, namespace_id: str, key: bytes, offset: int) -> None:
        """A listed row is gone without an index event (failed recovery)."""
        row = self.live.get((namespace_id, key))
        if row is not None and row.offset == offset:
            del self.live[(namespace_id, key)]
            self._append(rec.freed(self._ns[namespace_id], key))

    # -- checksums ---------------------------------------------------------------------

    def seal(self, idents: Iterable[tuple[str, bytes]]) -> None:
        """Computes checksums for listed rows that have none (after a warm restart)."""
        self._to_seal.extend(idents)
        self._schedule_seal()

    def _schedule_seal(self) -> None:
        if self._to_seal and not self._seal_scheduled and self._loop is not None:
            self._seal_scheduled = True
            self._loop.call_soon(self._start_seals)

    def _start_seals(self) -> None:
        """On the loop, a turn after the stores: hold the queued rows against
        eviction and hash them on the seal thread, one batch per turn."""
        self._seal_scheduled = False
        batch: list[tuple[Slot, int]] = []
        while self._to_seal and not self._closed:
            ns_id, key = self._to_seal.popleft()
            row = self.live.get((ns_id, key))
            if row is None or row.crc is not None:
                continue
            slot = self.index.begin_read(ns_id, key)
            if slot is None:
                continue
            if slot.extent.offset != row.offset:
                self.index.end_read(slot)
                continue
            nbytes = row_bytes(self.index, ns_id, key)
            if self.seal_backlog + nbytes > SEAL_BACKLOG_BYTES:
                self.index.end_read(slot)
                self.unsealed += 1
                continue
            self.seal_backlog += nbytes
            batch.append((slot, nbytes))
        if not batch:
            return
        arena, loop = self.arena, self._loop
        assert loop is not None

        def work() -> None:
            crcs: list[int | None] = []
            for slot, nbytes in batch:
                try:
                    crcs.append(row_crc(arena, slot.extent.offset, nbytes))
                except (ValueError, BufferError):  # the pool closed under it (shutdown)
                    crcs.append(None)
            loop.call_soon_threadsafe(self._sealed, batch, crcs)

        self._sealer.submit(work)

    def _sealed(self, batch: list[tuple[Slot, int]], crcs: list[int | None]) -> None:
        """On the loop: the checksums are recorded, the rows released."""
        records = []
        for (slot, nbytes), crc in zip(batch, crcs, strict=True):
            self.seal_backlog -= nbytes
            row = self.live.get((slot.namespace, slot.key))
            if crc is not None and row is not None and row.offset == slot.extent.offset:
                row.crc = crc
                records.append(rec.checksum(self._ns[slot.namespace], slot.key, crc))
            self.index.end_read(slot)
        if records:
            self._append(b"".join(records))  # one write for the batch

    # -- compaction --------------------------------------------------------------------

    def wants_compaction(self) -> bool:
        live = max(len(self.live), 1) * _RECORD_GUESS
        return (
            not self._compacting
            and self._bytes > COMPACT_MIN_BYTES
            and self._bytes > COMPACT_FACTOR * live
        )

    async def compact(self) -> None:
        """Rewrites the journal from the live rows without holding the loop: new
        records go to both files while the old rows are copied in slices."""
        if self._compacting or self._fd < 0:
            return
        self._compacting = True
        tmp = f"{self.path}.{os.getpid()}.tmp"
        before = self._bytes
        try:
            fd = _create(tmp)
            head = [rec.header(self.arena.size, self.index.allocator.granularity, self.boot_id)]
            head += [
                rec.layout(i, self.index.namespaces[ns_id].layout) for ns_id, i in self._ns.items()
            ]
            _write_all(fd, b"".join(head))
            self._mirror = fd
            idents = list(self.live)
            written = 0
            for start in range(0, len(idents), COMPACT_SLICE):
                parts = []
                for ident in idents[start : start + COMPACT_SLICE]:
                    row = self.live.get(ident)
                    if row is not None:
                        parts.append(rec.listed(self._ns[ident[0]], ident[1], row))
                data = b"".join(parts)
                _write_all(fd, data)
                written += len(data)
                await asyncio.sleep(0)
                if self._closed:
                    raise OSError("closed while compacting")
            os.replace(tmp, self.path)
            old, self._fd, self._mirror = self._fd, fd, None
            os.close(old)
            self._bytes = os.fstat(fd).st_size
            log.info("journal compacted: %d to %d bytes", before, self._bytes)
        except OSError as exc:
            if self._mirror is not None:
                os.close(self._mirror)
                self._mirror = None
            log.warning("journal compaction failed: %s", exc)
        finally:
            self._compacting = False

    def close(self) -> None:
        """Stops the checksums and closes the file (call before the pool is
        unmapped); `rewrite` may still follow."""
        self._closed = True
        self._sealer.shutdown(wait=True)
        for fd in (self._fd, self._mirror):
            if fd is not None and fd >= 0:
                os.close(fd)
        self._fd, self._mirror = -1, None

    def rewrite(self) -> None:
        """A clean shutdown's compaction, after the last copy: the live rows in
        one short file, so the next start finds every checksum there."""
        try:
            tmp, fd = self._write_compacted()
            os.close(fd)
            os.replace(tmp, self.path)
        except (OSError, JournalError) as exc:
            log.error("could not compact the journal %s: %s", self.path, exc)


@dataclass
class RecoveryProgress:
    total: int = 0
    verified: int = 0
    rejected: int = 0
    complete: bool = True
    reasons: dict[str, int] = field(default_factory=dict)


class Recovery:
    """Verifies the rows of a crashed daemon's journal and makes them READY."""

    BATCH = 256  # rows per hand-over to the event loop

    def __init__(
        self,
        index: BlockIndex,
        arena: Arena,
        journal: Journal,
        rows: list[tuple[str, bytes, Extent, int, bytes]],  # ns, key, extent, crc, event
        progress: RecoveryProgress,
    ) -> None:
        self.index = index
        self.arena = arena
        self.journal = journal
        self.rows = rows
        self.progress = progress
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_log = 0.0

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._thread = threading.Thread(
            target=self._run, args=(loop,), name="kvdepot-recovery", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        batch: list[tuple[str, bytes, Extent, bytes, bool]] = []
        for ns_id, key, extent, crc, event in self.rows:
            if self._stop.is_set():
                return
            ok = row_crc(self.arena, extent.offset, row_bytes(self.index, ns_id, key)) == crc
            batch.append((ns_id, key, extent, event, ok))
            if len(batch) >= self.BATCH:
                loop.call_soon_threadsafe(self._settle, batch)
                batch = []
        loop.call_soon_threadsafe(self._settle, batch, True)

    def _settle(
        self, batch: list[tuple[str, bytes, Extent, bytes, bool]], last: bool = False
    ) -> None:
        """On the loop: verified rows become READY (announced, with their chunk
        events), the others go."""
        p = self.progress
        for ns_id, key, extent, event, ok in batch:
            if ok and self.index.adopt_recovered(ns_id, key, extent, event) is not None:
                p.verified += 1
                continue
            if ok:  # stored again by an engine while it was being verified
                reason = "stored again"
            else:
                self.index.drop_recovering(extent)
                reason = "checksum mismatch"
                log.warning(
                    "crash recovery: block %s… of namespace %s at offset %d does not match "
                    "its checksum: dropped",
                    key.hex()[:16],
                    ns_id,
                    extent.offset,
                )
            self.journal.forget(ns_id, key, extent.offset)
            p.rejected += 1
            p.reasons[reason] = p.reasons.get(reason, 0) + 1
        now = time.monotonic()
        if last or now - self._last_log > 1.0:
            self._last_log = now
            log.info(
                "crash recovery: %d of %d block(s) checked, %d served, %d rejected",
                p.verified + p.rejected,
                p.total,
                p.verified,
                p.rejected,
            )
        if last:
            p.complete = True


def begin_recovery(
    index: BlockIndex, old: JournalState, progress: RecoveryProgress
) -> tuple[list[tuple[str, bytes, Extent, int, bytes]], list[tuple[str, bytes, Row]]]:
    """Declares the old journal's namespaces and claims the extents of its rows
    that carry a checksum (invisible until verified). Returns (rows to verify, with
    their checksums and chunk events; rows for the fresh journal). Rows without a
    checksum, or whose extent is not free, are dropped and counted."""
    for lay in old.layouts.values():
        try:
            index.declare_namespace(lay)
        except (LayoutError, ValueError) as exc:
            log.warning("crash recovery: namespace %s skipped: %s", lay.id, exc)
    to_verify: list[tuple[str, bytes, Extent, int, bytes]] = []
    listed: list[tuple[str, bytes, Row]] = []
    progress.total = len(old.rows)
    # Claimed in offset order: the allocator's free list stays short.
    for (ns_id, key), row in sorted(old.rows.items(), key=lambda kv: kv[1].offset):
        # A few fixed reasons (the log line counts them; a crafted journal cannot
        # make it long), the first example of each logged in full.
        reason = detail = None
        if row.crc is None:
            reason = "no checksum yet"
        elif ns_id not in index.namespaces:
            reason = "namespace not declared"
        else:
            lay = index.namespaces[ns_id].layout
            try:
                group = lay.key_group(key)
            except LayoutError as exc:
                reason, detail = "bad key", str(exc)
            else:
                # The slot's size for its group and the pool's bounds, checked before
                # anything is claimed: a huge, empty or outside extent never reaches
                # the allocator, and one that overlaps a claimed row is not free.
                want = index.allocator.round_up(lay.slot_bytes(group))
                if row.size != want:
                    reason, detail = "wrong size", f"{row.size} bytes, the slot's are {want}"
                elif row.offset + row.size > index.allocator.capacity:
                    reason, detail = "outside the pool", f"offset {row.offset}"
                else:
                    try:
                        extent = index.claim_recovering(row.offset, row.size)
                    except (OutOfSpace, ValueError) as exc:
                        reason, detail = "extent not free or misaligned", str(exc)
        if reason is not None:
            progress.rejected += 1
            seen = progress.reasons.get(reason, 0)
            progress.reasons[reason] = seen + 1
            if detail is not None and not seen:
                log.warning(
                    "crash recovery: block %s… of namespace %s dropped (%s: %s)",
                    key.hex()[:16],
                    ns_id,
                    reason,
                    detail,
                )
            continue
        # a row that reaches here has its CRC (rows without one were dropped above)
        to_verify.append((ns_id, key, extent, row.crc, row.chunk_event))  # type: ignore[arg-type]
        listed.append((ns_id, key, row))
    # Verify (and serve) the youngest rows last, as the LRU order had them.
    order = {ident: i for i, ident in enumerate(old.rows)}
    to_verify.sort(key=lambda r: order[(r[0], r[1])])
    listed.sort(key=lambda r: order[(r[0], r[1])])
    progress.complete = not to_verify
    return to_verify, listed


def _create(path: str) -> int:
    """A new journal file (mode 0600, no symlink followed, the daemon's own)."""
    return private_files.open_private(
        path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, "the journal"
    )


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


__all__ = [
    "Journal",
    "Recovery",
    "RecoveryProgress",
    "begin_recovery",
    "journal_path",
    "read",
]
