"""How `kvdepot bench` and `kvdepot bench serve` hand over their result: the table (on
stderr when JSON goes to stdout), the JSON, and the plot; or, when a run stops early,
why, and its exit code."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any, Protocol


class _Closable(Protocol):
    def close(self) -> None: ...


def report_stop(command: str, exc: BaseException, progress: _Closable | None = None) -> int:
    """A run that stopped early: closes the progress line, says why on stderr and
    returns the exit code (130 interrupted, as a shell's, else 1)."""
    if progress is not None:
        progress.close()
    if isinstance(exc, KeyboardInterrupt):
        print(f"{command}: interrupted", file=sys.stderr)
        return 130
    print(f"{command}: failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    return 1


def emit(
    result: dict[str, Any],
    table: str,
    *,
    as_json: bool,
    plot_path: str | None,
    plot: Callable[[dict[str, Any], str], None],
    command: str,
) -> bool:
    """Prints `table` and (`as_json`) the result, draws the plot at `plot_path`.
    False when the plot needs matplotlib and it is missing (said on stderr)."""
    if as_json:
        print(table, file=sys.stderr)
        print(json.dumps(result, indent=1))
    else:
        print(table)
    if plot_path:
        try:
            plot(result, plot_path)
        except ImportError:
            print(
                f"{command}: --plot needs matplotlib (pip install 'kvdepot[bench]')",
                file=sys.stderr,
            )
            return False
    return True
