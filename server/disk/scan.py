"""The recovery scan: the disk tier's index rebuilt from the records' headers.

After a restart (clean or not) the tier serves at once and this scan runs on a
thread of its own: it walks the file from offset 0, reads the header page at each
position (a window of pages at a time while records are small, one page when
they are large, so the payload is not read), and yields every header whose magic,
version and CRC check, jumping over its record; anything else moves on by one
page. The payload's digest is not checked here: every read checks it
(kvdepot.server.disk.tier), so a record torn by a crash, or damaged since, is
dropped the first time it is asked for, never served.

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
from kvdepot.server.disk.record import PAGE, Header, decode_header

WINDOW = 1 << 20  # bytes read at once while records are smaller than WINDOW / 4


@dataclass
class ScanProgress:
    total_bytes: int
    source: str = "scan"  # or "checkpoint" (a clean stop's), "empty" (a new file)
    scanned_bytes: int = 0
    headers: int = 0  # records found
    skipped: int = 0  # headers whose record runs past the end of the file

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
            header = decode_header(window[step : step + PAGE])
            if header is None:
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
