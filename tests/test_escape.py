"""kvdepot.common.escape: what a client sent, shown without acting on a terminal or a log."""

from __future__ import annotations

import io
import logging

from kvdepot.common.escape import EscapingFormatter, escaped


def test_escaped_writes_controls_as_repr_does() -> None:
    assert escaped("engine-a (TP=2) é 模型") == "engine-a (TP=2) é 模型"  # printable: as is
    assert escaped("\x1b[2J\x1b]0;pwned\x07") == "\\x1b[2J\\x1b]0;pwned\\x07"
    assert escaped("a\nb\tc\rd\x7f\x9b") == "a\\nb\\tc\\rd\\x7f\\x9b"  # DEL and C1 CSI too
    assert escaped("x\u202etxt.exe\u2028") == "x\\u202etxt.exe\\u2028"  # bidi, line separator
    assert escaped("a\nb", keep="\n") == "a\nb"


def test_log_lines_carry_no_raw_control_and_stay_one_line() -> None:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(EscapingFormatter("%(levelname)s %(message)s"))
    log = logging.getLogger("kvdepot.test-escape")
    log.addHandler(handler)
    log.propagate = False
    try:
        log.warning("opened by %s", "evil\x1b[2J\nFAKE kvdepot: forged line")
        try:
            raise ValueError("bad name \x1b]0;pwned\x07")
        except ValueError:
            log.exception("failed")
    finally:
        log.removeHandler(handler)
    text = out.getvalue()
    assert "\x1b" not in text and "\x07" not in text
    first, *rest = text.splitlines()
    assert first == "WARNING opened by evil\\x1b[2J\\nFAKE kvdepot: forged line"
    assert rest[0] == "ERROR failed" and rest[1].startswith("Traceback")  # kept multi-line
    assert rest[-1] == "ValueError: bad name \\x1b]0;pwned\\x07"
