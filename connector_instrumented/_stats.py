"""kvobs signals on the engine's own ``/metrics`` through vLLM's connector-stats plumbing.

Route (vLLM 0.32): worker ``get_kv_connector_stats()`` -> ``KVConnectorOutput`` ->
(TP ranks merged with ``aggregate``) -> scheduler, which ``aggregate``s the
scheduler-side connector's ``get_kv_connector_stats()`` into it -> ``SchedulerStats``
(``to_dict``) -> front-end: ``build_kv_connector_stats(data)`` for the log line and
``build_prom_metrics(...).observe(data)`` for Prometheus.

One class serves both sides, a superset of ``NixlKVConnectorStats`` (whose ``aggregate``
indexes every key of the other side, so both sides must share the key set). Worker-side
raw records (``RAW_*``) ride to the scheduler, which turns them into spans and the
finished facts below, then empties them so they never reach the front-end.
"""

from __future__ import annotations

from typing import Any

from kvobs import semconv as sc

from ._compat import NixlKVConnectorStats, NixlPromMetrics

# Worker -> scheduler raw records (consumed by the scheduler-side observer).
RAW_READS = "kvobs_raw_reads"  # [req_id, outcome, bytes, blocks, start_wall, dur, ttl, error,
#                                  setup]
RAW_RELEASES = "kvobs_raw_releases"  # [req_id, reason, read_count]

# Finished facts -> Prometheus (one key per metric).
READS = "kvobs_reads"  # [direction, outcome]
READ_BYTES = "kvobs_read_bytes"  # [direction, bytes]
READ_DURATION = "kvobs_read_duration"  # [direction, seconds]
READ_SETUP = "kvobs_read_setup"  # [direction, seconds]
REMAINING_TTL = "kvobs_remaining_ttl"  # seconds
DECLINED_EXPIRED = "kvobs_declined_expired"  # 1
PULL_DECISIONS = "kvobs_pull_decisions"  # decision
RETAINED_BLOCKS = "kvobs_retained_blocks"  # gauge samples, last wins
RETAINED_BYTES = "kvobs_retained_bytes"  # gauge samples, last wins
RETAINED_BLOCK_SECONDS = "kvobs_retained_block_seconds"  # block-seconds
RELEASES = "kvobs_releases"  # [reason, was_read]
RECOMPUTED_TOKENS = "kvobs_recomputed_tokens"  # [reason, tokens]
REUSED_TOKENS = "kvobs_reused_tokens"  # tokens
STUCK_WAITS = "kvobs_stuck_waits"  # 1
STUCK_PREVENTED = "kvobs_stuck_prevented"  # 1
PREFIX_MISMATCHES = "kvobs_prefix_mismatches"  # 1
TELEMETRY_ERRORS = "kvobs_telemetry_errors"  # n
TELEMETRY_DROPPED = "kvobs_telemetry_dropped"  # [reason, spans]

RAW_KEYS = (RAW_READS, RAW_RELEASES)
FACT_KEYS = (
    READS,
    READ_BYTES,
    READ_DURATION,
    READ_SETUP,
    REMAINING_TTL,
    DECLINED_EXPIRED,
    PULL_DECISIONS,
    RETAINED_BLOCKS,
    RETAINED_BYTES,
    RETAINED_BLOCK_SECONDS,
    RELEASES,
    RECOMPUTED_TOKENS,
    REUSED_TOKENS,
    STUCK_WAITS,
    STUCK_PREVENTED,
    PREFIX_MISMATCHES,
    TELEMETRY_ERRORS,
    TELEMETRY_DROPPED,
)
KVOBS_KEYS = RAW_KEYS + FACT_KEYS

DIRECTIONS = tuple(d.value for d in sc.ReadDirection)
BOOL_LABELS = ("false", "true")


class KvobsConnectorStats(NixlKVConnectorStats):
    """``NixlKVConnectorStats`` plus kvobs's lists (all plain, msgspec-serialisable)."""

    # vLLM's reset() types its lists as numbers; kvobs's lists hold records (lists).
    data: dict[str, Any]

    def reset(self):
        super().reset()
        for key in KVOBS_KEYS:
            self.data[key] = []

    def __post_init__(self):
        super().__post_init__()
        for key in KVOBS_KEYS:  # data built elsewhere (older peer, partial dict)
            self.data.setdefault(key, [])

    def clone_and_reset(self) -> KvobsConnectorStats:
        old = super().clone_and_reset()
        assert isinstance(old, KvobsConnectorStats)  # vLLM's is a copy of self
        return old

    def add(self, key: str, value: Any) -> None:
        self.data[key].append(value)

    def kvobs_empty(self) -> bool:
        return not any(self.data.get(key) for key in KVOBS_KEYS)

    def is_empty(self) -> bool:
        return super().is_empty() and self.kvobs_empty()

    def aggregate(self, other):
        if other.is_empty():
            return self
        for key, values in other.data.items():
            self.data.setdefault(key, []).extend(values)
        return self

    def reduce(self) -> dict[str, int | float]:
        out = super().reduce()
        if not self.kvobs_empty():
            out["kvobs reads"] = len(self.data[READS])
            out["kvobs pull decisions"] = len(self.data[PULL_DECISIONS])
            out["kvobs stuck waits"] = len(self.data[STUCK_WAITS])
        return out


def _gauge(cls, **kwargs):
    try:
        return cls(multiprocess_mode="mostrecent", **kwargs)
    except TypeError:  # metric classes without multiprocess support (Ray wrappers)
        return cls(**kwargs)


class KvobsPromMetrics(NixlPromMetrics):
    """``vllm:nixl_*`` (upstream, unchanged) plus ``vllm:kvobs_*``, label values at zero."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        outcomes = tuple(o.value for o in sc.ReadOutcome)
        self.kvobs_reads = self._make(sc.M_READS, [(d, o) for d in DIRECTIONS for o in outcomes])
        self.kvobs_read_bytes = self._make(sc.M_READ_BYTES, [(d,) for d in DIRECTIONS])
        self.kvobs_read_duration = self._make(sc.M_READ_DURATION, [(d,) for d in DIRECTIONS])
        self.kvobs_read_setup = self._make(sc.M_READ_SETUP, [(d,) for d in DIRECTIONS])
        self.kvobs_remaining_ttl = self._make(sc.M_REMAINING_TTL)
        self.kvobs_declined = self._make(sc.M_DECLINED_EXPIRED)
        self.kvobs_decisions = self._make(
            sc.M_PULL_DECISIONS, [(d.value,) for d in sc.PullDecision]
        )
        self.kvobs_retained_blocks = self._make(sc.M_RETAINED_BLOCKS)
        self.kvobs_retained_bytes = self._make(sc.M_RETAINED_BYTES)
        self.kvobs_block_seconds = self._make(sc.M_RETAINED_BLOCK_SECONDS)
        self.kvobs_releases = self._make(
            sc.M_RELEASES, [(r.value, b) for r in sc.ReleaseReason for b in BOOL_LABELS]
        )
        self.kvobs_recomputed = self._make(
            sc.M_RECOMPUTED_TOKENS, [(r.value,) for r in sc.RecomputeReason]
        )
        self.kvobs_reused = self._make(sc.M_REUSED_TOKENS)
        self.kvobs_stuck = self._make(sc.M_STUCK_WAITS)
        self.kvobs_stuck_prevented = self._make(sc.M_STUCK_PREVENTED)
        self.kvobs_prefix_mismatches = self._make(sc.M_PREFIX_MISMATCH)
        self.kvobs_errors = self._make(sc.M_TELEMETRY_ERRORS)
        self.kvobs_dropped = self._make(
            sc.M_ENGINE_TELEMETRY_DROPPED, [(r,) for r in sc.TELEMETRY_DROP_REASONS]
        )

    def _make(self, metric: sc.Metric, values: list[tuple[str, ...]] | None = None):
        """Per engine: the child (no extra labels) or {label values: child}, all at 0."""
        kwargs: dict[str, Any] = dict(
            name=metric.name,
            documentation=metric.doc,
            labelnames=list(self._labelnames) + list(metric.labels),
        )
        if metric.type == "counter":
            parent = self._counter_cls(**kwargs)
        elif metric.type == "gauge":
            parent = _gauge(self._gauge_cls, **kwargs)
        else:
            # vLLM types its three metric classes as one union: this one is a Histogram's.
            histogram: Any = self._histogram_cls
            parent = histogram(buckets=list(metric.buckets), **kwargs)
        children: dict[int, Any] = {}
        for idx, engine_values in self.per_engine_labelvalues.items():
            if values is None:
                children[idx] = parent.labels(*engine_values)
            else:
                children[idx] = {v: parent.labels(*engine_values, *v) for v in values}
        return children

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        super().observe(transfer_stats_data, engine_idx)
        data = transfer_stats_data
        get = data.get
        for direction, outcome in get(READS, ()):
            self.kvobs_reads[engine_idx][(direction, outcome)].inc()
        for direction, value in get(READ_BYTES, ()):
            self.kvobs_read_bytes[engine_idx][(direction,)].observe(value)
        for direction, value in get(READ_DURATION, ()):
            self.kvobs_read_duration[engine_idx][(direction,)].observe(value)
        for direction, value in get(READ_SETUP, ()):
            self.kvobs_read_setup[engine_idx][(direction,)].observe(value)
        for value in get(REMAINING_TTL, ()):
            self.kvobs_remaining_ttl[engine_idx].observe(value)
        for value in get(DECLINED_EXPIRED, ()):
            self.kvobs_declined[engine_idx].inc(value)
        for decision in get(PULL_DECISIONS, ()):
            self.kvobs_decisions[engine_idx][(decision,)].inc()
        if get(RETAINED_BLOCKS):
            self.kvobs_retained_blocks[engine_idx].set(data[RETAINED_BLOCKS][-1])
        if get(RETAINED_BYTES):
            self.kvobs_retained_bytes[engine_idx].set(data[RETAINED_BYTES][-1])
        for value in get(RETAINED_BLOCK_SECONDS, ()):
            self.kvobs_block_seconds[engine_idx].inc(value)
        for reason, was_read in get(RELEASES, ()):
            self.kvobs_releases[engine_idx][(reason, was_read)].inc()
        for reason, tokens in get(RECOMPUTED_TOKENS, ()):
            self.kvobs_recomputed[engine_idx][(reason,)].inc(tokens)
        for tokens in get(REUSED_TOKENS, ()):
            self.kvobs_reused[engine_idx].inc(tokens)
        for value in get(STUCK_WAITS, ()):
            self.kvobs_stuck[engine_idx].inc(value)
        for value in get(STUCK_PREVENTED, ()):
            self.kvobs_stuck_prevented[engine_idx].inc(value)
        for value in get(PREFIX_MISMATCHES, ()):
            self.kvobs_prefix_mismatches[engine_idx].inc(value)
        for value in get(TELEMETRY_ERRORS, ()):
            self.kvobs_errors[engine_idx].inc(value)
        for reason, spans in get(TELEMETRY_DROPPED, ()):
            child = self.kvobs_dropped[engine_idx].get((reason,))
            if child is not None:
                child.inc(spans)
