"""How the text of a `kvdepot serve` setting becomes its value.

Each parser takes the text of a flag or an environment variable and returns the value,
or raises ValueError with a message that says what is allowed (kvdepot.server.config
names the flag or variable in front of it). Pure functions, no state.
"""

from __future__ import annotations

import grp
import ipaddress
import math
from collections.abc import Callable
from typing import Any


def read(text: str, convert: Callable[[str], Any], complaint: str) -> Any:
    """`convert(text.strip())`; when it cannot, ValueError(complaint) instead of the
    converter's own exception (which says nothing a user can act on). The parsers that
    convert text (numbers, modes, addresses, groups) read it through this, then check
    the value's range."""
    try:
        return convert(text.strip())
    except (ValueError, KeyError):
        raise ValueError(complaint) from None


def text(value: str) -> str:
    """Free text, as given."""
    return value


def whole_number(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = read(text, int, f"{text!r} is not a whole number")
        if value < minimum or (maximum is not None and value > maximum):
            upper = f" and <= {maximum}" if maximum is not None else ""
            raise ValueError(f"{value} is out of range: must be >= {minimum}{upper}")
        return value

    return parse


def seconds(text: str) -> float:
    value = read(text, float, f"{text!r} is not a number of seconds")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{text!r} must be a positive number of seconds")
    return value


def octal_mode(text: str) -> int:
    value = read(
        text, lambda t: int(t, 8), f"{text!r} is not an octal file mode such as 660 or 0600"
    )
    if not 0 <= value <= 0o777:
        raise ValueError(f"{text!r} is not a file mode: use three octal digits, e.g. 660")
    return value


def host_port(text: str) -> str:
    host, _, port = text.strip().rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{text!r} is not HOST:PORT, e.g. 127.0.0.1:50051")
    return text.strip()


def address(text: str) -> str:
    value = text.strip().strip("[]")
    read(
        value, ipaddress.ip_address, f"{text!r} is not an IP address, e.g. 127.0.0.1, 0.0.0.0 or ::"
    )
    return value


def group(text: str) -> str:
    read(text, grp.getgrnam, f"no group named {text!r} on this host")
    return text.strip()


def one_of(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in choices:
            raise ValueError(f"{text!r} is not one of {', '.join(choices)}")
        return value

    # argparse reads a type function's `metavar`; functions declare no such attribute
    parse.metavar = "{" + ",".join(choices) + "}"  # type: ignore[attr-defined]
    return parse


# The words a switch's environment variable takes.
TRUE = {"1", "true", "yes", "on"}
FALSE = {"0", "false", "no", "off"}
