"""DepotState is the only API the gRPC services call (docs/architecture.md §2).

The services (server/service/*.py) translate messages onto DepotState's methods;
they never reach around it into the parts it owns (the block index, the remote
tier, the namespace access rules, ...), whose use the state keeps consistent
(membership checks, batch limits, invariants). This reads each service module's
syntax tree and fails on any such reach, e.g. `self.state.index.allocator`, and
on any import of the remote tier (a servicer holding a RemoteLink beside the state).

Those methods are plain, typed methods (help() and a type checker read them), and one
that hands a call to a facet has that facet method's signature; a property hands out
no container the services could change.
"""

from __future__ import annotations

import ast
import inspect
import typing
from collections.abc import Mapping, MutableMapping, MutableSequence, MutableSet
from pathlib import Path

from kvdepot.server.core.index import BlockIndex
from kvdepot.server.state.admin_evict import AdminEviction
from kvdepot.server.state.admin_queries import AdminQueries
from kvdepot.server.state.depot import DepotState
from kvdepot.server.state.key_calls import KeyCalls
from kvdepot.server.state.registry import SessionRegistry
from kvdepot.server.state.sessions import Sessions
from kvdepot.server.state.tiers import TiersBelow

REPO = Path(__file__).resolve().parents[1]
SERVICES = sorted((REPO / "server" / "service").glob("*.py"))

# DepotState's parts (server/state/depot.py): the services go through its methods.
PARTS = {
    "index",
    "tiers",
    "arena",
    "bus",
    "copy_queue",
    "jobs",
    "inline",
    "access",
    "admin",
    "listing",
    "journal",
    "traffic",
    "_sessions",
    # Its facets: the services make their calls on the state itself (its methods).
    "registry",
    "keys",
    "queries",
}


def _is_state(node: ast.expr) -> bool:
    """`st`, `state`, or anything's `.state` (self.state, self.lanes.state)."""
    if isinstance(node, ast.Name):
        return node.id in ("st", "state")
    return isinstance(node, ast.Attribute) and node.attr == "state"


def state_uses(source: str) -> tuple[list[str], list[str]]:
    """(every attribute read off the state, those that are its parts), as
    "line: attribute"."""
    used, reached = [], []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and _is_state(node.value):
            where = f"{node.lineno}: .{node.attr}"
            used.append(where)
            if node.attr in PARTS:
                reached.append(where)
    return used, reached


def remote_imports(source: str) -> list[str]:
    """Imports of a tier below the pool (kvdepot.server.remote..., kvdepot.server.disk...),
    also under TYPE_CHECKING."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        found += [
            f"{node.lineno}: {n}"
            for n in names
            if n.startswith(("kvdepot.server.remote", "kvdepot.server.disk"))
        ]
    return found


def test_the_check_finds_a_reach_around_the_state() -> None:
    for reach in (
        "capacity = self.state.index.allocator.capacity",
        "async def f(st):\n    return await st.tiers.prefetch(ns, keys)",
        "self.lanes.state.access.member(sid, ns)",
    ):
        assert state_uses(reach)[1], reach
    assert not state_uses("capacity = self.state.capacity_bytes")[1]
    assert remote_imports(
        "if TYPE_CHECKING:\n    from kvdepot.server.remote.link import RemoteLink"
    )
    assert remote_imports("from kvdepot.server import remote")


def test_the_services_call_only_depot_state() -> None:
    assert {p.name for p in SERVICES} >= {"admin.py", "depot.py", "job_lane.py"}
    seen = 0
    for path in SERVICES:
        used, reached = state_uses(path.read_text())
        seen += len(used)
        assert not reached, (
            f"{path.relative_to(REPO)} reaches around DepotState into its parts at "
            f"{reached}: add a DepotState method instead"
        )
        assert not remote_imports(path.read_text()), (
            f"{path.relative_to(REPO)} imports the remote tier: DepotState owns it"
        )
    assert seen > 20  # the services do call the state: the check looked at something


# DepotState's attributes that are facets (or parts) whose calls it offers as its own.
FACETS = {
    "registry": SessionRegistry,
    "keys": KeyCalls,
    "tiers": TiersBelow,
    "queries": AdminQueries,
    "admin": AdminEviction,
    "_sessions": Sessions,
}


def forwarders(source: str) -> dict[str, tuple[str, str]]:
    """DepotState's methods that call `self.<facet>.<their own name>(...)`:
    name -> (facet attribute, facet method)."""
    tree = ast.parse(source)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DepotState")
    found = {}
    for fn in cls.body:
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) or any(
            isinstance(d, ast.Name) and d.id == "property" for d in fn.decorator_list
        ):
            continue  # a property reads a value: the other test checks its type
        for node in ast.walk(fn):
            if (
                isinstance(node, ast.Attribute)
                and node.attr == fn.name
                and isinstance(node.value, ast.Attribute)
                and isinstance(node.value.value, ast.Name)
                and node.value.value.id == "self"
                and node.value.attr in FACETS
            ):
                found[fn.name] = (node.value.attr, node.attr)
    return found


def untyped(cls: type, shared: frozenset[str] = frozenset()) -> list[str]:
    """What help() or a type checker cannot read of `cls`' public calls: a method
    without a return or parameter type, and a property that hands out a container the
    caller could change (but those in `shared`, handed out by design)."""
    faults = []
    for name, member in vars(cls).items():
        if name.startswith("_"):
            continue
        if inspect.isfunction(member):
            sig = inspect.signature(member)
            params = list(sig.parameters.values())[1:]
            if sig.return_annotation is inspect.Signature.empty or any(
                p.annotation is inspect.Signature.empty for p in params
            ):
                faults.append(f"{cls.__name__}.{name}{sig} is not fully typed")
        elif isinstance(member, property) and name not in shared:
            returned = typing.get_type_hints(member.fget)["return"]
            origin = typing.get_origin(returned) or returned
            if isinstance(origin, type) and issubclass(
                origin, MutableMapping | MutableSequence | MutableSet
            ):
                faults.append(f"{cls.__name__}.{name} hands out a {returned} to change")
    return faults


def test_depot_state_calls_are_typed_methods() -> None:
    assert {"lookup", "open_session", "prefetch", "namespaces"} <= set(vars(DepotState))
    assert untyped(DepotState) == []
    # The sessions and registrations come out read-only.
    for name in ("sessions", "registrations"):
        prop = vars(DepotState)[name]
        assert typing.get_origin(typing.get_type_hints(prop.fget)["return"]) is Mapping


def test_the_block_index_calls_are_typed_methods() -> None:
    # internal_writers is the state's own set, which the index reads (DepotState's
    # add_internal_writer adds to it).
    assert untyped(BlockIndex, frozenset({"internal_writers"})) == []


def test_the_typing_check_finds_an_untyped_call() -> None:
    class Loose:
        def call(self, key):  # untyped on purpose
            return key

        @property
        def table(self) -> dict[str, int]:
            return {}

    assert len(untyped(Loose)) == 2


def test_a_call_handed_to_a_facet_keeps_the_facets_signature() -> None:
    forwarded = forwarders((REPO / "server" / "state" / "depot.py").read_text())
    assert {"lookup", "open_session", "prefetch", "evict_in_slices", "deny"} <= set(forwarded)
    assert len(forwarded) > 30  # the check found the forwarders
    for name, (facet, method_name) in forwarded.items():
        theirs = getattr(FACETS[facet], method_name)
        ours = getattr(DepotState, name)
        assert inspect.signature(ours) == inspect.signature(theirs), (
            f"DepotState.{name}{inspect.signature(ours)} differs from "
            f"{FACETS[facet].__name__}.{method_name}{inspect.signature(theirs)}"
        )
        assert inspect.iscoroutinefunction(ours) == inspect.iscoroutinefunction(theirs), name
        assert ours.__doc__, f"DepotState.{name} has no docstring"
