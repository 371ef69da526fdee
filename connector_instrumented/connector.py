"""``KvobsNixlConnector``: upstream's NIXL (pull) connector plus kvobs observation.

A thin facade in the style of upstream's ``nixl/connector.py``: every override calls
``super()`` exactly once and hands the facts to a scheduler-side or worker-side observer.
Observer code is guarded: a telemetry failure is counted and logged, never raised into
vLLM. Behaviour differs from upstream only through the documented options
(``docs/connector.md``): the prefix guard and the stuck-wait fix; with
``kvobs_telemetry: false`` the class is upstream's, observed by nothing.

Load it with::

    --kv-transfer-config '{"kv_connector": "KvobsNixlConnector",
        "kv_connector_module_path": "connector_instrumented", ...}'
"""

from __future__ import annotations

from typing import Any

from . import _compat
from ._compat import UpstreamNixlConnector
from ._options import Options
from ._registry import register
from ._scheduler_observer import SchedulerObserver
from ._stats import KvobsConnectorStats, KvobsPromMetrics
from ._telemetry import SpanSink
from ._worker_observer import WorkerObserver

_compat.check_connector_class()


_options_of = Options.from_vllm_config


class KvobsNixlConnector(UpstreamNixlConnector):
    """Drop-in for ``NixlConnector`` that emits kvobs spans and ``vllm:kvobs_*`` metrics."""

    def __init__(
        self, vllm_config: Any, role: Any, kv_cache_config: Any = None, *args: Any, **kwargs: Any
    ):
        super().__init__(vllm_config, role, kv_cache_config, *args, **kwargs)
        self.kvobs_options = _options_of(vllm_config)
        self._kvobs_sched: SchedulerObserver | None = None
        self._kvobs_worker: WorkerObserver | None = None
        self._kvobs_finishing = 0
        self._kvobs_sink: SpanSink | None = None
        if not self.kvobs_options.telemetry:
            return
        self._kvobs_sink = SpanSink(self.kvobs_options.role, self.kvobs_options.store_dir)
        if self.connector_scheduler is not None:
            _compat.require(
                self.connector_scheduler,
                _compat.SCHEDULER_HOOKS,
                type(self.connector_scheduler).__name__,
            )
            self._kvobs_sched = SchedulerObserver(
                self.connector_scheduler,
                vllm_config,
                kv_cache_config,
                self.kvobs_options,
                self._kvobs_sink,
            )
        if self.connector_worker is not None:
            bidirectional = bool(
                vllm_config.kv_transfer_config.get_from_extra_config("bidirectional_kv_xfer", False)
            )
            self._kvobs_worker = WorkerObserver(
                self.connector_worker, bidirectional, _compat.completion_method()
            )

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        obs = self._kvobs_sched
        if obs is None:
            return super().get_num_new_matched_tokens(request, num_computed_tokens)
        try:
            obs.before_match(request, num_computed_tokens)
        except Exception:  # noqa: BLE001
            obs.guard.failed("get_num_new_matched_tokens")
        result = super().get_num_new_matched_tokens(request, num_computed_tokens)
        try:
            return obs.after_match(request, result)
        except Exception:  # noqa: BLE001
            obs.guard.failed("get_num_new_matched_tokens")
            return result

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        result = super().update_state_after_alloc(request, blocks, num_external_tokens)
        obs = self._kvobs_sched
        if obs is not None:
            try:
                obs.after_alloc(request, num_external_tokens)
            except Exception:  # noqa: BLE001
                obs.guard.failed("update_state_after_alloc")
        return result

    def build_connector_meta(self, scheduler_output):
        meta = super().build_connector_meta(scheduler_output)
        obs = self._kvobs_sched
        if obs is not None:
            try:
                obs.on_meta(meta)
            except Exception:  # noqa: BLE001
                obs.guard.failed("build_connector_meta")
        return meta

    def update_connector_output(self, connector_output):
        result = super().update_connector_output(connector_output)
        obs = self._kvobs_sched
        if obs is not None:
            try:
                obs.on_output(connector_output)
            except Exception:  # noqa: BLE001
                obs.guard.failed("update_connector_output")
        return result

    # vLLM 0.32 ends requests through request_finished_all_groups (SupportsHMA);
    # request_finished is the non-HMA path. Observe whichever is the outermost call.
    def request_finished(self, request, block_ids):
        return self._finished(super().request_finished, request, block_ids)

    def request_finished_all_groups(self, request, block_ids):
        return self._finished(super().request_finished_all_groups, request, block_ids)

    def _finished(self, upstream, request, block_ids):
        self._kvobs_finishing += 1
        try:
            result = upstream(request, block_ids)
        finally:
            self._kvobs_finishing -= 1
        obs = self._kvobs_sched
        if obs is None or self._kvobs_finishing:
            return result
        try:
            return obs.on_finished(request, result)
        except Exception:  # noqa: BLE001
            obs.guard.failed("request_finished")
            return result

    # ------------------------------------------------------------------ worker side

    def start_load_kv(self, forward_context, **kwargs):
        obs = self._kvobs_worker
        if obs is not None:
            try:
                obs.on_start_load(self._connector_metadata)
            except Exception:  # noqa: BLE001
                obs.guard.failed("start_load_kv")
        return super().start_load_kv(forward_context, **kwargs)

    # ------------------------------------------------------------------ stats

    def get_kv_connector_stats(self):
        upstream = super().get_kv_connector_stats()
        if self._kvobs_sched is not None:  # scheduler process
            try:
                ours = self._kvobs_sched.take_stats()
            except Exception:  # noqa: BLE001
                self._kvobs_sched.guard.failed("get_kv_connector_stats")
                return upstream
            if ours is not None and upstream is not None:
                ours.aggregate(upstream)
            return ours if ours is not None else upstream
        obs = self._kvobs_worker
        if obs is None:  # kvobs_telemetry: false -> exactly upstream's
            return upstream
        try:
            reads, releases = obs.take()
            if upstream is None and not reads and not releases:
                return None
            stats = _as_kvobs(upstream)
            stats.data["kvobs_raw_reads"].extend(reads)
            stats.data["kvobs_raw_releases"].extend(releases)
            return stats
        except Exception:  # noqa: BLE001
            obs.guard.failed("get_kv_connector_stats")
            return upstream if upstream is None else _as_kvobs(upstream)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None):
        return KvobsConnectorStats(data=data) if data is not None else KvobsConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        if not _options_of(vllm_config).telemetry:
            return super().build_prom_metrics(
                vllm_config, metric_types, labelnames, per_engine_labelvalues
            )
        return KvobsPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self):
        # vLLM's only shutdown hook for a connector (EngineCore.shutdown -> Scheduler ->
        # here, on SIGTERM too). Flushed first: upstream's shutdown joins its handshake
        # listener thread without a timeout, and a SIGKILL after the process manager's
        # grace period (5 s) would take the queued spans with it. Again after, for
        # anything its shutdown emits.
        if self._kvobs_sink is not None:
            self._kvobs_sink.flush()
        try:
            return super().shutdown()
        finally:
            if self._kvobs_sink is not None:
                self._kvobs_sink.flush()


register(KvobsNixlConnector)  # MultiConnector rebuilds sub-connector stats by class name


def _as_kvobs(stats) -> KvobsConnectorStats:
    """Upstream worker stats as our class (one class on every worker and the scheduler)."""
    if isinstance(stats, KvobsConnectorStats):
        return stats
    ours = KvobsConnectorStats()
    if stats is not None:
        ours.data.update(stats.data)
    return ours
