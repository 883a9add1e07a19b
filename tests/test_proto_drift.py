"""The committed generated modules match the .proto files (regenerate with
`python proto/generate.py`)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_generated_code_matches_the_proto_files(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("generate", REPO / "proto" / "generate.py")
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    gen.generate(tmp_path)
    fresh = sorted((tmp_path / "kvdepot" / "v1").glob("*_pb2*.py*"))
    assert len(fresh) == 6
    for f in fresh:
        committed = REPO / "proto" / "kvdepot" / "v1" / f.name
        assert committed.read_text() == f.read_text(), (
            f"{committed} is stale: run `python proto/generate.py` and commit the result"
        )


def test_client_imports_without_server_dependencies() -> None:
    """kvdepot.client must import in a plain vLLM env: no uvloop, prometheus, health."""
    import subprocess

    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('uvloop', 'prometheus_client', 'grpc_health',\n"
        "                                  'grpc_reflection', 'numpy'):\n"
        "            raise ImportError(f'blocked {name}')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import kvdepot.client, kvdepot.client.fdpass, kvdepot.client.shm\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr
