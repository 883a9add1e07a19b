"""The daemon's sans-I/O core: plain objects, no sockets, threads, files or mmap.

    layout.py     namespace layouts (the arithmetic is kvdepot.common.chunks)
    allocator.py  extents of the pool
    index.py      keys -> slots: states, pins, LRU eviction; emits events
    planner.py    a job checked once, then planned into byte runs
    snapshot.py   the warm-restart snapshot's codec, check and restore
    kinds.py      slot states, outcomes and reasons as enums

The bytes themselves (arena, regions, copy engines, the pool file) are
kvdepot.server.memory; the daemon's state over both is kvdepot.server.state.
"""
