"""The client makes its RPCs in one place: `DepotClient` (kvdepot.client.depot_client).

Read from the source (client/ and client/vllm/): outside depot_client.py no module
calls anything through a gRPC stub (`client.stub.X(...)`, `stub.X(...)`,
`self._stub.X.future(...)`), and `RegisterKVRequest` is built exactly once, by
depot_client.py's one builder, which every memory path (shm, CUDA IPC, pvm) and
the observer join go through. The checker is shown to catch what it exists to stop:
each of the calls this rule replaced, put back into a copy of its module, fails it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.support.source_rules import assert_check_catches

CLIENT = Path(__file__).resolve().parents[1] / "client"
FACADE = "depot_client.py"


def _names(node: ast.expr) -> list[str]:
    """The names along a call's callee: `client.stub.Unpin.future` -> all four."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        names.append(node.id)
    return names


def violations(path: Path, source: str) -> list[str]:
    """Each RPC made through a stub, and each RegisterKVRequest built, in `source`."""
    found = []
    for node in ast.walk(ast.parse(source, str(path))):
        if not isinstance(node, ast.Call):
            continue
        names = _names(node.func)
        # Only a name before the last is the stub: `register_stub(...)` is no RPC.
        if any(n.lower().endswith("stub") for n in names[1:]):
            found.append(
                f"{path.name}:{node.lineno}: an RPC through a stub ({ast.unparse(node.func)})"
            )
        if names and names[0] == "RegisterKVRequest":
            found.append(f"{path.name}:{node.lineno}: builds a RegisterKVRequest")
    return found


def client_modules() -> list[Path]:
    return sorted(p for p in CLIENT.rglob("*.py") if "__pycache__" not in p.parts)


def test_only_depot_client_makes_rpcs() -> None:
    found = [
        v
        for path in client_modules()
        if path.name != FACADE
        for v in violations(path, path.read_text())
    ]
    assert not found, "RPCs belong in DepotClient (client/depot_client.py):\n" + "\n".join(found)


def test_register_kv_request_is_built_once() -> None:
    facade = CLIENT / FACADE
    builds = [v for v in violations(facade, facade.read_text()) if "RegisterKVRequest" in v]
    assert len(builds) == 1, builds


@pytest.mark.parametrize(
    ("module", "anchor", "planted"),
    [
        # What job_lane.py, cuda_ipc.py and pvm.py did before DepotClient made their calls.
        (
            "job_lane.py",
            "resp = client.open_lane(session_id, token, kind, timeout, batched)",
            "resp = client.stub.OpenJobLane(depot_pb2.OpenJobLaneRequest(session_id=session_id))",
        ),
        (
            "cuda_ipc.py",
            "return client.register_memory(",
            "client.stub.RegisterKV(depot_pb2.RegisterKVRequest(session_id=''))\n"
            "    return client.register_memory(",
        ),
        (
            "pvm.py",
            "resp = client.register_memory(",
            "request = depot_pb2.RegisterKVRequest(session_id=session_id)\n"
            "    resp = client.register_memory(",
        ),
        # An aio stub handed to a stream module, called there.
        (
            "watch.py",
            "call = client.open_watch_call(",
            "call = stub.Watch(request) or client.open_watch_call(",
        ),
    ],
)
def test_the_check_catches_a_stub_call_put_back(module: str, anchor: str, planted: str) -> None:
    assert_check_catches(violations, f"client/{module}", anchor, planted)
