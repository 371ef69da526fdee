"""The D export a turn's prompt extends (``kvobs.turns.lineage``): tests and wording the rules
share."""

from __future__ import annotations

import numpy as np

from kvobs.turns import columns as col
from kvobs.semconv import PullDecision
from kvobs.verdicts._base import Turn

# Decisions that mean P had no usable params.
LOST = (PullDecision.INVALID.value, PullDecision.NO_PARAMS.value)
EVIDENCE = (
    "extends_request_id",
    "extends_span_id",
    "extends_engine_id",
    "extends_endpoint",
    "extends_tokens",
    "extends_verified_tokens",
    "extends_ttl_left_s",
    "extends_engine_restarted_at",
)


def unrouted(turns):
    """No kvobs proxy span at all (neither its turn nor its lookup) and P got no params,
    though the prompt extends an export: another router (or none) sent the turn. A proxy
    turn without its lookup span is a lost span, not another router
    (``missing_metadata.missing``)."""
    return (
        col.null(turns, "lookup")
        & col.null(turns, "turn_span_id")
        & col.isin(turns, "decision", LOST)
        & col.present(turns, "extends_request_id")
    )


def unrouted_live(turns):
    """Sent by another router without D's params while D still held the KV the prompt
    extends: the turns whose M decides between missing-metadata, below-threshold and
    local-hit."""
    return unrouted(turns) & col.flag(turns, "extends_live")


def router_candidate(turns):
    """Per row, M had a router forwarded D's params: what a read of the export the prompt
    extends would have brought beyond P's own prefix cache (NaN: not known)."""
    # A prompt that extends the whole export (its chain's tail included) shares all of
    # it; else what the chain verified, to whole blocks.
    shared = np.where(
        col.flag(turns, "extends_fully"),
        col.num(turns, "extends_tokens"),
        col.num(turns, "extends_verified_tokens"),
    )
    shared = np.fmin(shared, col.num(turns, "prompt_tokens"))
    return shared - np.nan_to_num(col.num(turns, "local_hit_tokens"))


def worth_reading(turns):
    """That read would have happened: M at or above P's ``kv_recompute_threshold`` (and
    above 0). Unknown M or threshold: assumed so, as P would decide with params."""
    m = router_candidate(turns)
    threshold = np.fmax(np.nan_to_num(col.num(turns, "threshold")), 1)
    return np.isnan(m) | (m >= threshold)


def restarted(turns):
    return col.present(turns, "extends_engine_restarted_at")


def named(turn: Turn) -> str:
    """ "D engine <id> (<endpoint>) request <id> held <n> tokens (<s> s of TTL left)"."""
    left = turn.get("extends_ttl_left_s")
    ttl = (
        f", {left:.1f}s of TTL left"
        if left is not None and left > 0
        else (f", expired {-left:.1f}s earlier" if left is not None else "")
    )
    tokens = turn.get("extends_tokens")
    held = f"{int(tokens):,}" if tokens is not None else "some"
    return (
        f"D engine {turn.get('extends_engine_id')} ({turn.get('extends_endpoint')}) "
        f"request {turn.get('extends_request_id')} held {held} tokens of this "
        f"history{ttl}"
    )
