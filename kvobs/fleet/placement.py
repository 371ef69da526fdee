"""``kvobs whatif --placement``: the recorded turns again, had each conversation kept its
KV on D, in the host tier instead, or in both, with the router's gate for the host path.

For every later turn whose previous turn is recorded (the same turns for each choice):

- what the previous turn kept: D's export (``prev_export_tokens``), else its host copy
  whole (``prev_host_save_prompt_tokens + prev_host_save_output_tokens``: the copy as
  ``offload_prompt_only=false`` saves it), and the reusable remainder
  ``M = max(0, min(kept, N) - L)`` (``N`` the prompt, ``L`` the engine's own prefix);
- on D: P reads ``M`` when ``M`` reaches P's ``kv_recompute_threshold`` and D's blocks
  are not expiring at the gap (``settings.read_declined``), else it recomputes;
- in the host tier: the tier serves ``M`` when ``M`` reaches the router's
  ``minCachedTokenDelta`` (below it the router does not send P to the copy: the turn
  reads as below-threshold, the gate being the router's threshold as
  ``kv_recompute_threshold`` is P's) and the copy survived: a recorded eviction before
  the turn stands; a recording without host copies has no evictions to replay (the tier
  is taken to be large enough: said in the output);
- both: D serves what it would, the host tier the turns D would not.

Each choice rewrites those facts on the turn's row and decides the rows with the one
verdict decision (``kvobs.verdicts.decide``). Retention, per turn that kept its KV: on D
its blocks until the next turn's read released them, else for the TTL (the last turn of
a conversation too); in the host tier its bytes until the next turn (after that the
tier's LRU gives the room back on demand: a copy no later turn needs costs no turn).
Block-seconds become byte-seconds with the recorded bytes per token, so the places
compare; a read's time, where D never read in the recording, is taken to pay off (as
``kvobs.fleet.replay`` takes it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from kvobs.turns import columns as col
from kvobs.turns.arrays import value_where
from kvobs.turns.correlate import turn_links
from kvobs.fleet.replay import read_model
from kvobs.fleet.report import prompt_tokens
from kvobs.fleet.retention import GIB_HOUR, host_tokens_served
from kvobs.semconv import (
    VERDICT_VALUES,
    FallbackReason,
    LookupOutcome,
    PullDecision,
    ReadOutcome,
    ReleaseReason,
)
from kvobs.settings import DECODE_TTL, MIN_CACHED_TOKEN_DELTA, RECOMPUTE_THRESHOLD, read_declined
from kvobs.timeline import prefill_rate
from kvobs.verdicts import Context, decide

PLACES = ("device", "host", "both")
# Marks the host lookup a choice adds to a turn's row (a span id in a real recording).
_WHATIF_SPAN = "whatif"


def _median(values: np.ndarray) -> float | None:
    values = values[np.isfinite(values) & (values > 0)]
    return float(np.median(values)) if len(values) else None


@dataclass
class Facts:
    """Per row of the turn table: what any choice starts from."""

    later: np.ndarray  # the rows compared: later turns whose previous turn kept KV
    kept: np.ndarray  # tokens the row's own turn kept for the next (NaN: unknown)
    m: np.ndarray  # reusable remainder M from the previous turn's KV (later rows)
    prompt: np.ndarray
    local: np.ndarray
    gap: np.ndarray
    ttl: np.ndarray
    threshold: np.ndarray
    evicted: np.ndarray  # the previous turn's host copy was evicted before this turn
    has_next: np.ndarray
    previous: np.ndarray  # the row of the conversation's previous turn, -1 when none
    following: np.ndarray  # the row of the conversation's next turn (has_next), else its own
    bytes_per_token: float | None
    tokens_per_block: float | None
    read_s: np.ndarray  # a D read of M, as recorded or modelled


def _ratio(numerator: np.ndarray, denominator: np.ndarray) -> float | None:
    """The median ratio over rows that have both."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return _median(numerator / denominator)


def _facts(turns: pd.DataFrame, ttl_s: float | None, threshold: int | None) -> Facts:
    n = len(turns)
    whole_copy = col.num(turns, "host_save_prompt_tokens") + col.num(
        turns, "host_save_output_tokens"
    )
    exported = col.num(turns, "export_tokens")
    kept = np.where(np.isnan(exported), whole_copy, exported)
    previous, following = turn_links(turns)
    consecutive = previous >= 0
    prev_kept = np.where(consecutive, kept[np.maximum(previous, 0)], np.nan)
    has_next = following >= 0
    following = np.where(has_next, following, np.arange(n))
    prompt = prompt_tokens(turns)
    local = np.where(
        col.present(turns, "local_hit_tokens"),
        col.num(turns, "local_hit_tokens"),
        np.nan_to_num(col.num(turns, "host_local_tokens")),
    )
    local = np.nan_to_num(local)
    # No proxy turn spans (an engine with only the offloading connector): the gap from
    # the previous turn's copy being saved to this turn's lookup.
    gap = np.where(
        col.present(turns, "gap_s"),
        col.num(turns, "gap_s"),
        (col.num(turns, "host_lookup_start_ns") - col.num(turns, "prev_host_save_end_ns")) / 1e9,
    )
    later = (
        (col.num(turns, "turn") > 1)
        & consecutive
        & np.isfinite(prev_kept)
        & np.isfinite(prompt)
        & np.isfinite(gap)
    )
    m = np.maximum(0, np.minimum(np.nan_to_num(prev_kept), np.nan_to_num(prompt)) - local)
    recorded_ttl = col.num(turns, "prev_ttl_s")
    ttl = (
        np.full(n, float(ttl_s))
        if ttl_s is not None
        else np.where(np.isnan(recorded_ttl), DECODE_TTL.default, recorded_ttl)
    )
    recorded_threshold = col.num(turns, "threshold")
    thresholds = (
        np.full(n, float(threshold))
        if threshold is not None
        else np.where(np.isnan(recorded_threshold), RECOMPUTE_THRESHOLD.default, recorded_threshold)
    )
    looked_up = np.where(
        col.present(turns, "host_lookup_start_ns"),
        col.num(turns, "host_lookup_start_ns"),
        col.num(turns, "turn_start_ns"),
    )
    evicted = col.present(turns, "prev_host_evict_span_id") & (
        col.num(turns, "prev_host_evict_end_ns") <= looked_up
    )
    done = col.eq(turns, "read_outcome", ReadOutcome.DONE.value)
    per_token = _ratio(col.num(turns, "host_saved_bytes"), col.num(turns, "host_saved_tokens"))
    if per_token is None:
        per_token = _ratio(
            np.where(done, col.num(turns, "read_bytes"), np.nan), col.num(turns, "candidate_tokens")
        )
    per_block = _ratio(col.num(turns, "export_tokens"), col.num(turns, "export_blocks"))
    if per_block is None:
        per_block = _ratio(col.num(turns, "host_saved_tokens"), col.num(turns, "host_saved_blocks"))
    model = read_model(turns) if "read_outcome" in turns else None
    recorded_s = np.where(done, col.num(turns, "read_duration_s"), np.nan)
    modelled_s = model.seconds(m) if model else np.zeros(n)
    read_s = np.where(np.isfinite(recorded_s), recorded_s, modelled_s)
    return Facts(
        later,
        kept,
        m,
        prompt,
        local,
        gap,
        ttl,
        thresholds,
        evicted,
        has_next,
        previous,
        following,
        per_token,
        per_block,
        read_s,
    )


def _write(frame: pd.DataFrame, updates: dict[str, Any], on: np.ndarray) -> None:
    """Each column's new values where ``on``, its recorded ones elsewhere."""
    for column, values in updates.items():
        old = (
            frame[column].astype(object).to_numpy()
            if column in frame
            else np.full(len(frame), None, object)
        )
        new = np.broadcast_to(np.asarray(values, object), (len(frame),))
        frame[column] = pd.array(np.where(on, new, old), dtype=object)


def _decisions(m: np.ndarray, local: np.ndarray, threshold: np.ndarray) -> np.ndarray:
    """P's pull decision on ``M`` (``connector_instrumented/_scheduler_observer.py``)."""
    return np.where(
        m == 0,
        np.where(local > 0, PullDecision.LOCAL_HIT.value, PullDecision.NO_PARAMS.value),
        np.where(m < threshold, PullDecision.BELOW_THRESHOLD.value, PullDecision.PULL.value),
    )


def _device_path(
    frame: pd.DataFrame,
    f: Facts,
    rows: np.ndarray,
    threshold: np.ndarray,
    served: np.ndarray,
    on: np.ndarray,
    via_d: bool,
) -> None:
    """The proxy's params reach P, which decides on ``M`` under ``threshold``; with
    ``via_d`` D kept the KV: P reads it (``served``) or D's blocks were expiring (read
    declined; released before a turn that came after the TTL)."""
    m, gap, ttl = f.m[rows], f.gap[rows], f.ttl[rows]
    decision = _decisions(m, f.local[rows], threshold)
    declined = via_d & (decision == PullDecision.PULL.value) & ~served
    released = via_d & (gap >= ttl)
    _write(
        frame,
        {
            "lookup": LookupOutcome.HIT.value,
            "params_sent": True,
            "decision": decision,
            "prompt_tokens": f.prompt[rows],
            "local_hit_tokens": f.local[rows],
            "candidate_tokens": m,
            "threshold": threshold,
            "read_outcome": np.where(
                served,
                ReadOutcome.DONE.value,
                value_where(declined, ReadOutcome.DECLINED_EXPIRED.value),
            ),
            "read_duration_s": np.where(served, f.read_s[rows], np.nan),
            "fallback_reason": value_where(declined, FallbackReason.READ_DECLINED.value),
            "prev_release_reason": value_where(released, ReleaseReason.EXPIRED.value),
            "prev_release_end_ns": np.where(released, col.num(frame, "turn_start_ns") - 1, np.nan),
        },
        on,
    )


def _host_path(
    frame: pd.DataFrame, f: Facts, rows: np.ndarray, served: np.ndarray, on: np.ndarray
) -> None:
    """The turn looked up in the host tier, which held the previous turn whole (unless
    it evicted it, as recorded); ``served``: it gave ``M``."""
    accepted = np.where(served, f.m[rows], 0)
    _write(
        frame,
        {
            "host_lookup_span_id": _WHATIF_SPAN,
            "host_local_tokens": f.local[rows],
            "host_hit_tokens": accepted,
            "host_accepted_tokens": accepted,
            "host_hit_host_tokens": accepted,
            "host_hit_p2p_tokens": 0,
            "prev_host_saved_tokens": np.nan_to_num(f.kept[f.previous[rows]]),
            "prev_host_covers_response": True,
            "prev_host_save_incomplete": False,
        },
        on,
    )


def _verdicts(
    turns: pd.DataFrame, f: Facts, place: str, delta: int, context: Context
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(verdicts, tokens served by D, tokens served by the host tier) of the compared
    rows under ``place``."""
    rows = np.flatnonzero(f.later)
    frame = turns.iloc[rows].copy()
    m, threshold = f.m[rows], f.threshold[rows]
    on_d = (m > 0) & (m >= threshold) & ~read_declined(f.gap[rows], f.ttl[rows])
    in_host = (m > 0) & (m >= delta) & ~f.evicted[rows]
    everywhere, nowhere = np.ones(len(rows), bool), np.zeros(len(rows), bool)
    device = on_d if place != "host" else nowhere
    host = (in_host & ~device) if place != "device" else nowhere
    _write(frame, {"host_lookup_span_id": None}, everywhere)
    if place == "host":
        # Nothing on D; the router's gate reads as the threshold it is.
        _device_path(
            frame,
            f,
            rows,
            np.full(len(rows), float(max(delta, 1))),
            nowhere,
            everywhere,
            via_d=False,
        )
    else:
        _device_path(frame, f, rows, threshold, device, everywhere, via_d=True)
    if place != "device":
        _host_path(frame, f, rows, host, ~device)
    verdicts = decide(frame, context).verdict
    return verdicts, np.where(device, m, 0), np.where(host, m, 0)


def _costs(f: Facts, place: str, device_next: np.ndarray) -> dict[str, float | None]:
    """Retention of every turn that kept KV for a next turn, under ``place``
    (``device_next``: per row, whether D's read of the next turn released the blocks)."""
    kept = np.nan_to_num(f.kept)
    gap_next = np.where(f.has_next, np.nan_to_num(f.gap[f.following]), 0)
    # A turn's blocks expire under the TTL its next turn saw.
    ttl_own = np.where(f.has_next, f.ttl[f.following], f.ttl)
    device_held = np.where(device_next, gap_next, ttl_own)
    host_held = np.where(f.has_next, gap_next, 0)
    device_tokens_s = float((kept * device_held).sum()) if place != "host" else 0.0
    host_tokens_s = float((kept * host_held).sum()) if place != "device" else 0.0
    per_token, per_block = f.bytes_per_token, f.tokens_per_block
    device_bytes_s = device_tokens_s * per_token if per_token else None
    host_bytes_s = host_tokens_s * per_token if per_token else None
    return {
        "device_block_seconds": device_tokens_s / per_block if per_block else None,
        "device_byte_seconds": device_bytes_s,
        "device_gib_hours": device_bytes_s / GIB_HOUR if device_bytes_s is not None else None,
        "host_byte_seconds": host_bytes_s,
        "host_gib_hours": host_bytes_s / GIB_HOUR if host_bytes_s is not None else None,
    }


@dataclass
class Placement:
    min_cached_token_delta: int
    ttl_s: float | None  # None: each turn's recorded TTL (vLLM's default where none)
    threshold: int | None
    later_turns: int
    bytes_per_token: float | None
    tokens_per_block: float | None
    host_evictions: str  # "as recorded" | "none recorded"
    recorded: dict[str, Any]
    places: dict[str, dict[str, Any]]
    verdicts: dict[str, np.ndarray] = field(default_factory=dict, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "verdicts"}


def _summary(
    verdicts: np.ndarray, device: np.ndarray, host: np.ndarray, costs: dict[str, Any]
) -> dict[str, Any]:
    counts = pd.Series(verdicts).value_counts()
    return {
        "verdicts": {v: int(counts.get(v, 0)) for v in VERDICT_VALUES if counts.get(v, 0)},
        "turns_served_by_device": int((device > 0).sum()),
        "turns_served_by_host": int((host > 0).sum()),
        "tokens_served_by_device": int(device.sum()),
        "tokens_served_by_host": int(host.sum()),
        **costs,
    }


def placement(
    turns: pd.DataFrame,
    min_cached_token_delta: int = int(MIN_CACHED_TOKEN_DELTA.default),
    ttl_s: float | None = None,
    threshold: int | None = None,
    prefill_tokens_per_s: float | None = None,
) -> Placement:
    """``turns``: a labelled turn table (``kvobs.fleet.report.label_turns``)."""
    f = _facts(turns, ttl_s, threshold)
    context = Context(prefill_tokens_per_s or prefill_rate(turns))
    rows = np.flatnonzero(f.later)
    places, verdicts = {}, {}
    for place in PLACES:
        decided, device, host = _verdicts(turns, f, place, min_cached_token_delta, context)
        device_next = np.zeros(len(turns), bool)
        device_next[f.previous[rows]] = device > 0
        verdicts[place] = decided
        places[place] = _summary(decided, device, host, _costs(f, place, device_next))
    done = col.eq(turns, "read_outcome", ReadOutcome.DONE.value)[rows]
    recorded_device = np.where(done, np.nan_to_num(col.num(turns, "candidate_tokens")[rows]), 0)
    block_s = float(np.nansum(col.num(turns, "device_block_seconds")))
    host_bytes_s = float(np.nansum(col.num(turns, "host_byte_seconds")))
    per_block = (
        f.bytes_per_token * f.tokens_per_block if f.bytes_per_token and f.tokens_per_block else None
    )
    recorded = _summary(
        turns["verdict"].astype(object).to_numpy()[rows],
        recorded_device,
        host_tokens_served(turns)[rows],
        {
            "device_block_seconds": block_s,
            "device_byte_seconds": block_s * per_block if per_block else None,
            "device_gib_hours": block_s * per_block / GIB_HOUR if per_block else None,
            # the copies evicted in the recording (a copy still held has no end yet)
            "host_byte_seconds": host_bytes_s,
            "host_gib_hours": host_bytes_s / GIB_HOUR,
        },
    )
    return Placement(
        int(min_cached_token_delta),
        ttl_s,
        threshold,
        len(rows),
        f.bytes_per_token,
        f.tokens_per_block,
        "as recorded" if col.present(turns, "host_save_span_id").any() else "none recorded",
        recorded,
        places,
        verdicts,
    )
