"""Byte sizes as people write them ('64GiB', '512MiB', '50%' of the pool) and as the
daemon shows them. The settings (server/config/) read them; the state (server/state)
resolves a session's share of the pool and names sizes in its messages, without
depending on the settings table."""

from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "kib": 1 << 10,
    "m": 10**6, "mb": 10**6, "mib": 1 << 20,
    "g": 10**9, "gb": 10**9, "gib": 1 << 30,
    "t": 10**12, "tb": 10**12, "tib": 1 << 40,
}  # fmt: skip


def parse_size(text: str) -> int:
    """'64GiB' -> 68719476736; '512MiB', '1.5GB', '4096' work too."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(
            f"cannot read size {text!r}: use a number with an optional unit, e.g. 512MiB, 64GiB"
        )
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value < 1:
        raise ValueError(f"size {text!r} is less than one byte")
    return int(value)


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def pool_share_bytes(text: str, pool_size: int) -> int:
    """A byte budget given as a size ('8GiB') or a share of the pool ('50%')."""
    value = text.strip()
    if value.endswith("%"):
        try:
            percent = float(value[:-1].strip())
        except ValueError:
            raise ValueError(f"{text!r} is not a percentage such as 50%") from None
        if not 0 < percent <= 100:
            raise ValueError(f"{text!r} is out of range: a share of the pool is 0% to 100%")
        return int(pool_size * percent / 100)
    return parse_size(value)
