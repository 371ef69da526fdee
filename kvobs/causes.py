"""Latency causes: why a turn took its time, named from the phases that dominate it.

The reuse verdict says what happened to the previous turn's KV; a turn is often slow
elsewhere. Every phase belongs to one cause (``CAUSE_OF``). A cause applies to a turn
when its phases hold the turn's slowest phase, or take at least its share (``SHARE_OF``,
else ``DOMINANT_SHARE``) of its latency (of its TTFT for phases before the first token)
and ``MIN_SECONDS``. So a
turn whose slowest phase lies outside P's reuse path always gets a cause besides its
verdict. Each cause's ``explain`` is a small pure function of the turn and the
source-wide context, returning its evidence and remedy.
"""

from __future__ import annotations

from dataclasses import dataclass
import math
import operator
from typing import Any, Callable, Mapping

from kvobs import semconv as sc
from kvobs.turns import columns as col
from kvobs.semconv import LatencyCause as LC
from kvobs.semconv import Phase as P
from kvobs.timeline import PHASES, median, phase_column

DOMINANT_SHARE = 0.25
# A NIXL handshake is named at a lower share: it recurs after every engine (re)start, a
# 30 ms one is a fifth of a short turn's TTFT, and its remedy (warm each pair) is cheap.
SHARE_OF: dict[LC, float] = {LC.CONNECTION_SETUP: 0.10}
# A read whose unwatched end (``read_unobserved_s``) is at least this share of it was held
# by P's own compute step, not slowed by the link.
HELD_READ_SHARE = 0.5
MIN_SECONDS = 0.005
# Decode is "busy" when its seconds per output token exceed this multiple of the
# source's median: D was shared (other decodes, long prefills) while it generated.
DECODE_BUSY_FACTOR = 1.5
_BEFORE_FIRST_TOKEN = frozenset(PHASES[: PHASES.index(P.DECODE)])

CAUSE_OF: dict[P, LC] = {
    P.PROXY_IN: LC.PROXY_OVERHEAD,
    P.PROXY_HOP: LC.PROXY_OVERHEAD,
    P.PROXY_OUT: LC.PROXY_OVERHEAD,
    P.P_RETRY: LC.FAILED_ATTEMPT,
    P.P_FRONTEND: LC.ENGINE_API,
    P.P_RETURN: LC.ENGINE_API,
    P.D_FRONTEND: LC.ENGINE_API,
    P.P_QUEUE: LC.QUEUED_AT_P,
    P.READ_WAIT: LC.QUEUED_AT_P,
    P.HANDOFF_WAIT: LC.QUEUED_AT_D,
    P.P_SCHEDULE: LC.PREFILL_COMPUTE,
    P.P_COMPUTE: LC.PREFILL_COMPUTE,
    P.READ_SETUP: LC.CONNECTION_SETUP,
    P.HANDOFF_SETUP: LC.CONNECTION_SETUP,
    P.READ: LC.SLOW_READ,
    P.HANDOFF: LC.SLOW_HANDOFF,
    P.D_QUEUE: LC.QUEUED_AT_D,
    P.D_FIRST_TOKEN: LC.DECODE_BUSY,
    P.DECODE: LC.LONG_OUTPUT,
}


# An enum's ``value`` is a descriptor call (~0.3 us): read once a member, not once a
# finding (the live classifier writes every turn's causes as JSON).
_CAUSE_VALUES = {cause: cause.value for cause in LC}


@dataclass(frozen=True)
class CauseContext:
    """Source-wide facts causes weigh a turn against."""

    decode_s_per_token: float | None = None  # median over the source's turns


@dataclass(frozen=True)
class CauseFinding:
    cause: LC
    seconds: float
    share: float | None
    remedy: str
    evidence: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {
            "cause": _CAUSE_VALUES[self.cause],
            "seconds": self.seconds,
            "share": self.share,
            "remedy": self.remedy,
            "evidence": self.evidence,
        }


def _ms(seconds: float | None) -> str:
    return "?" if seconds is None else f"{seconds * 1000:.0f} ms"


def _get(turn: Mapping[str, Any], column: str) -> Any:
    value = turn.get(column)
    # math's, not numpy's: a numpy call on a Python float costs ~1 us, read ~30 times a turn.
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return value


def _pick(turn: Mapping[str, Any], *columns: str) -> dict[str, Any]:
    """Evidence: the named columns of the turn (missing ones are dropped by ``causes``)."""
    return {column: _get(turn, column) for column in columns}


def _phases(turn: Mapping[str, Any], *phases: P) -> dict[str, Any]:
    return {phase.value: _get(turn, phase_column(phase)) for phase in phases}


def _per_token(turn: Mapping[str, Any]) -> float | None:
    decode = _get(turn, phase_column(P.DECODE))
    tokens = _get(turn, "output_tokens")
    if decode is None or not tokens or tokens < 2:
        return None
    return decode / (tokens - 1)


def decode_context(turns: col.Table) -> CauseContext:
    decode = col.num(turns, phase_column(P.DECODE))
    tokens = col.num(turns, "output_tokens")
    usable = (tokens >= 2) & (decode > 0)
    if usable.sum() < 3:  # too few to call anything typical
        return CauseContext()
    return CauseContext(median(decode[usable] / (tokens[usable] - 1)))


# --------------------------------------------------------------------------- explanations
# Each: (turn row, seconds the cause took, context) -> (remedy, evidence).

Explain = Callable[[Mapping[str, Any], float, CauseContext], tuple[str, dict[str, Any]]]


def _queue_signal(phase: P) -> str:
    """Where the queueing a cause names is measured: vLLM's own queue-time histogram
    starts at its engine core's QUEUED event (vllm/v1/metrics/stats.py), after the step
    the engine was running when the request arrived, so it misses that wait; the
    classifier's phase histogram runs from vLLM's arrival time."""
    return (
        f'watch {sc.M_TURN_PHASE.name}{{phase="{phase.value}"}} (kvobs collect), not '
        f"{sc.M_VLLM_QUEUE_TIME.name}, which starts only once the engine core took the "
        "request in, after the step it was running"
    )


def _queued_at_p(turn, seconds, context):
    return (
        f"P queued the request {_ms(seconds)} behind other work: add prefill capacity or "
        "bound concurrent long prompts (max_num_batched_tokens, max_num_seqs); "
        f"{_queue_signal(P.P_QUEUE)}.",
        _pick(turn, "p_arrived_at", "p_scheduled_at", "prompt_tokens"),
    )


def _queued_at_d(turn, seconds, context):
    return (
        f"D held the request {_ms(seconds)} behind other work before scheduling it or "
        f"pulling P's KV: add decode capacity or lower its load; "
        f"{_queue_signal(P.D_QUEUE)}.",
        _pick(turn, "d_arrived_at", "d_scheduled_at"),
    )


def _connection_setup(turn, seconds, context):
    return (
        f"{_ms(seconds)} went to NIXL connection set-up (the handshake of the first "
        "transfer between this P and D, e.g. after an engine (re)start): warm each P/D "
        "pair with one request at start-up; watch vllm:kvobs_read_setup_seconds.",
        _pick(turn, "read_setup_s", "handoff_setup_s"),
    )


def _slow_read(turn, seconds, context):
    evidence = _pick(turn, "read_span_id", "read_bytes", "read_duration_s", "read_unobserved_s")
    held = _get(turn, "read_unobserved_s")
    if held and seconds and held >= HELD_READ_SHARE * seconds:
        # P polls its reads after each model step: a long step of other requests' prefill
        # holds a finished read, whatever the link did.
        return (
            f"The D->P read took {_ms(seconds)}, {_ms(held)} of it while P's own compute "
            "step ran without looking (the transfer ended somewhere within it): P was "
            "busy, not the link; bound P's step (max_num_batched_tokens, chunked "
            "prefill) or its load.",
            evidence,
        )
    return (
        f"The D->P read took {_ms(seconds)}: check the P<->D link and D's load (a busy "
        "D serves reads late; vllm:kvobs_remote_read_duration_seconds).",
        evidence,
    )


def _prefill_compute(turn, seconds, context):
    return (
        f"P computed for {_ms(seconds)} ({_get(turn, 'recomputed_tokens')} tokens it did "
        "not reuse): see the verdict for why they were not reused; add prefill capacity "
        "for long first turns.",
        _pick(turn, "recomputed_tokens", "prompt_tokens"),
    )


def _slow_handoff(turn, seconds, context):
    nbytes = _get(turn, "handoff_bytes")
    duration = _get(turn, "handoff_duration_s")
    rate = nbytes / duration / 1e6 if nbytes and duration else None
    return (
        f"D pulling P's KV (the P->D hand-off) took {_ms(seconds)}"
        + (f" at {rate:.1f} MB/s" if rate else "")
        + ": check the P->D link (vllm:kvobs_remote_read_duration_seconds"
        '{direction="p_to_d"} on D).',
        {
            "handoff_span_id": _get(turn, "handoff_span_id"),
            "handoff_bytes": nbytes,
            "handoff_duration_s": duration,
        },
    )


def _decode_busy(turn, seconds, context):
    per_token = _per_token(turn)
    return (
        f"D was slow to answer: {_ms(seconds)} from KV to tokens"
        + (
            f", {per_token * 1000:.1f} ms per token against a typical "
            f"{context.decode_s_per_token * 1000:.1f} ms"
            if per_token and context.decode_s_per_token
            else ""
        )
        + ": D's steps were shared or slowed (other requests' decodes or prefills, "
        "a cold engine, a starved API server); add decode capacity or lower "
        "max_num_seqs if it persists.",
        {
            "output_tokens": _get(turn, "output_tokens"),
            "decode_s_per_token": per_token,
            "typical_decode_s_per_token": context.decode_s_per_token,
        },
    )


def _long_output(turn, seconds, context):
    per_token = _per_token(turn)
    return (
        f"Decode took {_ms(seconds)} for {_get(turn, 'output_tokens')} tokens"
        + (f" ({per_token * 1000:.1f} ms each{_typical(context)})" if per_token else "")
        + ": latency follows output length; stream the answer to see the first token "
        "early, or cap max_tokens.",
        {"output_tokens": _get(turn, "output_tokens"), "decode_s_per_token": per_token},
    )


def _typical(context: CauseContext) -> str:
    # Without a measured typical rate (too few turns), not called typical.
    return ", typical for this source" if context.decode_s_per_token else ""


def _engine_api(turn, seconds, context):
    return (
        f"The engines' API servers (HTTP, tokenization, detokenization) took "
        f"{_ms(seconds)}: check their CPU headroom.",
        _phases(turn, P.P_FRONTEND, P.P_RETURN, P.D_FRONTEND),
    )


def _proxy_overhead(turn, seconds, context):
    evidence = _phases(turn, P.PROXY_IN, P.PROXY_HOP, P.PROXY_OUT)
    if _get(turn, "turn_span_id") is None and _get(turn, "turn_start_ns") is None:
        # No kvobs proxy in front: the only such phase measured is the hop between the
        # engines' front doors (kvobs.emit.engine_http), which is another router's.
        return (
            f"The router between P and D took {_ms(seconds)} from P's answer leaving P to "
            "D receiving the request: check the router's CPU and its connections to the "
            "engines (its own metrics).",
            evidence,
        )
    return (
        f"The proxy's own work (lookup, store, relaying) took {_ms(seconds)}: check its "
        "CPU and its metadata store (kvobs_proxy_phase_seconds).",
        evidence,
    )


def _failed_attempt(turn, seconds, context):
    return (
        f"P's first attempt failed ({_get(turn, 'fallback_reason')}) and the proxy "
        f"retried without params: {_ms(seconds)} lost; see the verdict.",
        _pick(turn, "fallback_span_id", "fallback_reason"),
    )


EXPLAIN: dict[LC, Explain] = {
    LC.QUEUED_AT_P: _queued_at_p,
    LC.QUEUED_AT_D: _queued_at_d,
    LC.CONNECTION_SETUP: _connection_setup,
    LC.SLOW_READ: _slow_read,
    LC.PREFILL_COMPUTE: _prefill_compute,
    LC.SLOW_HANDOFF: _slow_handoff,
    LC.DECODE_BUSY: _decode_busy,
    LC.LONG_OUTPUT: _long_output,
    LC.ENGINE_API: _engine_api,
    LC.PROXY_OVERHEAD: _proxy_overhead,
    LC.FAILED_ATTEMPT: _failed_attempt,
}
assert set(EXPLAIN) == set(LC) == set(CAUSE_OF.values()) | {LC.DECODE_BUSY}

# What each cause means and what to do (docs/timeline.md is generated from these).
CAUSE_DOCS: dict[LC, str] = {
    LC.QUEUED_AT_P: "P held the request behind other work (in its waiting queue, or its "
    "worker finishing a step before starting the read): add prefill "
    "capacity, bound concurrent long prompts.",
    LC.QUEUED_AT_D: "D held the request behind other work (before scheduling it, or "
    "before starting to pull P's KV): add decode capacity.",
    LC.CONNECTION_SETUP: "A NIXL handshake before the first transfer between a P and a D "
    "(after an engine start): warm each pair at start-up.",
    LC.SLOW_READ: "P's read of D's KV took long: the P<->D link, or a busy D.",
    LC.PREFILL_COMPUTE: "P computed the tokens it did not reuse: see the reuse verdict; "
    "prefill capacity for long prompts.",
    LC.SLOW_HANDOFF: "D pulling P's KV (the P->D hand-off) took long: the P->D link.",
    LC.DECODE_BUSY: "D produced tokens slower than this source's typical rate, or took "
    "long to its first token after the KV arrived: shared or slowed steps.",
    LC.LONG_OUTPUT: "Decode at the typical rate dominated: latency follows output length.",
    LC.ENGINE_API: "The engines' API servers (HTTP, tokenization, detokenization).",
    LC.PROXY_OVERHEAD: "The proxy's own work: lookup, store, relaying.",
    LC.FAILED_ATTEMPT: "P's first attempt failed and was retried without D's params.",
}
assert set(CAUSE_DOCS) == set(LC)


def cause_of(phase: P, turn: Mapping[str, Any], context: CauseContext) -> LC:
    """The cause a phase's time counts for on this turn (decode splits on its rate)."""
    if phase is P.DECODE:
        per_token = _per_token(turn)
        typical = context.decode_s_per_token
        if per_token and typical and per_token > DECODE_BUSY_FACTOR * typical:
            return LC.DECODE_BUSY
    return CAUSE_OF[phase]


# What ``causes`` reads of each phase, per turn: worked out once, with the phase's cause
# where it does not depend on the turn (``cause_of``: all but decode's).
_PHASE_READS = tuple(
    (
        phase,
        phase_column(phase),
        phase.value,
        phase in _BEFORE_FIRST_TOKEN,
        None if phase is P.DECODE else CAUSE_OF[phase],
    )
    for phase in PHASES
)
# The share of its latency (or TTFT) each cause needs to be named.
_NEEDED_SHARE = {cause: SHARE_OF.get(cause, DOMINANT_SHARE) for cause in LC}
_SECONDS = operator.attrgetter("seconds")


def causes(turn: Mapping[str, Any], context: CauseContext = CauseContext()) -> list[CauseFinding]:
    """The causes of one turn (a turn-table row with timeline columns), largest first."""
    latency = _get(turn, "latency_s")
    ttft = _get(turn, "ttft_s")
    slowest = _get(turn, "slowest_phase")
    seconds: dict[LC, float] = {}
    before_first: dict[LC, float] = {}
    slowest_cause = None  # the cause of the slowest phase: one phase, one cause
    get = turn.get  # ``_get`` inline: ~20 phases a turn
    for phase, column, name, before_first_token, fixed in _PHASE_READS:
        value = get(column)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            continue
        cause = fixed if fixed is not None else cause_of(phase, turn, context)
        seconds[cause] = seconds.get(cause, 0.0) + value
        if before_first_token:
            before_first[cause] = before_first.get(cause, 0.0) + value
        if slowest == name:
            slowest_cause = cause
    out = []
    for cause, total in seconds.items():
        share = total / latency if latency else None
        ttft_share = before_first.get(cause, 0.0) / ttft if ttft else 0.0
        needed = _NEEDED_SHARE[cause]
        dominant = total >= MIN_SECONDS and ((share or 0.0) >= needed or ttft_share >= needed)
        if not (dominant or cause is slowest_cause):
            continue
        remedy, evidence = EXPLAIN[cause](turn, total, context)
        evidence = {k: v for k, v in evidence.items() if v is not None}
        if ttft:
            evidence["ttft_share"] = ttft_share
        out.append(CauseFinding(cause, total, share, remedy, evidence))
    # Largest first; equal ones in the order found (a stable sort, reversed).
    out.sort(key=_SECONDS, reverse=True)
    return out
