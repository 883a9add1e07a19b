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


def test_readme_config_is_the_one_tested() -> None:
    assert README_CONFIG in (REPO / "README.md").read_text()


def test_front_end_metrics_accept_every_kvdepot_metric() -> None:
    registry = CollectorRegistry()

    class FrontEndProm(KVConnectorProm):
        # vLLM's own class, with its metrics in a private registry (one per test).
        _gauge_cls = functools.partial(Gauge, registry=registry)  # type: ignore[assignment]
        _counter_cls = functools.partial(Counter, registry=registry)  # type: ignore[assignment]
        _histogram_cls = functools.partial(Histogram, registry=registry)  # type: ignore[assignment]

    config = VllmConfig(
        model_config=ModelConfig(model=str(find_model_dir()), skip_tokenizer_init=True),
        kv_transfer_config=KVTransferConfig(**json.loads(README_CONFIG)),
    )
    prom = FrontEndProm(config, ["model_name", "engine"], {0: ["m", "0"]})
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
