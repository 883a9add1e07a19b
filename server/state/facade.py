"""How `DepotState` offers its facets' calls as its own.

`DepotState` (kvdepot.server.state.depot) is the one object the gRPC services call,
but the calls are written in facets with one job each (sessions and registrations,
calls on a joined namespace's keys, the tiers below the pool, the operators'
queries). A row `open_session = forward("registry", SessionRegistry.open_session)`
in `DepotState` names the facet attribute and the method that answers the call, so
the services' `state.open_session(...)` is `state.registry.open_session(...)`
without a wrapper written out per call. Naming the method itself (not a string)
keeps its signature and docstring for readers and type checkers, and a row that
names a method the facet lacks fails at import.

The row is a property whose getter is `operator.attrgetter` (C, no Python frame):
reading it costs about half a hand-written wrapper's call. The calls on a job's
path are written on `DepotState` itself. `forward_value` is the same for a facet's
attribute or property (a value, not a call); its row is annotated with the value's
type, read-only where the value is a container (`sessions: Mapping[str, Session]`),
so that type checkers read it and the services get no handle to change it.
"""

from __future__ import annotations

from collections.abc import Callable
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")

if TYPE_CHECKING:

    class Forwarded(Generic[P, R]):
        """What a row is to a type checker: a descriptor whose value is the facet's
        method, bound (a plain Callable class attribute would be bound to the state)."""

        def __get__(self, obj: object, owner: type | None = None) -> Callable[P, R]: ...

    def forward(part: str, method: Callable[Concatenate[Any, P], R]) -> Forwarded[P, R]: ...

else:

    def forward(part: str, method: Callable[..., Any]) -> property:
        """`self.<part>.<method's name>`, bound: the facet's method as the state's."""
        return property(attrgetter(f"{part}.{method.__name__}"), doc=method.__doc__)


def forward_value(path: str, doc: str) -> Any:
    """A read-only attribute that reads `self.<path>` ("part.name")."""
    return property(attrgetter(path), doc=doc)
