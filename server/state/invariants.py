"""The invariants that hold between any two steps of the daemon's event loop.

Checked after every state operation when the daemon runs with
KVDEPOT_CHECK_INVARIANTS=1 (the fuzz and fault tests do); a failure is logged
and sticks, and Admin/GetStats then answers INTERNAL. `@mutation` marks the
DepotState operations after which they are checked.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from kvdepot.server.core.kinds import SlotState

if TYPE_CHECKING:
    from kvdepot.server.state.depot import DepotState


def check_invariants(state: DepotState) -> None:
    """Raises AssertionError when the index, the allocator, the sessions and the
    registrations disagree."""
    state.index.check_invariants()
    sessions, registrations = state.sessions, state.registrations
    for s in sessions.values():
        for reg_id in s.registrations:
            reg = registrations.get(reg_id)
            assert reg is not None and reg.session_id == s.id and not reg.closing, (
                f"session {s.id} lists registration {reg_id}, which is gone or closing"
            )
    for reg in registrations.values():
        assert reg.inflight >= 0, f"registration {reg.id}: {reg.inflight} copies in flight"
        if reg.closing:  # kept only while copies still use its mapping
            assert reg.inflight > 0, f"registration {reg.id} closed but still mapped"
    for ns in state.index.namespaces.values():
        for slot in ns.slots.values():
            assert set(slot.pins or ()) <= sessions.keys(), (
                f"block {slot.key.hex()[:16]} pinned by a closed session"
            )
            if slot.state is SlotState.WRITING:
                writers = set((slot.writers or {}).values()) - state.internal_writers
                assert writers <= sessions.keys(), (
                    f"block {slot.key.hex()[:16]} reserved by a closed session"
                )
    assert state.traffic.inflight_jobs >= 0


F = TypeVar("F", bound=Callable[..., Any])


def mutation(fn: F) -> F:
    """Marks a state operation that may change the index, sessions or
    registrations: with KVDEPOT_CHECK_INVARIANTS=1 the invariants are checked
    when it returns (or raises)."""
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def run_async(self: DepotState, *args: Any, **kwargs: Any) -> Any:
            try:
                return await fn(self, *args, **kwargs)
            finally:
                self.verify_invariants()

        # functools.wraps keeps the signature F promises
        return run_async  # type: ignore[return-value]

    @functools.wraps(fn)
    def run(self: DepotState, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self, *args, **kwargs)
        finally:
            self.verify_invariants()

    # functools.wraps keeps the signature F promises
    return run  # type: ignore[return-value]
