"""Health during shutdown: a live daemon answers NOT_SERVING once SIGTERM arrives, and an
open health watch does not hold its exit.
"""

from __future__ import annotations

import contextlib
import signal
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.daemon import connect
from tests.support.faults import DaemonFactory
from tests.support.ops import HEALTH


def test_health_reports_not_serving_during_shutdown(daemon_factory: DaemonFactory) -> None:
    """A Health/Watch stream open across SIGTERM gets NOT_SERVING and then ends; a Check
    made after that answers NOT_SERVING or fails (the listener is closing), never
    SERVING; the open watch does not hold the daemon for the shutdown grace period."""
    d = daemon_factory("--pool-size", "16MiB")
    engine = connect(d.target, "shutdown-test")  # a Session stream open across shutdown too
    checks: list[str] = []
    with d.channel() as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        watch = stub.Watch(health_pb2.HealthCheckRequest(service="kvdepot.v1.Depot"))
        assert next(watch).status == HEALTH.SERVING
        assert d.proc is not None
        t0 = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        statuses = []
        with contextlib.suppress(grpc.RpcError):  # the stream may end with an error status
            for resp in watch:
                statuses.append(resp.status)
                if resp.status == HEALTH.NOT_SERVING:
                    # From here on no Check may say SERVING (new channel or old).
                    with d.channel() as fresh:
                        for channel in (ch, fresh):
                            try:
                                r = health_pb2_grpc.HealthStub(channel).Check(
                                    health_pb2.HealthCheckRequest(), timeout=2
                                )
                                checks.append(HEALTH.ServingStatus.Name(r.status))
                            except grpc.RpcError as exc:
                                checks.append(exc.code().name)
        assert statuses == [HEALTH.NOT_SERVING], statuses
        assert d.proc.wait(timeout=20) == 0, d.log()
        took = time.monotonic() - t0
    engine.close()
    assert checks and "SERVING" not in checks, checks
    # The daemon waits up to 5 s (SHUTDOWN_GRACE_SECONDS) for open calls: a health watch
    # must not be one of them.
    assert took < 4.5, f"shutdown took {took:.1f}s with a health watch open"
