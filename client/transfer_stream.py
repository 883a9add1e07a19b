"""`TransferStream`: one worker's Transfer jobs and their results, on a job lane or gRPC.

Made by `DepotClient.transfer_stream`. Jobs go on a job lane where the daemon offers
one (kvdepot.client.job_lane: a Unix socket pair, one datagram per job, sent from the
caller's thread), else on a bidirectional `Transfer` stream on the client's sync
channel (docs/architecture.md §3, 'Job lanes').

Threads:
- `submit`, `poll`, `wait`, `abort`, `close`, `inflight`, `uses_lane`: any caller
  thread (a vLLM worker's model-runner thread); `submit` never blocks.
- A reader thread per gRPC stream ("kvdepot-transfer") and per lane ("kvdepot-job-lane",
  run by the lane's kvdepot.client.lane_keeper.LaneKeeper) files each result under
  `_lock`, a Condition that `wait` sleeps on (and the keeper's lock too);
  gRPC runs the request iterator on a thread of its own.

Jobs come in as kvdepot.common.jobs.Job and results go out as JobResult: each job is
encoded once in `submit`, each result decoded once on the reader thread that got it
(kvdepot.client.job_codec), so callers never see a protobuf message.

Ownership: the stream owns its gRPC call, its lane and every job in flight until the
job has a result; a stream or lane that breaks, and `abort`, answer that job with a
failed result (UNAVAILABLE or CANCELLED), so no job is ever left without one. Memory
a LOAD targets stays the caller's; the daemon may write it until the job's result
arrives, and after `abort` until a copy already running ends (see `abort`).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Protocol

import grpc

from kvdepot.client.job_codec import job_to_proto, result_from_proto
from kvdepot.client.job_lane import SYNC_OPEN_TIMEOUT, ClientLane, LaneOwner, read_results
from kvdepot.client.job_lane import enabled_by_env as job_lane_enabled_by_env
from kvdepot.client.lane_keeper import LaneKeeper
from kvdepot.client.session import DepotUnavailable
from kvdepot.common.jobs import Job, JobResult
from kvdepot.v1 import depot_pb2

_STREAM_END = object()


class TransferOwner(LaneOwner, Protocol):
    """What a stream asks of its client (DepotClient) beyond its lane's: the call."""

    def open_transfer_call(
        self, requests: Iterator[depot_pb2.TransferJob], session_id: str
    ) -> grpc.Future: ...


class TransferStream:
    """One bidirectional Transfer stream: submit jobs, collect results.

    `submit` never blocks. Results are kept until `poll` takes them; `wait`
    blocks until the named jobs have results (or the timeout passes). When the
    stream breaks, every job in flight gets a failed result; the next `submit`
    opens a new stream.

    Where the daemon offers one, jobs go on a job lane instead (kvdepot.client.job_lane:
    a Unix socket pair, the same messages, no gRPC and no thread hand-off on the
    way out), opened with the stream (or in the background when the client was not
    connected yet, or after a break); until it is open, for jobs that do not fit
    in a datagram, and with `job_lane=False` or KVDEPOT_JOB_LANE=0, they go on the
    gRPC stream. A lane that breaks fails its jobs in flight like a broken stream.
    """

    def __init__(
        self, client: TransferOwner, job_lane: bool | None = None, *, open_lane_now: bool = True
    ) -> None:
        self.client = client
        self._lock = threading.Condition()
        # job id -> generation: > 0 a gRPC stream's, < 0 a lane's (LaneKeeper's)
        self._inflight: dict[int, int] = {}
        self._done: dict[int, JobResult] = {}
        self._requests: queue.SimpleQueue[object] | None = None
        self._call: grpc.Future | None = None
        self._generation = 0
        wanted = job_lane_enabled_by_env() if job_lane is None else job_lane
        # Every job asks for the lane (`submit`): a break waits for the next job.
        self._lanes = LaneKeeper(
            client,
            depot_pb2.LANE_TRANSFER_JOBS,
            "job",
            wanted=wanted,
            lock=self._lock,
            reader=self._read_lane,
            lost=self._lane_broke,
            reopen_on_break=False,
        )
        # Connected: open the lane now (a few ms, once) so that every job takes it;
        # later (re)opens happen in the background while jobs use the gRPC stream.
        self._lanes.want(wait_s=SYNC_OPEN_TIMEOUT if open_lane_now else None)

    @property
    def uses_lane(self) -> bool:
        """True while jobs go on a job lane (informational; results arrive alike)."""
        with self._lock:
            return self._lanes.lane is not None

    def _read_lane(self, lane: ClientLane, generation: int) -> str:
        """The lane's reader (on its thread): files each datagram's results under one
        lock hold; returns why the lane ended."""

        def deliver(results: list[JobResult]) -> None:
            with self._lock:
                for result in results:
                    # A job aborted meanwhile already has its (CANCELLED) result.
                    if self._inflight.get(result.job_id) == generation:
                        del self._inflight[result.job_id]
                        self._done[result.job_id] = result
                self._lock.notify_all()

        return read_results(lane, deliver)

    def _lane_broke(self, generation: int, error: str) -> None:
        for job_id, gen in list(self._inflight.items()):
            if gen == generation:
                self._fail(job_id, error)
        self._lock.notify_all()

    # -- the gRPC stream ---------------------------------------------------------------

    def _requests_iter(self, q: queue.SimpleQueue[object]) -> Iterator[depot_pb2.TransferJob]:
        while True:
            item = q.get()
            if item is _STREAM_END:
                return
            # the queue holds TransferJobs and the end marker, tested just above
            yield item  # type: ignore[misc]

    def _open(self, session_id: str) -> queue.SimpleQueue[object]:
        """The gRPC stream, opened as `session_id`'s (the daemon reads none of its jobs
        before it knows that session: server/service/gate.py)."""
        q: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._generation += 1
        generation = self._generation
        call = self._call = self.client.open_transfer_call(self._requests_iter(q), session_id)
        threading.Thread(
            target=self._read, args=(call, q, generation), name="kvdepot-transfer", daemon=True
        ).start()
        return q

    def _read(
        self,
        call: Iterable[depot_pb2.TransferResult],
        q: queue.SimpleQueue[object],
        generation: int,
    ) -> None:
        error = "the Transfer stream ended"
        try:
            for msg in call:
                result = result_from_proto(msg)  # decoded here, outside the lock
                with self._lock:
                    self._inflight.pop(result.job_id, None)
                    self._done[result.job_id] = result
                    self._lock.notify_all()
        except grpc.RpcError as exc:
            error = f"the Transfer stream broke: {exc.code() if hasattr(exc, 'code') else exc}"
        with self._lock:
            if self._requests is q:
                self._requests = None
            # Only this generation's jobs were on the broken stream.
            for job_id, gen in list(self._inflight.items()):
                if gen == generation:
                    self._fail(job_id, error)
            self._lock.notify_all()
        q.put(_STREAM_END)  # ends the request-iterator thread gRPC runs

    def _fail(self, job_id: int, error: str, code: str = "UNAVAILABLE") -> None:
        self._inflight.pop(job_id, None)
        self._done[job_id] = JobResult(job_id, False, error=error, error_code=code)

    def abort(self, reason: str = "aborted by the client") -> None:
        """Cancels the stream: every job in flight fails now (error_code CANCELLED).

        The daemon skips the cancelled jobs it has not started; a copy already
        running cannot be stopped and finishes in the daemon, so memory a LOAD
        targets must not be handed out again unless the daemon is known to be
        frozen or gone. The next `submit` opens a new stream (and lane).
        """
        with self._lock:
            call, self._call = self._call, None
            requests, self._requests = self._requests, None
            self._lanes.drop()
            for job_id in list(self._inflight):
                self._fail(job_id, reason, "CANCELLED")
            self._lock.notify_all()
        if requests is not None:
            requests.put(_STREAM_END)
        if call is not None:
            call.cancel()

    def submit(self, job: Job) -> None:
        """Sends `job` (its session_id, if empty, becomes the client's session);
        a job that cannot go now gets a failed result (UNAVAILABLE) instead."""
        with self._lock:
            if job.job_id in self._inflight or job.job_id in self._done:
                raise ValueError(f"job id {job.job_id} is already in use on this stream")
            try:
                if not job.session_id:
                    job.session_id = self.client.session_id
            except DepotUnavailable as exc:
                self._fail(job.job_id, f"kvdepot daemon unavailable: {exc}")
                self._lock.notify_all()
                return
            # The job's one encoding; one the wire cannot carry (a negative id) raises.
            msg = job_to_proto(job)
            try:
                lane = self._lanes.lane_for(job.session_id)
                if lane is not None and self._lanes.send(lane, msg.SerializeToString()):
                    self._inflight[job.job_id] = self._lanes.generation
                    return
                if self._requests is None:
                    self._requests = self._open(job.session_id)
            except (DepotUnavailable, grpc.RpcError, ValueError) as exc:
                self._fail(job.job_id, f"kvdepot daemon unavailable: {exc}")
                self._lock.notify_all()
                return
            self._inflight[job.job_id] = self._generation
            self._requests.put(msg)

    def poll(self) -> list[JobResult]:
        """Takes every result that arrived since the last call, failures included."""
        with self._lock:
            done, self._done = list(self._done.values()), {}
        return done

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> bool:
        """Blocks until every job in `job_ids` has a result; False on timeout."""
        ids = set(job_ids)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while True:
                missing = {j for j in ids if j not in self._done}
                if not missing:
                    return True
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._lock.wait(remaining)

    @property
    def inflight(self) -> int:
        with self._lock:
            return len(self._inflight)

    def close(self) -> None:
        """Ends the stream (and lane): the daemon answers the jobs it has, then closes."""
        with self._lock:
            self._lanes.finish()
            if self._requests is not None:
                self._requests.put(_STREAM_END)
                self._requests = None
