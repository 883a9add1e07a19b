"""A tiny progress bar on stderr (no tqdm: the server environment need not have it).

On a terminal it redraws one line; elsewhere (CI logs, pipes) it prints a plain
line per step, at most one every `min_interval` seconds, so logs stay readable.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """Counts steps towards a known total and shows the current one."""

    def __init__(
        self,
        total: int,
        *,
        enabled: bool = True,
        stream: TextIO | None = None,
        min_interval: float = 1.0,
    ) -> None:
        self.total = max(total, 1)
        self.done = 0
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.enabled and self.stream.isatty()
        self.min_interval = min_interval
        self.started = time.monotonic()
        self._last_print = 0.0
        self._label = ""

    def add_total(self, n: int) -> None:
        """Grows the plan (a section found out late how many steps it needs)."""
        self.total += n

    def step(self, label: str, n: int = 1) -> None:
        """Marks `n` steps done; `label` says what runs next."""
        self.done = min(self.done + n, self.total)
        self._label = label
        self._show(force=False)

    def label(self, label: str) -> None:
        """Says what runs now without counting a step."""
        self._label = label
        self._show(force=False)

    def note(self, message: str) -> None:
        """A line of its own (a warning, a phase change), kept above the bar."""
        if not self.enabled:
            return
        if self.tty:
            self.stream.write("\r\x1b[K")
        self.stream.write(f"kvdepot bench: {message}\n")
        self._show(force=True)

    def close(self) -> None:
        if not self.enabled:
            return
        self.done = self.total
        self._label = "done"
        self._show(force=True)
        if self.tty:
            self.stream.write("\n")
        self.stream.flush()

    def _show(self, force: bool) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not self.tty and not force and now - self._last_print < self.min_interval:
            return
        self._last_print = now
        frac = self.done / self.total
        width = 24
        fill = int(frac * width)
        elapsed = int(now - self.started)
        bar = "#" * fill + "-" * (width - fill)
        text = (
            f"[{bar}] {self.done}/{self.total} {frac:4.0%} "
            f"{elapsed // 60}:{elapsed % 60:02d} {self._label}"
        )
        if self.tty:
            self.stream.write("\r\x1b[K" + text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
