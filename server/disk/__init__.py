"""The disk tier: a node-local disk below the RAM pool (docs/disk-tier.md).

    record.py      the record: header page (namespace, key, length, keyed BLAKE3 tags) + payload
    secret.py      the record key: random, created at first use, 0600 in the tier's directory
    space.py       DiskSpace (sans-I/O): placement, the index, LRU eviction, the write bound
    files.py       TierFile: the preallocated file, O_DIRECT record I/O, buffered fallback
    scan.py        the scan of the records' headers (the index after a crash)
    checkpoint.py  the index written at a clean stop (sans-I/O encode and decode)
    recovery.py    the index brought back at open, in the background: checkpoint or scan
    health.py      up/down with back-off, logged in words
    stats.py       counters and recovery progress
    io_threads.py  IOThreads: daemon I/O threads with a bounded wait (a hung disk)
    upkeep.py      the tier's file kept in order: users, failures, probes, fdatasync
    tier.py        DiskTier: all of it, with its I/O threads
    link.py        DiskLink: the tier attached to the daemon (write-behind, promotion, figures)
    cold_end.py    ColdEndWriter: --disk-write evict, the pool's coldest rows written first
    metrics.py     its Prometheus series (kvdepot_disk_*)
    factory.py     `--disk` read into a started DiskLink (the daemon's tier registry)

The daemon builds a DiskLink for `kvdepot serve --disk DIR` through its tier registry
(kvdepot.server.tier_registry names factory.py); the state holds it as a `Tier`
(kvdepot.server.core.tier) and nothing else imports these modules. blake3 is the `disk` extra.
"""
