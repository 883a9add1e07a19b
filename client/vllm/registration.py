"""The registration thread of one worker rank.

Registrations die with the daemon: after every (re)connect this thread registers
again, for every namespace the worker has been asked to use (the base namespace
and the few most recent ones a connector reset moved to). It also:
- turns a refused pvm registration (no ptrace access) into an inline one, once,
  and says why in the log (`on_memory_changed`);
- while the worker is suspended (jobs got no answer in time), probes the daemon
  with a cheap call and lifts the suspension when it answers.

Callbacks run on this thread: `on_registered(namespace)` right after a namespace
became usable, `on_refused(namespace, reason)` when the daemon refused it for good.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import grpc

from kvdepot.client import DepotClient, DepotUnavailable
from kvdepot.client.fdpass import FdPassError
from kvdepot.client.vllm import memory_paths
from kvdepot.client.vllm.memory_paths import MemoryPath, MemoryPlan
from kvdepot.common.shards import RankRoute, shard_mismatch
from kvdepot.v1 import depot_pb2

log = logging.getLogger("kvdepot.vllm.worker")

# Registration errors that retrying cannot fix (the layout or memory is wrong).
PERMANENT = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.PERMISSION_DENIED,
}
RECENT_NAMESPACES = 4  # kept besides the base namespace


class Registrar:
    """Keeps one rank registered in every namespace it uses, across daemon restarts."""

    def __init__(
        self,
        client: DepotClient,
        plan: MemoryPlan,
        *,
        rank: int,
        namespace_id: str,
        make_layout: Callable[[str, list[list[int]]], depot_pb2.NamespaceLayout],
        layer_pages: list[list[int]],
        on_registered: Callable[[str], None],
        on_refused: Callable[[str, str], None],
        on_memory_changed: Callable[[MemoryPlan], None],
        route: RankRoute | None = None,
        node_shards: int = 1,
        units: int = 1,
    ) -> None:
        """`rank` is the rank on the daemon (on a shard: `route.rank`); `route` and
        `node_shards` say which shard the client must reach (unsharded: None, 1);
        `units` > 1: the registration stands for ranks [rank, rank + units) (a
        canonical namespace's units)."""
        self._client = client
        self._route = route
        self._node_shards = node_shards
        self.memory = plan
        self._rank = rank
        self._units = units
        self._make_layout = make_layout
        self._layer_pages = layer_pages
        self._on_registered = on_registered
        self._on_refused = on_refused
        self._on_memory_changed = on_memory_changed
        self._lock = threading.Lock()
        # namespace id -> registration id, valid for the current session only.
        self._registrations: dict[str, int] = {}
        self._wanted: list[str] = [namespace_id]
        self._refused: dict[str, str] = {}
        self._now = threading.Event()
        self._closed = threading.Event()
        self.suspended = False
        self._thread = threading.Thread(
            target=self._loop, name=f"kvdepot-register-r{rank}", daemon=True
        )

    def start(self) -> None:
        """Starts the thread (after the owner is ready for its callbacks)."""
        self._thread.start()
        self._client.add_disconnect_listener(self._on_disconnect)
        self._client.add_session_listener(self._on_session)

    # -- what the worker asks ---------------------------------------------------------------

    @property
    def current(self) -> str:
        """The namespace most recently asked for."""
        with self._lock:
            return self._wanted[-1]

    def registration(self, namespace_id: str) -> int | None:
        with self._lock:
            return self._registrations.get(namespace_id)

    def refused(self, namespace_id: str) -> str | None:
        with self._lock:
            return self._refused.get(namespace_id)

    @property
    def registered(self) -> bool:
        """Whether the current namespace is registered in the current session."""
        with self._lock:
            return self._wanted[-1] in self._registrations

    def wait_registered(self, timeout: float) -> bool:
        """Until the current namespace is registered (True), refused or `timeout` (False)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                current = self._wanted[-1]
                if current in self._registrations:
                    return True
                if current in self._refused:  # waiting longer cannot help
                    return False
            time.sleep(0.01)
        return self.registered

    def want(self, namespace_id: str) -> None:
        """Registers `namespace_id` soon (no-op when it is known already)."""
        with self._lock:
            if namespace_id not in self._wanted:
                self._wanted.append(namespace_id)
                del self._wanted[1:-RECENT_NAMESPACES]
        self._now.set()

    def suspend(self) -> None:
        """Jobs got no answer: probe the daemon until it answers again."""
        self.suspended = True
        self._now.set()

    def close(self) -> None:
        self._closed.set()
        self._now.set()

    # -- the thread ---------------------------------------------------------------------------

    def _on_session(self, boot_id: str) -> None:
        with self._lock:
            self._registrations = {}
            self._refused = {}
        self._now.set()

    def _on_disconnect(self) -> None:
        with self._lock:
            self._registrations = {}

    def _loop(self) -> None:
        while not self._closed.is_set():
            # Woken by want(), suspend(), a new session or a retry timer; only a
            # suspended rank polls (an idle wake would take the GIL from the engine).
            self._now.wait(0.5 if self.suspended else None)
            self._now.clear()
            if self._closed.is_set():
                return
            if not self._client.connected:
                continue
            if self.suspended:
                self._probe()
                continue
            with self._lock:
                todo = [
                    ns
                    for ns in self._wanted
                    if ns not in self._registrations and ns not in self._refused
                ]
            for ns in todo:
                if not self._register(ns):
                    break

    def _register(self, namespace_id: str) -> bool:
        """Registers one namespace; False when it must be retried later."""
        plan = self.memory
        hello = self._client.hello
        wrong = (
            None
            if self._route is None or hello is None
            else shard_mismatch(self._route, self._node_shards, hello.shard, hello.shard_count)
        )
        if wrong is not None:
            return self._refuse(namespace_id, wrong)
        try:
            session = self._client.session_id
            layout = self._make_layout(namespace_id, self._layer_pages)
            resp, note = memory_paths.register(
                self._client, plan, layout, self._rank, 10.0, self._units
            )
        except DepotUnavailable as exc:
            log.debug("kvdepot registration postponed: %s", exc)
            return False
        except FdPassError as exc:
            log.warning("kvdepot: passing the KV memory's fd failed (%s); retrying", exc)
            self._retry_later()
            return False
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            details = exc.details() if hasattr(exc, "details") else str(exc)
            if code in PERMANENT and plan.path is MemoryPath.PVM:
                self._fall_back_inline(f"the daemon refused the pvm path ({code}: {details})")
                self._now.set()
                return False
            if code in PERMANENT:
                return self._refuse(namespace_id, f"{code}: {details}")
            log.warning("kvdepot registration failed (%s: %s); retrying", code, details)
            self._retry_later()
            return False
        with self._lock:
            current = self._client.hello.session_id if self._client.hello else None
            if current != session or not self._client.connected or self.memory is not plan:
                self._now.set()  # a new session (or plan) began meanwhile: redo
                return False
            self._registrations[namespace_id] = resp.registration_id
        log.info(
            "kvdepot: rank %d registered in namespace %s (registration %d, %s)%s",
            self._rank,
            namespace_id,
            resp.registration_id,
            resp.memory_path or plan.path.value,
            f"; {note}" if note else "",
        )
        self._on_registered(namespace_id)
        return True

    def _refuse(self, namespace_id: str, reason: str) -> bool:
        """The daemon refused this registration, or is not the shard this rank needs:
        retrying will not change it (a new session, a restarted daemon, may)."""
        with self._lock:
            self._refused[namespace_id] = reason
        log.error(
            "kvdepot cannot register rank %d in namespace %s (%s); this rank "
            "offloads nothing in it until the daemon restarts",
            self._rank,
            namespace_id,
            reason,
        )
        self._on_refused(namespace_id, reason)
        return True

    def _fall_back_inline(self, reason: str) -> None:
        plan = memory_paths.inline_fallback(self.memory, reason)
        with self._lock:
            self.memory = plan
        memory_paths.log_choice(plan, self._rank)
        self._on_memory_changed(plan)

    def _probe(self) -> None:
        """Lifts the suspension once the daemon answers a cheap call again."""
        try:
            self._client.lookup(self._wanted[0], [], timeout=1.0)
        except DepotUnavailable:
            return
        except grpc.RpcError as exc:
            # Any answer (NOT_FOUND for a namespace it does not know, say) proves
            # the daemon is serving again; silence or a broken channel does not.
            if exc.code() in (
                grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.CANCELLED,
            ):
                return
        self.suspended = False
        log.warning("kvdepot daemon answers again; rank %d resumes transfers", self._rank)
        self._now.set()

    def _retry_later(self, delay: float = 0.5) -> None:
        timer = threading.Timer(delay, self._now.set)
        timer.daemon = True
        timer.start()
