"""The systemd notify protocol, against real AF_UNIX datagram sockets bound by the test."""

from __future__ import annotations

import array
import asyncio
import itertools
import logging
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from kvdepot.server.sdnotify import SEND_TIMEOUT_S, SystemdNotifier, run_watchdog

RECV_TIMEOUT_S = 5.0


@dataclass
class Listener:
    """A datagram socket standing in for systemd's notify socket."""

    sock: socket.socket
    env_value: str  # what NOTIFY_SOCKET holds: a path or "@name"

    def recv(self, timeout: float = RECV_TIMEOUT_S) -> str:
        self.sock.settimeout(timeout)
        return self.sock.recv(4096).decode()

    def recv_with_pid(self, timeout: float = RECV_TIMEOUT_S) -> tuple[str, int]:
        """One datagram and the sender's pid, as systemd sees it (SCM_CREDENTIALS)."""
        self.sock.settimeout(timeout)
        creds_size = struct.calcsize("3i")
        data, ancdata, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(creds_size))
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                pid, _uid, _gid = struct.unpack("3i", payload[:creds_size])
                return data.decode(), pid
        raise AssertionError("no SCM_CREDENTIALS on the datagram")

    def drain(self) -> list[str]:
        """Everything queued right now, without waiting."""
        out = []
        self.sock.setblocking(False)
        try:
            while True:
                out.append(self.sock.recv(4096).decode())
        except BlockingIOError:
            return out
        finally:
            self.sock.setblocking(True)


def _bind(address: str | bytes) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    # Like systemd: have the kernel attach the sender's credentials to each datagram.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    sock.bind(address)
    return sock


@pytest.fixture
def path_listener() -> Iterator[Listener]:
    # A short directory of our own: sun_path holds only 108 bytes, and pytest's tmp_path
    # can be longer than that.
    tmpdir = tempfile.mkdtemp(prefix="kvd-notify-")
    path = os.path.join(tmpdir, "notify.sock")
    sock = _bind(path)
    try:
        yield Listener(sock, path)
    finally:
        sock.close()
        shutil.rmtree(tmpdir, ignore_errors=True)


@pytest.fixture
def abstract_listener() -> Iterator[Listener]:
    name = f"kvdepot-test-notify-{uuid.uuid4().hex}"
    sock = _bind(b"\0" + name.encode())
    try:
        yield Listener(sock, "@" + name)
    finally:
        sock.close()


@pytest.fixture(params=["path", "abstract"])
def listener(request: pytest.FixtureRequest) -> Listener:
    return request.getfixturevalue(f"{request.param}_listener")


def test_messages_arrive(listener: Listener) -> None:
    with SystemdNotifier({"NOTIFY_SOCKET": listener.env_value}) as notifier:
        assert notifier.enabled
        assert notifier.ready()
        assert listener.recv() == "READY=1"
        assert notifier.status("pool warming: 12/64 GiB")
        assert listener.recv() == "STATUS=pool warming: 12/64 GiB"
        assert notifier.watchdog()
        assert listener.recv() == "WATCHDOG=1"
        assert notifier.stopping()
        assert listener.recv() == "STOPPING=1"
        assert notifier.extend_timeout(1.5)
        assert listener.recv() == "EXTEND_TIMEOUT_USEC=1500000"
        assert listener.drain() == []


def test_reads_process_environment(
    path_listener: Listener, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", path_listener.env_value)
    with SystemdNotifier() as notifier:
        assert notifier.ready()
    assert path_listener.recv() == "READY=1"


def test_one_datagram_per_message(listener: Listener) -> None:
    with SystemdNotifier({"NOTIFY_SOCKET": listener.env_value}) as notifier:
        assert notifier.notify(READY=1, STATUS="serving", MAINPID=os.getpid())
        assert notifier.notify("READY=1\nSTATUS=raw")
        assert notifier.notify("WATCHDOG=1", STATUS="both")
    assert listener.recv() == f"READY=1\nSTATUS=serving\nMAINPID={os.getpid()}"
    assert listener.recv() == "READY=1\nSTATUS=raw"
    assert listener.recv() == "WATCHDOG=1\nSTATUS=both"
    assert listener.drain() == []


def test_status_newline_cannot_inject_a_field(path_listener: Listener) -> None:
    with SystemdNotifier({"NOTIFY_SOCKET": path_listener.env_value}) as notifier:
        assert notifier.status("line one\nREADY=1\r\nline three")
    assert path_listener.recv() == "STATUS=line one READY=1  line three"


def test_nothing_to_send_sends_nothing(path_listener: Listener) -> None:
    with SystemdNotifier({"NOTIFY_SOCKET": path_listener.env_value}) as notifier:
        assert not notifier.notify()
        assert not notifier.notify("")
    assert path_listener.drain() == []


def test_sender_is_the_calling_process(path_listener: Listener) -> None:
    # NotifyAccess=main: systemd takes the sender's pid from the socket and drops messages
    # from any other process, so the datagram must come from us, not a helper.
    with SystemdNotifier({"NOTIFY_SOCKET": path_listener.env_value}) as notifier:
        notifier.ready()
    assert path_listener.recv_with_pid() == ("READY=1", os.getpid())


def test_child_process_reads_notify_socket(path_listener: Listener) -> None:
    # The daemon as systemd starts it: a fresh process with NOTIFY_SOCKET in its environment.
    code = (
        "from kvdepot.server.sdnotify import SystemdNotifier\n"
        "n = SystemdNotifier()\n"
        "assert n.ready() and n.status('up') and n.stopping()\n"
    )
    env = {**os.environ, "NOTIFY_SOCKET": path_listener.env_value}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env)
    try:
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    msgs = [path_listener.recv_with_pid() for _ in range(3)]
    assert msgs == [("READY=1", proc.pid), ("STATUS=up", proc.pid), ("STOPPING=1", proc.pid)]


def test_watchdog_keeps_coming(listener: Listener) -> None:
    watchdog_sec = 0.4  # systemd's WatchdogSec: a keep-alive is due every 0.2 s
    env = {
        "NOTIFY_SOCKET": listener.env_value,
        "WATCHDOG_USEC": str(int(watchdog_sec * 1e6)),
        "WATCHDOG_PID": str(os.getpid()),
    }
    notifier = SystemdNotifier(env)
    interval = notifier.watchdog_interval()
    assert interval == pytest.approx(watchdog_sec / 2)

    arrivals: list[float] = []
    pings = 7
    before_stop: list[str] = []
    after_stop: list[str] = []

    async def scenario() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(run_watchdog(notifier, stop))
        loop = asyncio.get_running_loop()
        listener.sock.setblocking(False)
        deadline = time.monotonic() + 20
        while len(arrivals) < pings and time.monotonic() < deadline:
            msg = await asyncio.wait_for(loop.sock_recv(listener.sock, 4096), 10)
            assert msg == b"WATCHDOG=1"
            arrivals.append(time.monotonic())
        stop.set()
        # A send is a synchronous sendto on this thread: what the watchdog sent before
        # the stop is queued now, and whatever it sends until its task ends will be
        # queued when the task has ended. Nothing can send after that.
        before_stop.extend(listener.drain())
        await asyncio.wait_for(task, 5)  # returns promptly once stopped
        after_stop.extend(listener.drain())
        listener.sock.setblocking(True)

    asyncio.run(scenario())
    notifier.close()
    assert len(arrivals) == pings
    gaps = sorted(b - a for a, b in itertools.pairwise(arrivals))
    # Load can only delay a timer, never advance it, so the lower bound is safe: no burst
    # (keep-alives sent without waiting would come microseconds apart).
    assert gaps[0] >= interval / 2, gaps
    # systemd restarts a daemon whose keep-alives are more than WatchdogSec apart. A loaded
    # machine may stretch one gap; most must stay well inside the limit.
    assert gaps[len(gaps) // 2] < watchdog_sec, gaps
    # Nothing after stop. (One due while the 7th was being read may precede it.)
    assert after_stop == [], after_stop
    assert before_stop in ([], ["WATCHDOG=1"]), before_stop


def test_watchdog_first_keepalive_is_immediate(path_listener: Listener) -> None:
    # WatchdogSec=60: the first keep-alive must not wait 30 s.
    env = {"NOTIFY_SOCKET": path_listener.env_value, "WATCHDOG_USEC": "60000000"}
    notifier = SystemdNotifier(env)
    assert notifier.watchdog_interval() == 30.0

    async def scenario() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(run_watchdog(notifier, stop))
        await asyncio.sleep(0.05)
        stop.set()
        await asyncio.wait_for(task, 5)

    asyncio.run(scenario())
    assert path_listener.recv(timeout=1) == "WATCHDOG=1"
    assert path_listener.drain() == []


def test_unset_notify_socket_is_a_noop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    monkeypatch.setenv("WATCHDOG_USEC", "100000")
    notifier = SystemdNotifier()
    assert not notifier.enabled
    assert notifier.watchdog_interval() is None
    for send in (notifier.ready, notifier.stopping, notifier.watchdog):
        assert send() is False
    assert notifier.status("x") is False
    assert notifier.notify("READY=1") is False
    assert notifier._sock is None  # no socket was even opened

    async def scenario() -> None:
        await asyncio.wait_for(run_watchdog(notifier, asyncio.Event()), 1)

    asyncio.run(scenario())  # returns at once although the event is never set


def test_watchdog_pid_of_another_process_disables_watchdog(path_listener: Listener) -> None:
    other_pid = os.getppid()
    env = {
        "NOTIFY_SOCKET": path_listener.env_value,
        "WATCHDOG_USEC": "100000",
        "WATCHDOG_PID": str(other_pid),
    }
    notifier = SystemdNotifier(env)
    assert notifier.enabled  # other notifications still go out
    assert notifier.watchdog_interval() is None

    async def scenario() -> None:
        await asyncio.wait_for(run_watchdog(notifier, asyncio.Event()), 1)

    asyncio.run(scenario())  # run_watchdog returned: it will send nothing now
    assert path_listener.drain() == []  # and sent nothing (a send is queued at once)


@pytest.mark.parametrize(
    ("usec", "pid", "expected"),
    [
        (None, None, None),
        ("", None, None),
        ("0", None, None),
        ("-5", None, None),
        ("soon", None, None),
        ("30000000", None, 15.0),
        ("30000000", "self", 15.0),
        ("30000000", "garbage", None),
    ],
)
def test_watchdog_interval_from_environment(
    usec: str | None, pid: str | None, expected: float | None
) -> None:
    env = {"NOTIFY_SOCKET": "/run/systemd/notify"}
    if usec is not None:
        env["WATCHDOG_USEC"] = usec
    if pid is not None:
        env["WATCHDOG_PID"] = str(os.getpid()) if pid == "self" else pid
    assert SystemdNotifier(env).watchdog_interval() == expected


@pytest.mark.parametrize("value", ["", "relative/notify.sock", "vsock:2:1234"])
def test_unusable_address_disables(value: str) -> None:
    notifier = SystemdNotifier({"NOTIFY_SOCKET": value, "WATCHDOG_USEC": "100000"})
    assert not notifier.enabled
    assert notifier.watchdog_interval() is None
    assert notifier.ready() is False


def test_failures_never_raise_and_warn_once(caplog: pytest.LogCaptureFixture) -> None:
    tmpdir = tempfile.mkdtemp(prefix="kvd-notify-")
    try:
        gone = os.path.join(tmpdir, "nobody-listens.sock")
        notifier = SystemdNotifier({"NOTIFY_SOCKET": gone})
        with caplog.at_level(logging.DEBUG, logger="kvdepot.sdnotify"):
            assert notifier.ready() is False
            assert notifier.status("x") is False
            assert notifier.watchdog() is False
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1, caplog.text
        assert warnings[0].name == "kvdepot.sdnotify"
        assert gone in warnings[0].getMessage()
        notifier.close()
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


def test_recovers_when_listener_appears(caplog: pytest.LogCaptureFixture) -> None:
    # systemd re-creates its socket on daemon-reexec: sends must follow the path again.
    tmpdir = tempfile.mkdtemp(prefix="kvd-notify-")
    path = os.path.join(tmpdir, "notify.sock")
    try:
        with SystemdNotifier({"NOTIFY_SOCKET": path}) as notifier:
            with caplog.at_level(logging.WARNING, logger="kvdepot.sdnotify"):
                assert notifier.ready() is False
            sock = _bind(path)
            try:
                assert notifier.watchdog() is True
                assert Listener(sock, path).recv() == "WATCHDOG=1"
            finally:
                sock.close()
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


def _fill_queue(notifier: SystemdNotifier) -> int:
    """Send keep-alives until the listener's queue is full; returns how many went in."""
    sent = 0
    while notifier.watchdog():
        sent += 1
        assert sent < 100_000, "the queue never filled"
    return sent


def test_keepalive_never_waits_on_a_full_queue(path_listener: Listener) -> None:
    # A systemd that stops reading must not stall the daemon's event loop: keep-alives are
    # non-blocking and report failure once the queue is full.
    with SystemdNotifier({"NOTIFY_SOCKET": path_listener.env_value}) as notifier:
        start = time.monotonic()
        assert _fill_queue(notifier) >= 1
        results = [notifier.watchdog() for _ in range(1000)]
        elapsed = time.monotonic() - start
    assert elapsed < 2, elapsed
    assert not any(results)


def test_other_messages_wait_for_room(path_listener: Listener) -> None:
    # READY=1 must not be lost because PID 1 is momentarily behind: it waits for room.
    received: list[str] = []
    with SystemdNotifier({"NOTIFY_SOCKET": path_listener.env_value}) as notifier:
        queued = _fill_queue(notifier)

        def slow_reader() -> None:
            # Drain everything: depending on the host, the limit that was hit is the
            # receiver's queue length or the sender's buffer, which only wakes the sender
            # once mostly empty.
            time.sleep(0.2)
            while "READY=1" not in received:
                received.append(path_listener.recv())

        reader = threading.Thread(target=slow_reader)
        reader.start()
        start = time.monotonic()
        assert notifier.ready() is True
        elapsed = time.monotonic() - start
        reader.join(timeout=10)
    assert 0.1 <= elapsed < SEND_TIMEOUT_S, elapsed
    assert received == ["WATCHDOG=1"] * queued + ["READY=1"]


def test_wait_for_room_is_bounded(
    path_listener: Listener, caplog: pytest.LogCaptureFixture
) -> None:
    with SystemdNotifier({"NOTIFY_SOCKET": path_listener.env_value}) as notifier:
        _fill_queue(notifier)
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="kvdepot.sdnotify"):
            assert notifier.status("nobody reads this") is False
        elapsed = time.monotonic() - start
    assert SEND_TIMEOUT_S * 0.9 <= elapsed < SEND_TIMEOUT_S + 2, elapsed
    assert "failed" in caplog.text


def test_sends_from_threads_stay_whole(path_listener: Listener) -> None:
    # Status updates may come from a warm-up thread while the loop sends keep-alives. Every
    # datagram must arrive whole, and True must mean it arrived. The kernel's datagram queue
    # can be short (net.unix.max_dgram_qlen is 10 in some containers), so a reader drains it
    # concurrently and the senders may still see a full queue now and then.
    received: list[str] = []
    done = threading.Event()

    def reader() -> None:
        path_listener.sock.settimeout(0.05)
        while True:
            try:
                received.append(path_listener.sock.recv(4096).decode())
            except TimeoutError:
                if done.is_set():
                    return

    notifier = SystemdNotifier({"NOTIFY_SOCKET": path_listener.env_value})
    accepted: list[str] = []

    def sender(n: int) -> None:
        for i in range(50):
            text = f"thread {n} step {i}"
            if notifier.status(text):
                accepted.append(f"STATUS={text}")

    reader_thread = threading.Thread(target=reader)
    reader_thread.start()
    senders = [threading.Thread(target=sender, args=(n,)) for n in range(4)]
    for t in senders:
        t.start()
    for t in senders:
        t.join()
    done.set()
    reader_thread.join(timeout=10)
    notifier.close()
    assert accepted, "no send succeeded"
    assert sorted(received) == sorted(accepted)


def test_datagrams_carry_no_file_descriptors(path_listener: Listener) -> None:
    # systemd treats FDSTORE=1 specially; a plain notification must carry no SCM_RIGHTS.
    with SystemdNotifier({"NOTIFY_SOCKET": path_listener.env_value}) as notifier:
        notifier.ready()
    fds = array.array("i")
    path_listener.sock.settimeout(RECV_TIMEOUT_S)
    _, ancdata, _, _ = path_listener.sock.recvmsg(4096, socket.CMSG_SPACE(16 * fds.itemsize))
    assert all(kind != socket.SCM_RIGHTS for _, kind, _ in ancdata)


# --- the daemon, as systemd runs it ---------------------------------------------------------


def test_daemon_notifies_systemd(path_listener: Listener) -> None:
    """`kvdepot serve` with systemd's environment: READY=1 only once the socket accepts
    connections, WATCHDOG=1 at half of WATCHDOG_USEC, STOPPING=1 on SIGTERM, all from the
    daemon's own pid (NotifyAccess=main)."""
    import signal

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from tests.support.daemon import kvdepot_command

    workdir = tempfile.mkdtemp(prefix="kvd-sd-")
    sock_path = os.path.join(workdir, "kvdepot.sock")
    env = {
        **os.environ,
        "NOTIFY_SOCKET": path_listener.env_value,
        "WATCHDOG_USEC": "400000",  # keep-alive every 0.2 s
    }
    env.pop("WATCHDOG_PID", None)
    log_path = os.path.join(workdir, "daemon.log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [*kvdepot_command(), "serve", "--socket", sock_path, "--pool-size", "16MiB"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:

        def daemon_log() -> str:
            with open(log_path, errors="replace") as f:
                return f.read()

        # Until READY=1, at most STATUS/EXTEND_TIMEOUT messages; READY=1 must not be early.
        messages: list[str] = []
        deadline = time.monotonic() + 60
        while True:
            assert time.monotonic() < deadline, f"no READY=1 within 60 s:\n{daemon_log()}"
            assert proc.poll() is None, f"daemon exited {proc.returncode}:\n{daemon_log()}"
            try:
                msg, pid = path_listener.recv_with_pid(timeout=1)
            except TimeoutError:
                continue
            assert pid == proc.pid, (msg, pid, proc.pid)
            messages.append(msg)
            if "READY=1" in msg.split("\n"):
                break
            assert "WATCHDOG=1" not in msg.split("\n"), "keep-alive before READY=1"
        # Right now, with no retry: the socket accepts and the health service answers.
        with grpc.insecure_channel(f"unix://{sock_path}") as channel:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
        assert resp.status == health_pb2.HealthCheckResponse.SERVING

        # Keep-alives keep coming (STATUS= lines about the warm-up may come in between).
        keepalives: list[float] = []
        deadline = time.monotonic() + 30
        while len(keepalives) < 5:
            assert time.monotonic() < deadline, f"got {keepalives}, {messages}"
            msg, pid = path_listener.recv_with_pid(timeout=5)
            assert pid == proc.pid
            messages.append(msg)
            if "WATCHDOG=1" in msg.split("\n"):
                keepalives.append(time.monotonic())
        span = keepalives[-1] - keepalives[0]
        assert 0.2 * 4 * 0.5 <= span <= 0.4 * 4, (span, keepalives)

        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while True:
            assert time.monotonic() < deadline, f"no STOPPING=1: {messages[-5:]}"
            msg, pid = path_listener.recv_with_pid(timeout=30)
            assert pid == proc.pid
            messages.append(msg)
            if "STOPPING=1" in msg.split("\n"):
                break
        assert proc.wait(timeout=60) == 0, daemon_log()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


def test_a_channel_carries_the_messages_and_nobody_elses() -> None:
    # A shard's notifier (server/shards.py): its end of a socketpair, no NOTIFY_SOCKET
    # read; keep-alives never wait when the supervisor does not read, other messages
    # wait at most SEND_TIMEOUT_S; a closed supervisor end fails sends, never raises.
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    env = {"NOTIFY_SOCKET": "/nonexistent/notify", "WATCHDOG_USEC": "2000000"}
    with SystemdNotifier(env, channel=theirs) as notifier:
        assert notifier.enabled and notifier.watchdog_interval() == 1.0
        assert notifier.ready() and notifier.status("serving\nsecond line")
        mine.settimeout(5)
        assert mine.recv(4096) == b"READY=1"
        assert mine.recv(4096) == b"STATUS=serving second line"
        start = time.monotonic()
        assert _fill_queue(notifier) >= 1
        assert not any(notifier.watchdog() for _ in range(100))
        assert time.monotonic() - start < 2
        mine.close()
        assert notifier.status("gone") is False
