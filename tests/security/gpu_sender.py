"""A client process that registers a GPU's CUDA IPC handle, holding the device nodes
it is told to (as a CUDA process holds its GPUs'), for tests/security/test_cuda_ipc.py.

    python tests/security/gpu_sender.py --target T --handle HEX --uuid GPU-...
        [--hold PATH]... [--send-node PATH]

Opens a session of its own (kvdepot's client: attested, as any engine's), registers
the handle's bytes (with `--send-node`, sending that file over the fd socket as its
proof of the GPU, CudaIpcHandle.gpu_token) and prints one JSON object: {"code",
"message"} of RegisterKV.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import grpc

if __package__ in (None, ""):  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvdepot.client import DepotClient
from kvdepot.client.fdpass import send_fd
from kvdepot.v1 import depot_pb2 as pb

PAGE = 4096
BLOCKS = 16  # the fake GPUs' allocations hold 16 pages (fake_gpu_serve.ALLOC_BYTES)
EVENT = bytes(range(100, 164))  # the fake driver opens any event handle


def register_gpu(
    client: DepotClient, handle: bytes, uuid: str, namespace: str, gpu_token: str = ""
) -> pb.RegisterKVResponse:
    """RegisterKV of a fake GPU's whole allocation: one layer of BLOCKS pages;
    `gpu_token`: the fd_token of a device node sent as the proof of the GPU."""
    return client.register_memory(
        pb.NamespaceLayout(
            id=namespace,
            world_size=1,
            blocks_per_chunk=1,
            groups=[pb.GroupLayout(layer_page_bytes=[PAGE])],
        ),
        0,
        [
            pb.MemoryRegion(
                cuda_ipc=pb.CudaIpcHandle(
                    ipc_handle=handle,
                    device_uuid=uuid,
                    size=BLOCKS * PAGE,
                    event_handle=EVENT,
                    gpu_token=gpu_token,
                )
            )
        ],
        [pb.KVTensor(region_index=0, num_blocks=BLOCKS, block_stride_bytes=PAGE, page_bytes=PAGE)],
        [pb.GroupRefs(layers=[pb.LayerRef(tensor_index=0, page_bytes=PAGE)])],
        timeout=10,
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--target", required=True)
    p.add_argument("--handle", required=True)
    p.add_argument("--uuid", required=True)
    p.add_argument("--hold", action="append", default=[])
    p.add_argument("--send-node")
    args = p.parse_args()
    held = [os.open(path, os.O_RDONLY) for path in args.hold]
    client = DepotClient(args.target, client_name="gpu-sender").start()
    try:
        if not client.wait_connected(10):
            raise SystemExit("no daemon")
        token = ""
        if args.send_node:
            assert client.hello is not None
            node = os.open(args.send_node, os.O_RDONLY)
            token = send_fd(client.hello.fd_socket, client.session_id, node)
            os.close(node)
        try:
            resp = register_gpu(client, bytes.fromhex(args.handle), args.uuid, "sender", token)
            out = {"code": "OK", "message": f"registration {resp.registration_id}"}
        except grpc.RpcError as exc:
            out = {"code": exc.code().name, "message": exc.details() or ""}
        print(json.dumps(out), flush=True)
    finally:
        client.close()
        for fd in held:
            os.close(fd)


if __name__ == "__main__":
    main()
