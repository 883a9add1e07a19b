"""The settings table's row: `Setting`, and `setting(...)`, the dataclass field that
carries one (kvdepot.server.config: the table is `ServeConfig`'s fields)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvdepot.server import setting_parsers as parsers


@dataclass(frozen=True)
class Setting:
    """One `kvdepot serve` setting (see `ServeConfig` for the rows).

    flag: the command-line flag; env: its environment fallback (derived from the flag).
    parse: text -> value, raising ValueError with what is allowed.
    shown: how the default reads in --help ("" = say nothing about a default).
    switch: a flag without a value that sets the opposite of the default; its
        environment variable takes 1/true/yes/on or 0/false/no/off.
    """

    flag: str
    help: str
    parse: Callable[[str], Any] = parsers.text
    shown: str = ""
    switch: bool = False
    metavar: str | None = None

    @property
    def env(self) -> str:
        return "KVDEPOT_" + self.flag.removeprefix("--").replace("-", "_").upper()

    def from_env(self, raw: str) -> Any:
        if not self.switch:
            return self.parse(raw)
        word = raw.strip().lower()
        if word in parsers.TRUE | parsers.FALSE:
            return word in parsers.TRUE
        raise ValueError(f"{raw!r} is not one of 1, true, yes, on, 0, false, no, off")


def setting(
    flag: str,
    default: Any = None,
    *,
    help: str,
    parse: Callable[[str], Any] = parsers.text,
    shown: str | None = None,
    default_factory: Callable[[], Any] | None = None,
    switch: bool = False,
    metavar: str | None = None,
) -> Any:
    """A `ServeConfig` field that is also a setting (one row of the table). A parser
    that names its own value in --help (`parsers.one_of`: its choices) gives the metavar."""
    if shown is None:
        shown = "" if default is None or switch else str(default)
    metavar = metavar or getattr(parse, "metavar", None)
    meta = {"setting": Setting(flag, help, parse, shown, switch, metavar)}
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)
