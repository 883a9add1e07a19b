"""The shards' supervisor: no other process can reach its channels (docs/security.md).

With `--shards`, each shard sends its READY=1, STATUS= and watchdog keep-alives to the
supervisor. They used to go to a datagram socket in the abstract namespace: no file
mode guards such a socket, and its name is listed in /proc/net/unix for anyone to
read. Any local process (no group, no access to the daemon's sockets) flooded it; the
shards' keep-alives, sent without waiting, were dropped against the full queue; the
supervisor took a shard for stuck, sent it SIGABRT and stopped them all, and systemd
gave up after 5 restarts in 300 s. Now each shard has a socketpair end of its own,
named nowhere.

The attacker here is a real process (uid 65534 without capabilities where the tests
run as root) that does what that attack did: it reads /proc/net/unix and floods every
abstract socket named like the daemon's for three watchdog timeouts. The daemon,
under a stand-in for systemd's notification socket with WatchdogSec=2s, must keep
sending WATCHDOG=1, keep both shards running and serving, and stop cleanly after.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvdepot.common.shards import shard_socket
from tests.support.faults import DaemonFactory
from tests.support.notify import NotifyListener
from tests.support.unprivileged import AS_NOBODY, nobody_python

pytestmark = pytest.mark.timeout(120)

FLOOD_SECONDS = 6.0  # three watchdog timeouts (WATCHDOG_USEC 2 s)

# Finds the daemon's abstract sockets as anyone can (/proc/net/unix), then floods each
# with datagrams until time is up; blocking sends (0.1 s at most each), so the queue
# stays full whenever the supervisor makes room. Prints what it found and sent.
ATTACKER = r"""
import json, socket, struct, sys, time

def targets():
    names = set()
    with open("/proc/net/unix") as f:
        next(f)
        for line in f:
            parts = line.split()
            if len(parts) >= 8 and parts[7].startswith("@") and "kvdepot" in parts[7]:
                names.add(parts[7][1:])
    return sorted(names)

end = time.monotonic() + float(sys.argv[1])
sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", 0, 100_000))
found, sent, scans = targets(), 0, 1
print(json.dumps({"found": found}), flush=True)
while time.monotonic() < end:
    if not found:  # a socket made later (a restart) is flooded too
        time.sleep(0.05)
        found, scans = targets(), scans + 1
    for name in found:
        try:
            sock.sendto(b"WATCHDOG=1", b"\0" + name.encode())
            sent += 1
        except OSError:
            pass
print(json.dumps({"found": found, "sent": sent, "scans": scans}), flush=True)
"""


def attacker(seconds: float) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-c", ATTACKER, str(seconds)]
    if os.geteuid() == 0 and shutil.which("setpriv"):
        cmd = [*AS_NOBODY, nobody_python(), "-c", ATTACKER, str(seconds)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)


def serving(socket_path: str) -> bool:
    try:
        with grpc.insecure_channel(f"unix://{socket_path}") as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(), timeout=2.0
            )
    except grpc.RpcError:
        return False
    return resp.status == health_pb2.HealthCheckResponse.SERVING


def test_a_flood_of_the_supervisors_sockets_cannot_stop_the_shards(
    daemon_factory: DaemonFactory,
) -> None:
    d = daemon_factory("--shards", "2", "--pool-size", "64MiB", start=False)
    notify = NotifyListener(d)
    sockets = [shard_socket(d.socket_path, i) for i in range(2)]
    try:
        d.launch()
        notify.until("READY=1", 30)
        notify.until("WATCHDOG=1", 5)
        assert d.proc is not None
        p = attacker(FLOOD_SECONDS)
        started = time.monotonic()
        health: list[bool] = []
        try:
            while p.poll() is None:  # the legitimate path beside it: both shards answer
                notify.drain()
                health.append(all(serving(s) for s in sockets))
                time.sleep(0.25)
            out, _ = p.communicate(timeout=10)
        finally:
            p.kill()
        ended = time.monotonic()
        notify.drain()
        report = json.loads(out.strip().splitlines()[-1])
        print(f"attacker: {report}")
        # Nothing to flood: the shards' channels are named nowhere.
        assert report["found"] == [], report
        assert d.proc.poll() is None, d.log()
        assert "sent no watchdog keep-alive" not in d.log(), d.log()
        # systemd heard WATCHDOG=1 all along: never a gap of a whole timeout (2 s).
        beats = [t for t in notify.times_of("WATCHDOG=1") if t >= started - 2.0]
        gaps = [b - a for a, b in itertools.pairwise(beats)]
        print(f"WATCHDOG=1 during the attack: {len(beats)}, longest gap {max(gaps):.2f} s")
        assert beats and beats[-1] > ended - 2.0, beats
        assert max(gaps) < 2.0, gaps
        assert health and all(health), health
        d.proc.send_signal(signal.SIGTERM)
        notify.until("STOPPING=1", 20)
        assert d.proc.wait(timeout=40) == 0, d.log()
    finally:
        notify.sock.close()
