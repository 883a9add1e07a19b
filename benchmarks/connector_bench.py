"""The vLLM connector's scheduler-side cost, next to vLLM's own CPU offloading manager.

    python -m kvdepot.bench.connector_bench [--socket PATH] [--quick] [--json] [--shards N]
    (also run by `kvdepot bench`, which calls `run_connector_bench`)

What it measures, in one run, against a real daemon (the one at --socket, or a
private one it starts):
- lookup: microseconds per `OffloadingManager.lookup()` (the scheduler calls it per
  key, many times per step), kvdepot's local mirror vs vLLM's CPUOffloadingManager,
  over the same keys (half hits, half misses);
- pin: latency p50/p99 of the one pin call a step with hits makes (16 keys = one
  request's 256-token hit, and 1024 keys = 64 such requests in one step), on the
  pin lane the steps use (kvdepot.client.pin_lane) and as a gRPC Pin call;
- step: scheduler time per step (`Scheduler.schedule()` + `update_from_output()`)
  with 64 running requests, for no connector, vLLM's OffloadingConnector with its
  CPU manager, and KVDepotConnector; the admission step (64 requests arrive, each
  with a 256-token hit) and the steady decode steps. "Added" is the difference to
  no connector in the same round ("thread CPU": the CPU time the scheduler's thread
  itself used, without what other threads and processes on its core took from it,
  e.g. the daemons it woke); rounds (5, or 1 with --quick) build a fresh engine
  per setup in a rotating order, and the figures are medians over rounds (one
  admission step per engine is too few to judge on a noisy machine). Workers are
  out of the picture (their jobs complete at once): this is what the connector
  costs the scheduler thread, the budget docs/architecture.md §10 sets.

With `--shards N` the daemon is `kvdepot serve --shards N` and kvdepot's engines run at
TP=N with `kvdepot_shards: N` (the scheduler is one whatever the TP): each step then
reads N Watch streams and pins on N shards, which is what sharding costs the scheduler.
The pin figures are shard 0's lane and gRPC call alone.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TextIO


def cpu_environment() -> None:
    """vLLM picks its platform when first imported: without a GPU it must be told (the
    capacity bench sets it up the same way)."""
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    if not has_cuda:
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class _ConnectorTime:
    """Sums the time the scheduler spends inside its connector's methods while `on`:
    what the connector's own code costs the scheduler thread, apart from what other
    threads and processes take from it. Outermost calls only (one method calling
    another of the connector's is counted once); the wrapper's own cost, a fraction
    of a microsecond per call, falls on kvdepot and vLLM alike."""

    def __init__(self, connector: Any) -> None:
        """`connector` None (no connector): nothing to time, always 0."""
        self.seconds = 0.0
        self.on = False
        self._inside = False
        for name in dir(type(connector)) if connector is not None else ():
            if not name.startswith("_") and inspect.isfunction(getattr(type(connector), name)):
                setattr(connector, name, self._timed(getattr(connector, name)))

    def _timed(self, method: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on or self._inside:
                return method(*args, **kwargs)
            self._inside = True
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self._inside = False

        return timed

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def _steps(engine: Any, prompts: list[list[int]], decode_steps: int) -> dict[str, float]:
    """Admits the prompts in one step, lets them prefill, then times decode steps."""
    inside = _ConnectorTime(engine.scheduler.connector)
    for p in prompts:
        engine.add_request(p, max_tokens=decode_steps + 64)
    inside.on = True
    engine.step()
    admission = engine.last_schedule_s + engine.last_update_s
    admission_cpu = engine.last_step_cpu_s
    admission_schedule = engine.last_schedule_s
    admission_inside = inside.take()
    inside.on = False
    # Let loads land and prefills finish.
    for _ in range(200):
        if len(engine.scheduler.running) == len(prompts) and not engine.scheduler.waiting:
            req = next(iter(engine.scheduler.running))
            if req.num_computed_tokens >= req.num_prompt_tokens:
                break
        engine.step()
    times, cpu = [], []
    inside.on = True
    for _ in range(decode_steps):
        engine.step()
        times.append(engine.last_schedule_s + engine.last_update_s)
        cpu.append(engine.last_step_cpu_s)
    decode_inside = inside.take()
    assert len(engine.scheduler.running) == len(prompts), "requests finished early"
    return {
        "admission_step_ms": admission * 1e3,
        "admission_step_cpu_ms": admission_cpu * 1e3,
        "admission_schedule_ms": admission_schedule * 1e3,
        "admission_in_connector_ms": admission_inside * 1e3,
        "decode_step_ms_mean": statistics.fmean(times) * 1e3,
        "decode_step_ms_p50": _pct(times, 0.5) * 1e3,
        "decode_step_ms_p99": _pct(times, 0.99) * 1e3,
        "decode_step_cpu_ms_mean": statistics.fmean(cpu) * 1e3,
        "decode_in_connector_ms": decode_inside / decode_steps * 1e3,
    }


def _time_lookups(manager: Any, keys: list[bytes], rounds: int) -> float:
    from vllm.v1.kv_offload.base import ReqContext

    ctx = ReqContext(req_id="bench")
    lookup = manager.lookup
    start = time.perf_counter()
    for _ in range(rounds):
        for key in keys:
            lookup(key, ctx)
    return (time.perf_counter() - start) / (rounds * len(keys)) * 1e6


def run_connector_bench(
    target: str | None = None,
    quick: bool = False,
    requests: int = 64,
    hit_tokens: int = 256,
    new_tokens: int = 256,
    out: TextIO | None = None,
    rounds: int | None = None,
    shards: int = 1,
) -> dict[str, Any]:
    """Runs the measurements; prints a table to `out` (default stderr) and returns
    the figures as a dict. `target` is the daemon ("unix:///path"); None starts one
    (of `shards` shards; kvdepot's engines then run at TP=`shards`)."""
    cpu_environment()
    from kvdepot.bench.daemon import OwnDaemon, target_of
    from kvdepot.client.vllm.pins import EARLY_PIN_KEYS
    from kvdepot.common.shards import shard_namespace_id
    from kvdepot.testing.environment import model_dir_for_tp
    from kvdepot.testing.vllm_engine import EngineConfig, GroupDef, SyntheticEngine, prompt_for

    out = out if out is not None else sys.stderr
    lookup_rounds = 20 if quick else 200
    pin_reps = 50 if quick else 400
    decode_steps = 20 if quick else 100
    rounds = rounds or (1 if quick else 5)
    # kvdepot's engines run at TP=shards: a model config whose heads they can split
    # (every setup uses it, so that they compare alike); checked before any daemon starts.
    model_tmp = Path(tempfile.mkdtemp(prefix="kvdepot-bench-model-"))
    try:
        model_dir = str(model_dir_for_tp(shards, model_tmp))
    except ValueError as exc:
        shutil.rmtree(model_tmp, ignore_errors=True)
        raise SystemExit(f"connector_bench: --shards {shards}: {exc}") from None
    own = None
    if target is None:
        own = OwnDaemon(f"{256 * shards}MiB", extra=["--shards", str(shards)])
        own.wait_serving()
        target = own.target
    target = target_of(target)
    # A small KV geometry: the scheduler's work does not depend on page bytes.
    groups = (GroupDef("full", block_size=16, num_layers=2, num_kv_heads=1),)
    # Room for every request's prompt and decode tokens: no preemption.
    blocks = requests * ((hit_tokens + new_tokens + decode_steps + 64) // 16 + 2) + 64
    common = dict(
        model_dir=model_dir,
        groups=groups,
        num_gpu_blocks=blocks,
        max_num_seqs=requests,
        max_num_batched_tokens=requests * (hit_tokens + new_tokens),
    )
    hit_prefixes = [prompt_for(1000 + i, hit_tokens) for i in range(requests)]
    prompts = [p + prompt_for(5000 + i, new_tokens) for i, p in enumerate(hit_prefixes)]
    result: dict[str, Any] = {
        "config": {
            "requests": requests,
            "hit_tokens": hit_tokens,
            "new_tokens": new_tokens,
            "block_size": 16,
            "decode_steps": decode_steps,
            "rounds": rounds,
            "target": target,
            # A step's loads go to the pin lane in parts of this many keys.
            "early_pin_keys": EARLY_PIN_KEYS,
            "shards": shards,
        },
    }
    # kvdepot's engines: at TP=shards, each rank on its own shard.
    depot_config = dict(common, tp=shards, extra_config={"kvdepot_shards": shards})
    engines: list[Any] = []
    try:
        # 1. The real write path fills the daemon with every prompt's hit prefix.
        writer = SyntheticEngine(EngineConfig(socket=target, **depot_config))
        engines.append(writer)
        writer.wait_registered()
        writer.generate(hit_prefixes, timeout=120)
        hit_keys = [k for p in hit_prefixes for k in writer.offload_keys(p)]
        writer.wait_ready(hit_keys, timeout=60)
        miss_keys = [k for p in prompts for k in writer.offload_keys(p)[hit_tokens // 16 :]]
        # Its threads and sessions must not compete with what is measured.
        engines.remove(writer)
        writer.shutdown()

        def make_depot() -> Any:  # kvdepot, scheduler side only
            engine = SyntheticEngine(EngineConfig(socket=target, workers=False, **depot_config))
            try:
                engine.wait_ready(hit_keys, timeout=60)
                # The steps' pins and unpins take their lanes once they are open (in
                # the background), on every shard.
                manager = engine.manager
                engine.wait_until(
                    lambda: manager.lanes_open, what="every shard's pin and unpin lanes"
                )
            except BaseException:
                engine.shutdown()
                raise
            return engine

        def make_cpu() -> Any:  # vLLM's CPU manager, holding the same hit keys
            from vllm.v1.kv_offload.base import ReqContext

            engine = SyntheticEngine(
                EngineConfig(
                    socket=None,
                    workers=False,
                    connector="OffloadingConnector",
                    connector_module=None,
                    extra_config={"spec_name": "CPUOffloadingSpec", "cpu_bytes_to_use": 1 << 30},
                    **common,
                )
            )
            ctx = ReqContext(req_id="bench-fill")
            engine.manager.prepare_store(hit_keys, ctx)
            engine.manager.complete_store(hit_keys, ctx)
            return engine

        def make_bare() -> Any:  # no connector: the baseline "added" subtracts
            return SyntheticEngine(
                EngineConfig(socket=None, workers=False, connector=None, **common)
            )

        # 2. kvdepot's lookups and pins.
        depot = make_depot()
        engines.append(depot)
        manager = depot.manager
        lookup_keys = hit_keys + miss_keys[: len(hit_keys)]
        result["lookup_us"] = {"kvdepot": _time_lookups(manager, lookup_keys, lookup_rounds)}

        pins: dict[str, Any] = {}
        client, lane = manager._client, manager.pin_lane
        ns = shard_namespace_id(manager.namespace_id, 0, shards)  # shard 0's
        for batch in (16, 1024):
            keys = hit_keys[:batch]
            for path in ("lane", "gRPC"):
                lat = []
                for _ in range(pin_reps if batch == 16 else max(10, pin_reps // 10)):
                    t = time.perf_counter()
                    if path == "lane":
                        pinned = lane.pin(client.session_id, ns, keys, timeout=1.0)
                        assert pinned is not None, "the pin lane closed"
                    else:
                        client.pin(ns, keys, timeout=1.0)
                    lat.append(time.perf_counter() - t)
                    client.unpin(ns, keys, wait=True)
                pins[f"{batch}_keys_{path}"] = {
                    "p50_ms": _pct(lat, 0.5) * 1e3,
                    "p99_ms": _pct(lat, 0.99) * 1e3,
                    "n": len(lat),
                }
        result["pin"] = pins
        engines.remove(depot)
        depot.shutdown()

        # 3. vLLM's own CPU offloading manager, same keys.
        cpu = make_cpu()
        engines.append(cpu)
        result["lookup_us"]["vllm_cpu"] = _time_lookups(cpu.manager, lookup_keys, lookup_rounds)
        engines.remove(cpu)
        cpu.shutdown()

        # 4. Scheduler steps: each round builds one engine per setup, in an order that
        # rotates, so that every setup meets the machine's slow moments alike; the
        # "added" figures compare a setup with no connector in the same round.
        setups = {"kvdepot": make_depot, "vllm_cpu": make_cpu, "none": make_bare}
        names = list(setups)
        per_round: dict[str, list[dict[str, float]]] = {n: [] for n in names}
        pin_rpcs = lane_pins = lane_unpins = 0
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                engine = setups[name]()
                engines.append(engine)
                per_round[name].append(_steps(engine, prompts, decode_steps))
                if name == "kvdepot":
                    pin_rpcs += engine.manager.pin_rpcs
                    lane_pins += engine.manager.pin_lane.lane_pins
                    lane_unpins += engine.manager.unpin_lane.lane_unpins
                engines.remove(engine)
                engine.shutdown()
        result["kvdepot_pin_rpcs_in_steps"] = pin_rpcs
        result["kvdepot_lane_pins_in_steps"] = lane_pins
        result["kvdepot_lane_unpins_in_steps"] = lane_unpins
        result["step_ms"] = {
            n: {k: statistics.median(x[k] for x in per_round[n]) for k in per_round[n][0]}
            for n in names
        }
        result["step_rounds"] = per_round
    finally:
        for engine in engines:
            with contextlib.suppress(Exception):  # a broken engine must not hide the figures
                engine.shutdown()
        if own is not None:
            own.stop()
        shutil.rmtree(model_tmp, ignore_errors=True)

    result["added_ms"], result["added_rounds"] = _added(result["step_rounds"])
    print(format_table(result), file=out)
    return result


# What a connector adds over no connector: its key in `added_ms`, the step figure it is
# the difference of, the table's row and the round count's label.
ADDED = (
    ("admission_step", "admission_step_ms", "added per admission step (ms)", "admission"),
    ("decode_step", "decode_step_ms_mean", "added per decode step (ms)", "decode"),
    (
        "admission_step_cpu",
        "admission_step_cpu_ms",
        "added thread CPU per admission step (ms)",
        "admission, thread CPU",
    ),
    (
        "decode_step_cpu",
        "decode_step_cpu_ms_mean",
        "added thread CPU per decode step (ms)",
        "decode, thread CPU",
    ),
)


def _added(
    per_round: dict[str, list[dict[str, float]]],
) -> tuple[dict[str, dict[str, float]], dict[str, list[dict[str, float]]]]:
    """What each connector adds to a step over no connector in the same round:
    (the median over rounds, every round's figure)."""
    rounds: dict[str, list[dict[str, float]]] = {}
    for name in ("kvdepot", "vllm_cpu"):
        rounds[name] = [
            {added: mine[key] - none[key] for added, key, _, _ in ADDED}
            for mine, none in zip(per_round[name], per_round["none"], strict=True)
        ]
    median = {
        name: {added: statistics.median(x[added] for x in rs) for added, *_ in ADDED}
        for name, rs in rounds.items()
    }
    return median, rounds


def format_table(r: dict[str, Any]) -> str:
    cfg = r["config"]
    lines = [
        f"vLLM connector, scheduler side ({cfg['requests']} requests, "
        f"{cfg['hit_tokens']}-token hits + {cfg['new_tokens']} new tokens, "
        f"{cfg['decode_steps']} decode steps; medians of {cfg['rounds']} round(s))"
        + (
            f"; kvdepot on {cfg['shards']} shards at TP={cfg['shards']}"
            if cfg.get("shards", 1) > 1
            else ""
        ),
        f"{'':44}{'kvdepot':>12}{'vLLM CPU':>12}{'none':>12}",
        f"{'lookup (us per key)':44}{r['lookup_us']['kvdepot']:>12.3f}"
        f"{r['lookup_us']['vllm_cpu']:>12.3f}{'-':>12}",
    ]
    s = r["step_ms"]
    for label, key in (
        ("admission step (ms)", "admission_step_ms"),
        ("decode step, mean (ms)", "decode_step_ms_mean"),
        ("decode step, p99 (ms)", "decode_step_ms_p99"),
    ):
        lines.append(
            f"{label:44}{s['kvdepot'][key]:>12.3f}{s['vllm_cpu'][key]:>12.3f}"
            f"{s['none'][key]:>12.3f}"
        )
    a = r["added_ms"]
    for key, _, label, _ in ADDED:
        lines.append(f"{label:44}{a['kvdepot'][key]:>12.3f}{a['vllm_cpu'][key]:>12.3f}{'0':>12}")
    for label, key in (
        ("in the connector, admission (ms)", "admission_in_connector_ms"),
        ("in the connector, decode (ms)", "decode_in_connector_ms"),
    ):
        lines.append(f"{label:44}{s['kvdepot'][key]:>12.3f}{s['vllm_cpu'][key]:>12.3f}{'0':>12}")

    def at_or_below(pairs: list[tuple[float, float]], label: str) -> None:
        lower = sum(mine <= theirs for mine, theirs in pairs)
        count = f"{lower} of {len(pairs)} rounds"
        lines.append(f"{'kvdepot <= vLLM CPU, ' + label:44}{count:>12}")

    added = r["added_rounds"]
    for step, _, _, label in ADDED:
        mine, theirs = added["kvdepot"], added["vllm_cpu"]
        at_or_below([(m[step], t[step]) for m, t in zip(mine, theirs, strict=True)], label)
    steps = r["step_rounds"]
    for key, label in (
        ("admission_in_connector_ms", "admission, in connector"),
        ("decode_in_connector_ms", "decode, in connector"),
    ):
        mine, theirs = steps["kvdepot"], steps["vllm_cpu"]
        at_or_below([(m[key], t[key]) for m, t in zip(mine, theirs, strict=True)], label)
    for batch, p in r["pin"].items():
        lines.append(
            f"{'pin ' + batch.replace('_', ' ', 2).replace('_', ', ') + ' p50 / p99 (ms)':44}"
            f"{p['p50_ms']:>12.3f}{p['p99_ms']:>12.3f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m kvdepot.bench.connector_bench", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--socket", help="a running daemon (default: start a private one)")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument(
        "--rounds", type=int, help="rounds of scheduler steps (default 5; 1 with --quick)"
    )
    ap.add_argument("--json", action="store_true", help="print the figures as JSON too")
    ap.add_argument(
        "--shards",
        type=int,
        default=1,
        help="start a daemon of N shards and run kvdepot's engines at TP=N on them",
    )
    args = ap.parse_args(argv)
    result = run_connector_bench(
        args.socket,
        quick=args.quick,
        requests=args.requests,
        out=sys.stdout,
        rounds=args.rounds,
        shards=args.shards,
    )
    if args.json:
        print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
