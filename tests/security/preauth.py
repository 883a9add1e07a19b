"""An attacker that costs the daemon before (or without) authenticating.

    python tests/security/preauth.py TARGET SECONDS SHAPE

Runs for SECONDS, sending the same pre-serialized message over and over (so that its
own encoding never slows it down), then prints one JSON object: what it sent and the
status codes (or job error codes) it got back, counted. Shapes:

- `transfer-4mi`: Transfer jobs of 4 Mi block ids (4 MiB, under the 5.2 MiB bound of
  every request but Put), no session, on Transfer streams (a new one whenever the
  daemon ends one);
- `transfer-counts`: Transfer jobs of 100,000 block ids (more than --max-job-blocks,
  under every byte bound), no session;
- `transfer-bound`: Transfer jobs of as many one-byte block ids as the daemon's job
  byte bound allows (about 1.2 Mi), no session;
- `session-4mi`, `session-counts`, `session-bound`: the same, on Transfer streams of a
  session of its own (named in the stream's metadata, as kvdepot's client does);
- `lane-4mi`, `lane-counts`, `lane-bound`: the same jobs as datagrams on a job lane of
  a session of its own (lanes need one);
- `large`, `large-fake`: 200 MiB messages, four at a time, to Put, Lookup, RegisterKV,
  Pin and Transfer, with no session (`large-fake`: naming a made-up one in the
  kvdepot-session metadata); `large-session`: to Session (no session needed);
  `large-own`: to those five and PutParts, naming a session of its own;
- `parts-over`: with a session of its own and an inline namespace of 64 KiB sections,
  PutParts calls of fifty 4 MiB parts, four at a time (more than any section);
- `churn`: opens a session and ends it, and makes a call with no session, in a loop
  (each used to log a line: 21,800 lines in 12 s).
"""

from __future__ import annotations

import collections
import json
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc

if __package__ in (None, ""):  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvdepot.client import DepotClient, session_stub
from kvdepot.client.fdpass import send_fd
from kvdepot.v1 import depot_pb2 as pb

JOB_BOUND_BLOCKS = 1_240_000  # one-byte block ids within bounds.max_job_bytes at the defaults


def job_bytes(blocks: int, session_id: str) -> bytes:
    job = pb.TransferJob(
        job_id=1,
        direction=pb.LOAD,
        registration_id=1,
        group_sizes=[blocks],
        block_indices=[0],
        session_id=session_id,
    )
    job.block_ids.extend([1] * blocks)
    return job.SerializeToString()


def transfer(
    target: str, payload: bytes, metadata: list, until: float, codes: collections.Counter
) -> None:
    options = [("grpc.max_send_message_length", 64 << 20)]
    with grpc.insecure_channel(target, options=options) as ch:
        call = ch.stream_stream(
            "/kvdepot.v1.Depot/Transfer",
            request_serializer=None,  # bytes as they are
            response_deserializer=pb.TransferResult.FromString,
        )
        while time.monotonic() < until:

            def jobs() -> Iterator[bytes]:
                while time.monotonic() < until:
                    yield payload

            try:
                timeout = max(0.1, until - time.monotonic() + 5)
                for result in call(jobs(), timeout=timeout, metadata=metadata):
                    codes[result.error_code or "OK"] += 1
            except grpc.RpcError as exc:
                codes[exc.code().name] += 1


def lane(target: str, blocks: int, until: float, codes: collections.Counter) -> None:
    client = DepotClient(target, client_name="lane-attacker").start()
    assert client.wait_connected(10) and client.hello is not None
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    token = send_fd(client.hello.fd_socket, client.session_id, theirs.fileno())
    theirs.close()
    client.stub.OpenJobLane(
        pb.OpenJobLaneRequest(
            session_id=client.session_id, fd_token=token, kind=pb.LANE_TRANSFER_JOBS
        ),
        timeout=10,
    )
    mine.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
    payload = job_bytes(blocks, client.session_id)
    mine.settimeout(10)
    while time.monotonic() < until:
        try:
            mine.send(payload)
            answer = mine.recv(1 << 16)
        except OSError as exc:
            codes[f"lane {type(exc).__name__}"] += 1
            break
        if not answer:
            codes["lane closed"] += 1
            break
        codes[pb.TransferResult.FromString(answer).error_code or "OK"] += 1
    mine.close()
    client.close()


LARGE_METHODS = ("Put", "Lookup", "RegisterKV", "Pin", "Transfer")
PART_SECTION = 64 << 10  # parts-over: the namespace's section (one layer of 32 KiB, 2 blocks)


def large(
    target: str, method: str, payload: bytes, metadata: list, codes: collections.Counter
) -> None:
    options = [("grpc.max_send_message_length", 1 << 30)]
    with grpc.insecure_channel(target, options=options) as ch:
        path = f"/kvdepot.v1.Depot/{method}"
        try:
            if method == "Transfer":
                call = ch.stream_stream(path, request_serializer=None)
                list(call(iter([payload]), timeout=60, metadata=metadata))
            elif method == "PutParts":
                call = ch.stream_unary(path, request_serializer=None)
                call(iter([payload]), timeout=60, metadata=metadata)
            elif method == "Session":
                call = ch.unary_stream(path, request_serializer=None)
                next(iter(call(payload, timeout=60)))
            else:
                ch.unary_unary(path, request_serializer=None)(
                    payload, timeout=60, metadata=metadata
                )
            codes[f"{method} OK"] += 1
        except grpc.RpcError as exc:
            codes[f"{method} {exc.code().name}"] += 1


def own_session(target: str, name: str) -> tuple[DepotClient, list[tuple[str, str]]]:
    """A session of the attacker's own, and the metadata that names it."""
    client = DepotClient(target, client_name=name).start()
    assert client.wait_connected(10)
    return client, [("kvdepot-session", client.session_id)]


def parts_over(client: DepotClient, part: bytes, codes: collections.Counter) -> None:
    """PutParts of fifty `part`s for one 64 KiB section: the daemon must stop reading."""
    key = bytes(32) + (0).to_bytes(4, "big")

    def parts() -> Iterator[pb.PutRequest]:
        yield pb.PutRequest(
            session_id=client.session_id, namespace_id="parts", key=key, rank=0, data=part
        )
        for _ in range(49):
            yield pb.PutRequest(data=part)

    try:
        client.stub.PutParts(parts(), timeout=60)
        codes["PutParts OK"] += 1
    except grpc.RpcError as exc:
        codes[f"PutParts {exc.code().name}"] += 1


def churn(target: str, until: float, codes: collections.Counter) -> None:
    with grpc.insecure_channel(target) as ch:
        stub = session_stub(ch)
        while time.monotonic() < until:
            call = stub.Session(pb.SessionRequest(client_name="churn"), timeout=10)
            next(iter(call))
            call.cancel()
            codes["sessions"] += 1
            try:
                stub.Lookup(pb.LookupRequest(namespace_id="x"), timeout=10)
            except grpc.RpcError as exc:
                codes[f"Lookup {exc.code().name}"] += 1


def together(n: int, attack: Callable[..., None], *args: object) -> None:
    """`n` threads of `attack(*args)` at once; returns when all have ended."""
    threads = [threading.Thread(target=attack, args=args) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def main() -> None:
    target, seconds, shape = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    until = time.monotonic() + seconds
    codes: collections.Counter[str] = collections.Counter()
    if shape == "churn":
        print(json.dumps({"ready": 0}), flush=True)
        together(2, churn, target, until, codes)
        print(json.dumps({"shape": shape, "codes": dict(codes)}), flush=True)
        return
    if shape == "parts-over":
        client, _ = own_session(target, "parts-attacker")
        layout = pb.NamespaceLayout(
            id="parts",
            world_size=1,
            blocks_per_chunk=2,
            groups=[pb.GroupLayout(layer_page_bytes=[PART_SECTION // 2])],
        )
        client.register_kv(layout, 0, None, [], [])
        print(json.dumps({"ready": 4 << 20}), flush=True)
        together(4, parts_over, client, b"\0" * (4 << 20), codes)
        print(json.dumps({"shape": shape, "codes": dict(codes)}), flush=True)
        return
    if shape.startswith("large"):
        payload = b"\0" * (200 << 20)
        fake = [("kvdepot-session", secrets.token_hex(16))] if shape == "large-fake" else []
        methods = ("Session",) if shape == "large-session" else LARGE_METHODS
        if shape == "large-own":
            _, fake = own_session(target, "large-attacker")
            methods = (*LARGE_METHODS, "PutParts")
        print(json.dumps({"ready": len(payload)}), flush=True)
        for method in methods:  # four at a time, as the attack did
            together(4, large, target, method, payload, fake, codes)
        print(json.dumps({"shape": shape, "codes": dict(codes)}), flush=True)
        return
    blocks = {"4mi": 4 << 20, "counts": 100_000, "bound": JOB_BOUND_BLOCKS}[shape.split("-")[1]]
    if shape.startswith(("transfer", "session")):
        metadata: list[tuple[str, str]] = []
        session_id = secrets.token_hex(16)  # a session that does not exist
        if shape.startswith("session"):  # one of its own, named as the client names it
            client = DepotClient(target, client_name="stream-attacker").start()
            assert client.wait_connected(10)
            session_id = client.session_id
            metadata = [("kvdepot-session", session_id)]
        payload = job_bytes(blocks, session_id)
        print(json.dumps({"ready": len(payload)}), flush=True)
        together(2, transfer, target, payload, metadata, until, codes)
    else:
        print(json.dumps({"ready": blocks}), flush=True)
        lane(target, blocks, until, codes)
    print(json.dumps({"shape": shape, "codes": dict(codes)}), flush=True)


if __name__ == "__main__":
    main()
