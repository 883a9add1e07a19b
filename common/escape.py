"""Client-supplied text made safe to show: on a terminal (`kvdepot status`) and in logs.

A client name, engine id or namespace description is whatever a process on the node
sent. Printed raw, "\\x1b[2J\\x1b]0;pwned\\x07" clears the operator's screen and retitles
the terminal, and "\\n" forges a log line. `escaped` writes every character that
`str.isprintable` rejects (C0 and C1 controls, DEL, Unicode format characters such as
bidi overrides, line separators) the way Python's repr does (\\n, \\x1b, \\u202e), so
what is shown is what was sent, visibly, and never acts on the terminal.
"""

from __future__ import annotations

import logging

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(ch: str) -> str:
    if ch in _NAMED:
        return _NAMED[ch]
    n = ord(ch)
    if n < 0x100:
        return f"\\x{n:02x}"
    return f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"


def escaped(text: str, keep: str = "") -> str:
    """`text` with each non-printable character (except those in `keep`) escaped."""
    if text.isprintable():
        return text  # the common case: no copy
    return "".join(ch if ch.isprintable() or ch in keep else _escape(ch) for ch in text)


class EscapingFormatter(logging.Formatter):
    """A log formatter whose lines carry no raw control characters: one record is one
    line (a message's newlines are escaped); a traceback keeps its line breaks only."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return escaped(super().formatMessage(record))

    def formatException(self, ei: object) -> str:
        # logging hands this exc_info's tuple on as it got it
        return escaped(super().formatException(ei), keep="\n")  # type: ignore[arg-type]

    def formatStack(self, stack_info: str) -> str:
        return escaped(super().formatStack(stack_info), keep="\n")
