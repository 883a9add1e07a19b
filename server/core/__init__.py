"""The daemon's sans-I/O core: plain objects, no sockets, threads, files or mmap.

    layout.py     namespace layouts (the arithmetic is kvdepot.common.chunks)
    allocator.py  extents of the pool
    index.py      keys -> slots: states, pins, eviction; emits events (its parts:
                  index_writes.py, index_pins.py, index_evict.py, index_recovery.py;
                  its records: index_types.py; its invariant check: index_check.py)
    eviction.py   the eviction policy's interface, its LRU and ARC implementations
    job_check.py  a job checked once against its namespace and a rank's memory
    planner.py    a rank's memory map; a checked job planned into byte runs
    snapshot.py   the warm-restart snapshot's codec, check and restore
    kinds.py      slot states, outcomes and reasons as enums

The bytes themselves (arena, regions, copy engines, the pool file) are
kvdepot.server.memory; the daemon's state over both is kvdepot.server.state.
"""
