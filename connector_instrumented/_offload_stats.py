"""Host-path metrics on the engine's ``/metrics`` through vLLM's offloading stats.

vLLM's ``OffloadingConnectorStats`` is self-describing (metric name -> type, label
values -> value), and ``OffloadPromMetrics`` builds one Prometheus metric per definition
its spec and connector declare. kvobs adds its definitions (from ``kvobs.semconv``) to
that table and records into the same stats object, so ``vllm:kvobs_host_*`` sit next to
``vllm:kv_offload_*`` under the engine's labels, every label value initialised at zero.
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
    OffloadPromMetrics,
)
from vllm.v1.kv_offload.base import (
    OffloadingCounterMetadata,
    OffloadingHistogramMetadata,
    OffloadingMetricMetadata,
)

from kvobs import semconv as sc

BOOL_LABELS = ("false", "true")
TIERS = tuple(t.value for t in sc.HostTier)
LOOKUP_OUTCOMES = tuple(o.value for o in sc.HostLookupOutcome)
HOST_METRICS = (
    sc.M_HOST_SAVES,
    sc.M_HOST_SAVE_INCOMPLETE,
    sc.M_HOST_EVICTED_BLOCKS,
    sc.M_HOST_EVICTED_AGE,
    sc.M_HOST_LOOKUPS,
    sc.M_HOST_LOADS,
    sc.M_HOST_LOADED_TOKENS,
)
# Label values each metric starts with at zero.
_INITIAL = {
    sc.M_HOST_SAVES.name: [(b,) for b in BOOL_LABELS],
    sc.M_HOST_LOOKUPS.name: [(o,) for o in LOOKUP_OUTCOMES],
    sc.M_HOST_LOADS.name: [(t,) for t in TIERS],
    sc.M_HOST_LOADED_TOKENS.name: [(t,) for t in TIERS],
}


def definitions() -> dict[str, OffloadingMetricMetadata]:
    out: dict[str, OffloadingMetricMetadata] = {}
    for metric in HOST_METRICS:
        if metric.type == "counter":
            out[metric.name] = OffloadingCounterMetadata(metric.doc, metric.labels)
        else:
            out[metric.name] = OffloadingHistogramMetadata(
                metric.doc, metric.labels, metric.buckets
            )
    return out


class HostStats:
    """kvobs's host-path facts of one stats interval, as upstream's stats payload."""

    def __init__(self):
        self._stats = OffloadingConnectorStats()

    def saved(self, covers_response: bool, incomplete: bool) -> None:
        self._stats.increase_counter(sc.M_HOST_SAVES.name, 1, (BOOL_LABELS[covers_response],))
        if incomplete:
            self._stats.increase_counter(sc.M_HOST_SAVE_INCOMPLETE.name, 1)

    def evicted(self, blocks: int, oldest_age: float | None) -> None:
        self._stats.increase_counter(sc.M_HOST_EVICTED_BLOCKS.name, blocks)
        if oldest_age is not None:
            self._stats.observe_histogram(sc.M_HOST_EVICTED_AGE.name, oldest_age)

    def looked_up(self, outcome: str) -> None:
        self._stats.increase_counter(sc.M_HOST_LOOKUPS.name, 1, (outcome,))

    def load(self, tier: str) -> None:
        self._stats.increase_counter(sc.M_HOST_LOADS.name, 1, (tier,))

    def loaded_tokens(self, tier: str, tokens: int) -> None:
        self._stats.increase_counter(sc.M_HOST_LOADED_TOKENS.name, tokens, (tier,))

    def take(self) -> OffloadingConnectorStats | None:
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, OffloadingConnectorStats()
        return stats


class KvobsOffloadPromMetrics(OffloadPromMetrics):
    """Upstream's offload metrics (unchanged) plus ``vllm:kvobs_host_*``."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        for name, metadata in definitions().items():
            self._offloading_metric_metadata[name] = metadata
            self._offloading_metric_defs[name] = self._create_metric(name, metadata)
            for engine_idx in per_engine_labelvalues:
                for values in _INITIAL.get(name, [()]):
                    self._get_prometheus_metric(name, values, engine_idx)
