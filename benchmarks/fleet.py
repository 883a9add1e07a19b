"""The worker processes (engine ranks) and the pipe protocol that drives them."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class WorkerError(RuntimeError):
    """A worker refused a command or died; carries the tail of its log."""


@dataclass
class WorkerProc:
    engine: int
    rank: int
    proc: subprocess.Popen[str]
    log_path: Path

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-3000:]
        except OSError:
            return ""


class Fleet:
    """`engines` x `tp` worker processes; commands go to a subset and run concurrently."""

    def __init__(self, engines: int, tp: int) -> None:
        self.logdir = Path(tempfile.mkdtemp(prefix="kvdbench-workers-"))
        self.workers: list[WorkerProc] = []
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        for e in range(engines):
            for r in range(tp):
                log_path = self.logdir / f"engine{e}-rank{r}.log"
                with open(log_path, "w") as log:
                    proc = subprocess.Popen(
                        [sys.executable, "-m", "kvdepot.bench.worker"],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=log,
                        text=True,
                        env=env,
                    )
                self.workers.append(WorkerProc(e, r, proc, log_path))

    def engine_workers(self, engines: int) -> list[WorkerProc]:
        """The ranks of the first `engines` engines."""
        return [w for w in self.workers if w.engine < engines]

    def call(
        self, workers: list[WorkerProc], make: Any, synchronized: bool = False
    ) -> list[dict[str, Any]]:
        """Sends `make(worker)` to each worker, then collects every reply.

        With `synchronized`, every command carries one `start_at` instant a little
        in the future, so the workers begin their timed loops together.
        """
        start_at = time.monotonic() + 0.05 + 0.02 * len(workers) if synchronized else None
        for w in workers:
            cmd = dict(make(w))
            if start_at is not None:
                cmd["start_at"] = start_at
            self._send(w, cmd)
        return [self._receive(w) for w in workers]

    def setup(
        self,
        target: str,
        geometry: dict[str, Any],
        num_blocks: int,
        salt: bytes,
        namespace: str,
        arena_bytes: int,
    ) -> None:
        """Every worker builds its KV memory and registers it with the daemon at `target`."""
        self.call(
            self.workers,
            lambda w: {
                "cmd": "setup",
                "target": target,
                "geometry": geometry,
                "rank": w.rank,
                "engine": w.engine,
                "num_blocks": num_blocks,
                "salt": salt.hex(),
                "namespace": namespace,
                "arena_bytes": arena_bytes,
            },
        )

    def _send(self, w: WorkerProc, cmd: dict[str, Any]) -> None:
        assert w.proc.stdin is not None
        try:
            w.proc.stdin.write(json.dumps(cmd) + "\n")
            w.proc.stdin.flush()
        except OSError as exc:
            raise WorkerError(self._describe(w, f"cannot reach the worker: {exc}")) from None

    def _receive(self, w: WorkerProc) -> dict[str, Any]:
        assert w.proc.stdout is not None
        line = w.proc.stdout.readline()
        if not line:
            w.proc.wait(timeout=5)
            raise WorkerError(self._describe(w, f"the worker exited ({w.proc.returncode})"))
        reply = json.loads(line)
        if not reply.get("ok"):
            raise WorkerError(self._describe(w, reply.get("error", "failed")))
        return reply

    @staticmethod
    def _describe(w: WorkerProc, what: str) -> str:
        return f"engine {w.engine} rank {w.rank}: {what}\n--- worker log ---\n{w.log_tail()}"

    def close(self) -> None:
        for w in self.workers:
            if w.proc.poll() is None and w.proc.stdin is not None:
                try:
                    w.proc.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
                    w.proc.stdin.close()
                except OSError:
                    pass
        for w in self.workers:
            try:
                w.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait(timeout=5)
        for w in self.workers:
            w.log_path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # a log someone opened stays
            self.logdir.rmdir()
