"""One synthetic engine rank, in its own process, driven by the bench over a pipe.

    python -m kvdepot.bench.worker     (started by `kvdepot bench`, not by hand)

Protocol: one JSON object per line on stdin, one JSON reply per line on stdout
(`{"ok": true, ...}` or `{"ok": false, "error": ...}`). Commands:

- `setup`: allocate the rank's KV memfd and pre-fault it, create and pre-fault
  the private arena of the in-process limit, connect to the daemon and register.
- `run`: time a series of store or load jobs, through the daemon (`mode:
  "daemon"`) or in-process (`mode: "inproc"`), optionally starting at an agreed
  CLOCK_MONOTONIC instant so that several workers run side by side.
- `empty`: jobs that name no key (the floor of a job's round trip).
- `verify_store` / `verify_load`: a content check (store random pages, load
  them elsewhere, compare), so the bench never times a copy that does nothing.
- `exit`.

Being a separate process is the point: the daemon path is measured the way a
vLLM worker would see it, with its own interpreter, GIL and gRPC channel.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time
import traceback
from typing import Any

from kvdepot.bench.geometry import (
    BenchGeometry,
    JobShape,
    job_shape,
    kv_bytes,
    layout_pb,
    registration_pb,
    tensor_offsets,
)
from kvdepot.bench.inproc import InProcessCopier
from kvdepot.client import DepotClient, SharedKVBuffer
from kvdepot.common.jobs import Job
from kvdepot.v1 import depot_pb2 as pb

DIRECTIONS = {"store": pb.STORE, "load": pb.LOAD}


class Worker:
    """The state of one rank: its KV memory, its arena, its daemon session."""

    def __init__(self) -> None:
        self.geo: BenchGeometry | None = None
        self.buffer: SharedKVBuffer | None = None
        self.copier: InProcessCopier | None = None
        self.client: DepotClient | None = None
        self.stream: Any = None
        self.registration_id = 0
        self.next_job = 1

    # -- commands ------------------------------------------------------------------

    def setup(self, cmd: dict[str, Any]) -> dict[str, Any]:
        geo = self.geo = BenchGeometry(**cmd["geometry"])
        self.rank, self.engine = int(cmd["rank"]), int(cmd["engine"])
        self.num_blocks = int(cmd["num_blocks"])
        self.salt = bytes.fromhex(cmd["salt"])
        size = kv_bytes(geo, self.num_blocks)
        buf = self.buffer = SharedKVBuffer.allocate(size, name="kvdepot-bench-kv")
        # Pre-fault every page of the engine's KV memory (a live engine's cache is
        # resident): a first touch inside a timed copy would be measured as copy.
        ctypes.memset(buf.address, 0x40 + (self.engine * 8 + self.rank) % 64, size)
        offsets = tensor_offsets(geo, self.num_blocks)
        self.copier = InProcessCopier(
            geo, self.rank, buf.address, size, offsets, self.num_blocks, int(cmd["arena_bytes"])
        )
        target = cmd.get("target")
        if target:
            client = self.client = DepotClient(
                target, client_name=f"kvdepot-bench engine {self.engine} rank {self.rank}"
            ).start()
            if not client.wait_connected(15):
                raise RuntimeError(f"no kvdepot daemon answered at {target} within 15 s")
            tensors, refs = registration_pb(geo, self.num_blocks)
            reg = client.register_kv(
                layout_pb(geo, cmd["namespace"]), self.rank, buf, tensors, refs
            )
            self.registration_id = reg.registration_id
            self.stream = client.transfer_stream()
        self.copier.wait_warm()
        return {
            "kv_bytes": size,
            "arena_bytes": self.copier.arena.size,
            "registration_id": self.registration_id,
        }

    def _shapes(self, cmd: dict[str, Any]) -> list[tuple[JobShape, int]]:
        """Every job of a run, built before the clock starts: (shape, key set)."""
        assert self.geo is not None
        chunks, total = int(cmd["chunks"]), int(cmd["warmup"]) + int(cmd["jobs"])
        key_sets, seq0, pattern0 = (
            int(cmd.get("key_sets", 0)),
            int(cmd["key_seq"]),
            int(cmd["pattern"]),
        )
        out = []
        for j in range(total):
            s = j % key_sets if key_sets else j  # loads cycle over stored sets; stores are fresh
            shape = job_shape(
                self.geo,
                self.num_blocks,
                self.salt,
                self.engine,
                seq0 + s * chunks,
                chunks,
                pattern0 + j,
            )
            out.append((shape, s))
        return out

    def run(self, cmd: dict[str, Any]) -> dict[str, Any]:
        direction = DIRECTIONS[cmd["direction"]]
        shapes = self._shapes(cmd)
        start_at = cmd.get("start_at")
        if start_at is not None:
            delay = float(start_at) - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        warmup = int(cmd["warmup"])
        chunks = int(cmd["chunks"])
        if cmd["mode"] == "paired":
            return self._run_paired(direction, shapes, chunks, warmup)
        if cmd["mode"] == "inproc":
            jobs = self._run_inproc(direction, shapes, chunks)
            failed, dropped, error = 0, 0, ""
        else:
            jobs, failed, dropped, error = self._run_daemon(
                direction, shapes, max(1, int(cmd.get("depth", 1)))
            )
        return {"jobs": jobs[warmup:], "failed": failed, "dropped": dropped, "error": error}

    def _run_paired(
        self, direction: int, shapes: list[tuple[JobShape, int]], chunks: int, warmup: int
    ) -> dict[str, Any]:
        """Each job twice, in-process and through the daemon, back to back.

        Pairing job by job puts both modes in the same few milliseconds of a
        noisy machine. The order flips every job, so neither mode always finds
        the source pages still in the cache from the other's copy.
        """
        inproc: list[list[float]] = []
        daemon: list[list[float]] = []
        failed = dropped = 0
        error = ""
        for j, item in enumerate(shapes):
            for mode in ("inproc", "daemon") if j % 2 == 0 else ("daemon", "inproc"):
                if mode == "inproc":
                    inproc += self._run_inproc(direction, [item], chunks)
                else:
                    jobs, f, d, e = self._run_daemon(direction, [item], 1)
                    daemon += jobs
                    failed, dropped, error = failed + f, dropped + d, error or e
        return {
            "jobs": daemon[warmup:],
            "inproc_jobs": inproc[warmup:],
            "failed": failed,
            "dropped": dropped,
            "error": error,
        }

    def _run_inproc(
        self, direction: int, shapes: list[tuple[JobShape, int]], chunks: int
    ) -> list[list[float]]:
        assert self.copier is not None
        out = []
        for shape, key_set in shapes:
            t0 = time.monotonic()
            copy_s, nbytes = self.copier.run(direction, shape, chunks, key_set)
            t1 = time.monotonic()
            # Same record as a daemon job: the "server" time is all of it.
            out.append([t0, t1, nbytes, copy_s, t1 - t0])
        return out

    def _run_daemon(
        self, direction: int, shapes: list[tuple[JobShape, int]], depth: int
    ) -> tuple[list[list[float]], int, int, str]:
        if self.stream is None:
            raise RuntimeError("this worker has no daemon (setup without a target)")
        stream = self.stream
        out: list[list[float]] = []
        pending: dict[int, float] = {}  # job id -> submit time
        failed = dropped = 0
        error = ""
        i = 0
        while i < len(shapes) or pending:
            while i < len(shapes) and len(pending) < depth:
                shape = shapes[i][0]
                job_id = self.next_job
                self.next_job += 1
                job = Job(
                    job_id=job_id,
                    direction=direction,
                    registration_id=self.registration_id,
                    keys=shape.keys,
                    block_ids=shape.block_ids,
                    group_sizes=shape.group_sizes,
                    block_indices=shape.block_indices,
                )
                pending[job_id] = time.monotonic()
                stream.submit(job)
                i += 1
            oldest = min(pending)
            if not stream.wait({oldest}, timeout=120):
                raise RuntimeError(f"job {oldest} got no answer within 120 s")
            t1 = time.monotonic()
            for r in sorted(stream.poll(), key=lambda r: r.job_id):
                t0 = pending.pop(r.job_id)
                if not r.success:
                    failed += 1
                    error = error or f"{r.error_code}: {r.error}"
                dropped += r.dropped_keys
                out.append([t0, t1, r.bytes, r.copy_seconds, r.total_seconds])
        return out, failed, dropped, error

    def empty(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Jobs that name no key: the round trip of the job path with nothing to copy."""
        assert self.geo is not None
        groups = len(self.geo.groups)
        shape = JobShape([], [], [0] * groups, [0] * groups)
        jobs, failed, _, error = self._run_daemon(
            pb.STORE, [(shape, 0)] * (int(cmd["jobs"]) + int(cmd["warmup"])), 1
        )
        if failed:
            raise RuntimeError(f"empty jobs failed: {error}")
        return {"jobs": jobs[int(cmd["warmup"]) :]}

    def verify_store(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Fills one job's source pages with random bytes and stores them."""
        shape = self._verify_shape(cmd, pattern=-1)
        self._fill(shape, random_bytes=True)
        self.expected = self._pages(shape)
        jobs, failed, dropped, error = self._run_daemon(pb.STORE, [(shape, 0)], 1)
        if failed or dropped or jobs[0][2] == 0:
            raise RuntimeError(f"verification store failed: {error or 'keys dropped'}")
        return {}

    def verify_load(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Loads the stored chunk into other blocks and compares every byte."""
        store_shape = self._verify_shape(cmd, pattern=-1)
        shape = self._verify_shape(cmd, pattern=-2)
        if set(shape.block_ids) & set(store_shape.block_ids):
            # The check proves nothing if the load lands where the bytes already are.
            shape = JobShape(
                shape.keys,
                [(b + 1) % self.num_blocks for b in store_shape.block_ids],
                shape.group_sizes,
                shape.block_indices,
            )
        self._fill(shape, random_bytes=False)
        _, failed, _, error = self._run_daemon(pb.LOAD, [(shape, 0)], 1)
        if failed:
            raise RuntimeError(f"verification load failed: {error}")
        got = self._pages(shape)
        bad = sum(a != b for a, b in zip(got, self.expected, strict=True))
        return {"pages": len(got), "mismatched_pages": bad}

    # -- helpers -------------------------------------------------------------------

    def _verify_shape(self, cmd: dict[str, Any], pattern: int) -> JobShape:
        assert self.geo is not None
        return job_shape(
            self.geo,
            self.num_blocks,
            self.salt,
            self.engine,
            int(cmd["key_seq"]),
            int(cmd["chunks"]),
            pattern,
        )

    def _page_spans(self, shape: JobShape) -> list[tuple[int, int]]:
        """(offset, size) in the memfd of every page of a job, in job order."""
        assert self.geo is not None
        offsets = tensor_offsets(self.geo, self.num_blocks)
        spans, pos, layer0 = [], 0, 0
        for g, n in enumerate(shape.group_sizes):
            pages = self.geo.groups[g]
            for block in shape.block_ids[pos : pos + n]:
                for i, p in enumerate(pages):
                    spans.append((offsets[layer0 + i] + block * p, p))
            pos += n
            layer0 += len(pages)
        return spans

    def _fill(self, shape: JobShape, random_bytes: bool) -> None:
        assert self.buffer is not None
        mv = self.buffer.memoryview()
        for off, p in self._page_spans(shape):
            mv[off : off + p] = os.urandom(p) if random_bytes else bytes(p)

    def _pages(self, shape: JobShape) -> list[bytes]:
        assert self.buffer is not None
        mv = self.buffer.memoryview()
        return [bytes(mv[off : off + p]) for off, p in self._page_spans(shape)]

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
        if self.client is not None:
            self.client.close()
        if self.copier is not None:
            self.copier.close()


def main() -> int:
    # Replies own the real stdout; anything else printed goes to stderr (the log).
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    sys.stdout = sys.stderr
    worker = Worker()
    handlers = {
        "setup": worker.setup,
        "run": worker.run,
        "empty": worker.empty,
        "verify_store": worker.verify_store,
        "verify_load": worker.verify_load,
    }
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd.get("cmd") == "exit":
                break
            try:
                reply: dict[str, Any] = {"ok": True, **handlers[cmd["cmd"]](cmd)}
            except Exception as exc:
                traceback.print_exc()
                reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            replies.write(json.dumps(reply) + "\n")
    finally:
        worker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
