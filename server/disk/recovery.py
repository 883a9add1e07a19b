"""Bringing the disk tier's index back at open: the clean stop's checkpoint, else a scan.

- `take_checkpoint` reads and deletes `kvdepot-disk.index`
  (kvdepot.server.disk.checkpoint) and returns its records when it vouches for the
  file as it is now; `save_checkpoint` writes it at a clean stop (atomically, the
  daemon's own file: kvdepot.server.memory.private_files).
- `IndexRebuild` is the thread that brings the index back while the tier serves:
  from the checkpoint when there is one that applies (its extents claimed in offset
  order, then the records made readable in their LRU order), otherwise from the
  records' headers (kvdepot.server.disk.scan: after a SIGKILL, a power cut, a file
  changed since). It hands its work to the tier in batches through `apply`, which
  runs a function on the tier's DiskSpace under the tier's lock (and not at all
  once the file is no longer the tier's); `finished` is called once, with the
  reason when the file could not be read. Records a fleet key admitted (rows
  fetched from the remote tier) come back only while the node still holds that
  key (`held_fleet_keys`): a restart without it drops them, counted (`unheld`).
"""

from __future__ import annotations

import functools
import logging
import mmap
import threading
from collections.abc import Callable, Sequence

from kvdepot.server.disk import checkpoint
from kvdepot.server.disk.checkpoint import Item
from kvdepot.server.disk.files import TierFile
from kvdepot.server.disk.scan import WINDOW, ScanProgress, scan_headers
from kvdepot.server.disk.space import DiskSpace
from kvdepot.server.memory import pool_file, private_files

log = logging.getLogger("kvdepot.disk")

BATCH = 512  # records handed over at once (one lock hold in the tier)

#: Runs a function on the tier's space under its lock; the function answers
#: (records kept, records dropped).
Apply = Callable[[Callable[[DiskSpace], tuple[int, int]]], None]


def take_checkpoint(file: TierFile) -> list[Item] | None:
    """The clean stop's records, consumed; None: there is none, or it does not apply."""
    try:
        data = pool_file.take(file.path.with_name(checkpoint.FILE_NAME))
    except OSError as exc:
        log.warning("disk tier: the index checkpoint cannot be read (%s): scanning", exc)
        return None
    if data is None:
        return None
    items = checkpoint.decode(data, file.found_identity)
    if items is None:
        log.warning(
            "disk tier %s: the index checkpoint does not match the file (written since the "
            "clean stop, replaced, damaged, or of an older kvdepot): the index is rebuilt "
            "from the headers",
            file.path,
        )
    return items


def save_checkpoint(file: TierFile, items: list[Item]) -> None:
    """Writes the index for the next open. Raises OSError."""
    data = checkpoint.encode(file.identity_now(), items)
    private_files.write_atomically(
        file.path.with_name(checkpoint.FILE_NAME), data, "the disk tier's index checkpoint"
    )


class IndexRebuild(threading.Thread):
    def __init__(
        self,
        file: TierFile,
        progress: ScanProgress,
        apply: Apply,
        finished: Callable[[str | None], None],
        halt: threading.Event,
        held_fleet_keys: frozenset[bytes] = frozenset(),
    ) -> None:
        super().__init__(name="kvdepot-disk-index", daemon=True)
        self.file = file
        self._held = held_fleet_keys
        self.progress = progress
        self._apply = apply
        self._finished = finished
        self._halt = halt

    def run(self) -> None:
        error: str | None = None
        try:
            items = take_checkpoint(self.file)
            if items is None:
                self._scan()
            else:
                self.progress.source = "checkpoint"
                self.progress.headers = len(items)
                self._load([item for item in items if self._kept(item[5])])
        except OSError as exc:
            error = str(exc)
        finally:
            self._finished(error)

    def _load(self, items: Sequence[Item]) -> None:
        claimed = [False] * len(items)
        by_offset = sorted(range(len(items)), key=lambda i: items[i][2])

        def claim(space: DiskSpace, chunk: Sequence[int]) -> tuple[int, int]:
            for i in chunk:
                claimed[i] = space.claim(items[i][2], items[i][3])
            return 0, 0

        def publish(space: DiskSpace, chunk: range) -> tuple[int, int]:
            kept = sum(1 for i in chunk if claimed[i] and space.publish(*items[i]))
            return kept, len(chunk) - kept

        for start in range(0, len(items), BATCH):
            self._apply(functools.partial(claim, chunk=by_offset[start : start + BATCH]))
        for start in range(0, len(items), BATCH):  # in LRU order, least recent first
            end = min(start + BATCH, len(items))
            self._apply(functools.partial(publish, chunk=range(start, end)))
        self.progress.scanned_bytes = self.progress.total_bytes

    def _scan(self) -> None:
        window = mmap.mmap(-1, WINDOW)
        batch: list[Item] = []

        def adopt(space: DiskSpace, found: list[Item]) -> tuple[int, int]:
            kept = sum(1 for item in found if space.adopt(*item))
            return kept, len(found) - kept

        try:
            for offset, h in scan_headers(self.file, memoryview(window), self.progress):
                if self._kept(h.admitted_by):
                    fleet, event = h.admitted_by, h.chunk_event
                    batch.append((h.namespace, h.key, offset, h.length, h.digest, fleet, event))
                if len(batch) >= BATCH:
                    self._apply(functools.partial(adopt, found=batch))
                    batch = []
                if self._halt.is_set():
                    break
            self._apply(functools.partial(adopt, found=batch))
        finally:
            window.close()

    def _kept(self, admitted_by: bytes) -> bool:
        """A record of this node's own rows, or of one a fleet key it holds admitted."""
        if not admitted_by or admitted_by in self._held:
            return True
        self.progress.unheld += 1
        return False
