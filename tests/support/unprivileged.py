"""A real `kvdepot serve` running as uid 65534 with no capabilities: it may not
read or write a root process's memory, so the pvm path is refused (needs root)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.support.daemon import DaemonProcess, kvdepot_command

NOBODY = 65534
# The command prefix that runs a process as uid/gid 65534, no groups, no capabilities.
AS_NOBODY = (
    "setpriv",
    f"--reuid={NOBODY}",
    f"--regid={NOBODY}",
    "--clear-groups",
    "--inh-caps=-all",
    "--bounding-set=-all",
)


@contextmanager
def unprivileged_daemon(*args: str) -> Iterator[DaemonProcess]:
    """Starts the daemon under setpriv as uid/gid 65534 (caller must be root)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        raise RuntimeError("needs root and setpriv (util-linux)")
    workdir = Path(f"/tmp/kvd-nobody-{os.getpid()}")
    workdir.mkdir(mode=0o777, exist_ok=True)
    os.chmod(workdir, 0o777)  # the daemon creates its sockets here
    d = DaemonProcess(
        workdir,
        *(args or ("--pool-size", "16MiB", "--pvm")),
        command=[*AS_NOBODY, *kvdepot_command()],
    )
    try:
        d.start()
        yield d
    finally:
        d.kill()
        shutil.rmtree(workdir, ignore_errors=True)
