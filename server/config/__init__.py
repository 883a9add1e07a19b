"""`kvdepot serve` settings, written once.

`ServeConfig` is the table: each field that carries a `Setting` is one setting, with its
flag, its environment fallback (KVDEPOT_<FLAG>), its default, its help text and the
parser that turns text into its value. The `serve` flags, their help and the config the
daemon runs with are all derived from it, so adding a setting is adding one field.
The fields are written by topic, a module each, which `ServeConfig` joins in --help's
order: serving.py (sockets, the pool), observing.py (metrics, KV events), sessions.py,
process.py, access.py (socket modes, operators, TLS), copies.py (copy threads, NUMA,
shards), bounds.py (request bounds, shares, eviction), fleet.py (`--remote`), disk.py
(`--disk`); table.py is a row's machinery.

Contract: a bad value, on the command line or in the environment, ends `kvdepot serve`
with exit status 2 and one line on stderr naming the flag or the variable; never a
traceback. An empty environment variable counts as unset (systemd's `KEY=`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from kvdepot.server.config.access import AccessSettings
from kvdepot.server.config.bounds import BoundSettings
from kvdepot.server.config.copies import CopySettings
from kvdepot.server.config.disk import DiskTierSettings
from kvdepot.server.config.fleet import FleetSettings
from kvdepot.server.config.observing import ObservingSettings
from kvdepot.server.config.process import ProcessSettings
from kvdepot.server.config.serving import ServingSettings, default_socket_path
from kvdepot.server.config.sessions import SessionSettings
from kvdepot.server.config.table import Setting, setting
from kvdepot.server.sizes import parse_size

__all__ = [
    "ServeConfig",
    "Setting",
    "SettingsParser",
    "add_serve_arguments",
    "config_from_args",
    "default_socket_path",
    "parse_size",
    "setting",
    "settings",
]


# A dataclass takes its bases' fields in reverse order of the bases: the last base's
# first. So the topics are listed last to first, and --help lists them first to last.
@dataclass
class ServeConfig(
    DiskTierSettings,
    FleetSettings,
    BoundSettings,
    CopySettings,
    AccessSettings,
    ProcessSettings,
    SessionSettings,
    ObservingSettings,
    ServingSettings,
):
    """What the daemon runs with. Fields with a `setting(...)` are the settings table: the
    daemon's own (its topics, from `ServingSettings`) and then the tiers' below the pool
    (the fleet's Redis, the local disk), in the order --help and the docs list them."""

    # Not settings: fixed for the daemon, changed only by tests that build a state directly.
    slot_granularity: int = 4096
    keepalive_seconds: float = 5.0
    # Which of the `shards` this process is: set only by the supervisor (server/shards.py).
    shard: int = 0


def settings() -> Iterator[tuple[str, Setting]]:
    """(field name, setting) for every row of the table, in --help order."""
    for f in dataclasses.fields(ServeConfig):
        if "setting" in f.metadata:
            yield f.name, f.metadata["setting"]


def _builtin_default(name: str) -> Any:
    f = ServeConfig.__dataclass_fields__[name]
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _argparse_type(s: Setting) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return s.parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


class SettingsParser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line (no usage dump), exit status 2.

    Errors found in the environment while the arguments were added are reported when
    this parser is used, before --help, so a bad variable is never silently ignored.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.environment_errors: list[str] = []

    # one signature for argparse's overloads: the daemon passes no namespace type
    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        if self.environment_errors:
            self.error(self.environment_errors[0])
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def add_serve_arguments(parser: argparse.ArgumentParser, only: Sequence[str] = ()) -> None:
    """Adds the settings' flags (all, or the fields named in `only`) to `parser`.

    Each flag's default is its environment variable when set, else the table's default.
    """
    if not only:
        parser.epilog = (
            "A flag on the command line wins over its environment variable; an empty "
            "variable counts as unset."
        )
    errors: list[str] = []
    for name, s in settings():
        if only and name not in only:
            continue
        default = _builtin_default(name)
        raw = os.environ.get(s.env, "")
        if raw.strip():
            try:
                value = s.from_env(raw)
                # A switch's variable says whether the flag is given, not the value.
                default = (not default if value else default) if s.switch else value
            except ValueError as exc:
                errors.append(f"{s.env}: {exc} (the environment fallback of {s.flag})")
        shown = f"; default {s.shown}" if s.shown else ""
        # A switch stores the opposite of the table's default; the others parse a value.
        kind: dict[str, Any] = (
            {"action": "store_const", "const": not _builtin_default(name)}
            if s.switch
            else {"type": _argparse_type(s), "metavar": s.metavar}
        )
        parser.add_argument(
            s.flag, dest=name, default=default, help=f"{s.help} ({s.env}{shown})", **kind
        )
    if not errors:
        return
    if isinstance(parser, SettingsParser):
        parser.environment_errors.extend(errors)
    else:
        parser.error(errors[0])


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    return ServeConfig(**{name: getattr(args, name) for name, _ in settings()})
