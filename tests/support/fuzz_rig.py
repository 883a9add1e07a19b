"""The fuzz tests' rig (tests/fuzz/): a debug daemon with KVDEPOT_CHECK_INVARIANTS=1, a
home session to fuzz from, a guardian whose pinned blocks must survive, and the checks
made after every example and at the end of each test.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from hypothesis import HealthCheck, settings

from kvdepot.client import DepotClient
from kvdepot.testing.waiting import wait_for
from kvdepot.v1 import depot_pb2 as pb
from tests.support import soak
from tests.support.daemon import DaemonProcess
from tests.support.engine import Engine, Geometry
from tests.support.faults import (
    DOCUMENTED_CODES,
    assert_pool_accounting,
    fd_targets,
    stats,
)

LONG = os.environ.get("KVDEPOT_LONG") == "1"

MAX_JOB_KEYS = 16  # small, so RESOURCE_EXHAUSTED is reachable
NS = "fz"  # world size 2, two groups (the soak geometry)
NS1 = "fz1"  # world size 1, one group
GUARD_ROWS = 6
U32 = 2**32 - 1
U64 = 2**64 - 1
I64_MIN, I64_MAX = -(2**63), 2**63 - 1


def fuzz_settings(examples: int) -> settings:
    return settings(
        max_examples=examples * 20 if LONG else examples,
        derandomize=not LONG,
        database=None,
        deadline=None,
        suppress_health_check=[
            HealthCheck.function_scoped_fixture,
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
        ],
    )


# -- the rig: a debug daemon, a home session to fuzz from, a guardian to protect ------------


@dataclass
class RawSession:
    """A Session stream opened by hand (cancel() ends the session)."""

    call: Any
    id: str
    fd_socket: str

    @classmethod
    def open(cls, stub: Any, name: str = "fuzz", pid: int = 0, engine_id: str = "") -> RawSession:
        call = stub.Session(pb.SessionRequest(client_name=name, pid=pid, engine_id=engine_id))
        hello = next(call).hello
        return cls(call, hello.session_id, hello.fd_socket)

    def close(self) -> None:
        self.call.cancel()


@dataclass
class Rig:
    daemon: DaemonProcess
    channel: grpc.Channel
    stub: Any
    admin: Any
    home: DepotClient
    guardian: DepotClient
    home_engines: list[Engine]
    ns1_engine: Engine
    guard_keys: list[bytes]
    base_fds: int
    codes: dict[str, int] = field(default_factory=dict)
    admin_channel: grpc.Channel | None = None  # the operator socket (Admin)

    @property
    def session_id(self) -> str:
        return self.home.session_id

    def resolve(self, session: str) -> str:
        return self.session_id if session == "HOME" else session

    def registrations(self) -> list[tuple[int, Geometry]]:
        return [
            (e.registration.registration_id, e.geo) for e in [*self.home_engines, self.ns1_engine]
        ]

    def note(self, code: grpc.StatusCode | str) -> None:
        name = code if isinstance(code, str) else code.name
        self.codes[name] = self.codes.get(name, 0) + 1

    def call(self, fn: Callable[..., Any], request: Any, **kw: Any) -> Any:
        """A unary call that must end with a documented status; returns the reply or None."""
        try:
            reply = fn(request, timeout=10, **kw)
        except grpc.RpcError as exc:
            self.note(exc.code())
            assert exc.code() in DOCUMENTED_CODES, (fn, request, exc.code(), exc.details())
            return None
        self.note(grpc.StatusCode.OK)
        return reply

    def check(self) -> None:
        """After each example: alive, and the invariants hold (INTERNAL otherwise)."""
        assert self.daemon.proc is not None and self.daemon.proc.poll() is None, self.daemon.log()[
            -3000:
        ]
        try:
            stats(self.admin)
        except grpc.RpcError as exc:
            raise AssertionError(f"GetStats: {exc.code()} {exc.details()}") from None

    def final_check(self) -> None:
        """Closes every session and checks the daemon holds nothing any more."""
        self.check()
        # The guardian's pinned rows survived everything, byte for byte.
        geo = soak.geometry(NS)
        for rank in range(geo.world_size):
            eng = Engine(self.guardian, geo, rank)
            blocks, indices = soak.group_job(geo, 0, self.guard_keys, soak.LOAD_BASE)
            res = eng.job(pb.LOAD, self.guard_keys, blocks, indices)
            assert res.success, res.error
            assert eng.mismatches(0, self.guard_keys, blocks[0], 0) == 0
        self.home.close()
        self.guardian.close()
        wait_for(lambda: stats(self.admin).sessions == 0, timeout=10, what="every session to end")
        s = assert_pool_accounting(self.admin)
        assert (s.pinned_blocks, s.pinned_bytes, s.registrations, s.inflight_jobs) == (0, 0, 0, 0)
        pid = self.daemon.proc.pid  # type: ignore[union-attr]
        try:
            wait_for(
                lambda: len(fd_targets(pid)) <= self.base_fds,
                timeout=10,
                what="the daemon's fds to return to the baseline",
            )
        except AssertionError as exc:
            raise AssertionError(
                f"{exc}: {self.base_fds} at the start, now {sorted(fd_targets(pid))}"
            ) from None
        print(f"status codes seen: {dict(sorted(self.codes.items()))}")


def settled_fd_count(pid: int) -> int:
    """The daemon's fd count once it stops moving (start-up connections closing)."""
    counts = [len(fd_targets(pid))]
    while len(counts) < 4 or len(set(counts[-4:])) > 1:
        time.sleep(0.05)
        counts.append(len(fd_targets(pid)))
    return counts[-1]
