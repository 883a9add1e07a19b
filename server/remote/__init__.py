"""The remote tier: a shared store below the node's pool (docs/architecture.md §13).

    tier.py        RemoteTier, the small interface a store implements (batches, deadlines)
    redis_tier.py  RemoteTier on Redis Cluster or standalone Redis (redis-py asyncio)
    url.py         --remote URLs, parsed without the client library
    codec.py       key names and value framing: namespace, key, length, keyed-BLAKE3 MAC
    fleet_key.py   the fleet key file: current and previous key, checked permissions
    writer.py      write-behind of READY (or evicted) rows, bounded, deduplicated
    reader.py      Prefetch: fetch on a local miss, verify, make READY in the pool
    health.py      up/down with back-off, logged in words
    stats.py       counters and histograms (GetStats, Prometheus)
    metrics.py     the Prometheus collector
    link.py        RemoteLink: all of it attached to one daemon through its hooks
    factory.py     `--remote` and the fleet key read into a started RemoteLink (the registry)

Only `kvdepot serve --remote` imports these modules; redis-py is the `remote` extra.
"""
