"""Clients that take more than their share, and a victim that measures what it loses.

    python tests/security/owners.py MODE TARGET SECONDS

Each mode prints {"ready": ...} when under way and, at the end, one JSON object of
what it did and got. Modes:

- `churn`: opens Sessions in a loop on the engines' socket with raw gRPC, never
  attesting, keeping each open, while 8 child processes hold the fd socket's places
  (8 connections each, the most one process may; reconnecting whenever one is shut).
  Before, every new session ended the oldest session nobody had attested, whoever's
  it was: a TCP engine's (those never attest), or a local engine's that could not
  attest for want of a place on the fd socket.
- `tcp-victim`: an engine over TCP that cannot reach the fd socket (run as another
  uid): an inline registration, one row Put, then Gets of it for SECONDS; counts the
  sessions it had to open and the Gets that failed or came back wrong, and the Gets'
  p50 in the first QUIET seconds and after.
- `hold-writing`: two sessions of this one process, each storing rank 0 of rows of
  a two-rank namespace worth 60 % of the pool (rank 1 never comes, so the rows stay
  being written); then waits SECONDS. Before, each session had a quota of 50 %: the
  pool was held whole.
- `hold-pins`: two sessions of this one process, each storing complete rows worth
  half the pool and pinning them; then waits SECONDS. `hold-pins-one I [PERCENT]`: one
  session doing so, with the I-th half's keys (two such processes: the pool-wide bound);
  PERCENT of the pool instead of half.
- `sessions N`: N attested sessions (kvdepot's client) held for SECONDS.
- `streams N`: one session of its own, then N Transfer streams on it (over several
  connections), each left idle, for SECONDS; `bare-streams N`: the same streams
  naming no session; `unread-calls N`: N Lookup calls of its session whose request
  never comes (a unary call is open from its headers on).
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import select
import signal
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import grpc

if __package__ in (None, ""):  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvdepot.client import DepotClient, session_stub
from kvdepot.v1 import depot_pb2 as pb
from kvdepot.v1 import depot_pb2_grpc
from tests.support.engine import Engine, Geometry, chunk_plan, make_key

QUIET = 2.0  # seconds the tcp-victim measures before the attack starts
POOL = 8 << 20  # the --pool-size the tests give these modes
ROW = 64 << 10  # one row: a rank's section of 32 KiB, two ranks (hold-writing)
GEO_WRITING = Geometry(
    groups=[[16384, 16384]], world_size=2, blocks_per_chunk=1, num_blocks=128, namespace="hog-w"
)
GEO_PINS = Geometry(
    groups=[[16384, 16384]], world_size=1, blocks_per_chunk=2, num_blocks=128, namespace="hog-p"
)


def say(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def hold_fd_places(fd_socket: str, until: float) -> None:
    """A child's loop: 8 connections to the fd socket, each reopened when shut."""
    conns: list[socket.socket] = []
    while time.monotonic() < until:
        while len(conns) < 8:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(fd_socket)
            except OSError:
                s.close()
                break
            conns.append(s)
        ready, _, _ = select.select(conns, [], [], 0.05)
        for s in ready:  # shut (a refusal, a deadline, or made room): reconnect
            conns.remove(s)
            s.close()
    for s in conns:
        s.close()


def churn(target: str, seconds: float) -> None:
    until = time.monotonic() + seconds
    children = []
    for _ in range(8):
        pid = os.fork()
        if pid == 0:
            try:
                hold_fd_places(target.removeprefix("unix://") + ".fd", until)
            finally:
                os._exit(0)
        children.append(pid)
    codes: collections.Counter[str] = collections.Counter()
    calls = []
    say({"ready": len(children)})
    with grpc.insecure_channel(target) as ch:
        stub = session_stub(ch)
        while time.monotonic() < until:
            try:
                call = stub.Session(pb.SessionRequest(client_name="churn"), timeout=seconds + 30)
                next(iter(call))
                calls.append(call)  # kept open: the daemon must make room
                codes["opened"] += 1
            except grpc.RpcError as exc:
                codes[exc.code().name] += 1
            calls = calls[-64:]
    for c in calls:
        c.cancel()
    for pid in children:
        os.waitpid(pid, 0)
    say({"codes": dict(codes)})


def tcp_victim(target: str, seconds: float) -> None:
    client = DepotClient(target, client_name="tcp-victim").start()
    assert client.wait_connected(10), "no session"
    geo = Geometry(groups=[[4096, 4096]], world_size=1, namespace="tcp-victim")
    key, section = make_key(1, 0), bytes(range(256)) * 64  # 2 blocks x 2 layers x 4 KiB
    assert client.register_kv(geo.layout(), 0, None, [], []).memory_path == "inline"
    assert client.put(geo.namespace, key, 0, section, timeout=10).ready
    say({"ready": client.sessions_opened})
    gets = wrong = failed = 0
    started = time.monotonic()
    quiet: list[float] = []  # ms, the first QUIET seconds (before the attack starts)
    loud: list[float] = []
    while (now := time.monotonic()) < started + seconds:
        try:
            got = client.get(geo.namespace, key, 0, timeout=5)
            gets += 1
            wrong += got != section
            (quiet if now < started + QUIET else loud).append((time.monotonic() - now) * 1e3)
        except Exception:  # a session ended under it (or not yet reopened)
            failed += 1
            time.sleep(0.01)
    say(
        {
            "sessions_opened": client.sessions_opened,
            "gets": gets,
            "wrong": wrong,
            "failed": failed,
            "p50_quiet_ms": round(statistics.median(quiet or [0]), 2),
            "p50_attack_ms": round(statistics.median(loud or [0]), 2),
        }
    )
    client.close()


def two_sessions(target: str, geo: Geometry) -> list[Engine]:
    engines = []
    for i in range(2):
        c = DepotClient(target, client_name=f"hog-{i}").start()
        assert c.wait_connected(10), "no session"
        engines.append(Engine(c, geo, 0))
    return engines


def hold_writing(target: str, seconds: float) -> None:
    rows = int(POOL * 0.6) // ROW
    stored = []
    for i, eng in enumerate(two_sessions(target, GEO_WRITING)):
        keys, blocks, indices = chunk_plan(GEO_WRITING, range(i * rows, (i + 1) * rows))
        res = eng.job(pb.STORE, keys, blocks, indices)
        stored.append(res.stored_keys)
    say({"ready": stored})
    time.sleep(seconds)
    say({"stored": stored})


def hold_pins(
    target: str, seconds: float, sessions: int = 2, first: int = 0, percent: int = 50
) -> None:
    chunks = POOL * percent // 100 // (2 * 2 * 16384)  # `percent` of the pool per session
    pinned = []
    for i, eng in enumerate(two_sessions(target, GEO_PINS)[:sessions], start=first):
        keys, blocks, indices = chunk_plan(GEO_PINS, range(i * chunks, (i + 1) * chunks))
        assert eng.job(pb.STORE, keys, blocks, indices).success
        try:
            pinned.append(sum(eng.client.pin(GEO_PINS.namespace, keys)))
        except grpc.RpcError as exc:
            pinned.append(exc.code().name)
    say({"ready": pinned})
    time.sleep(seconds)
    say({"pinned": pinned})


def sessions(target: str, seconds: float, n: int) -> None:
    clients = [DepotClient(target, client_name=f"holder-{i}").start() for i in range(n)]
    held = sum(c.wait_connected(10) for c in clients)
    say({"ready": held})
    time.sleep(seconds)
    say({"held": held, "opened": sum(c.sessions_opened for c in clients)})
    for c in clients:
        c.close()


async def streams(target: str, seconds: float, n: int, bare: bool, unary: bool) -> None:
    client = DepotClient(target, client_name="streams").start()
    assert client.wait_connected(10), "no session"
    metadata = [] if bare else [("kvdepot-session", client.session_id)]
    codes: collections.Counter[str] = collections.Counter()
    # Connections of their own (channels to one target share one by default).
    options = [("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.aio.insecure_channel(target, options=options) for _ in range(n // 100 + 1)]
    calls = []
    stopping = False

    async def one(i: int) -> None:
        channel = channels[i % len(channels)]
        for _ in range(5):  # a call reset in the burst (grpc's pending limit) is retried
            if unary:  # a Lookup whose request never comes: the call is open all the same
                call = channel.stream_unary("/kvdepot.v1.Depot/Lookup")(metadata=metadata)
            else:
                call = depot_pb2_grpc.DepotStub(channel).Transfer(metadata=metadata)
            calls.append(call)
            try:
                if unary:
                    await call
                else:
                    async for _ in call:
                        pass
                codes["ended"] += 1
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.CANCELLED or stopping:
                    codes[exc.code().name] += 1
                    return
                await asyncio.sleep(0.5)
        codes["CANCELLED"] += 1

    tasks = [asyncio.create_task(one(i)) for i in range(n)]
    # Under way once the daemon has answered all it will: the burst itself is grpc's
    # to queue (calls past its pending limit are reset, whoever's).
    settled, seen = 0, -1
    for _ in range(60):
        await asyncio.sleep(0.5)
        settled = settled + 1 if sum(codes.values()) == seen else 0
        seen = sum(codes.values())
        if settled >= 3:
            break
    say({"ready": n, "refused_so_far": dict(codes)})
    await asyncio.sleep(seconds)
    ended = dict(codes)  # by the daemon (CANCELLED: reset five times in a row)
    stopping = True
    for c in calls:
        c.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    say({"codes": ended, "open": n - sum(ended.values())})
    client.close()


def main() -> None:
    mode, target, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
    argv5 = len(sys.argv) > 5
    signal.signal(signal.SIGTERM, lambda *_: os._exit(1))
    if mode == "churn":
        churn(target, seconds)
    elif mode == "tcp-victim":
        tcp_victim(target, seconds)
    elif mode == "hold-writing":
        hold_writing(target, seconds)
    elif mode == "hold-pins":
        hold_pins(target, seconds)
    elif mode == "hold-pins-one":
        hold_pins(target, seconds, 1, int(sys.argv[4]), int(sys.argv[5]) if argv5 else 50)
    elif mode == "sessions":
        sessions(target, seconds, int(sys.argv[4]))
    elif mode in ("streams", "bare-streams", "unread-calls"):
        n, bare, unary = int(sys.argv[4]), mode == "bare-streams", mode == "unread-calls"
        asyncio.run(streams(target, seconds, n, bare, unary))
    else:
        raise SystemExit(f"unknown mode {mode}")
    sys.stdout.flush()
    threading.Event().wait(0)


if __name__ == "__main__":
    main()
