"""kvdepot's vLLM 0.33 integration: offload KV blocks to the node-local kvdepot daemon.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVDepotConnector",
        "kv_connector_module_path": "kvdepot.client.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"kvdepot_socket": "unix:///run/kvdepot/kvdepot.sock"}}'

See client/vllm/README.md for every `kv_connector_extra_config` key.
"""

from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from kvdepot.client.vllm.config import DepotSettings
from kvdepot.client.vllm.connector import KVDepotConnector, KVDepotWorkerMetadata
from kvdepot.client.vllm.logs import follow_vllm_logging
from kvdepot.client.vllm.manager import KVDepotOffloadingManager
from kvdepot.client.vllm.spec import SPEC_NAME, KVDepotOffloadingSpec
from kvdepot.client.vllm.worker import KVDepotOffloadingWorker

follow_vllm_logging()

# So that `"spec_name": "KVDepotOffloadingSpec"` works without `spec_module_path`
# (vLLM imports this module by the connector's module path first).
if SPEC_NAME not in OffloadingSpecFactory._registry:
    OffloadingSpecFactory.register_spec(SPEC_NAME, "kvdepot.client.vllm.spec", SPEC_NAME)

__all__ = [
    "DepotSettings",
    "KVDepotConnector",
    "KVDepotOffloadingManager",
    "KVDepotOffloadingSpec",
    "KVDepotOffloadingWorker",
    "KVDepotWorkerMetadata",
]
