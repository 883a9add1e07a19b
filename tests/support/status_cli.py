"""Running `kvdepot status` as a user would: in a subprocess, at 80 columns, and reading
its --json report or its one-line error.
"""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

from tests.support.daemon import kvdepot_command

WIDTH = 80


def status(
    *args: str, env: dict[str, str] | None = None, user: str | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """Runs `kvdepot status ARGS` (as `user` when given: needs root) at 80 columns."""
    cmd = [*kvdepot_command(), "status", *args]
    if user is not None:
        import pwd

        from tests.support.unprivileged import nobody_kvdepot

        pw = pwd.getpwnam(user)
        # Another uid runs kvdepot from a copy it can read (tests/support/unprivileged.py).
        cmd = [
            *("setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--clear-groups"),
            *nobody_kvdepot(),
            "status",
            *args,
        ]
    full_env = {**os.environ, "COLUMNS": str(WIDTH), "LINES": "60", **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env)


def status_json(socket_path: str, *args: str) -> dict[str, Any]:
    out = status("--socket", socket_path, "--json", *args)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def one_line_error(out: subprocess.CompletedProcess[str]) -> str:
    assert out.returncode == 1, (out.returncode, out.stdout, out.stderr)
    assert out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line, got:\n{out.stderr}"
    assert lines[0].startswith("kvdepot status: ")
    return lines[0]
