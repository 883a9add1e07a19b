"""`kvdepot serve` settings of the process: plain-memory engines (pvm), fds kept free,
logging."""

from __future__ import annotations

from dataclasses import dataclass

from kvdepot.server import setting_parsers as parsers
from kvdepot.server.config.table import setting


@dataclass
class ProcessSettings:
    """The process: process-memory engines, fd headroom, log level."""

    pvm: bool = setting(
        "--pvm",
        False,
        switch=True,
        help="serve the pvm memory path: copy engines' plain memory with "
        "process_vm_readv/writev (each registration copies only the process that made it)",
    )
    fd_reserve: int = setting(
        "--fd-reserve",
        256,
        parse=parsers.whole_number(16),
        metavar="N",
        help="file descriptors kept free below RLIMIT_NOFILE for connections and files: "
        "fds and registrations that would eat into them are refused",
    )
    log_level: str = setting(
        "--log-level",
        "info",
        parse=parsers.one_of("debug", "info", "warning", "error"),
        help="log level",
    )
