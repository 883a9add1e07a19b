"""`kvdepot serve` settings: copy threads, NUMA placement and shards."""

from __future__ import annotations

from dataclasses import dataclass

from kvdepot.common.shards import MAX_SHARDS
from kvdepot.server import setting_parsers as parsers
from kvdepot.server.config.table import setting


def _numa(text: str) -> str:
    """Checks a --numa value and that the nodes it names have memory on this host."""
    from kvdepot.server.memory import numa

    value = numa.parse_setting(text)
    if value[0].isdigit():
        numa.check_nodes(value, numa.read_topology())  # NumaError is a ValueError
    return value


@dataclass
class CopySettings:
    """The copy threads, their NUMA placement, and shards."""

    copy_threads: int = setting(
        "--copy-threads",
        2,
        parse=parsers.whole_number(1),
        metavar="N",
        help="threads that copy bytes with the CPUs (shared memory, process memory, "
        "inline and tier copies), shared by every engine",
    )
    gpu_copy_threads: int = setting(
        "--gpu-copy-threads",
        2,
        parse=parsers.whole_number(1),
        metavar="N",
        help="copy threads of each GPU's own, which queue its DMA and wait for it: no "
        "GPU's jobs wait behind another's (--copy-threads: the threads that copy with the "
        "CPUs, shared)",
    )
    numa: str = setting(
        "--numa",
        "auto",
        parse=_numa,
        metavar="auto|off|interleave|NODE[,NODE]",
        help="NUMA placement of the pool and the copy threads: auto puts the pool on the "
        "node of the host's GPUs (interleaved over their nodes if several; without GPUs, "
        "the nodes of the daemon's CPUs) and the copy threads on those nodes' CPUs; "
        "interleave spreads the pool over every node; NODE[,NODE] binds it there; off "
        "leaves both to the kernel",
    )
    shards: int = setting(
        "--shards",
        1,
        parse=parsers.whole_number(1, MAX_SHARDS),
        metavar="N",
        help="run the daemon as N processes (shards), each with its own event loop, copy "
        "threads, pool (--pool-size / N) and index; shard i > 0 listens on PATH.shardI. "
        "Engines started after it find N by themselves (kvdepot_shards auto)",
    )
