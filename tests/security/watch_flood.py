"""A Watch flood: a namespace of its own full of small rows, Watch streams reopened in a loop.

    python tests/security/watch_flood.py TARGET ROWS SECONDS THREADS

It opens a session of its own (attested, as an engine's), registers a namespace of one
4 KiB page per row, stores ROWS rows in jobs of 4,096, prints "ready", waits for a line
on stdin, then for SECONDS reopens Watch streams on THREADS threads: each stream reads
its first message and is cancelled, so every open costs the daemon a snapshot's start.
Prints one JSON line: the streams opened, the first messages read, and the status codes
of streams that failed.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import grpc

if __package__ in (None, ""):  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvdepot.client import DepotClient, session_stub
from kvdepot.v1 import depot_pb2 as pb
from tests.support.engine import Engine, Geometry, make_key

PER_JOB = 4096
GEO = Geometry(
    groups=[[4096]], blocks_per_chunk=1, world_size=1, num_blocks=PER_JOB, namespace="watch-flood"
)


def fill(client: DepotClient, rows: int) -> None:
    engine = Engine(client, GEO, 0)
    for start in range(0, rows, PER_JOB):
        keys = [make_key(c, 0, b"flood") for c in range(start, min(start + PER_JOB, rows))]
        result = engine.job(pb.STORE, keys, [list(range(len(keys)))], [0])
        assert result.success, result.error


def main() -> None:
    target, rows, seconds, threads = (
        sys.argv[1],
        int(sys.argv[2]),
        float(sys.argv[3]),
        int(sys.argv[4]),
    )
    client = DepotClient(target, client_name="watch-flood").start()
    if not client.wait_connected(10):
        raise SystemExit("no daemon")
    fill(client, rows)
    print("ready", flush=True)
    sys.stdin.readline()  # go
    sid = client.session_id
    counts: Counter[str] = Counter()
    lock = threading.Lock()
    end = time.monotonic() + seconds

    def flood() -> None:
        with grpc.insecure_channel(target) as channel:
            stub = session_stub(channel)
            while time.monotonic() < end:
                stream = stub.Watch(pb.WatchRequest(session_id=sid, namespace_id=GEO.namespace))
                try:
                    first = next(stream)
                    code = "first_message" if first.kind == pb.WatchEvent.SNAPSHOT else "other"
                except grpc.RpcError as exc:
                    code = exc.code().name
                stream.cancel()
                with lock:
                    counts["opened"] += 1
                    counts[code] += 1

    workers = [threading.Thread(target=flood) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    print(json.dumps(dict(counts)), flush=True)
    client.close()


if __name__ == "__main__":
    main()
