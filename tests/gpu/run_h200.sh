#!/usr/bin/env bash
# The GPU checks of the CUDA data path, in one run on one H200 (under nine minutes at
# worst: every step has a timeout, and the node series starts no shard count after 330 s):
# tests/gpu (IPC registration, every byte back, store ordering, a killed engine's
# mappings released, bad handles refused, a handle from a process without the GPU
# refused, expandable segments detected) and the
# GPU benchmark (store/load GB/s through the daemon next to in-process
# cudaMemcpyAsync, and the ratio).
#
# Two steps, because the GPU machine reaches no package registry:
#
#   1. here, on a machine with PyPI (once per fresh checkout):
#        bash tests/gpu/run_h200.sh --prepare
#      downloads the wheels the daemon needs that the GPU image may lack or have in
#      another version (grpcio, protobuf: the generated code needs grpcio >= 1.85.1
#      and protobuf 7.x; grpcio-health-checking, grpcio-reflection: not in the image)
#      into build/gpu-wheels/ (ignored by git; about 8 MB).
#   2. on the GPU machine, from the repository root, carrying build/gpu-wheels:
#        bash tests/gpu/run_h200.sh
#      (device tool: command "bash tests/gpu/run_h200.sh", carry ["build/gpu-wheels"],
#      timeout_s 540). Logs go to $OUT (or build/gpu-out): run_h200.log (everything),
#      env.txt, context_cost.txt (the GPU memory one daemon process's CUDA context
#      holds), sender_check.txt (each GPU's device minor; the /dev/nvidia* nodes a
#      CUDA context holds open: the CUDA IPC sender check's premises), daemons.log, gpu_bench.txt, gpu_bench.json, gpu_bench_daemon.log,
#      cpu_bench.json (kvdepot bench's CPU series on the GPU machine's cores),
#      job_cost.txt (one TP=8 rank job's loop time, step by step, on this CPU),
#      node_bench_s{1,8,2,4}.json (the node series: 8 engines x TP=8 over 1-8
#      daemon shards, one file per shard count), mla_vllm.txt (the MLA checks below).
#
#   The MLA checks with real vLLM engines (tests/gpu/test_mla_vllm.py: the V2 model
#   runner, vLLM's default on GPU, loads what the V1 runner stored; TP=2 stores one
#   section a row that TP=1 loads, on two GPUs) run last, and only where vLLM 0.33
#   with CUDA imports: this workplace's GPU image has no vLLM and its wheel is larger
#   than a device call carries, so there the step says "NOT RUN" and costs nothing.
#   Where vLLM imports, the step adds up to 7 minutes (two or three engine starts):
#   with the default budget, give it a call of its own (KVDEPOT_GPU_TESTS=0
#   KVDEPOT_GPU_CPU_BENCH=0 KVDEPOT_GPU_NODE_BENCH=0; the GPU benchmark still runs).
#   KVDEPOT_GPU_MLA=0 skips it. NOT YET RUN on any GPU host: written without one.
#
#   Settings: KVDEPOT_GPU_SWEEP="1:16,64 4:16" also runs the GPU benchmark against a
#   daemon per entry, THREADS:SIZES (its --gpu-copy-threads, the job sizes in chunks),
#   with each table and the daemon's own account of its copy threads in the log;
#   KVDEPOT_GPU_CPU_BENCH=0 skips the CPU series, KVDEPOT_GPU_NODE_BENCH=0 the node
#   series, KVDEPOT_GPU_TESTS=0 the tests.
#
# Nothing is fetched on the GPU machine: the wheels go to a private --target folder,
# and kvdepot itself is imported from this tree through a symlink farm that
# tests/gpu/mirror_package.py makes from pyproject's package-dir; it also compiles
# the optional C extensions there with the machine's cc (numpy fallbacks without).
set -uo pipefail
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
WHEELS="$REPO/build/gpu-wheels"
PY="${PYTHON:-python3}"

if [[ "${1:-}" == "--prepare" ]]; then
    set -e
    mkdir -p "$WHEELS"
    PIP_PY="${PREPARE_PYTHON:-$REPO/.venv/bin/python}"
    [[ -x "$PIP_PY" ]] || PIP_PY=python3
    # The GPU image's python3 is CPython 3.12 on x86-64 (see the device notes).
    "$PIP_PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$WHEELS" \
        grpcio==1.85.3 protobuf==7.36.2 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1
    ls -l "$WHEELS"
    echo "ready: on the GPU machine run 'bash tests/gpu/run_h200.sh' carrying build/gpu-wheels"
    exit 0
fi

OUT="${OUT:-$REPO/build/gpu-out}"
mkdir -p "$OUT"
exec > >(tee "$OUT/run_h200.log") 2>&1
cd "$REPO"
export PYTHONUNBUFFERED=1
started=$(date +%s)
echo "== kvdepot GPU checks: $(date -u +%FT%TZ) on $(hostname)"

SITE=/tmp/kvdepot-site
rm -rf "$SITE" && mkdir -p "$SITE"
if compgen -G "$WHEELS/*.whl" > /dev/null; then
    echo "== installing the carried wheels into $SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "$WHEELS"/*.whl || { echo "FAILED: pip install of the wheels"; exit 2; }
else
    echo "== no wheels in build/gpu-wheels: using the image's grpcio/protobuf as they are"
fi
PKG=/tmp/kvdepot-pkg
echo "== mirroring the kvdepot package from pyproject.toml, building its C extensions"
"$PY" tests/gpu/mirror_package.py "$PKG" || { echo "FAILED: tests/gpu/mirror_package.py"; exit 2; }
export PYTHONPATH="$SITE:$PKG:$REPO${PYTHONPATH:+:$PYTHONPATH}"
export KVDEPOT_GPU_LOG_DIR="$OUT"

{
    echo "== nvidia-smi"; nvidia-smi || true
    echo "== versions"
    "$PY" - <<'EOF'
import sys, importlib
print("python", sys.version.split()[0], sys.executable)
for m in ("torch", "grpc", "google.protobuf", "grpc_health", "grpc_reflection", "uvloop",
          "pytest", "numpy", "prometheus_client"):
    try:
        mod = importlib.import_module(m)
        print(m, getattr(mod, "__version__", "?"), getattr(mod, "__file__", ""))
    except Exception as exc:
        print(m, "MISSING:", exc)
import torch
print("torch.cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
from kvdepot.common import cuda_driver as driver
print("kvdepot cuda:", driver.unavailable_reason() or "available",
      "batch ABI", driver.load().batch_abi if driver.cuda_available() else "-")
EOF
} 2>&1 | tee "$OUT/env.txt"

if ! "$PY" -c "import kvdepot.server.daemon, kvdepot.client.cuda_ipc, kvdepot.bench.gpu_bench, tests.support.daemon"; then
    echo "FAILED: kvdepot does not import here. If grpc/protobuf are missing or too old, run"
    echo "'bash tests/gpu/run_h200.sh --prepare' on a machine with PyPI and carry build/gpu-wheels."
    exit 2
fi
if ! grep -q enable_cuda server/daemon.py; then
    echo "NOTE: server/daemon.py does not call enable_cuda yet; tests/gpu/serve_cuda.py wires it"
fi

rc=0
# What every daemon process that serves a GPU costs that GPU: its CUDA context. Routing
# engines over several shards would multiply it (docs/architecture.md 10.1).
echo "== one daemon process's CUDA context (GPU 0)"
timeout 60 "$PY" - <<'EOF' 2>&1 | tee "$OUT/context_cost.txt"
import os, subprocess, time
from kvdepot.common import cuda_driver
drv = cuda_driver.load()
drv.set_current(drv.primary_context(0))  # as the daemon's CUDA engine does
time.sleep(0.5)
apps = subprocess.run(
    ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
    capture_output=True, text=True,
).stdout
mine = [line for line in apps.splitlines() if line.split(",")[0].strip() == str(os.getpid())]
print("a primary context on GPU 0 holds:", mine[0].split(",")[1].strip() if mine else apps)
EOF
# The CUDA IPC sender check's premises on this host (docs/security.md, "CUDA IPC"): each
# GPU's device minor from the driver's /proc entries, and the /dev/nvidia* nodes a
# process with a context on GPU 0 holds open. tests/gpu/test_gpu_ipc.py then checks the
# engine's registration passes and its handle from a process without the GPU is refused.
echo "== the CUDA IPC sender check: device minors, nodes a CUDA context holds"
timeout 60 "$PY" - <<'EOF' 2>&1 | tee "$OUT/sender_check.txt"
import os
from kvdepot.common import cuda_driver
from kvdepot.common.cuda_handles import format_uuid
from kvdepot.server.cuda.senders import SenderGpus
drv = cuda_driver.load()
senders = SenderGpus()
for d in drv.devices():
    print(format_uuid(d.uuid), d.pci_bus_id, "device minor",
          senders.device_minor(d.pci_bus_id, format_uuid(d.uuid)))
print("before a context, this process holds minors", sorted(senders.held_minors(os.getpid())))
drv.set_current(drv.primary_context(0))
print("with a context on device 0, it holds minors", sorted(senders.held_minors(os.getpid())))
EOF
(( PIPESTATUS[0] == 0 )) || rc=1
if [[ "${KVDEPOT_GPU_TESTS:-1}" != 0 ]]; then
    echo "== tests/gpu"
    timeout 180 "$PY" -m pytest tests/gpu -v -p no:cacheprovider -o addopts="-ra" \
        --ignore tests/gpu/test_mla_vllm.py || rc=1
    echo "== tests/gpu done after $(( $(date +%s) - started )) s (rc=$rc)"
fi

echo "== GPU benchmark"
timeout 150 "$PY" -m kvdepot.bench.gpu_bench --serve-script tests/gpu/serve_cuda.py \
    --out "$OUT" || rc=1
for run in ${KVDEPOT_GPU_SWEEP:-}; do
    threads=${run%%:*} sizes=${run#*:}
    echo "== GPU benchmark, daemon with --gpu-copy-threads $threads, jobs of $sizes chunks"
    timeout 90 "$PY" -m kvdepot.bench.gpu_bench --serve-script tests/gpu/serve_cuda.py \
        --gpu-copy-threads "$threads" --sizes "$sizes" --out "/tmp/kvdepot-sweep-$run" || rc=1
    grep -h "CUDA copies" "/tmp/kvdepot-sweep-$run/gpu_bench_daemon.log"
done
if [[ "${KVDEPOT_GPU_CPU_BENCH:-1}" != 0 ]]; then
    echo "== the CPU series of kvdepot bench on this machine's cores (no GPU, no vLLM here)"
    timeout 90 "$PY" -m kvdepot.server.cli bench --json --no-gpu --no-connector \
        > "$OUT/cpu_bench.json" || rc=1
fi
echo "== one rank job's loop time, step by step, on this CPU (no socket, copies off)"
timeout 60 "$PY" -m kvdepot.bench.job_cost | tee "$OUT/job_cost.txt" || rc=1
if [[ "${KVDEPOT_GPU_NODE_BENCH:-1}" != 0 ]]; then
    # How the node's control plane grows with daemon shards where there are cores for
    # them (docs/architecture.md 10.1): 8 engines x TP=8, 1 to 8 shards, copies off.
    # One run per shard count, 1 and 8 first, each into a file of its own: a count cut
    # short by its timeout, or by the run's budget (NODE_UNTIL s since the start, so
    # the whole run stays under the device's ten minutes a call), loses only itself.
    echo "== the node series: 8 engines x TP=8 over 1, 8, 2, 4 shards (copies off)"
    for shards in 1 8 2 4; do
        if (( $(date +%s) - started > ${NODE_UNTIL:-330} )); then
            echo "== node series: no time left for $shards shard(s)"; rc=1; break
        fi
        timeout 90 "$PY" -m kvdepot.server.cli bench --node --json --quiet \
            --node-geometry 70b-tp8 --node-shards "$shards" --node-engines 8 \
            --pool-size 16GiB > "$OUT/node_bench_s$shards.json" || rc=1
        echo "== node series, $shards shard(s), done after $(( $(date +%s) - started )) s"
    done
fi
if [[ "${KVDEPOT_GPU_MLA:-1}" != 0 ]]; then
    echo "== MLA with real vLLM engines: V1 and V2 model runners, TP=2 stores, TP=1 loads"
    if "$PY" -c "import vllm, torch; assert torch.cuda.is_available()" 2> /dev/null; then
        timeout 420 "$PY" -m pytest tests/gpu/test_mla_vllm.py -v -p no:cacheprovider \
            -o addopts="-ra" 2>&1 | tee "$OUT/mla_vllm.txt"
        (( PIPESTATUS[0] == 0 )) || rc=1
    else
        echo "NOT RUN: vLLM with CUDA does not import here (the MLA checks need vLLM 0.33)" \
            | tee "$OUT/mla_vllm.txt"
    fi
    echo "== MLA checks done after $(( $(date +%s) - started )) s"
fi
echo "== all done after $(( $(date +%s) - started )) s (rc=$rc)"
exit $rc
