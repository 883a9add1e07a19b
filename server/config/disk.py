"""`kvdepot serve` settings of the disk tier below the pool (`--disk`)."""

from __future__ import annotations

from dataclasses import dataclass

from kvdepot.server import setting_parsers as parsers
from kvdepot.server.config.table import setting
from kvdepot.server.sizes import parse_size


@dataclass
class DiskTierSettings:
    """The disk tier below the pool."""

    disk: str | None = setting(
        "--disk",
        metavar="DIR",
        shown="off",
        help="a disk tier below the pool, in the daemon's own directory DIR (one "
        "preallocated file): ready rows are written behind, misses in RAM read back",
    )
    disk_size: int = setting(
        "--disk-size",
        64 << 30,
        parse=parse_size,
        shown="64GiB",
        metavar="SIZE",
        help="bytes of the disk tier's file, reserved at start; past it, LRU evicts",
    )
    disk_write: str = setting(
        "--disk-write",
        "ready",
        parse=parsers.one_of("ready", "evict"),
        help="write a row to the disk tier when it becomes ready, or only ahead of eviction "
        "(the pool's least recently used rows, once the pool is over 80 percent full)",
    )
    disk_write_priority: str = setting(
        "--disk-write-priority",
        "low",
        parse=parsers.one_of("low", "normal"),
        help="CPU and I/O priority of the disk tier's write threads: low (nice 19, the "
        "lowest best-effort I/O class: stores and loads always win the CPU, and writes the "
        "disk cannot take in time are dropped) or normal (as the daemon's other threads)",
    )
