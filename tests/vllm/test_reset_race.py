"""A connector reset is in force when it returns: no block stored before it is
loaded after it.

vLLM's real Scheduler and the real KVDepotOffloadingSpec against a real `kvdepot serve`.
Each test holds one part of the reset path still while the reset runs (the Watch
stream in the middle of applying an old-namespace event, the daemon itself, the
worker's registration of the new namespace, a request that was running at the reset)
and shows that nothing stored before the reset is loaded after it, and that what is
stored after it is kept and loads back.

`KVDEPOT_RESET_REPS` (default 3) repeats the plain scenarios; the long run uses 50:
    KVDEPOT_RESET_REPS=50 .venv/bin/python -m pytest tests/vllm/test_reset_race.py
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

import grpc
import pytest

pytest.importorskip("vllm")

from vllm.v1.kv_offload.base import LookupResult, ReqContext

from kvdepot.testing.vllm_engine import SyntheticEngine, prompt_for

pytestmark = pytest.mark.vllm

REPS = int(os.environ.get("KVDEPOT_RESET_REPS", "3"))
TOKENS = 56  # three full 16-token chunks and a tail computed each time


def connector_reset(engine: SyntheticEngine) -> None:
    """As vLLM's own test_reset_cache does it: the connector scheduler, then the
    GPU prefix cache (so a hit can only come from kvdepot)."""
    engine.scheduler.connector.connector_scheduler.reset_cache()
    engine.reset_gpu_prefix_cache()


def scheduler_reset(engine: SyntheticEngine) -> None:
    """vLLM's reset with the connector, e.g. after a weight update."""
    assert engine.scheduler.reset_prefix_cache(reset_connector=True)


RESETS: dict[str, Callable[[SyntheticEngine], None]] = {
    "connector": connector_reset,
    "scheduler": scheduler_reset,
}


def stored(engine: SyntheticEngine, prompt: list[int]) -> list[bytes]:
    """Generates `prompt` and waits until its chunks are in the scheduler's mirror."""
    engine.generate([prompt])
    keys = engine.offload_keys(prompt)
    engine.wait_ready(keys)
    return keys


def misses(engine: SyntheticEngine, keys: list[bytes]) -> bool:
    ctx = ReqContext(req_id="probe")
    return all(engine.manager.lookup(k, ctx) is LookupResult.MISS for k in keys)


def in_namespace(engine: SyntheticEngine, namespace_id: str, keys: list[bytes]) -> list[bool]:
    """The daemon's answer (a namespace no job ever named is unknown to it: nothing)."""
    try:
        return engine.manager._client.lookup(namespace_id, keys)
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.NOT_FOUND, exc
        return [False] * len(keys)


def assert_stored_again_and_loads_back(engine: SyntheticEngine, prompt: list[int]) -> None:
    """After the reset the prompt's chunks were computed, stored in the new
    namespace (not dropped), and load back byte for byte."""
    keys = engine.offload_keys(prompt)
    engine.wait_ready(keys)
    new_ns = engine.manager.namespace_id
    assert in_namespace(engine, new_ns, keys) == [True] * len(keys)
    engine.reset_gpu_prefix_cache()
    [again] = engine.generate([prompt])
    assert len(keys) == 3 and again.external_tokens == 16 * len(keys)
    for name in engine.group_layers(0):
        for i, b in enumerate(again.block_ids[0][: len(keys)]):
            want = engine.expected_page(prompt, 0, i, name, 0)
            assert bool((engine.page(0, name, b) == want).all()), f"{name} block {i}"


@pytest.mark.parametrize("rep", range(REPS))
@pytest.mark.parametrize("how", sorted(RESETS))
def test_nothing_from_before_a_reset_loads_after_it(daemon, make_engine, how, rep) -> None:
    engine = make_engine(socket=daemon.target, num_gpu_blocks=64)
    engine.wait_registered()
    prompt = prompt_for(300 + rep, TOKENS)
    keys = stored(engine, prompt)
    RESETS[how](engine)
    assert misses(engine, keys)
    [after] = engine.generate([prompt])
    assert after.external_tokens == 0
    assert_stored_again_and_loads_back(engine, prompt)


def test_an_old_namespace_event_being_applied_during_the_reset(daemon, make_engine) -> None:
    """The Watch stream delivers a STORED event of the old namespace and is held in
    the middle of applying it (after its generation check) while the reset runs: the
    keys must not reach the new namespace's mirror."""
    engine = make_engine(socket=daemon.target, num_gpu_blocks=64)
    engine.wait_registered()
    manager = engine.manager
    mirror = manager.mirror
    entered, release = threading.Event(), threading.Event()
    apply_event = mirror.apply

    def held(event) -> None:  # type: ignore[no-untyped-def]
        if event.keys and not entered.is_set():
            entered.set()
            assert release.wait(10)
        apply_event(event)

    mirror.apply = held
    prompt = prompt_for(320, TOKENS)
    engine.generate([prompt])  # its STORED event comes to `held`, which holds it
    assert entered.wait(10), "no STORED event arrived"
    resetting = threading.Thread(target=scheduler_reset, args=(engine,))
    resetting.start()
    time.sleep(0.2)  # the reset runs (or waits for the event) while the event is held
    release.set()
    resetting.join(10)
    assert not resetting.is_alive()
    mirror.apply = apply_event
    keys = engine.offload_keys(prompt)
    assert manager.mirror_size == 0 and misses(engine, keys)
    [after] = engine.generate([prompt])
    assert after.external_tokens == 0


def test_a_reset_while_the_daemon_is_frozen(daemon, make_engine) -> None:
    """The reset waits on nothing of the daemon's: it returns at once with the daemon
    stopped (SIGSTOP), the old keys miss from then on, and once the daemon answers
    again the engine stores in its new namespace."""
    engine = make_engine(
        socket=daemon.target, num_gpu_blocks=64, extra_config={"kvdepot_job_timeout_s": 2.0}
    )
    engine.wait_registered()
    prompt = prompt_for(330, TOKENS)
    keys = stored(engine, prompt)
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        t = time.monotonic()
        scheduler_reset(engine)
        took = time.monotonic() - t
        assert misses(engine, keys)
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    assert took < 1.0, took
    [after] = engine.generate([prompt], timeout=60)
    assert after.external_tokens == 0
    engine.wait_registered()
    other = prompt_for(331, TOKENS)
    engine.generate([other])
    assert_stored_again_and_loads_back(engine, other)


def test_a_reset_while_the_new_namespace_is_still_registering(daemon, make_engine) -> None:
    """The worker's registration of the new namespace is held: the request after the
    reset misses (its store job waits for the registration), and once the
    registration goes through that first store is kept."""
    engine = make_engine(socket=daemon.target, num_gpu_blocks=64)
    engine.wait_registered()
    prompt = prompt_for(340, TOKENS)
    keys = stored(engine, prompt)
    registrar = engine.ranks[0].offloading_worker._registrar
    register, release = registrar._register, threading.Event()

    def held(namespace_id: str) -> bool:
        assert release.wait(20)
        return register(namespace_id)

    registrar._register = held
    scheduler_reset(engine)
    assert misses(engine, keys)
    done = threading.Event()

    def run() -> None:
        [after] = engine.generate([prompt], timeout=60)
        assert after.external_tokens == 0
        done.set()

    generating = threading.Thread(target=run)
    generating.start()
    time.sleep(0.3)  # the store job is held meanwhile
    assert not engine.manager.is_ready(keys[0])
    release.set()
    generating.join(60)
    assert done.is_set()
    registrar._register = register
    worker = engine.ranks[0].offloading_worker
    assert worker.stats["held"] >= 1 and worker.stats["failed_stores"] == 0
    assert_stored_again_and_loads_back(engine, prompt)


def test_a_request_running_at_the_reset_stores_nothing_after_it(daemon, make_engine) -> None:
    """vLLM re-offloads the requests still running at a reset from chunk 0; their KV
    was computed before it, so none of it may reach the new namespace."""
    engine = make_engine(socket=daemon.target, num_gpu_blocks=64)
    engine.wait_registered()
    prompt = prompt_for(350, TOKENS)
    keys = engine.offload_keys(prompt)
    engine.add_request(prompt, max_tokens=40)
    deadline = time.monotonic() + 10
    while not all(engine.manager.is_ready(k) for k in keys):
        assert time.monotonic() < deadline, "the running request's chunks were not stored"
        engine.step()
    engine.scheduler.reset_prefix_cache(reset_connector=True)  # refused for the GPU cache
    new_ns = engine.manager.namespace_id
    engine.run(timeout=60)  # the running request finishes after the reset
    assert not any(in_namespace(engine, new_ns, keys))
    engine.reset_gpu_prefix_cache()
    [after] = engine.generate([prompt])
    assert after.external_tokens == 0
