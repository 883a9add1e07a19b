"""The optional sections of `kvdepot bench`: the vLLM connector and the CUDA path.

`connector_bench.run_connector_bench` needs vLLM and `gpu_bench.run_gpu_bench` needs
a CUDA device. Each section runs when its environment is there; otherwise it says
why it did not (`{"skipped": reason}`). An error inside one is reported
(`{"error": ..., "traceback": ...}`) and the rest of the bench stands.
"""

from __future__ import annotations

import importlib.util
import traceback
from collections.abc import Callable, Sequence
from typing import Any, TextIO


def need_vllm() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (pip install 'kvdepot[vllm]')"
    return None


def need_cuda() -> str | None:
    if importlib.util.find_spec("torch") is None:
        return "no torch, so no CUDA"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device on this machine"
    return None


def guarded(name: str, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """`run()`'s figures, or what went wrong in it: one section never sinks the bench."""
    try:
        return run()
    except Exception as exc:
        return {
            "error": f"{name}: {type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc(limit=5),
        }


def connector_section(target: str, quick: bool, out: TextIO) -> dict[str, Any]:
    """The vLLM connector's scheduler-side figures (`connector_bench`)."""
    why_not = need_vllm()
    if why_not:
        return {"skipped": why_not}

    def run() -> dict[str, Any]:
        from kvdepot.bench.connector_bench import run_connector_bench

        return run_connector_bench(target=target, quick=quick, out=out)

    return guarded("connector_bench", run)


def gpu_section(
    quick: bool,
    sizes: Sequence[int],
    reps: int,
    target: str | None = None,
) -> dict[str, Any]:
    """The CUDA IPC path's figures (`gpu_bench`). Without `target` it starts its own
    daemon: it sizes its own pool (GiB of page-locked memory), and the GPU's copy
    threads are its default (`--gpu-copy-threads`)."""
    why_not = need_cuda()
    if why_not:
        return {"skipped": why_not}

    def run() -> dict[str, Any]:
        from kvdepot.bench.gpu_bench import run_gpu_bench

        return run_gpu_bench(target, quick=quick, sizes=sizes, reps=reps)

    return guarded("gpu_bench", run)
