"""The worker's job ledger: every job between vLLM's submit and `get_finished`.

A job (kvdepot.common.jobs.Job) is, at any time, in at most one of: held (its
namespace is not registered yet), in flight on the Transfer stream, or in flight
on the inline thread; it leaves the ledger with a result. Results the daemon sent
are settled by `settle` on the model-runner thread; results decided in this
process (never sent, failed early, timed out, carried inline) go through
`finish_local` from any thread and wait in the ledger for the next `get_finished`.

Owned by one KVDepotOffloadingWorker, which shares its `lock` (a Condition: it is
notified whenever a job leaves held or inline flight). Called from the model-runner
thread, the registration thread and the inline thread; every method takes the lock
itself unless it says otherwise. `stats` are the worker's figures.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from vllm.v1.kv_offload.base import TransferResult

from kvdepot.common.jobs import Job, JobResult

log = logging.getLogger("kvdepot.vllm.worker")


@dataclass(slots=True)
class Submitted:
    """A job taken from vLLM and not reported yet: the job and the worker's bookkeeping."""

    job: Job
    submitted: float  # time.monotonic(): held and in-flight jobs time out from here
    cuda_event: torch.cuda.Event | None = None  # the inline path waits on it


class JobLedger:
    """Held and in-flight jobs of one worker, and the results not yet handed to vLLM."""

    def __init__(self, job_timeout: float) -> None:
        self.lock = threading.Condition()
        self.job_timeout = job_timeout
        self._jobs: dict[int, Submitted] = {}  # in flight, on either path
        self._on_stream: set[int] = set()
        self._held: dict[int, Submitted] = {}  # waiting for their namespace's registration
        self._local_pending: set[int] = set()
        self._local_results: list[TransferResult] = []
        self._failed_load_keys: set[bytes] = set()
        # Figures for tests, benchmarks and the connector.
        self.stats = {
            "stores": 0,
            "loads": 0,
            "failed_stores": 0,
            "failed_loads": 0,
            "dropped_keys": 0,
            "registrations": 0,
            "abandoned": 0,
            "held": 0,
        }

    # -- held jobs ----------------------------------------------------------------------

    def hold_unless_registered(
        self, entry: Submitted, registration: Callable[[str], int | None]
    ) -> int | None:
        """The registration of the job's namespace; if there is none yet, the job is held
        (looked up and held under the lock, so a registration cannot slip between)."""
        with self.lock:
            found = registration(entry.job.namespace_id)
            if found is None:
                self._held[entry.job.job_id] = entry
                self.stats["held"] += 1
            return found

    def release_held(self, namespace_id: str, inline: bool | None) -> list[Submitted]:
        """Takes the namespace's held jobs, expedited first, then oldest first. With
        `inline` not None they are claimed as in flight on that path before anyone
        waiting is woken (wait() must find them in flight)."""
        with self.lock:
            held = [s for s in self._held.values() if s.job.namespace_id == namespace_id]
            for entry in held:
                del self._held[entry.job.job_id]
                if inline is not None:
                    self.claim(entry, inline)
            self.lock.notify_all()
        return sorted(held, key=lambda s: (not s.job.expedited, s.submitted))

    def take_all_held(self) -> list[Submitted]:
        with self.lock:
            held, self._held = list(self._held.values()), {}
        return held

    def expire_held(self, now: float, only: set[int] | None = None) -> None:
        """Fails held jobs whose namespace did not register within the job timeout."""
        with self.lock:
            expired = [
                s
                for s in self._held.values()
                if (only is None or s.job.job_id in only) and now - s.submitted >= self.job_timeout
            ]
            for entry in expired:
                del self._held[entry.job.job_id]
        for entry in expired:
            self.fail_local(
                entry.job,
                f"namespace {entry.job.namespace_id} was not registered within "
                f"{self.job_timeout:.1f}s (kvdepot_job_timeout_s)",
            )

    def wait_held(self, ids: set[int]) -> None:
        """Until none of `ids` is held, or the oldest of them has been for the timeout."""
        with self.lock:
            while ids & self._held.keys():
                oldest = min(self._held[j].submitted for j in ids & self._held.keys())
                remaining = oldest + self.job_timeout - time.monotonic()
                if remaining <= 0:
                    break
                self.lock.wait(remaining)

    # -- in flight ----------------------------------------------------------------------

    def claim(self, entry: Submitted, inline: bool) -> None:
        """Records a job as in flight on the inline thread or the stream (lock held)."""
        self._jobs[entry.job.job_id] = entry
        if inline:
            self._local_pending.add(entry.job.job_id)
        else:
            self._on_stream.add(entry.job.job_id)

    def on_stream(self, ids: set[int] | None = None) -> set[int]:
        """The jobs in flight on the stream (of `ids`, if given)."""
        with self.lock:
            return set(self._on_stream) if ids is None else ids & self._on_stream

    def overdue(self, now: float) -> set[int]:
        """Jobs on the stream whose answer is later than the job timeout."""
        with self.lock:
            return {
                j
                for j in self._on_stream
                if (entry := self._jobs.get(j)) is not None
                and now - entry.submitted > self.job_timeout
            }

    def abandon(self, job_ids: set[int]) -> None:
        """Gives up on jobs on the stream: each fails now, and a late answer is ignored."""
        for job_id in job_ids:
            with self.lock:
                self._on_stream.discard(job_id)
                entry = self._jobs.get(job_id)
            self.stats["abandoned"] += 1
            if entry is not None:
                self.fail_local(entry.job, "no answer in time")

    def wait_local(self, ids: set[int], deadline: float) -> None:
        """Until none of `ids` is in flight on the inline thread, or `deadline`."""
        with self.lock:
            while ids & self._local_pending:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self.lock.wait(remaining)

    # -- results ------------------------------------------------------------------------

    def settle(self, r: JobResult) -> TransferResult | None:
        """A result from the stream (model-runner thread); None for a job abandoned
        after a timeout, whose result came late."""
        with self.lock:
            self._on_stream.discard(r.job_id)
            entry = self._jobs.pop(r.job_id, None)
        if entry is None:
            return None
        job = entry.job
        if r.success:
            if job.is_load:
                self.stats["loads"] += 1
            else:
                self.stats["stores"] += 1
                self.stats["dropped_keys"] += r.dropped_keys
        else:
            self._count_failure(job.is_load, job.keys, f"{r.error_code or 'FAILED'}: {r.error}")
        return vllm_result(r)

    def fail_local(self, job: Job, error: str) -> None:
        self.finish_local(job, JobResult(job.job_id, False, error=error))

    def finish_local(self, job: Job, result: JobResult) -> None:
        """Reports a job that ended in this process (any thread): never sent, failed
        before the daemon answered, or carried by the inline thread."""
        if not result.success:
            self._count_failure(job.is_load, job.keys, result.error)
        elif job.keys:
            self.stats["loads" if job.is_load else "stores"] += 1
        with self.lock:
            self._jobs.pop(job.job_id, None)
            self._local_pending.discard(job.job_id)
            self._local_results.append(vllm_result(result))
            self.lock.notify_all()

    def take_local_results(self) -> list[TransferResult]:
        with self.lock:
            results, self._local_results = self._local_results, []
        return results

    def take_failed_load_keys(self) -> set[bytes]:
        """Keys of loads that failed since the last call."""
        with self.lock:
            keys, self._failed_load_keys = self._failed_load_keys, set()
        return keys

    def _count_failure(self, is_load: bool, keys: Sequence[bytes], error: str) -> None:
        if is_load:
            with self.lock:
                self.stats["failed_loads"] += 1
                self._failed_load_keys.update(keys)
            log.warning(
                "kvdepot load of %d keys failed (%s); vLLM recomputes them", len(keys), error
            )
        else:
            self.stats["failed_stores"] += 1
            log.debug("kvdepot store of %d keys failed: %s", len(keys), error)


def vllm_result(r: JobResult) -> TransferResult:
    """vLLM's form of a result: size and time only for a success."""
    if not r.success:
        return TransferResult(job_id=r.job_id, success=False)
    return TransferResult(
        job_id=r.job_id,
        success=True,
        transfer_size=r.bytes,
        transfer_time=r.copy_seconds or r.total_seconds,
    )
