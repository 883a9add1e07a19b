"""Yama's ptrace scope, which decides whether the daemon may read an engine's memory
(the pvm path): the client checks it before offering the path and names the daemon
as its ptracer under scope 1; the daemon checks it when it enables the path and when
a registration's probe fails, to say which setting to change."""

from __future__ import annotations

YAMA_SCOPE_PATH = "/proc/sys/kernel/yama/ptrace_scope"


def ptrace_scope() -> int | None:
    """Yama's ptrace_scope (0-3), or None when the kernel has no Yama."""
    try:
        with open(YAMA_SCOPE_PATH) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None
