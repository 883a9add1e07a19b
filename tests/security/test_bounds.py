"""No request may hold the daemon (docs/security.md).

An attacker process sends, for each size limit, the largest request the limits allow
and one just above: the one above is refused at once with a status naming the limit;
the largest legal ones, sent in a loop, leave another client's Lookup latency low,
and that client's own store and load still round-trip its bytes. Before: one job of
1,024 keys at blocks_per_chunk 4,096 was answered after 6.9 s and every Lookup waited
7.6 s behind it. A real `kvdepot serve`, real processes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvdepot.client import DepotClient
from kvdepot.v1 import depot_pb2 as pb
from tests.support.engine import Engine, Geometry, chunk_plan, make_key

REPO = Path(__file__).resolve().parents[2]

# The defaults (server/config/, server/core/layout.py) the attacker probes.
MAX_JOB_KEYS, MAX_JOB_BLOCKS, MAX_JOB_PAGES, MAX_BATCH_KEYS = 4096, 16384, 1 << 20, 16384
MAX_GROUPS, MAX_LAYOUT_LAYERS = 16, 1024
LAYERS = 126  # Llama-3-405B
PAGES_BPC = 16
PAGES_BLOCKS = MAX_JOB_PAGES // LAYERS // PAGES_BPC * PAGES_BPC  # 8320 blocks, 520 keys

# The attacker: `probe` prints one JSON line of {case: [status, details, seconds]};
# `loop` stores its largest legal jobs once, prints "ready", then loads them over and
# over until killed (LOAD: the whole claim, plan and copy every time), with a Lookup of
# the most keys allowed, each of the longest, between them.
ATTACKER = r"""
import json, sys, time
sys.path.insert(0, sys.argv[3])
import grpc
from kvdepot.client import DepotClient
from kvdepot.v1 import depot_pb2 as pb
from tests.support.engine import Engine, Geometry, make_key
from tests.security.test_bounds import (
    LAYERS, MAX_BATCH_KEYS, MAX_GROUPS, MAX_JOB_BLOCKS, MAX_JOB_KEYS, MAX_LAYOUT_LAYERS,
    PAGES_BLOCKS, PAGES_BPC,
)

target, mode = sys.argv[1], sys.argv[2]
c = DepotClient(target, client_name="attacker").start()
assert c.wait_connected(10)
out = {}

def timed(name, fn):
    t = time.perf_counter()
    try:
        r = fn()
        status = "OK" if getattr(r, "success", True) else r.error_code
        details = getattr(r, "error", "")
    except grpc.RpcError as exc:
        status, details = exc.code().name, exc.details()
    out[name] = [status, details, time.perf_counter() - t]

def engine(ns, groups, bpc, blocks):
    return Engine(c, Geometry(groups=groups, blocks_per_chunk=bpc, world_size=1,
                              num_blocks=blocks, namespace=ns), 0)

def job(e, direction, n_keys, n_blocks, salt=b""):
    keys = [make_key(i, 0, salt) for i in range(n_keys)]
    return lambda: e.job(direction, keys, [list(range(n_blocks))], [0])

by_keys = engine("atk-keys", [[16] * LAYERS], 1, MAX_JOB_KEYS + 1)
by_pages = engine("atk-pages", [[16] * LAYERS], PAGES_BPC, PAGES_BLOCKS + PAGES_BPC)
by_blocks = engine("atk-blocks", [[16]], 16, MAX_JOB_BLOCKS + 16)
legal = [
    job(by_keys, pb.STORE, MAX_JOB_KEYS, MAX_JOB_KEYS),
    job(by_pages, pb.STORE, PAGES_BLOCKS // PAGES_BPC, PAGES_BLOCKS),
    job(by_blocks, pb.STORE, MAX_JOB_BLOCKS // 16, MAX_JOB_BLOCKS),
]
if mode == "probe":
    timed("job keys: largest", legal[0])
    timed("job keys: above", job(by_keys, pb.STORE, MAX_JOB_KEYS + 1, MAX_JOB_KEYS + 1, b"x"))
    timed("job pages: largest", legal[1])
    timed("job pages: above", job(by_pages, pb.STORE, PAGES_BLOCKS // PAGES_BPC + 1,
                                  PAGES_BLOCKS + PAGES_BPC, b"x"))
    timed("job blocks: largest", legal[2])
    timed("job blocks: above", job(by_blocks, pb.STORE, MAX_JOB_BLOCKS // 16 + 1,
                                   MAX_JOB_BLOCKS + 1, b"x"))
    per_group = MAX_LAYOUT_LAYERS // MAX_GROUPS
    timed("layout: largest", lambda: engine("atk-big", [[16] * per_group] * MAX_GROUPS, 1, 4))
    timed("layout groups: above", lambda: engine("atk-g", [[16]] * (MAX_GROUPS + 1), 1, 4))
    timed("layout layers: above", lambda: engine("atk-l", [[16] * (MAX_LAYOUT_LAYERS + 1)], 1, 4))
    keys = [make_key(i, 0) for i in range(MAX_BATCH_KEYS + 1)]
    timed("lookup keys: largest", lambda: c.lookup("atk-keys", keys[:-1]))
    timed("lookup keys: above", lambda: c.lookup("atk-keys", keys))
    wide = [bytes(252) + bytes(4) for _ in range(MAX_BATCH_KEYS)]
    timed("request bytes: largest", lambda: c.lookup("atk-keys", wide))
    wider = [bytes(i.to_bytes(4, "big")) * 95 + bytes(4) for i in range(MAX_BATCH_KEYS)]
    timed("request bytes: above", lambda: c.lookup("atk-keys", wider))  # 384-byte keys
    print(json.dumps(out), flush=True)
else:
    for run in legal:
        run()
    wide = [bytes(252) + i.to_bytes(4, "big") for i in range(MAX_BATCH_KEYS)]
    loads = [
        job(by_keys, pb.LOAD, MAX_JOB_KEYS, MAX_JOB_KEYS),
        job(by_pages, pb.LOAD, PAGES_BLOCKS // PAGES_BPC, PAGES_BLOCKS),
        job(by_blocks, pb.LOAD, MAX_JOB_BLOCKS // 16, MAX_JOB_BLOCKS),
        lambda: c.lookup("atk-keys", wide),  # the largest call
    ]
    print("ready", flush=True)
    n = 0
    while True:
        r = loads[n % 4]()
        assert getattr(r, "success", True), r
        n += 1
        if n % 4 == 0:
            print(f"jobs {n}", flush=True)
"""


def attacker(target: str, mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", ATTACKER, target, mode, str(REPO)],
        stdout=subprocess.PIPE,
        text=True,
    )


@pytest.fixture
def target(daemon_factory) -> str:
    return daemon_factory("--pool-size", "256MiB").target


EXPECTED = {
    "job keys": ("RESOURCE_EXHAUSTED", "--max-job-keys"),
    "job pages": ("RESOURCE_EXHAUSTED", "--max-job-pages"),
    "job blocks": ("RESOURCE_EXHAUSTED", "--max-job-blocks"),
    "layout groups": ("INVALID_ARGUMENT", "MAX_GROUPS"),
    "layout layers": ("INVALID_ARGUMENT", "MAX_LAYOUT_LAYERS"),
    "lookup keys": ("RESOURCE_EXHAUSTED", "--max-batch-keys"),
    # grpc refuses it from its length (the receive limit is the largest legal request).
    "request bytes": ("RESOURCE_EXHAUSTED", "Received message larger than max"),
}


def test_each_limit_takes_its_largest_request_and_refuses_one_above(target: str) -> None:
    p = attacker(target, "probe")
    try:
        out, _ = p.communicate(timeout=300)
    finally:
        p.kill()
    results = json.loads(out.strip().splitlines()[-1])
    for name, (status, details, seconds) in results.items():
        print(f"{name:24} {status:20} {seconds * 1e3:8.1f} ms  {details[:90]}")
    for limit, (code, words) in EXPECTED.items():
        if limit != "layout groups" and limit != "layout layers":
            status, details, _ = results[f"{limit}: largest"]
            assert status == "OK", (limit, status, details)
        status, details, seconds = results[f"{limit}: above"]
        assert status == code and words in details, (limit, status, details)
        assert seconds < 2.0, f"{limit}: refused after {seconds:.1f} s"
    assert results["layout: largest"][0] == "OK", results["layout: largest"]


def test_largest_legal_requests_in_a_loop_leave_others_lookups_fast(target: str) -> None:
    victim = DepotClient(target, client_name="victim").start()
    assert victim.wait_connected(10)
    geo = Geometry(groups=[[4096, 4096]], blocks_per_chunk=2, world_size=1, num_blocks=64)
    mine = Engine(victim, geo, 0)
    keys, group_blocks, indices = chunk_plan(geo, range(4))
    mine.fill(0, keys, group_blocks[0], indices[0])
    assert mine.job(pb.STORE, keys, group_blocks, indices).success
    p = attacker(target, "loop")
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        assert p.stdout.readline().startswith("jobs")  # a round of its largest jobs ran
        rtts = []
        for i in range(300):
            t = time.perf_counter()
            assert victim.lookup(geo.namespace, [keys[i % 4], make_key(999, 0)]) == [True, False]
            rtts.append(time.perf_counter() - t)
        line = p.stdout.readline()
        assert p.poll() is None and line.startswith("jobs"), "the attacker's loop stopped"
    finally:
        p.kill()
        p.wait()
    rtts.sort()
    print(
        f"victim Lookup under the attacker's largest legal jobs ({line.strip()}): "
        f"median {rtts[150] * 1e3:.2f} ms, p99 {rtts[296] * 1e3:.2f} ms, "
        f"max {rtts[-1] * 1e3:.2f} ms"
    )
    assert rtts[-1] < 0.1, f"a Lookup waited {rtts[-1] * 1e3:.0f} ms"
    # The victim's own bytes still round-trip.
    fresh = Engine(victim, geo, 0)
    assert fresh.job(pb.LOAD, keys, [list(range(8, 16))], indices).success
    assert fresh.mismatches(0, keys, list(range(8, 16)), indices[0], rank=0) == 0
    victim.close()
