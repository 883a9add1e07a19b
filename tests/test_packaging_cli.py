"""Packaging and the `kvdepot` command: a wheel with the whole namespace, sizes,
--version, clean shutdown."""

from __future__ import annotations

import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import kvdepot
from kvdepot.server.config import parse_size
from tests.support.daemon import kvdepot_command

REPO = Path(__file__).resolve().parents[1]


def test_wheel_maps_the_top_level_folders_onto_one_namespace(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(REPO),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("kvdepot-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for path in (
        "kvdepot/__init__.py",
        "kvdepot/v1/depot_pb2.py",
        "kvdepot/v1/depot.proto",
        "kvdepot/server/core/index.py",
        "kvdepot/server/service/depot.py",
        "kvdepot/client/depot_client.py",
        "kvdepot/client/vllm/__init__.py",
        "kvdepot/bench/__init__.py",
        "kvdepot/testing/vllm_engine.py",
    ):
        assert path in names, f"{path} missing from the wheel"
    # The test engine is its own package: the connector's package ships only the connector.
    assert "kvdepot/client/vllm/testing.py" not in names
    assert not any(n.startswith("tests/") for n in names)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("512MiB", 512 << 20),
        ("64GiB", 64 << 30),
        ("1.5GB", 1_500_000_000),
        ("4096", 4096),
        ("2 kib", 2048),
    ],
)
def test_human_sizes(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "12 parsecs", "-1GiB", "0"])
def test_bad_sizes_say_how_to_write_one(text: str) -> None:
    with pytest.raises(ValueError, match=r"512MiB|less than one byte"):
        parse_size(text)


def test_version() -> None:
    out = subprocess.run([*kvdepot_command(), "--version"], capture_output=True, text=True)
    assert out.stdout.strip() == f"kvdepot {kvdepot.__version__}"


def test_a_bad_pool_size_is_a_usage_error() -> None:
    out = subprocess.run(
        [*kvdepot_command(), "serve", "--pool-size", "lots"], capture_output=True, text=True
    )
    assert out.returncode == 2 and "512MiB" in out.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_clean_shutdown_removes_the_sockets(daemon_factory, sig: signal.Signals) -> None:
    d = daemon_factory("--pool-size", "8MiB")
    assert Path(d.socket_path).exists() and Path(d.socket_path + ".fd").exists()
    d.proc.send_signal(sig)
    assert d.proc.wait(timeout=20) == 0
    assert not Path(d.socket_path).exists() and not Path(d.socket_path + ".fd").exists()
    assert "stopped; sockets removed" in d.log()
