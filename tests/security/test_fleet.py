"""The fleet (remote) tier loads only what a holder of the fleet key wrote
(docs/security.md; docs/remote.md "The fleet key").

Real redis-server, real daemons as nodes, and the attacker a process of its own
with write access to the store and no key: it plants values framed as kvdepot
frames them (format 1 with a valid CRC, format 2 with a made-up MAC, format 2
under a key of its own, a value far larger than a row) for keys node B then
prefetches. None is loaded, each is counted, and B keeps loading node A's rows
byte for byte beside them.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from kvdepot.client import DepotClient
from kvdepot.server.remote.codec import Codec
from kvdepot.server.remote.fleet_key import Keyring
from kvdepot.testing.waiting import wait_for
from kvdepot.v1 import depot_pb2 as pb
from tests.remote.helpers import prefetch
from tests.remote.test_remote_daemons import load_and_compare, store_on
from tests.support.daemon import kvdepot_command, stats
from tests.support.engine import Engine, Geometry, chunk_plan
from tests.support.fleet_key import new_secret, write_key_file
from tests.support.ops import free_port
from tests.support.redis_servers import RedisServer, free_ports, require_redis

FETCHING = pb.PrefetchResponse.FETCHING
ABSENT = pb.PrefetchResponse.ABSENT

# The attacker: write access to the store, kvdepot's code, no fleet key. It frames
# a row for each key it is given exactly as kvdepot would without the key.
ATTACKER = r"""
import os, sys, redis
from kvdepot.server.remote.codec import Codec, HEADER_V1, HEADER_V2
from kvdepot.server.remote.fleet_key import Keyring
port, ns, row, legit_name = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
keys = [bytes.fromhex(k) for k in sys.argv[5:]]
r = redis.Redis(port=port)
keyed = Codec(Keyring.from_secrets(os.urandom(32).hex().encode()))  # a key of its own
evil = b"EVIL" * (row // 4)
# 1. Format 1, valid CRC, under the name node B reads (what any kvdepot once wrote),
#    padded to a format-2 row's size so that it is downloaded and read.
old = Codec(None).encode(ns, keys[0], evil)
r.set(keyed.remote_key(ns, keys[0]), old + bytes(HEADER_V2 - HEADER_V1))
# 2. Format 2 with the fleet's key id, copied from a row a node wrote, and a made-up MAC.
key_id = r.get(bytes.fromhex(legit_name))[20:28]
forged = bytearray(keyed.encode(ns, keys[1], evil))
forged[20:28] = key_id
forged[28:HEADER_V2] = os.urandom(32)
r.set(keyed.remote_key(ns, keys[1]), bytes(forged))
# 3. Format 2, MAC'd under the attacker's own key.
r.set(keyed.remote_key(ns, keys[2]), keyed.encode(ns, keys[2], evil))
# 4. 64 MiB under a row's name: STRLEN tells it is no row, so it is never downloaded.
r.set(keyed.remote_key(ns, keys[3]), os.urandom(64 << 20))
print("planted")
"""


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    require_redis()
    s = RedisServer(tmp_path_factory.mktemp("redis"), free_ports(1)[0]).start()
    yield s
    s.kill()


def _node(daemon_factory, url: str, key_file: Path, *extra: str):
    d = daemon_factory("--pool-size", "64MiB", "--remote", url, "--remote-key-file", str(key_file))
    c = DepotClient(d.target, client_name="node").start()
    assert c.wait_connected(10)
    return d, c


def _metrics(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


def _net_output_bytes(port: int) -> int:
    return int(redis.Redis(port=port).info("stats")["total_net_output_bytes"])


def test_rows_planted_without_the_key_are_never_loaded(store, daemon_factory, tmp_path) -> None:
    secret = new_secret()
    key_file = write_key_file(tmp_path / "fleet.key", secret)
    geo = Geometry(namespace=f"fleet-{time.monotonic_ns()}")
    chunks = range(0, 4)
    d_a, a = _node(daemon_factory, store.url, key_file)
    metrics_port = free_port()
    d_b = daemon_factory(
        "--pool-size",
        "64MiB",
        "--remote",
        store.url,
        "--remote-key-file",
        str(key_file),
        "--metrics-port",
        str(metrics_port),
    )
    b = DepotClient(d_b.target, client_name="node B").start()
    assert b.wait_connected(10)
    _, keys = store_on(a, geo, chunks)
    wait_for(lambda: stats(a).remote_writes == len(keys), what="A's writes")

    # Keys of group 0 that A never wrote: the attacker is their only source.
    planted, _, _ = chunk_plan(Geometry(groups=geo.groups[:1]), range(100, 104))
    codec = Codec(Keyring.from_secrets(secret.encode()))
    legit = redis.Redis(port=store.port).get(codec.remote_key(geo.namespace, keys[0]))
    legit_name = codec.remote_key(geo.namespace, keys[0]).hex()
    row = len(legit) - codec.frame_bytes(geo.namespace, keys[0], 0)  # a group-0 row's bytes
    out = subprocess.run(
        [sys.executable, "-c", ATTACKER, str(store.port), geo.namespace, str(row), legit_name]
        + [k.hex() for k in planted],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0 and "planted" in out.stdout, out.stderr[-2000:]

    engines_b = [Engine(b, geo, r) for r in range(geo.world_size)]
    sent_before = _net_output_bytes(store.port)
    # Two calls: a Prefetch fetches a leading run, nothing after a key no tier has.
    states = list(prefetch(b, geo.namespace, planted).states)
    states += prefetch(b, geo.namespace, keys).states
    # Right-sized forgeries are fetched and fail verification; the 64 MiB value is
    # refused on its size alone. A's rows are fetched.
    assert states == [FETCHING, FETCHING, FETCHING, ABSENT] + [FETCHING] * len(keys)
    wait_for(lambda: all(b.lookup(geo.namespace, keys)), what="A's rows ready on B")
    wait_for(lambda: stats(b).remote_verify_failures == 4, what="4 rejected values")
    assert b.lookup(geo.namespace, planted) == [False] * 4  # never in B's pool
    for e in engines_b:  # nothing of a planted row can be loaded ...
        res = e.job(pb.LOAD, planted, [[], []], [0, 0])
        assert not res.success, res
    # ... and A's rows load byte for byte beside them.
    assert load_and_compare(engines_b, geo, chunks, keys) == 0
    s = stats(b)
    assert s.remote_hits == len(keys) and s.remote_verify_failures == 4
    # The 64 MiB value never crossed the wire (A's rows and headers did: ~200 KiB).
    assert _net_output_bytes(store.port) - sent_before < 8 << 20
    body = _metrics(metrics_port)
    for reason in ("old_format", "bad_mac", "unknown_key", "wrong_size"):
        assert f'kvdepot_remote_verify_failures_total{{reason="{reason}"}} 1.0' in body, reason
    # Said in the log, without the key.
    assert "discarded" in d_b.log()
    assert secret not in d_a.log() + d_b.log()
    # A prefetch of the planted keys again queues nothing: they are not downloaded again.
    assert list(prefetch(b, geo.namespace, planted).states) == [ABSENT] * 4
    a.close()
    b.close()


def test_rotation_reads_rows_of_the_previous_key_and_writes_with_the_new(
    store, daemon_factory, tmp_path
) -> None:
    """A has only the old key; B has the new and the old one. B loads A's rows byte
    for byte; B's own rows carry the new key, which A (old key only) refuses."""
    old, new = new_secret(), new_secret()
    _, a = _node(daemon_factory, store.url, write_key_file(tmp_path / "old.key", old))
    _, b = _node(daemon_factory, store.url, write_key_file(tmp_path / "both.key", new, old))
    geo = Geometry(namespace=f"rotate-{time.monotonic_ns()}")
    _, keys = store_on(a, geo, range(0, 3))
    wait_for(lambda: stats(a).remote_writes == len(keys), what="A's writes")
    engines_b = [Engine(b, geo, r) for r in range(geo.world_size)]
    assert list(prefetch(b, geo.namespace, keys).states) == [FETCHING] * len(keys)
    wait_for(lambda: all(b.lookup(geo.namespace, keys)), what="A's rows on B")
    assert load_and_compare(engines_b, geo, range(0, 3), keys) == 0
    assert stats(b).remote_verify_failures == 0

    geo2 = Geometry(namespace=f"rotate2-{time.monotonic_ns()}")
    _, keys2 = store_on(b, geo2, range(0, 2))
    wait_for(lambda: stats(b).remote_writes == len(keys2), what="B's writes")
    engines_a = [Engine(a, geo2, r) for r in range(geo2.world_size)]  # A joins geo2
    assert list(prefetch(a, geo2.namespace, keys2).states) == [FETCHING] * len(keys2)
    wait_for(lambda: stats(a).remote_verify_failures == len(keys2), what="A refuses B's rows")
    assert a.lookup(geo2.namespace, keys2) == [False] * len(keys2)
    assert len(engines_a) == geo2.world_size
    a.close()
    b.close()


ROW_LAYERS = [4096, 4096]  # inline rows of one rank, one group: 16 KiB
ROW = 2 * sum(ROW_LAYERS)


def _joined(d, namespace: str) -> DepotClient:
    c = DepotClient(d.target, client_name="node").start()
    assert c.wait_connected(10)
    return _joined_from(c, namespace)


def _row(key: bytes) -> bytes:
    seed = hashlib.sha256(b"row of " + key).digest()
    return (seed * (ROW // len(seed) + 1))[:ROW]


def _put(c: DepotClient, namespace: str, names: list[bytes]) -> list[bytes]:
    keys = [hashlib.sha256(n).digest() + bytes(4) for n in names]
    for k in keys:
        assert c.put(namespace, k, 0, _row(k)).outcome == "stored"
    return keys


def test_rows_admitted_under_a_dropped_key_are_dropped_with_it(
    store, daemon_factory, tmp_path
) -> None:
    """Node B (key file: new, old) fetches rows node A wrote under the old key and
    rows node C wrote under the new one; its disk tier keeps them, beside B's own
    rows. B restarts with the new key alone (the rotation's last step, e.g. after
    the old key leaked): what the old key admitted is gone from B's pool file and
    disk, and still refused from the store, while the rows of the new key come back
    from B's disk byte for byte and B's own rows from its pool file. A fleet row
    is never written back to the fleet, not even when the disk promotes it."""
    old, new = new_secret(), new_secret()
    ns = f"dropped-key-{time.monotonic_ns()}"
    _, a = _node(daemon_factory, store.url, write_key_file(tmp_path / "old.key", old))
    _, c = _node(daemon_factory, store.url, write_key_file(tmp_path / "new.key", new))
    b_key = write_key_file(tmp_path / "b.key", new, old)
    d_b = daemon_factory(
        "--pool-size", "32MiB", "--pool-file", str(tmp_path / "b.pool"),
        "--disk", str(tmp_path / "b-disk"), "--disk-size", "8MiB",
        "--disk-write-priority", "normal",
        "--remote", store.url, "--remote-key-file", str(b_key),
    )  # fmt: skip
    a, c = _joined_from(a, ns), _joined_from(c, ns)
    by_old = _put(a, ns, [b"a0", b"a1", b"a2"])
    by_new = _put(c, ns, [b"c0", b"c1", b"c2"])
    wait_for(lambda: stats(a).remote_writes == 3 and stats(c).remote_writes == 3, what="writes")
    b = _joined(d_b, ns)
    own = _put(b, ns, [b"b0", b"b1"])
    fleet = by_old + by_new
    assert list(prefetch(b, ns, fleet).states) == [FETCHING] * 6
    wait_for(lambda: all(b.lookup(ns, fleet)), what="the fleet's rows on B")
    wait_for(lambda: stats(b).disk_writes == 8, what="B's disk holds all eight rows")
    assert stats(b).remote_writes == 2  # its own rows only
    b.close()

    assert d_b.stop() == 0  # a clean stop: the pool file's snapshot, the disk's checkpoint
    write_key_file(b_key, new)  # the old key dropped
    d_b.start()
    b = _joined(d_b, ns)
    s = wait_for(lambda: (s := stats(b)).disk_recovery_complete and s, what="disk index back")
    assert s.warm_restarted and s.disk_recovery_source == "checkpoint"
    assert b.lookup(ns, own) == [True, True]  # B's own rows: in the pool file
    assert b.lookup(ns, fleet) == [False] * 6  # the fleet's: never kept there
    assert s.disk_records == 5  # B's two and the new key's three
    assert "3 records of rows fetched from the fleet were dropped" in d_b.log()
    for k in own:
        assert b.get(ns, k, 0) == _row(k)

    r = redis.Redis(port=store.port)
    codec = Codec(Keyring.from_secrets(new.encode()))
    r.delete(*[codec.remote_key(ns, k) for k in by_new])  # the disk is their only source
    states = list(prefetch(b, ns, fleet).states)
    # The old key's rows: fetched from the store (right-sized) and refused there.
    assert states == [FETCHING] * 6
    wait_for(lambda: all(b.lookup(ns, by_new)), what="the new key's rows from B's disk")
    wait_for(lambda: stats(b).remote_verify_failures == 3, what="the old key's rows refused")
    assert b.lookup(ns, by_old) == [False] * 3
    for k in by_new:
        assert b.get(ns, k, 0) == _row(k)
    assert stats(b).disk_hits == 3
    # Promoted from disk, the new key's rows are still the fleet's: not written back.
    (late,) = _put(b, ns, [b"b2"])
    wait_for(lambda: stats(b).remote_writes == 1, what="B's own new row written")
    assert not any(r.exists(codec.remote_key(ns, k)) for k in by_new)
    assert r.exists(codec.remote_key(ns, late))
    b.close()

    d_b.kill()  # and after a crash, the journal brings back B's rows alone
    d_b.start()
    b = _joined(d_b, ns)
    wait_for(lambda: stats(b).recovery_complete, what="crash recovery")
    assert b.lookup(ns, [*own, late]) == [True] * 3
    assert b.lookup(ns, by_new) == [False] * 3
    b.close()
    a.close()
    c.close()


def _joined_from(client: DepotClient, namespace: str) -> DepotClient:
    """`client` with the inline layout of `namespace` registered."""
    layout = pb.NamespaceLayout(
        id=namespace,
        world_size=1,
        blocks_per_chunk=2,
        groups=[pb.GroupLayout(layer_page_bytes=ROW_LAYERS)],
    )
    client.register_kv(layout, 0, None, [], [])
    return client


def _serve(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            *kvdepot_command(),
            "serve",
            "--socket",
            str(tmp_path / "s.sock"),
            "--pool-size",
            "16MiB",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_remote_without_a_usable_key_file_refuses_to_start(store, tmp_path) -> None:
    out = _serve(tmp_path, "--remote", store.url)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "--remote-key-file" in out.stderr and "--remote-insecure" in out.stderr
    assert "Traceback" not in out.stderr
    secret = new_secret()
    for mode in (0o644, 0o640, 0o606):  # others or the group may read or write it
        key_file = write_key_file(tmp_path / "fleet.key", secret, mode=mode)
        out = _serve(tmp_path, "--remote", store.url, "--remote-key-file", str(key_file))
        assert out.returncode == 2, (oct(mode), out.stderr[-2000:])
        assert f"mode {mode:04o}" in out.stderr and "chmod 600" in out.stderr
        assert secret not in out.stdout + out.stderr and "Traceback" not in out.stderr
    short = write_key_file(tmp_path / "short.key", "tooshort")
    out = _serve(tmp_path, "--remote", store.url, "--remote-key-file", str(short))
    assert out.returncode == 2 and "openssl rand -hex 32" in out.stderr
    assert "tooshort" not in out.stderr


def test_insecure_is_said_at_start_and_still_shares(store, daemon_factory) -> None:
    """--remote-insecure: CRC-only rows (format 1, kvd1: names), a warning at start,
    and two such nodes still share rows byte for byte."""
    nodes = []
    for _ in range(2):
        d = daemon_factory("--pool-size", "64MiB", "--remote", store.url, "--remote-insecure")
        c = DepotClient(d.target).start()
        assert c.wait_connected(10)
        nodes.append((d, c))
    (d_a, a), (_, b) = nodes
    assert "without a fleet key (--remote-insecure)" in d_a.log()
    geo = Geometry(namespace=f"insecure-{time.monotonic_ns()}")
    _, keys = store_on(a, geo, range(0, 2))
    wait_for(lambda: stats(a).remote_writes == len(keys), what="A's writes")
    engines_b = [Engine(b, geo, r) for r in range(geo.world_size)]
    prefetch(b, geo.namespace, keys)
    wait_for(lambda: all(b.lookup(geo.namespace, keys)), what="rows on B")
    assert load_and_compare(engines_b, geo, range(0, 2), keys) == 0
    a.close()
    b.close()


def test_a_value_grown_after_its_size_was_checked_is_read_only_up_to_a_row(store) -> None:
    """The fetch after STRLEN is a GETRANGE bounded by the row's size: a value replaced
    by a huge one in between costs at most a row's bytes (the tier's contract)."""
    import asyncio

    from kvdepot.server.remote.redis_tier import RedisTier

    name = f"kvd2:grown-{time.monotonic_ns()}".encode()
    redis.Redis(port=store.port).set(name, b"x" * (64 << 20))

    async def go() -> list[bytes | None]:
        tier = RedisTier(store.url)
        try:
            return await tier.get_many([name], time.monotonic() + 10, [4097])
        finally:
            await tier.close()

    before = _net_output_bytes(store.port)
    (got,) = asyncio.run(go())
    assert got is not None and len(got) == 4097
    assert _net_output_bytes(store.port) - before < 1 << 20
