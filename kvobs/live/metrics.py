"""The live classifier's /metrics: true verdicts, causes and phases of final turns
(``semconv.M_TURN*``), every label value created at zero, the turn's trace id as
exemplar; and the classifier's own health."""

from __future__ import annotations

import math
from typing import Any

from prometheus_client import CollectorRegistry

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
        for row in result.finalized:
            if row["first_final"] and not row.get("superseded"):
                self._count(row)

    def _count(self, row: dict[str, Any]) -> None:
        turn = sc.turn_bucket(int(row["turn"]))
        prompt = sc.prompt_bucket(int(row.get("prompt_tokens") or 0))
        verdict = row["verdict"]
        trace = row.get("trace_id")
        exemplar = {sc.EXEMPLAR_TRACE_ID: trace} if trace else None
        series = self._series
        series(self.turns, verdict, turn, prompt).inc(1, exemplar)
        for cause in row.get("causes") or ():
            series(self.causes, cause["cause"], turn).inc(1, exemplar)
        if row.get("slowest_phase"):
            series(self.slowest, row["slowest_phase"], turn).inc(1, exemplar)
        for phase, seconds in (row.get("phases") or {}).items():
            seconds = _seconds(seconds)
            if seconds is not None and phase in _PHASES:
                series(self.phase, phase, turn).observe(seconds, exemplar)
        latency = _seconds(row.get("latency_s"))
        if latency is not None:
            series(self.latency, verdict, turn).observe(latency, exemplar)

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
