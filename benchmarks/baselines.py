"""The machine's own limits, measured in the same run as the daemon's figures.

- copy bandwidth: one large memmove on one thread, and the same bytes cut into
  one slice per core copied at once (ctypes.memmove releases the GIL);
- the transport's floor: a bare gRPC bidi-stream echo of 200-byte messages
  between two processes over a Unix socket, the server on grpc.aio + uvloop
  (as the daemon), the client a sync channel feeding its stream from a queue
  (as the engines' TransferStream). The empty job's round trip is quoted
  against it.

    python -m kvdepot.bench.baselines echo-serve SOCKET   (started by the bench)
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import mmap
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import grpc

from kvdepot.bench.stats import GB, percentile

ECHO_METHOD = "/kvdepot.bench.Echo/Echo"
ECHO_BYTES = 200


def memmove_bandwidth(nbytes: int, reps: int = 3) -> dict[str, Any]:
    """Best-of-`reps` GB/s (bytes copied per second) of one and of all-core memmoves."""
    threads = os.cpu_count() or 1
    src, dst = mmap.mmap(-1, nbytes), mmap.mmap(-1, nbytes)
    try:
        s_addr = ctypes.addressof(ctypes.c_char.from_buffer(src))
        d_addr = ctypes.addressof(ctypes.c_char.from_buffer(dst))
        ctypes.memset(s_addr, 1, nbytes)  # pre-fault both: page faults are not copy speed
        ctypes.memset(d_addr, 2, nbytes)
        one = min(_timed(lambda: ctypes.memmove(d_addr, s_addr, nbytes)) for _ in range(reps))
        step = nbytes // threads

        def sliced() -> None:
            ts = [
                threading.Thread(
                    target=ctypes.memmove, args=(d_addr + i * step, s_addr + i * step, step)
                )
                for i in range(threads)
            ]
            for t in ts:
                t.start()
            for t in ts:
                t.join()

        every = min(_timed(sliced) for _ in range(reps))
        return {
            "bytes": nbytes,
            "threads": threads,
            "one_thread_gbps": nbytes / one / GB,
            "all_cores_gbps": step * threads / every / GB,
        }
    finally:
        src.close()
        dst.close()


def _timed(fn: Any) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def echo_floor(messages: int, warmup: int = 50) -> dict[str, Any]:
    """Round trips of a bare gRPC bidi-stream echo (a server process of its own)."""
    workdir = Path(tempfile.mkdtemp(prefix="kvdecho-"))
    sock = str(workdir / "echo.sock")
    server = subprocess.Popen(
        [sys.executable, "-m", "kvdepot.bench.baselines", "echo-serve", sock],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 20
        while not os.path.exists(sock):
            if server.poll() is not None or time.monotonic() > deadline:
                err = server.stderr.read().decode(errors="replace") if server.stderr else ""
                raise RuntimeError(f"the echo server did not start: {err[-2000:]}")
            time.sleep(0.02)
        with grpc.insecure_channel(f"unix://{sock}") as channel:
            call = channel.stream_stream(ECHO_METHOD)
            requests: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
            replies = call(iter(requests.get, None))
            payload = os.urandom(ECHO_BYTES)
            rtt = []
            for i in range(messages + warmup):
                t = time.perf_counter()
                requests.put(payload)
                if next(replies) != payload:
                    raise RuntimeError("the echo server answered other bytes")
                if i >= warmup:
                    rtt.append((time.perf_counter() - t) * 1e3)
            requests.put(None)
            for _ in replies:  # the server ends the stream after the client's end
                pass
        return {
            "transport": "gRPC bidi-stream echo, grpc.aio + uvloop server, sync client, "
            "Unix socket",
            "message_bytes": ECHO_BYTES,
            "messages": len(rtt),
            "rtt_ms": {"p50": percentile(rtt, 50), "p99": percentile(rtt, 99)},
        }
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        if server.stderr is not None:
            server.stderr.close()
        for p in workdir.iterdir():
            p.unlink()
        workdir.rmdir()


async def _serve_echo(sock: str) -> None:
    async def echo(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        async for msg in requests:
            yield msg

    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "kvdepot.bench.Echo", {"Echo": grpc.stream_stream_rpc_method_handler(echo)}
            ),
        )
    )
    server.add_insecure_port(f"unix://{sock}.tmp")
    await server.start()
    os.rename(f"{sock}.tmp", sock)  # the client waits for the final name: listening
    await server.wait_for_termination()


def _echo_main(argv: list[str]) -> int:
    import uvloop

    uvloop.install()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve_echo(argv[0]))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] != ["echo-serve"]:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(_echo_main(sys.argv[2:]))
