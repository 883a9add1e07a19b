"""The operations guide, end to end: real `kvdepot serve` processes, real grpcurl, real
HTTP scrapes. No mocks.

- The operations guide (docs/operations.md) cannot rot: every `$ ` command in its
  ```console blocks runs against a live daemon after a known scenario, and its answer
  must match the output printed in the guide (volatile fields such as the boot id,
  uptimes and pids aside). The guide must also cover every Admin method and every
  kvdepot_ metric a live daemon exports.

Metrics, systemd notify, health during shutdown and the Admin calls are in
tests/test_metrics.py, tests/test_notify_sequence.py, tests/test_health_shutdown.py and
tests/test_admin_api.py; the scenario and command runner in tests/support/guide.py.

The guide's outputs are captured from a live daemon by this file itself:

    python tests/test_operations.py --write-docs

reruns the scenario and rewrites the output under every command in the guide (review
the diff: the test then holds the guide to it).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a script (--write-docs)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvdepot.v1 import admin_pb2
from tests.support.daemon import DaemonProcess
from tests.support.faults import DaemonFactory
from tests.support.guide import (
    GUIDE,
    GUIDE_SOCKET,
    guide_daemons,
    output_mismatch,
    parse_guide,
    run_guide,
)


def test_guide_commands_answer_as_printed(daemon_factory: DaemonFactory) -> None:
    """Every command of the operations guide, in order, against a live daemon: same
    success or failure, same answer as printed (volatile fields aside)."""
    problems = []
    with guide_daemons(daemon_factory) as (daemons, port):
        results = run_guide(daemons, port)
    assert len(results) >= 15, "the guide lost its commands"
    for cmd, rc, out in results:
        failed = cmd.expected.startswith("ERROR:")
        if (rc != 0) != failed:
            problems.append(f"line {cmd.line}: `{cmd.command}` exited {rc}:\n{out}")
            continue
        diff = output_mismatch(cmd.expected, out)
        if diff:
            problems.append(f"line {cmd.line}: `{cmd.command}`\n{diff}")
    assert not problems, (
        "docs/operations.md is out of date (python tests/test_operations.py "
        "--write-docs regenerates the outputs; review the diff):\n\n" + "\n\n".join(problems)
    )


def test_guide_covers_every_operation() -> None:
    """The guide shows every Admin method, paging, filters, both kinds of Evict, the
    refusal of destructive calls, health, reflection and the metrics scrape."""
    commands = parse_guide(GUIDE.read_text())
    grpcurl = [c for c in commands if c.command.startswith("grpcurl ")]
    for c in grpcurl:
        assert f"-unix {GUIDE_SOCKET}" in c.command, f"line {c.line}: use the standard socket"
    text = "\n".join(c.command for c in grpcurl)
    methods = admin_pb2.DESCRIPTOR.services_by_name["Admin"].methods
    for m in methods:
        assert f"kvdepot.v1.Admin/{m.name}" in text, f"the guide never calls Admin/{m.name}"
    for needle in (
        " list",
        " describe ",
        "grpc.health.v1.Health/Check",
        '"page_token"',
        '"has_group"',
        '"group"',
        '"keys"',
        "-emit-defaults",
    ):
        assert needle in text, f"the guide shows no grpcurl command with {needle!r}"
    evicts = [c for c in grpcurl if c.command.endswith("kvdepot.v1.Admin/Evict")]
    assert any('"keys"' not in c.command for c in evicts), "no Evict of a whole namespace"
    denied = [c for c in grpcurl if "Code: PermissionDenied" in c.expected]
    assert {c.command.rsplit("/", 1)[-1] for c in denied} >= {"Evict", "Clear"}
    assert all(c.daemon == "readonly" for c in denied)
    assert any(c.command.startswith("curl ") and "/metrics" in c.command for c in commands)
    assert "scrape_configs" in GUIDE.read_text()


# --- regenerating the guide's outputs ---------------------------------------------------------


def write_guide_outputs() -> int:
    """Reruns the scenario and rewrites each command's output in docs/operations.md."""
    made: list[DaemonProcess] = []

    def factory(*args: str) -> DaemonProcess:
        d = DaemonProcess(Path(tempfile.mkdtemp(prefix="kvd-doc-")), *args)
        made.append(d)
        return d.start()

    try:
        with guide_daemons(factory) as (daemons, port):
            results = run_guide(daemons, port)
    finally:
        for d in made:
            d.stop()
            shutil.rmtree(d.workdir, ignore_errors=True)
    lines = GUIDE.read_text().splitlines()
    for cmd, _rc, out in sorted(results, key=lambda r: -r[0].out_start):
        live = out.replace(str(made[0].socket_path), GUIDE_SOCKET)
        lines[cmd.out_start : cmd.out_end] = live.splitlines()
    GUIDE.write_text("\n".join(lines) + "\n")
    print(f"rewrote the outputs of {len(results)} commands in {GUIDE}")
    return 0


if __name__ == "__main__":
    if sys.argv[1:] != ["--write-docs"]:
        raise SystemExit(f"usage: python {sys.argv[0]} --write-docs")
    raise SystemExit(write_guide_outputs())
