"""DepotState is the only API the gRPC services call (docs/architecture.md §2).

The services (server/service/*.py) translate messages onto DepotState's methods;
they never reach around it into the parts it owns (the block index, the remote
tier, the namespace access rules, ...), whose use the state keeps consistent
(membership checks, batch limits, invariants). This reads each service module's
syntax tree and fails on any such reach, e.g. `self.state.index.allocator`, and
on any import of the remote tier (a servicer holding a RemoteLink beside the state).
"""

from __future__ import annotations

import ast
from pathlib import Path

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
    # Its facets: the services make their calls on the state itself (state/facade.py).
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
