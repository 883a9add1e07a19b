"""How `kvdepot bench` and `kvdepot bench serve` hand over their result: the table (on
stderr when JSON goes to stdout), the JSON, and the plot."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any


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
