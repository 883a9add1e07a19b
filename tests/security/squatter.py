"""A squatter: declares an engine's namespace id first, with another layout.

    python tests/security/squatter.py --target T --model M

An engine's unsalted namespace id is a digest anyone with the same model can compute
(here: `Geometry.digested(M)` of the victim's geometry, as tests/security/
test_squatting.py builds it). This process opens a session of its own and registers
real shm memory under that id with layouts that differ from the victim's: without the
digest's inputs, with the victim's inputs but other pages, pages of several sizes, other
blocks per chunk, another world size, fewer layers, and inputs of its own layout under
the victim's id. Then one namespace of its own, to show it is a working client. Prints
one JSON object (per attempt: "OK" or the status code and message), then holds its
registrations until its stdin closes.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import grpc

if __package__ in (None, ""):  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvdepot.client import DepotClient
from tests.support.engine import Engine, Geometry

# The victim's geometry (test_squatting.py declares it with the model's inputs).
VICTIM = Geometry(groups=[[4096, 4096]], world_size=1, num_blocks=64)


def attempts(model: str) -> dict[str, Geometry]:
    real = VICTIM.digested(model)
    forged = replace(VICTIM, groups=[[8192, 8192]]).digested(model)
    return {
        "no_inputs": replace(real, groups=[[8192, 8192]], digest_inputs=""),
        "other_pages": replace(real, groups=[[8192, 8192]]),
        "several_sizes": replace(real, groups=[[4096, 8192]]),
        "other_blocks_per_chunk": replace(real, blocks_per_chunk=4),
        "other_world_size": replace(real, world_size=2),
        "fewer_layers": replace(real, groups=[[4096]]),
        "inputs_of_another_layout": replace(forged, namespace=real.namespace),
        "own_namespace": replace(VICTIM, namespace="squatter-own"),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--target", required=True)
    p.add_argument("--model", required=True)
    args = p.parse_args()
    client = DepotClient(args.target, client_name="squatter").start()
    if not client.wait_connected(10):
        raise SystemExit("no daemon")
    held, got = [], {}
    for name, geo in attempts(args.model).items():
        try:
            held.append(Engine(client, geo, 0))
            got[name] = {"code": "OK", "message": ""}
        except grpc.RpcError as exc:
            got[name] = {"code": exc.code().name, "message": exc.details() or ""}
    print(json.dumps(got), flush=True)
    sys.stdin.read()  # hold the registrations (and so the namespaces) until told
    client.close()


if __name__ == "__main__":
    main()
