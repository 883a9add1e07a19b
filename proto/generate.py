"""Regenerates the committed protobuf/gRPC modules from the .proto files.

    python proto/generate.py            # rewrite kvdepot/v1/*_pb2*.py
    python proto/generate.py --out DIR  # write elsewhere (the drift test)

The generated modules are committed so that `kvdepot.client` imports in a plain
vLLM environment without grpcio-tools; tests/test_proto_drift.py fails when they
no longer match the .proto files.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PROTOS = ["kvdepot/v1/depot.proto", "kvdepot/v1/admin.proto"]


def generate(out: Path) -> None:
    from grpc_tools import protoc

    out.mkdir(parents=True, exist_ok=True)
    for proto in PROTOS:
        rc = protoc.main(
            [
                "grpc_tools.protoc",
                f"-I{PROTO_ROOT}",
                f"--python_out={out}",
                f"--pyi_out={out}",
                f"--grpc_python_out={out}",
                str(PROTO_ROOT / proto),
            ]
        )
        if rc != 0:
            raise SystemExit(f"protoc failed on {proto} (exit {rc})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROTO_ROOT)
    generate(parser.parse_args().out)


if __name__ == "__main__":
    sys.exit(main())
