"""The recovery scan: the disk tier's index rebuilt from the records' headers.

After a restart (clean or not) the tier serves at once and this scan runs on a
thread of its own: it walks the file from offset 0, reads the header page at each
position (a window of pages at a time while records are small, one page when
they are large, so the payload is not read), and yields every header whose magic
and version check and whose tag the file's record key gives for that very offset
(kvdepot.server.disk.record), jumping over its record; anything else moves on by
one page. Free space holds old payload bytes, a client's among them: a page there
that imitates a header (of another format version, or without the key) is never
adopted, only counted (`old_format`, `refused`) and logged. The payload's tag is
not checked here: every read checks it (kvdepot.server.disk.tier), so a record torn
by a crash, or damaged since, is dropped the first time it is asked for, never
served.

A header whose record would run past the end of what the file held is skipped
(a truncated file). What the scan yields may still conflict (a duplicate key, an
extent written since the start): DiskSpace.adopt refuses those.

The caller passes a `TierFile` and one page-aligned buffer of WINDOW bytes (an
anonymous mmap) and reads `ScanProgress` while it runs.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from kvdepot.server.disk.files import TierFile
from kvdepot.server.disk.record import PAGE, Header, Refusal, decode_header, refusal

WINDOW = 1 << 20  # bytes read at once while records are smaller than WINDOW / 4


@dataclass
class ScanProgress:
    total_bytes: int
    source: str = "scan"  # or "checkpoint" (a clean stop's), "empty" (a new file)
    scanned_bytes: int = 0
    headers: int = 0  # records found
    skipped: int = 0  # headers whose record runs past the end of the file
    refused: int = 0  # pages like a header whose tag fails: forged, damaged, another key's
    old_format: int = 0  # headers of another record format version: not adopted
    unheld: int = 0  # records of fleet rows admitted by a key the node no longer holds

    @property
    def fraction(self) -> float:
        return 1.0 if not self.total_bytes else self.scanned_bytes / self.total_bytes


def scan_headers(
    file: TierFile, window: memoryview, progress: ScanProgress
) -> Iterator[tuple[int, Header]]:
    """Yields (offset, header) of each record in file order, up to
    `progress.total_bytes`. Raises OSError when the file cannot be read."""
    limit = progress.total_bytes
    pos = 0
    want = len(window)
    while pos + PAGE <= limit:
        got = file.read_at(window[: min(want, limit - pos)], pos)
        if got < PAGE:
            break
        step = 0
        while step + PAGE <= got:
            page = window[step : step + PAGE]
            header = decode_header(page, pos + step, file.key)
            if header is None:
                why = refusal(page)
                if why is Refusal.UNAUTHENTIC:
                    progress.refused += 1
                elif why is Refusal.OLD_FORMAT:
                    progress.old_format += 1
                step += PAGE
                want = len(window)  # free or damaged space: read ahead again
                continue
            if pos + step + header.record_size > limit:
                progress.skipped += 1
                step += PAGE
                continue
            progress.headers += 1
            yield pos + step, header
            step += header.record_size
            # Large records: read their header pages only, not the payload between.
            want = PAGE if header.record_size > len(window) // 4 else len(window)
        pos += step
        progress.scanned_bytes = min(pos, limit)
    progress.scanned_bytes = limit
