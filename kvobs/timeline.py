"""Where a turn's time went: consecutive phases between timeline marks.

The stage between correlation and classification. A turn's marks are wall-clock instants
from the proxy's turn span, P's and D's request spans and the read and hand-off spans
(``MARKS``, in time order); phase *i* (``semconv.Phase``) runs from mark *i* to mark
*i + 1*, so a turn's phases add up to its latency by construction.

A mark can be:
- known: the span carrying it is there;
- not applicable: the turn had no such step (no D->P read, no fallback retry): its phase
  is 0 and the next phase starts at the previous mark;
- missing: the step happened (or may have) but the span is absent. Nothing is guessed:
  the phases on both sides of a missing mark merge into one (``"p-queue+p-schedule"``)
  and ``unmeasured`` names each merged phase with the span that would have split it.

A turn the proxy retried without params (a failed or declined read, a P error) has one
``p-retry`` phase for its whole first attempt, that attempt's read included; the P marks
after it are the retry's, which reads nothing.

Marks come from different processes' wall clocks (the engines may run on other hosts):
durations within a process are exact, a phase that crosses processes carries their
clock offset. A phase more than ``SKEW_TOLERANCE_S`` below zero is reported as skew.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable, Mapping

import numpy as np

from kvobs.turns import columns as col
from kvobs import semconv as sc
from kvobs.semconv import Phase

SKEW_TOLERANCE_S = 0.005
PHASES: tuple[Phase, ...] = tuple(Phase)
# Phases of P's reuse path: what the reuse verdict already explains.
REUSE_PATH = frozenset({Phase.READ_SETUP, Phase.READ, Phase.P_COMPUTE})


def _phase_column_name(phase: Phase) -> str:
    return "phase_" + phase.value.replace("-", "_") + "_s"


# Read for every phase of every turn: built once.
_COLUMN_OF_PHASE = {phase: _phase_column_name(phase) for phase in PHASES}
PHASE_COLUMNS = tuple(_COLUMN_OF_PHASE.values())


def phase_column(phase: Phase) -> str:
    """Turn-table column holding a phase's seconds (NaN: not measured alone)."""
    return _COLUMN_OF_PHASE[phase]


# Columns this stage adds to the turn table (public: JSON, CSV, report).
TIMELINE_COLUMNS = (
    "latency_s",
    "ttft_s",
    "ttft_source",
    "slowest_phase",
    "slowest_s",
    "slowest_share",
    "compute_saved_tokens",
    "compute_saved_s",
    "ttft_gained_s",
) + PHASE_COLUMNS

_T = col.Table
_C = col.Cached  # what mark readers get: the turn table, each column converted once


Applies = Callable[[_C], np.ndarray]  # per turn: whether a mark applies


@dataclass(frozen=True)
class Reader:
    """A mark reader that says which turn columns it reads (docs/timeline.md)."""

    source: str
    read: Callable[[_C], np.ndarray]

    def __call__(self, c: _C) -> np.ndarray:
        return self.read(c)


def _sourced(source: str, read: Callable[[_C], np.ndarray]) -> Reader:
    return Reader(source, read)


def _ns(column: str) -> Reader:
    return _sourced(column, lambda c: c.num(column) / 1e9)


def _col(column: str) -> Reader:
    return _sourced(column, lambda c: c.num(column))


def _always(c: _C) -> np.ndarray:
    return np.ones(len(c), bool)


def _or_vllm(column: str, role: str, ttft: bool = False) -> Reader:
    """A connector mark, else the same instant from vLLM's own request span (its start
    is vLLM's arrival time; its first token is that plus its TTFT)."""

    def read(c: _C) -> np.ndarray:
        vllm = c.num(f"vllm_{role}_start_ns") / 1e9
        if ttft:
            vllm = vllm + c.num(f"vllm_{role}_ttft_s")
        own = c.num(column)
        return np.where(np.isnan(own), vllm, own)

    vllm = f"vllm_{role}_start_ns" + (f" + vllm_{role}_ttft_s" if ttft else "")
    return _sourced(f"{column}, else {vllm}", read)


def _or_http(column: str, http_ns: str) -> Reader:
    """A proxy mark, else the same instant at the engine's HTTP front door
    (``kvobs.emit.engine_http``): behind another router, where the request reached the
    engine or its answer left it."""

    def read(c: _C) -> np.ndarray:
        own = c.num(column)
        return np.where(np.isnan(own), c.num(http_ns) / 1e9, own)

    return _sourced(f"{column}, else {http_ns}", read)


def _requested(prefix: str) -> Reader:
    """When the worker was asked for a read: its start less its set-up (one span)."""
    return _sourced(
        f"{prefix}_start_ns - {prefix}_setup_s",
        lambda c: c.num(f"{prefix}_start_ns") / 1e9 - c.num(f"{prefix}_setup_s"),
    )


_D_FIRST_TOKEN = _or_vllm("d_first_token_at", "d", True)


def _first_token(c: _C) -> np.ndarray:
    """Client-visible first token: the first output at the proxy when streamed, else
    D's engine-side first token (the proxy sees a non-streamed answer only at its end)."""
    streamed = c.num("d_first_output_at")
    return np.where(np.isnan(streamed), _D_FIRST_TOKEN(c), streamed)


_FIRST_TOKEN_AT = _sourced(
    f"d_first_output_at (streamed), else {_D_FIRST_TOKEN.source}", _first_token
)


def _d_answered(c: _C) -> np.ndarray:
    """D's whole answer at the proxy; without a proxy in front (another router), its last
    byte leaving D's API server, else D's last token: its request span's end, else
    vLLM's arrival plus its end-to-end time."""
    engine = c.num("d_finished_ns") / 1e9
    vllm = c.num("vllm_d_start_ns") / 1e9 + c.num("vllm_d_e2e_s")
    engine = np.where(np.isnan(engine), vllm, engine)
    http = c.num("d_http_end_ns") / 1e9
    engine = np.where(np.isnan(http), engine, http)
    proxy = c.num("d_answered_at")
    return np.where(np.isnan(proxy), engine, proxy)


_D_ANSWERED_AT = _sourced(
    "d_answered_at, else d_http_end_ns, else d_finished_ns, else vllm_d_start_ns + vllm_d_e2e_s",
    _d_answered,
)


@dataclass(frozen=True)
class Mark:
    """A timeline instant: how to read it, which span carries it, when it applies."""

    name: str
    read: Reader
    span: sc.SpanName
    applies: Applies = _always


def _retried(c: _C) -> np.ndarray:
    """The proxy retried P without params."""
    return c.present("p_retry_sent_at")


def _read_applies(c: _C) -> np.ndarray:
    """P decided to read D's KV (or a read span exists), and the proxy did not retry P."""
    # A retried turn's read is its failed first attempt's, before the proxy's retry: that
    # time is `p-retry`. The retry (without params) reads nothing, and its request span
    # gives the P marks after `p-retry-sent`; the read placed after them went negative.
    read = c.eq("decision", sc.PullDecision.PULL.value) | c.present("read_span_id")
    return read & ~_retried(c)


def _read_done(c: _C) -> np.ndarray:
    """P's read of D's KV succeeded, in the attempt P answered (no retry)."""
    return c.eq("read_outcome", sc.ReadOutcome.DONE.value) & ~_retried(c)


def _handoff_applies(c: _C) -> np.ndarray:
    """D pulled P's KV (or did not say: its request span is missing too)."""
    return (
        c.present("handoff_span_id") | c.present("d_kv_ready_at") | ~c.present("d_request_span_id")
    )


MARKS: tuple[Mark, ...] = (
    Mark("turn-start", _ns("turn_start_ns"), sc.SPAN_PROXY_TURN),
    Mark("p-sent", _or_http("p_sent_at", "p_http_start_ns"), sc.SPAN_PROXY_TURN),
    Mark("p-retry-sent", _col("p_retry_sent_at"), sc.SPAN_PROXY_TURN, _retried),
    Mark("p-arrived", _or_vllm("p_arrived_at", "p"), sc.SPAN_PREFILL_REQUEST),
    Mark("p-scheduled", _col("p_scheduled_at"), sc.SPAN_PREFILL_REQUEST),
    Mark("p-allocated", _col("p_allocated_at"), sc.SPAN_PREFILL_REQUEST),
    Mark("read-requested", _requested("read"), sc.SPAN_READ, _read_applies),
    Mark("read-start", _ns("read_start_ns"), sc.SPAN_READ, _read_applies),
    Mark("p-kv-ready", _col("p_kv_ready_at"), sc.SPAN_PREFILL_REQUEST, _read_done),
    Mark("p-first-token", _or_vllm("p_first_token_at", "p", True), sc.SPAN_PREFILL_REQUEST),
    Mark("p-answered", _or_http("p_answered_at", "p_http_end_ns"), sc.SPAN_PROXY_TURN),
    Mark("d-sent", _or_http("d_sent_at", "d_http_start_ns"), sc.SPAN_PROXY_TURN),
    Mark("d-arrived", _or_vllm("d_arrived_at", "d"), sc.SPAN_DECODE_REQUEST),
    Mark("d-scheduled", _col("d_scheduled_at"), sc.SPAN_DECODE_REQUEST),
    Mark("handoff-requested", _requested("handoff"), sc.SPAN_HANDOFF, _handoff_applies),
    Mark("handoff-start", _ns("handoff_start_ns"), sc.SPAN_HANDOFF, _handoff_applies),
    Mark("d-kv-ready", _col("d_kv_ready_at"), sc.SPAN_DECODE_REQUEST, _handoff_applies),
    Mark("first-token", _FIRST_TOKEN_AT, sc.SPAN_DECODE_REQUEST),
    Mark("d-answered", _D_ANSWERED_AT, sc.SPAN_PROXY_TURN),
    Mark("turn-end", _ns("turn_end_ns"), sc.SPAN_PROXY_TURN),
)
assert len(MARKS) == len(PHASES) + 1
_FIRST_TOKEN = [m.name for m in MARKS].index("first-token")

KNOWN, NOT_APPLICABLE, MISSING = 0, 1, 2


@dataclass(frozen=True)
class Marks:
    """Every turn's marks: ``value`` (marks x rows, unix s; a not-applicable mark holds
    the previous mark's value) and ``status`` (KNOWN, NOT_APPLICABLE or MISSING). Mark
    major: each mark's row of millions of turns is contiguous."""

    value: np.ndarray
    status: np.ndarray


def read_marks(turns: _T | _C) -> Marks:
    c = turns if isinstance(turns, col.Cached) else col.Cached(turns)
    rows = len(c)
    value = np.empty((len(MARKS), rows))
    status = np.empty((len(MARKS), rows), np.int8)
    last = np.full(rows, np.nan)
    # Written into the rows in place: no temporaries of millions of turns per mark.
    for i, mark in enumerate(MARKS):
        read = mark.read(c)
        applies = mark.applies(c)
        known = applies & ~np.isnan(read)
        value[i] = last
        np.copyto(value[i], read, where=applies)
        status[i] = NOT_APPLICABLE
        status[i][applies] = MISSING
        status[i][known] = KNOWN
        np.copyto(last, read, where=known)
    return Marks(value, status)


def _missing_reason(mark: Mark, turns_row: Mapping[str, Any]) -> str:
    proxied = any(isinstance(turns_row.get(c), str) for c in ("turn_span_id", "lookup_span_id"))
    if mark.span is sc.SPAN_PROXY_TURN and not proxied:
        # No kvobs proxy in front: what lies between the engines' marks is the router's
        # (and the engines' HTTP front ends'), said as such.
        return f"the router's time: no kvobs proxy span to split it at mark {mark.name}"
    alternative = " or vLLM's own request span" if "vllm_" in mark.read.source else ""
    if mark.name == "first-token" and not turns_row.get("stream"):
        return (
            "non-streamed turn: the proxy sees only the end of D's answer, and D's "
            f"first token needs the {mark.span.name} span ({mark.span.service.value})" + alternative
        )
    return f"no {mark.span.name} span ({mark.span.service.value}){alternative} for mark {mark.name}"


@dataclass
class Timeline:
    """One turn's phases: ``phases`` in time order (merged names for phases a missing
    mark could not split), ``unmeasured`` {phase: why}, and the headline numbers."""

    phases: dict[str, float] = field(default_factory=dict)
    unmeasured: dict[str, str] = field(default_factory=dict)
    latency_s: float | None = None
    ttft_s: float | None = None
    ttft_source: str | None = None
    slowest_phase: str | None = None
    slowest_s: float | None = None
    slowest_share: float | None = None
    skew: list[str] = field(default_factory=list)

    @property
    def slowest(self) -> tuple[str, float] | None:
        if self.slowest_phase is None or self.slowest_s is None:
            return None
        return self.slowest_phase, self.slowest_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "latency_s": self.latency_s,
            "ttft_s": self.ttft_s,
            "ttft_source": self.ttft_source,
            "phases": self.phases,
            "slowest_phase": self.slowest_phase,
            "slowest_share": self.slowest_share,
            "unmeasured": self.unmeasured,
            "clock_skew": self.skew,
        }


# The headline numbers: Timeline's scalar fields, as add_timeline wrote them.
_HEADLINE = tuple(f.name for f in fields(Timeline) if f.default is None)
# Each phase's name: an Enum's ``value`` is a descriptor call, ~20 a turn.
_PHASE_NAMES = tuple(phase.value for phase in PHASES)


def timeline_of(marks: Marks, row: int, turn: Mapping[str, Any]) -> Timeline:
    """The phases of one turn (``row`` of ``marks``; ``turn`` its row of the table
    ``add_timeline`` made, whose headline numbers it carries over), with merged phases
    named and why they could not be split."""
    # As Python numbers: a numpy scalar's comparison costs ~10 times a float's, and
    # the live classifier times every turn it classifies.
    value, status = marks.value[:, row].tolist(), marks.status[:, row].tolist()
    headline: dict[str, Any] = {name: turn.get(name) for name in _HEADLINE}
    out = Timeline(**headline)
    phases, unmeasured = out.phases, out.unmeasured
    start = None
    pending: list[str] = []  # phases a missing mark keeps from being split
    gaps: list[str] = []  # why: the missing marks
    for i, phase in enumerate(_PHASE_NAMES):
        if start is None and status[i] == KNOWN:
            start = value[i]
        end = status[i + 1]
        if end == NOT_APPLICABLE:
            continue  # a step this turn did not take: no phase, the start carries on
        if start is None:  # before the first known mark: outside the measured latency
            unmeasured[phase] = _missing_reason(MARKS[i], turn)
            continue
        if end == MISSING:
            pending.append(phase)
            gaps.append(_missing_reason(MARKS[i + 1], turn))
            continue
        seconds = value[i + 1] - start  # Python floats (``tolist``)
        if pending:  # merged with the phases before it
            pending.append(phase)
            name = "+".join(pending)
            for merged in pending:
                unmeasured[merged] = f"measured only as {name}: " + "; ".join(gaps)
            pending, gaps = [], []
        else:  # the usual phase: measured alone
            name = phase
        if seconds < -SKEW_TOLERANCE_S:
            before, after = MARKS[i].span.service.value, MARKS[i + 1].span.service.value
            out.skew.append(
                f"{name}: {seconds * 1000:.1f} ms "
                + (
                    f"(clocks of {before} and {after} disagree)"
                    if before != after
                    else f"(marks of {before} out of order: one clock, so not skew)"
                )
            )
        phases[name] = seconds
        start = value[i + 1]
    for pending_phase in pending:  # after the last known mark
        out.unmeasured[pending_phase] = "; ".join(gaps)
    if status[0] == MISSING:
        http = status[1] == KNOWN  # P's HTTP front door, kvobs.emit.engine_http
        out.unmeasured["latency"] = "no kvobs.proxy.turn span: latency runs from " + (
            "P's API server receiving the request to D's sending its last byte; the "
            "client-facing edges (the router's before P and after D) are unseen"
            if http
            else "the first engine mark (P's arrival) to D's last token; the "
            "client-facing edges (the router's and the engines' HTTP servers' before "
            "P's arrival and after D's last token) are unseen"
        )
    return out


def add_timeline(
    turns: _T, prefill_tokens_per_s: float | None = None
) -> tuple[_T, Marks, float | None]:
    """The turn table with ``TIMELINE_COLUMNS`` added in place (a phase's seconds when
    measured alone, 0 for a step the turn did not take, NaN when merged or missing; in
    place because a fleet table has millions of rows), the marks for ``timeline_of`` and
    the P compute rate the reuse gains were priced at (given, or measured here)."""
    c = col.Cached(turns)
    marks = read_marks(c)
    value, status = marks.value, marks.status
    rows = len(turns)
    # A phase is measured alone when it starts at a known instant (its own mark, or
    # the last known one carried over marks that do not apply) and ends at a known mark.
    starts_known = _carried_known(status)[:-1]
    end = status[1:]
    phase_seconds = value[1:] - value[:-1]
    phase_seconds[~(starts_known & (end == KNOWN))] = np.nan
    phase_seconds[starts_known & (end == NOT_APPLICABLE)] = 0.0
    # Marks are in time order: the latency runs from the first known to the last.
    # (Reductions run mark by mark: each mark's row is contiguous, a reduction across
    # marks per turn is not.)
    earliest, latest = np.full(rows, np.nan), np.full(rows, np.nan)
    count = np.zeros(rows, np.int8)
    for i in range(len(MARKS)):
        known = status[i] == KNOWN
        np.copyto(earliest, value[i], where=known & (count == 0))
        np.copyto(latest, value[i], where=known)
        count += known
    latency = np.where(count >= 2, latest - earliest, np.nan)
    ttft_known = (status[0] == KNOWN) & (status[_FIRST_TOKEN] == KNOWN)
    streamed = c.present("d_first_output_at")
    best, best_s = np.zeros(rows, np.int64), np.zeros(rows)
    for i in range(len(PHASES)):
        longer = phase_seconds[i] > best_s  # NaN compares False
        best[longer] = i
        np.copyto(best_s, phase_seconds[i], where=longer)
    has_best = best_s > 0
    with np.errstate(invalid="ignore", divide="ignore"):
        share = np.where(has_best & (latency > 0), best_s / latency, np.nan)
    # Categorical: two names (and the phases') over millions of rows.
    col.assign(
        turns,
        {
            **dict(zip(PHASE_COLUMNS, phase_seconds)),
            "latency_s": latency,
            "ttft_s": np.where(ttft_known, value[_FIRST_TOKEN] - value[0], np.nan),
            "ttft_source": col.Categories(
                np.where(ttft_known, np.where(streamed, 0, 1), -1), ["proxy-stream", "engine"]
            ),
            "slowest_phase": col.Categories(
                np.where(has_best, best, -1), [p.value for p in PHASES]
            ),
            "slowest_s": np.where(has_best, best_s, np.nan),
            "slowest_share": share,
        },
    )
    rate = prefill_tokens_per_s or prefill_rate(c)
    _reuse_gain(c, rate)
    return turns, marks, rate


def _reuse_gain(c: _C, rate: float | None) -> None:
    """Compute saved and TTFT gained by a read, apart: the read saved P computing the
    tokens it brought (tokens, and seconds at ``rate``); TTFT gained what those seconds
    were worth less what the read cost (set-up and read phases). Reuse can save compute
    and still gain no TTFT."""
    done = _read_done(c)
    tokens = c.num("offered_tokens") if "offered_tokens" in c else c.num("candidate_tokens")
    tokens = np.where(done, tokens, np.where(c.present("decision"), 0, np.nan))
    saved = tokens / rate if rate else np.full(len(c), np.nan)
    cost = np.nan_to_num(_first_of(c, phase_column(Phase.READ_SETUP), "read_setup_s")) + _first_of(
        c, phase_column(Phase.READ), "read_duration_s"
    )
    col.assign(
        c.turns,
        {
            "compute_saved_tokens": tokens,
            "compute_saved_s": saved,
            "ttft_gained_s": np.where(done, saved - cost, np.where(tokens == 0, 0.0, np.nan)),
        },
    )


def _first_of(c: _C, *columns: str) -> np.ndarray:
    """Per row, the first of ``columns`` with a value (NaN when none has)."""
    out = np.full(len(c), np.nan)
    for column in columns:
        out = np.where(np.isnan(out), c.num(column), out)
    return out


def _carried_known(status: np.ndarray) -> np.ndarray:
    """Per mark: whether its value (its own, or carried over marks that do not apply)
    is a known instant."""
    out = np.empty(status.shape, bool)
    last = np.zeros(status.shape[1], bool)
    for i in range(status.shape[0]):
        last = np.where(status[i] == KNOWN, True, np.where(status[i] == MISSING, False, last))
        out[i] = last
    return out


def computed_tokens(c: _C) -> np.ndarray:
    """Tokens P computed itself (recompute spans summed; else N - L)."""
    recomputed = c.num("recomputed_tokens")
    fallback = c.num("prompt_tokens") - np.nan_to_num(c.num("local_hit_tokens"))
    return np.where(np.isnan(recomputed), fallback, recomputed)


def median(values: np.ndarray) -> float:
    """``np.median`` of values without NaN, the same float (the middle value, or the
    mean of the two middle ones): ``np.median`` imports ``numpy.ma`` (~4 ms of a
    ``kvobs diagnose`` process) to look for NaN."""
    ordered = np.sort(values)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return float(ordered[middle])
    return float((ordered[middle - 1] + ordered[middle]) / 2)


def prefill_rate(turns: _T | _C) -> float | None:
    """Measured P compute rate (tokens/s): median over turns that read nothing of the
    tokens P computed over its compute phase (the P leg the proxy timed when the
    engines' request spans are absent). None when no such turn exists."""
    c = turns if isinstance(turns, col.Cached) else col.Cached(turns)
    computed = computed_tokens(c)
    no_read = ~c.present("read_outcome")
    for column in (phase_column(Phase.P_COMPUTE), "prefill_leg_s"):
        seconds = c.num(column)
        usable = no_read & (computed > 0) & (seconds > 0)
        if usable.any():
            return median(computed[usable] / seconds[usable])
    return None
