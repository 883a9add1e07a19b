"""`KVDepotConnector`: vLLM's OffloadingConnector, pointed at kvdepot, that survives failures.

What it adds to vLLM 0.33.0's stock OffloadingConnector:
- the spec defaults to `KVDepotOffloadingSpec` (so the user config is only the
  connector name, module path and socket), in every process: vLLM's front end
  builds the connector's Prometheus metrics from the class alone
  (`build_prom_metrics`), never constructing it, so the default is applied there too;
- a failed transfer no longer trips `assert transfer_result.success` in the worker:
  a failed load is reported to the scheduler as a load error, and vLLM recomputes
  the blocks (`kv_load_failure_policy: "recompute"`):
    * one KV-cache group: the load's GPU block ids, through
      `get_block_ids_with_load_errors()` (vLLM keeps the valid prefix);
    * several groups (hybrid models): block ids are ambiguous across groups and
      vLLM refuses them, so the request is reported in `failed_recving`; sync
      (in-step) loads, which can only report block ids, are switched off;
- the keys of failed loads travel back to the scheduler (in the worker metadata),
  which treats them as misses for a while instead of retrying the same failure.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
    OffloadingConnectorWorker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.kv_offload.base import OffloadingSpec
from vllm.v1.outputs import KVConnectorOutput

from kvdepot.client.vllm.manager import KVDepotOffloadingManager
from kvdepot.client.vllm.spec import SPEC_NAME, ConnectorContext, connector_context
from kvdepot.client.vllm.worker import KVDepotOffloadingWorker

log = logging.getLogger("kvdepot.vllm")


@dataclass
class KVDepotWorkerMetadata(OffloadingWorkerMetadata):
    """vLLM's worker -> scheduler metadata plus the keys of failed loads."""

    failed_load_keys: set[bytes] = field(default_factory=set)

    def aggregate(self, other: Any) -> KVDepotWorkerMetadata:
        merged = OffloadingWorkerMetadata.aggregate(self, other)
        assert isinstance(merged, OffloadingWorkerMetadata)
        keys = set(self.failed_load_keys)
        keys |= getattr(other, "failed_load_keys", set())
        return KVDepotWorkerMetadata(
            completed_jobs=merged.completed_jobs,
            transfer_stats=merged.transfer_stats,
            failed_load_keys=keys,
        )


class KVDepotConnectorWorker(OffloadingConnectorWorker):
    """vLLM's offloading worker connector with failures reported, not asserted."""

    _connector_worker_meta: OffloadingWorkerMetadata  # vLLM's, declared for the checker

    def __init__(
        self,
        spec: OffloadingSpec,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        *,
        report_block_ids: bool,
    ) -> None:
        super().__init__(spec, vllm_config, kv_cache_config)
        self._report_block_ids = report_block_ids
        self._load_block_ids: dict[int, np.ndarray] = {}
        self._invalid_block_ids: set[int] = set()
        self._failed_recving: set[str] = set()
        self._failed_load_keys: set[bytes] = set()
        self.load_errors = 0  # failed load jobs seen (for tests and logs)

    def start_kv_transfers(self, metadata: OffloadingConnectorMetadata) -> None:
        for job_id, entry in metadata.load_jobs.items():
            self._load_block_ids[job_id] = entry.dst_spec.block_ids
        super().start_kv_transfers(metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """Like vLLM's, but a failed job is completed as a failure instead of
        asserting: failed loads become load errors, failed stores are dropped."""
        assert self.worker is not None
        finished_recving: set[str] = set()
        meta = self._connector_worker_meta
        for result in self.worker.get_finished():
            job_id = result.job_id
            is_load = job_id in self._load_jobs
            if result.success:
                if result.transfer_time is not None and result.transfer_size is not None:
                    stats = meta.transfer_stats.load if is_load else meta.transfer_stats.store
                    stats.record(result.transfer_size, result.transfer_time)
            elif is_load:
                self.load_errors += 1
                req_id = self._load_jobs[job_id]
                block_ids = self._load_block_ids.get(job_id)
                if self._report_block_ids and block_ids is not None:
                    self._invalid_block_ids.update(int(b) for b in block_ids)
                elif req_id is not None:
                    self._failed_recving.add(req_id)
                else:
                    log.error(
                        "kvdepot: an in-step load failed in a multi-group model; vLLM "
                        "cannot be told which blocks (sync loads should be off)"
                    )
            meta.mark_completed(job_id)
            self._load_block_ids.pop(job_id, None)
            req_id = self._load_jobs.pop(job_id, None)
            if req_id is not None:
                finished_recving.add(req_id)
        if isinstance(self.worker, KVDepotOffloadingWorker):
            self._failed_load_keys |= self.worker.take_failed_load_keys()
        return set(), finished_recving

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving = self.get_finished(finished_req_ids)
        failed, self._failed_recving = self._failed_recving, set()
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving, failed_recving=failed
        )

    def take_block_ids_with_load_errors(self) -> set[int]:
        ids, self._invalid_block_ids = self._invalid_block_ids, set()
        return ids

    def build_connector_worker_meta(self) -> OffloadingWorkerMetadata | None:
        meta = self._connector_worker_meta
        if not meta.completed_jobs and not self._failed_load_keys:
            return None
        self._connector_worker_meta = OffloadingWorkerMetadata()
        keys, self._failed_load_keys = self._failed_load_keys, set()
        return KVDepotWorkerMetadata(
            completed_jobs=meta.completed_jobs,
            transfer_stats=meta.transfer_stats,
            failed_load_keys=keys,
        )

    def shutdown(self) -> None:
        self._load_block_ids.clear()
        super().shutdown()


class KVDepotConnector(OffloadingConnector):
    """`"kv_connector": "KVDepotConnector", "kv_connector_module_path": "kvdepot.client.vllm"`."""

    connector_worker: OffloadingConnectorWorker | None  # vLLM's, declared for the checker

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        transfer_config = vllm_config.kv_transfer_config
        assert transfer_config is not None
        extra = self.apply_spec_default(vllm_config)
        multi_group = len(kv_cache_config.kv_cache_groups) > 1
        if multi_group and int(extra.get("sync_load_budget_bytes", 0) or 0):
            log.warning(
                "kvdepot: sync_load_budget_bytes is ignored for models with several KV-cache "
                "groups (vLLM cannot recompute a failed in-step load there)"
            )
            extra["sync_load_budget_bytes"] = 0
        if transfer_config.kv_load_failure_policy != "recompute":
            log.warning(
                "kvdepot: kv_load_failure_policy is %r, so a request whose KV load fails "
                '(the daemon restarting, for example) fails; set it to "recompute" to '
                "recompute the blocks instead",
                transfer_config.kv_load_failure_policy,
            )
        token = connector_context.set(ConnectorContext(vllm_config, kv_cache_config))
        try:
            super().__init__(vllm_config, role, kv_cache_config)
        finally:
            connector_context.reset(token)
        if role == KVConnectorRole.WORKER:
            assert self.connector_worker is not None
            self.connector_worker = KVDepotConnectorWorker(
                self.connector_worker.spec,
                vllm_config,
                kv_cache_config,
                report_block_ids=not multi_group,
            )

    @staticmethod
    def apply_spec_default(vllm_config: VllmConfig) -> dict[str, Any]:
        """Makes `spec_name` default to KVDepotOffloadingSpec in the user's extra config
        (vLLM's own default is CPUOffloadingSpec) and returns that config."""
        transfer_config = vllm_config.kv_transfer_config
        assert transfer_config is not None
        extra = transfer_config.kv_connector_extra_config
        extra.setdefault("spec_name", SPEC_NAME)
        return extra

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> Any:
        # Runs in vLLM's front-end process, where no connector is constructed: without
        # the default, vLLM would define CPUOffloadingSpec's metrics and then fail on
        # the first kvdepot metric it observes.
        cls.apply_spec_default(vllm_config)
        return super().build_prom_metrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues
        )

    # -- worker side ----------------------------------------------------------------------

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        worker = self.connector_worker
        assert isinstance(worker, KVDepotConnectorWorker)
        return worker.get_transfer_results(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        worker = self.connector_worker
        if isinstance(worker, KVDepotConnectorWorker):
            return worker.take_block_ids_with_load_errors()
        return set()

    # -- scheduler side ---------------------------------------------------------------------

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        # Runs every step: one type check, then vLLM's scheduler side directly.
        meta = connector_output.kv_connector_worker_meta
        if type(meta) is KVDepotWorkerMetadata and meta.failed_load_keys:
            manager = self.scheduler.manager
            if isinstance(manager, KVDepotOffloadingManager):
                manager.note_load_failures(meta.failed_load_keys)
        self.scheduler.update_connector_output(connector_output)
