"""An engine-like process for the GPU tests: torch CUDA KV tensors in vLLM's layout,
registered with a daemon over CUDA IPC. Prints one JSON line with what it saw.

    python tests/gpu/gpu_engine.py roundtrip --target T [--chunks 64 --job-chunks 16]
    python tests/gpu/gpu_engine.py hold --target T --num-blocks 2048   (then waits to die;
        prints its first region's IPC handle and the /dev/nvidia* nodes it holds open)
    python tests/gpu/gpu_engine.py export-only                          (tries to export)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvdepot.bench.cuda_engine import CudaEngine, make_key
from kvdepot.common.nvidia_gpus import device_minor, held_node
from kvdepot.v1 import depot_pb2 as pb
from tests.support.daemon import connect


def roundtrip(args: argparse.Namespace) -> dict[str, object]:
    import torch

    client = connect(args.target, f"gpu-engine pid {os.getpid()}", engine_id="", timeout=30)
    n = args.chunks
    eng = CudaEngine(client, num_blocks=2 * n + 32)
    src, dst = list(range(n)), list(range(n, 2 * n))
    eng.fill_random(src, seed=11)
    eng.zero(dst)
    torch.cuda.synchronize()
    expected = eng.pages(src)
    keys = [make_key(b"roundtrip", i) for i in range(n)]
    out: dict[str, object] = {
        "registration": eng.registration.memory_path,
        "device_uuid": eng.export.device_uuid,
    }
    res, _ = eng.run(pb.STORE, keys, src, args.job_chunks)
    out["store_failed"] = [r.error for r in res if not r.success]
    out["stored_keys"] = sum(r.stored_keys for r in res)
    out["stored_bytes"] = sum(r.bytes for r in res)
    # Scribble over the source after the store: a load must bring back the stored bytes.
    eng.fill_random(src, seed=12)
    res, _ = eng.run(pb.LOAD, keys, dst, args.job_chunks)
    out["load_failed"] = [r.error for r in res if not r.success]
    got = eng.pages(dst)
    out["mismatched_pages"] = int((got != expected).flatten(2).any(-1).sum())
    out["compared_bytes"] = int(expected.numel())

    # Ordering: the store is submitted right after a slow kernel and the write that
    # follows it on the same stream, without synchronising. Only the daemon's wait on
    # the inter-process event keeps it from copying the old (zero) bytes.
    order_src, order_dst = list(range(2 * n, 2 * n + 16)), list(range(2 * n + 16, 2 * n + 32))
    eng.zero(order_src + order_dst)
    torch.cuda.synchronize()
    pattern = torch.randint(
        -128, 128, (len(eng.tensors), 16, eng.page), dtype=torch.int8, device=eng.device
    )
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the write lands
    idx = torch.tensor(order_src, device=eng.device)
    for layer, t in enumerate(eng.tensors):
        t[idx] = pattern[layer]
    okeys = [make_key(b"ordering", i) for i in range(16)]
    t0 = time.perf_counter()
    res, _ = eng.run(pb.STORE, okeys, order_src, 16)  # records the event, then submits
    out["ordering_store_seconds"] = time.perf_counter() - t0
    out["ordering_store_failed"] = [r.error for r in res if not r.success]
    res, _ = eng.run(pb.LOAD, okeys, order_dst, 16)
    out["ordering_load_failed"] = [r.error for r in res if not r.success]
    got = eng.pages(order_dst)
    out["ordering_mismatched_pages"] = int((got != pattern).flatten(2).any(-1).sum())
    eng.close()
    client.close()
    return out


def hold(args: argparse.Namespace) -> None:
    import torch

    client = connect(args.target, f"gpu-engine pid {os.getpid()}", engine_id="", timeout=30)
    eng = CudaEngine(client, num_blocks=args.num_blocks)
    eng.fill_random(range(8), seed=3)
    torch.cuda.synchronize()
    res, _ = eng.run(pb.STORE, [make_key(b"hold", i) for i in range(8)], list(range(8)), 8)
    region = eng.export.regions[0].cuda_ipc
    print(
        json.dumps(
            {
                "ready": True,
                "pid": os.getpid(),
                "ok": all(r.success for r in res),
                "kv_bytes": eng.kv.numel(),
                # What another process could copy, and the device nodes this one holds.
                "handle": region.ipc_handle.hex(),
                "device_uuid": region.device_uuid,
                # What register_cuda_kv sent as its proof of the GPU (gpu_token).
                "node_fd": held_node(device_minor(eng.export.pci_bus_id, eng.export.device_uuid)),
                "held_nodes": sorted(
                    os.readlink(f"/proc/self/fd/{fd}")
                    for fd in os.listdir("/proc/self/fd")
                    if os.path.exists(f"/proc/self/fd/{fd}")
                    and os.readlink(f"/proc/self/fd/{fd}").startswith("/dev/nvidia")
                ),
            }
        ),
        flush=True,
    )
    while True:  # until SIGKILL
        time.sleep(3600)


def export_only(args: argparse.Namespace) -> dict[str, object]:
    import torch

    from kvdepot.client.cuda_ipc import UnexportableMemory, export_kv_tensors

    kv = torch.zeros(4 * 16 * 4096, dtype=torch.int8, device="cuda")
    tensors = [kv[i * 16 * 4096 : (i + 1) * 16 * 4096].view(16, 4096) for i in range(4)]
    try:
        exp = export_kv_tensors(tensors)
    except UnexportableMemory as exc:
        return {"exported": False, "error": str(exc)}
    return {"exported": True, "regions": len(exp.regions), "size": exp.registered_bytes}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("action", choices=["roundtrip", "hold", "export-only"])
    p.add_argument("--target")
    p.add_argument("--chunks", type=int, default=64)
    p.add_argument("--job-chunks", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=1024)
    args = p.parse_args()
    if args.action == "hold":
        hold(args)
    result = roundtrip(args) if args.action == "roundtrip" else export_only(args)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
