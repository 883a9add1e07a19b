"""vLLM's front end builds the connector's Prometheus metrics from the connector class
alone, from the user's `--kv-transfer-config`, in a process where no connector (and so
no spec default) was ever constructed. With the README's config exactly as written,
every metric the kvdepot scheduler reports must be known there."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm.config import KVTransferConfig, ModelConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)

from kvdepot.client.vllm.spec import KVDepotOffloadingSpec
from kvdepot.client.vllm.stats import MetricName
from kvdepot.testing.environment import find_model_dir

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]

# The README's --kv-transfer-config, verbatim (tests/test_docs.py keeps it in the README).
README_CONFIG = """{
  "kv_connector": "KVDepotConnector",
  "kv_connector_module_path": "kvdepot.client.vllm",
  "kv_role": "kv_both",
  "kv_load_failure_policy": "recompute",
  "kv_connector_extra_config": {"kvdepot_socket": "unix:///run/kvdepot/kvdepot.sock"}
}"""


def front_end(registry: CollectorRegistry) -> KVConnectorProm:
    """vLLM's own front-end class, with its metrics in `registry` (one per test)."""

    class FrontEndProm(KVConnectorProm):
        _gauge_cls = functools.partial(Gauge, registry=registry)  # type: ignore[assignment]
        _counter_cls = functools.partial(Counter, registry=registry)  # type: ignore[assignment]
        _histogram_cls = functools.partial(Histogram, registry=registry)  # type: ignore[assignment]

    config = VllmConfig(
        model_config=ModelConfig(model=str(find_model_dir()), skip_tokenizer_init=True),
        kv_transfer_config=KVTransferConfig(**json.loads(README_CONFIG)),
    )
    return FrontEndProm(config, ["model_name", "engine"], {0: ["m", "0"]})


def test_readme_config_is_the_one_tested() -> None:
    assert README_CONFIG in (REPO / "README.md").read_text()


def test_front_end_metrics_accept_every_kvdepot_metric() -> None:
    registry = CollectorRegistry()
    prom = front_end(registry)
    assert prom.prom_metrics is not None

    # Every metric kvdepot's scheduler side can report, as it reports them.
    definitions = KVDepotOffloadingSpec.build_metric_definitions({})
    stats = OffloadingConnectorStats()
    for name, meta in definitions.items():
        kind = type(meta).__name__
        if "Gauge" in kind:
            stats.set_gauge(name, 1.0)
        elif "Counter" in kind:
            stats.increase_counter(name, 2)
        else:
            stats.observe_histogram(name, 0.001)
    # Every name the manager's parts count is declared (vLLM asserts on any other).
    names = {v for k, v in vars(MetricName).items() if k.isupper()}
    assert names == set(definitions), names ^ set(definitions)
    prom.observe(stats.data, engine_idx=0)

    assert registry.get_sample_value("kvdepot_connected", {"model_name": "m", "engine": "0"}) == 1
    assert (
        registry.get_sample_value("kvdepot_pin_rpcs_total", {"model_name": "m", "engine": "0"}) == 2
    )


def test_vllms_offload_usage_gauges_say_the_pools_usage(daemon_factory, make_engine) -> None:
    """vLLM's CPU tier gauges (kv_offload_cpu_cache_{,write_,read_}usage_perc) come from
    the daemon's keepalive: rows pinned for a load by another client of the node count
    as read usage, the pool's fill as kvdepot_pool_used_perc; through vLLM's own stats
    class and front end, they equal the daemon's GetStats."""
    from kvdepot.client import DepotClient
    from kvdepot.testing.vllm_engine import prompt_for

    d = daemon_factory("--pool-size", "64MiB")
    engine = make_engine(socket=d.target, num_gpu_blocks=64)
    engine.wait_registered()
    prompt = prompt_for(51, 160)
    keys = engine.offload_keys(prompt)
    engine.generate([prompt])
    engine.wait_ready(keys)
    other = DepotClient(d.target, client_name="pinner").start()
    assert other.wait_connected(10)
    assert other.pin(engine.manager.namespace_id, keys[:3]) == [True] * 3

    st = d.stats()
    assert st.pinned_bytes > 0 and st.writing_blocks == 0
    want = {
        MetricName.CPU_CACHE_USAGE_PERC: st.pinned_bytes / st.capacity_bytes,
        MetricName.CPU_CACHE_WRITE_USAGE_PERC: 0.0,
        MetricName.CPU_CACHE_READ_USAGE_PERC: st.pinned_bytes / st.capacity_bytes,
        MetricName.POOL_USED_PERC: st.used_bytes / st.capacity_bytes,
    }
    got: dict[str, float] = {}
    sent: list[OffloadingConnectorStats] = []

    def gauges_arrived() -> bool:  # the next keepalive (every 5 s) brings them
        stats = engine.manager.get_stats()
        if stats is not None:
            sent.append(stats)
            got.update({n: v[()] for n, v in stats.data["data"].items() if n in want})
        return got == want

    engine.wait_until(gauges_arrived, timeout=20, what="the pool's usage gauges")
    assert 0 < want[MetricName.CPU_CACHE_USAGE_PERC] < want[MetricName.POOL_USED_PERC] < 1

    registry = CollectorRegistry()
    prom = front_end(registry)
    for stats in sent:
        prom.observe(stats.data, engine_idx=0)
    labels = {"model_name": "m", "engine": "0"}
    for name, value in want.items():
        assert registry.get_sample_value(name, labels) == pytest.approx(value), name
    other.close()
