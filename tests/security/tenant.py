"""Tenant B: a separate process that names tenant A's namespace without joining it.

    python tests/security/tenant.py --target T --namespace NS --key HEX --rank R
        --section BYTES --registration RID [--join]

It opens a session of its own (kvdepot's client: attested, as any engine's), then
calls the daemon with raw stubs, never through the library (which would join for
it): Get, Lookup, Watch, Pin, Unpin, Put and Prefetch naming A's namespace; a LOAD
job naming A's registration, on a Transfer stream and on a job lane; a pin and an
unpin datagram on lanes of its own. With `--join` it first joins A's namespace as
an observer (RegisterKV of the id alone). Prints one JSON object: per attack, the
status code name and message it got (or "OK" and what came back).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
from pathlib import Path
from typing import Any

import grpc

if __package__ in (None, ""):  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvdepot.client import DepotClient
from kvdepot.client.fdpass import send_fd
from kvdepot.v1 import depot_pb2 as pb


def outcome(call: Any) -> dict[str, Any]:
    """The status of a unary call: {"code", "message"} (code "OK" with the answer)."""
    try:
        resp = call()
    except grpc.RpcError as exc:
        return {"code": exc.code().name, "message": exc.details() or ""}
    return {"code": "OK", "message": str(resp)[:200]}


def lane(client: DepotClient, kind: int) -> socket.socket:
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    assert client.hello is not None
    token = send_fd(client.hello.fd_socket, client.session_id, theirs.fileno())
    theirs.close()
    client.stub.OpenJobLane(
        pb.OpenJobLaneRequest(session_id=client.session_id, fd_token=token, kind=kind), timeout=10
    )
    mine.settimeout(10)
    return mine


def lane_closed(sock: socket.socket, wait: float) -> bool:
    """True when the daemon closed the lane (EOF or reset) within `wait` seconds;
    False if it answered, or kept it open without an answer (an unpin)."""
    sock.settimeout(wait)
    try:
        return sock.recv(1 << 16) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def main() -> None:
    p = argparse.ArgumentParser()
    for name in ("--target", "--namespace", "--key"):
        p.add_argument(name, required=True)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--section", type=int, required=True)
    p.add_argument("--registration", type=int, required=True)
    p.add_argument("--join", action="store_true")
    args = p.parse_args()
    ns, key = args.namespace, bytes.fromhex(args.key)
    client = DepotClient(args.target, client_name="tenant-b").start()
    if not client.wait_connected(10):
        raise SystemExit("no daemon")
    sid, stub = client.session_id, client.stub
    out: dict[str, Any] = {}
    if args.join:
        out["join"] = outcome(
            lambda: stub.RegisterKV(
                pb.RegisterKVRequest(session_id=sid, namespace=pb.NamespaceLayout(id=ns)),
                timeout=10,
            )
        )
    out["get"] = outcome(
        lambda: stub.Get(
            pb.GetRequest(session_id=sid, namespace_id=ns, key=key, rank=args.rank), timeout=10
        )
    )
    out["lookup"] = outcome(
        lambda: stub.Lookup(pb.LookupRequest(session_id=sid, namespace_id=ns, keys=[key]), 10)
    )
    out["pin"] = outcome(
        lambda: stub.Pin(pb.PinRequest(session_id=sid, namespace_id=ns, keys=[key]), timeout=10)
    )
    out["unpin"] = outcome(
        lambda: stub.Unpin(pb.UnpinRequest(session_id=sid, namespace_id=ns, keys=[key]), 10)
    )
    out["put"] = outcome(
        lambda: stub.Put(
            pb.PutRequest(
                session_id=sid,
                namespace_id=ns,
                key=key,
                rank=args.rank,
                data=b"\xee" * args.section,
            ),
            timeout=10,
        )
    )
    out["prefetch"] = outcome(
        lambda: stub.Prefetch(pb.PrefetchRequest(session_id=sid, namespace_id=ns, keys=[key]), 10)
    )

    def first_watch_event() -> pb.WatchEvent:
        call = stub.Watch(pb.WatchRequest(session_id=sid, namespace_id=ns), timeout=10)
        try:
            return next(iter(call))
        finally:
            call.cancel()

    out["watch"] = outcome(first_watch_event)
    # A LOAD job naming A's registration (ids are guessable: they count up).
    job = pb.TransferJob(
        job_id=7,
        direction=pb.LOAD,
        registration_id=args.registration,
        keys=[key],
        block_ids=[0],
        group_sizes=[1],
        block_indices=[0],
        session_id=sid,
    )
    (result,) = list(stub.Transfer(iter([job]), timeout=10))
    out["transfer_load"] = {"code": result.error_code or "OK", "message": result.error}
    jobs = lane(client, pb.LANE_TRANSFER_JOBS)
    jobs.send(job.SerializeToString())
    result = pb.TransferResult.FromString(jobs.recv(1 << 16))
    out["lane_load"] = {"code": result.error_code or "OK", "message": result.error}
    pins = lane(client, pb.LANE_PINS)
    pins.send(pb.PinRequest(session_id=sid, namespace_id=ns, keys=[key]).SerializeToString())
    out["pin_lane_closed"] = lane_closed(pins, 10)
    unpins = lane(client, pb.LANE_UNPINS)
    unpins.send(pb.UnpinRequest(session_id=sid, namespace_id=ns, keys=[key]).SerializeToString())
    out["unpin_lane_closed"] = lane_closed(unpins, 2)
    print(json.dumps(out), flush=True)
    client.close()


if __name__ == "__main__":
    main()
