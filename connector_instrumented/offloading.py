"""``KvobsOffloadingConnector``: vLLM's OffloadingConnector plus kvobs host-path spans.

A thin facade like ``KvobsNixlConnector``: each override calls ``super()`` once and hands
the facts to ``OffloadObserver`` (scheduler side) or records per-job copy results
(worker side); observer code runs guarded, never raising into vLLM. Behaviour is
upstream's: the class changes no decision, and with ``kvobs_telemetry: false`` nothing
is observed. Spans (``kvobs.host.*``): lookup, load, save, evict (``docs/telemetry.md``).

Load it alone, or as one connector of vLLM's MultiConnector::

    {"kv_connector": "KvobsOffloadingConnector",
     "kv_connector_module_path": "connector_instrumented.offloading",
     "kv_connector_extra_config": {"spec_name": "KvobsHostCopySpec",
        "spec_module_path": "connector_instrumented.host_copy",
        "cpu_bytes_to_use": 67108864, "offload_prompt_only": false}}
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)

from kvobs import semconv as sc

from ._offload_observer import OffloadObserver
from .host_copy import HOST_COPY_SPECS
from ._offload_stats import KvobsOffloadPromMetrics
from ._options import Options
from ._registry import register
from ._telemetry import SpanSink

__all__ = ["KvobsOffloadingConnector", "KvobsOffloadingWorkerMetadata"]


@dataclass
class KvobsOffloadingWorkerMetadata(OffloadingWorkerMetadata):
    """Upstream's worker metadata plus per-job copy results for per-turn attribution.

    ``kvobs_jobs``: ``[job_id, bytes, seconds, end wall-clock]`` per finished copy."""

    kvobs_jobs: list = field(default_factory=list)

    def aggregate(self, other):
        merged = super().aggregate(other)
        return KvobsOffloadingWorkerMetadata(
            completed_jobs=merged.completed_jobs,
            transfer_stats=merged.transfer_stats,
            kvobs_jobs=[*self.kvobs_jobs, *getattr(other, "kvobs_jobs", ())],
        )


_options_of = Options.from_vllm_config


class KvobsOffloadingConnector(OffloadingConnector):
    """Drop-in for ``OffloadingConnector`` that emits ``kvobs.host.*`` spans and metrics."""

    def __init__(
        self, vllm_config: Any, role: Any, kv_cache_config: Any = None, *args: Any, **kwargs: Any
    ):
        super().__init__(vllm_config, role, kv_cache_config, *args, **kwargs)
        self.kvobs_options = _options_of(vllm_config)
        self._kvobs_obs: OffloadObserver | None = None
        self._kvobs_jobs: list | None = None
        self._kvobs_sink: SpanSink | None = None
        if not self.kvobs_options.telemetry:
            return
        self._kvobs_sink = SpanSink(self.kvobs_options.role, self.kvobs_options.store_dir)
        if self.connector_scheduler is not None:
            self._kvobs_obs = OffloadObserver(
                self.connector_scheduler, self._kvobs_sink, _copy_engine(vllm_config)
            )
        if self.connector_worker is not None:
            self._kvobs_jobs = []

    # ------------------------------------------------------------------ scheduler side

    def _tell(self, hook: str, *args: Any) -> None:
        """Hand facts to the observer's ``hook``; a telemetry failure is counted only."""
        obs = self._kvobs_obs
        if obs is None:
            return
        try:
            getattr(obs, hook)(*args)
        except Exception:  # noqa: BLE001
            obs.guard.failed(hook)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        result = super().get_num_new_matched_tokens(request, num_computed_tokens)
        self._tell("on_match", request, num_computed_tokens, result)
        return result

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        result = super().update_state_after_alloc(request, blocks, num_external_tokens)
        self._tell("on_alloc", request, num_external_tokens)
        return result

    def build_connector_meta(self, scheduler_output):
        if self._kvobs_obs is not None:  # before upstream: its step retires finished requests
            self._tell("on_meta", self.scheduler.get_external_cache_hit_sources)
        return super().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output):
        # Before upstream retires the jobs the per-job results name.
        jobs = getattr(connector_output.kv_connector_worker_meta, "kvobs_jobs", None)
        if jobs:
            self._tell("on_job_results", jobs)
        return super().update_connector_output(connector_output)

    def request_finished(self, request, block_ids):
        result = super().request_finished(request, block_ids)
        self._tell("on_finished", request)
        return result

    def request_finished_all_groups(self, request, block_ids):
        result = super().request_finished_all_groups(request, block_ids)
        self._tell("on_finished", request)
        return result

    def get_kv_connector_stats(self):
        upstream = super().get_kv_connector_stats()
        obs = self._kvobs_obs
        if obs is None:
            return upstream
        try:
            ours = obs.take_stats()
        except Exception:  # noqa: BLE001
            obs.guard.failed("get_kv_connector_stats")
            return upstream
        if ours is None:
            return upstream
        return ours if upstream is None else upstream.aggregate(ours)

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        if not _options_of(vllm_config).telemetry:
            return super().build_prom_metrics(
                vllm_config, metric_types, labelnames, per_engine_labelvalues
            )
        return KvobsOffloadPromMetrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues
        )

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches):
        result = super().register_kv_caches(kv_caches)
        if self._kvobs_jobs is not None:
            self._observe_copies(self.connector_worker.worker)
        return result

    def _observe_copies(self, worker: Any) -> None:
        get_finished = worker.get_finished

        def observed_get_finished():
            results = get_finished()
            try:
                now = time.time()
                for r in results:
                    if r.transfer_size is not None and r.transfer_time is not None:
                        self._kvobs_jobs.append(
                            [r.job_id, int(r.transfer_size), float(r.transfer_time), now]
                        )
            except Exception:  # noqa: BLE001
                pass  # a lost record costs one span, never the copy
            return results

        worker.get_finished = observed_get_finished

    def build_connector_worker_meta(self):
        meta = super().build_connector_worker_meta()
        jobs = self._kvobs_jobs
        if meta is None or not jobs:
            return meta
        self._kvobs_jobs = []
        return KvobsOffloadingWorkerMetadata(
            completed_jobs=meta.completed_jobs, transfer_stats=meta.transfer_stats, kvobs_jobs=jobs
        )

    def shutdown(self):
        try:
            return super().shutdown()
        finally:
            if self._kvobs_sink is not None:
                self._kvobs_sink.flush()


register(KvobsOffloadingConnector)


def _copy_engine(vllm_config: Any) -> str:
    extra = getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None) or {}
    if extra.get("spec_name") in HOST_COPY_SPECS:
        return sc.CopyEngine.HOST_MEMCPY.value
    return sc.CopyEngine.DEVICE.value
