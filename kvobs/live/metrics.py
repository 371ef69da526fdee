"""The live classifier's /metrics: true verdicts, causes and phases of final turns
(``semconv.M_TURN*``), every label value created at zero, the turn's trace id as
exemplar; and the classifier's own health."""

from __future__ import annotations

import bisect
import math
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector

from kvobs import semconv as sc
from kvobs.emit.prometheus import counter, gauge, histogram
from kvobs.live.classifier import PassResult

_FINITE = (int, float)


def _seconds(value: Any) -> float | None:
    if (
        isinstance(value, _FINITE)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= 0
    ):
        return float(value)
    return None


class TurnMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.turns = counter(sc.M_TURNS, r)
        self.causes = counter(sc.M_TURN_CAUSES, r)
        self.slowest = counter(sc.M_TURN_SLOWEST_PHASE, r)
        self.phase = histogram(sc.M_TURN_PHASE, r)
        self.latency = histogram(sc.M_TURN_LATENCY, r)
        self.reclassified = counter(sc.M_TURNS_RECLASSIFIED, r)
        self.spans = counter(sc.M_CLASSIFIER_SPANS, r)
        self.open_turns = gauge(sc.M_CLASSIFIER_OPEN_TURNS, r)
        self.held_spans = gauge(sc.M_CLASSIFIER_HELD_SPANS, r)
        self.pass_seconds = histogram(sc.M_CLASSIFIER_PASS, r)
        self.write_errors = counter(sc.M_CLASSIFIER_WRITE_ERRORS, r)
        self.peer_failures = counter(sc.M_CLASSIFIER_PEER_FAILURES, r)
        # sc.M_PROCESS_CPU and the other process_* series: how much of its one core the
        # service uses (KvobsClassifierSaturated).
        ProcessCollector(registry=r)
        self._span_totals = dict.fromkeys(sc.CLASSIFIER_SPAN_OUTCOMES, 0)
        # Each series' child, once: ``labels()`` validates its values on every call (~3 us),
        # and a final turn touches ~20 series.
        self._children: dict[tuple, Any] = {}
        self._zero()

    def _zero(self) -> None:
        # A rate over a turn's first observation needs the series before it.
        for turn in sc.TURN_BUCKET_VALUES:
            for verdict in sc.Verdict:
                self.latency.labels(verdict.value, turn)
                for prompt in sc.PROMPT_BUCKET_VALUES:
                    self.turns.labels(verdict.value, turn, prompt)
            for cause in sc.LatencyCause:
                self.causes.labels(cause.value, turn)
            for phase in sc.Phase:
                self.slowest.labels(phase.value, turn)
                self.phase.labels(phase.value, turn)
        for outcome in sc.CLASSIFIER_SPAN_OUTCOMES:
            self.spans.labels(outcome)

    def observe(self, result: PassResult) -> None:
        self.pass_seconds.observe(result.seconds)
        self.reclassified.inc(result.reclassified)
        observed = _Observations()
        for row in result.finalized:
            if row["first_final"] and not row.get("superseded"):
                self._count(row, observed)
        observed.flush()

    def _count(self, row: dict[str, Any], observed: "_Observations") -> None:
        turn = sc.turn_bucket(int(row["turn"]))
        prompt = sc.prompt_bucket(int(row.get("prompt_tokens") or 0))
        verdict = row["verdict"]
        trace = row.get("trace_id")
        exemplar = {sc.EXEMPLAR_TRACE_ID: trace} if trace else None
        series, inc, add = self._series, observed.inc, observed.observe
        inc(series(self.turns, verdict, turn, prompt), exemplar)
        for cause in row.get("causes") or ():
            inc(series(self.causes, cause["cause"], turn), exemplar)
        if row.get("slowest_phase"):
            inc(series(self.slowest, row["slowest_phase"], turn), exemplar)
        for phase, seconds in (row.get("phases") or {}).items():
            seconds = _seconds(seconds)
            if seconds is not None and phase in _PHASES:
                add(series(self.phase, phase, turn), _BOUNDS[sc.M_TURN_PHASE], seconds, exemplar)
        latency = _seconds(row.get("latency_s"))
        if latency is not None:
            add(series(self.latency, verdict, turn), _BOUNDS[sc.M_TURN_LATENCY], latency, exemplar)

    def _series(self, metric: Any, *values: str) -> Any:
        key = (id(metric), *values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child

    def health(
        self, classified: int, late: int, unreadable: int, open_turns: int, held_spans: int
    ) -> None:
        """Totals since start, as the classifier counts them."""
        for outcome, total in zip(sc.CLASSIFIER_SPAN_OUTCOMES, (classified, late, unreadable)):
            self.spans.labels(outcome).inc(max(0, total - self._span_totals[outcome]))
            self._span_totals[outcome] = max(total, self._span_totals[outcome])
        self.open_turns.set(open_turns)
        self.held_spans.set(held_spans)


_PHASES = frozenset(p.value for p in sc.Phase)
# A histogram's bucket bounds as prometheus_client keeps them (+Inf last).
_BOUNDS = {metric: [*metric.buckets, math.inf] for metric in (sc.M_TURN_PHASE, sc.M_TURN_LATENCY)}


class _Observations:
    """A pass's counts and observations, given to their series at the end of the pass
    with the exemplars the series keep: a counter keeps its latest exemplar, a
    histogram one per bucket (each bucket's latest), so only those are passed. Each
    exemplar costs prometheus_client a validation (~2 us), and a final turn touches
    ~20 series; a pass's turns add up to far fewer counter calls than turns."""

    def __init__(self) -> None:
        self._counts: dict[Any, list] = {}  # counter child -> [count, latest exemplar]
        self._values: dict[Any, tuple[list[float], dict[int, tuple[int, dict]]]] = {}

    def inc(self, child: Any, exemplar: dict | None) -> None:
        counted = self._counts.setdefault(child, [0, None])
        counted[0] += 1
        if exemplar is not None:
            counted[1] = exemplar

    def observe(self, child: Any, bounds: list[float], value: float, exemplar: dict | None) -> None:
        values, latest = self._values.setdefault(child, ([], {}))
        if exemplar is not None:  # the bucket prometheus_client puts it in: first bound >= value
            latest[bisect.bisect_left(bounds, value)] = (len(values), exemplar)
        values.append(value)

    def flush(self) -> None:
        for child, (count, exemplar) in self._counts.items():
            if exemplar is None:
                child.inc(count)
            else:  # an exemplar's value is its own increment: one turn's
                if count > 1:
                    child.inc(count - 1)
                child.inc(1, exemplar)
        for child, (values, latest) in self._values.items():
            exemplars = dict(latest.values())  # position -> exemplar
            for i, value in enumerate(values):
                child.observe(value, exemplars.get(i))
