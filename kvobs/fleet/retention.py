"""Retention cost: what keeping each turn's KV for a later turn cost on D (device blocks x
seconds held) and in the host tier (bytes x seconds held), and what each bought (tokens a
later turn took from it instead of computing), per conversation and fleet-wide.

The per-turn costs are the turn columns ``device_block_seconds`` and ``host_byte_seconds``
(``kvobs.turns.schema.RETENTION``, derived in ``kvobs.turns.correlate``); this module only sums
them. Device block-seconds become byte-seconds with the bytes per block D's reads moved
(no read: unknown, left out), so the two places compare in GiB-hours.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from kvobs.semconv import ReadOutcome
from kvobs.turns.schema import CONVERSATION_KEYS, DEVICE_BLOCK_SECONDS, HOST_BYTE_SECONDS

GIB_HOUR = 2**30 * 3600
# Conversations listed by name in the report: the costliest in each place.
TOP_CONVERSATIONS = 5
# Instants that bound the recording: a copy still in the tier has been held at least until
# the last of them.
_RECORDING_ENDS = ("turn_end_ns", "release_end_ns", "host_save_end_ns", "host_evict_end_ns")


def _numbers(turns: pd.DataFrame, name: str) -> np.ndarray:
    """A column as floats, NaN for null; all NaN when the table lacks it (turn files of
    an older kvobs)."""
    if name not in turns:
        return np.full(len(turns), np.nan)
    return turns[name].astype("Float64").to_numpy(float, na_value=np.nan)


def bytes_per_block(turns: pd.DataFrame) -> float | None:
    """The median bytes per block of D's done reads: what one retained block weighs."""
    done = (turns["read_outcome"] == ReadOutcome.DONE.value).fillna(False).to_numpy(bool)
    per_block = _numbers(turns, "read_bytes")[done] / _numbers(turns, "read_blocks")[done]
    per_block = per_block[np.isfinite(per_block)]
    return float(np.median(per_block)) if len(per_block) else None


def host_tokens_served(turns: pd.DataFrame) -> np.ndarray:
    """Per turn, the prompt tokens the offloading tiers (host, p2p) served it."""
    return np.nan_to_num(_numbers(turns, "host_hit_host_tokens")) + np.nan_to_num(
        _numbers(turns, "host_hit_p2p_tokens")
    )


def per_turn(turns: pd.DataFrame) -> pd.DataFrame:
    """Per turn: its retention costs and what the KV it reused was worth, by place.

    ``device_tokens_served``: tokens this turn read from D's retained KV (a done D->P
    read); ``host_tokens_served``: tokens it took from the offloading tiers (host, p2p).
    A turn's reuse is bought by the previous turn's retention."""
    done = (turns["read_outcome"] == ReadOutcome.DONE.value).fillna(False).to_numpy(bool)
    host_served = host_tokens_served(turns)
    return pd.DataFrame(
        {
            **{key: turns[key].array for key in CONVERSATION_KEYS},  # positional, typed
            DEVICE_BLOCK_SECONDS.name: _numbers(turns, DEVICE_BLOCK_SECONDS.name),
            HOST_BYTE_SECONDS.name: _numbers(turns, HOST_BYTE_SECONDS.name),
            "device_tokens_served": np.where(
                done, np.nan_to_num(_numbers(turns, "candidate_tokens")), 0.0
            ),
            "host_tokens_served": host_served,
        }
    )


def by_conversation(turns: pd.DataFrame) -> pd.DataFrame:
    """Per conversation (tenant, conversation_id): its costs and reuse summed over turns,
    and ``device_byte_seconds`` (block-seconds x bytes per block; NaN when unknown)."""
    rows = (
        per_turn(turns)
        .groupby(CONVERSATION_KEYS, observed=True, sort=True)
        .sum(min_count=1)
        .reset_index()
    )
    for column in ("device_tokens_served", "host_tokens_served"):
        rows[column] = rows[column].fillna(0).astype(np.int64)
    weight = bytes_per_block(turns)
    rows["device_byte_seconds"] = rows[DEVICE_BLOCK_SECONDS.name] * (weight if weight else np.nan)
    return rows


def still_held(turns: pd.DataFrame) -> tuple[int, float]:
    """Host copies saved and never seen evicted, and their bytes x seconds from the save
    until the recording's end: a lower bound of what they cost (held for longer still)."""
    saved = _numbers(turns, "host_saved_bytes")
    open_ = np.isfinite(saved) & ~np.isfinite(_numbers(turns, HOST_BYTE_SECONDS.name))
    if not open_.any():
        return 0, 0.0
    ends = np.concatenate([_numbers(turns, name) for name in _RECORDING_ENDS])
    end = np.nanmax(ends)  # the save end of an open copy is finite: never all NaN
    since = _numbers(turns, "host_save_end_ns")[open_]
    held = np.clip((end - since) / 1e9, 0, None)
    return int(open_.sum()), float(np.nansum(saved[open_] * held))


def _gib_hours(byte_seconds: float) -> float:
    return byte_seconds / GIB_HOUR


def _per_gib_hour(tokens: int, byte_seconds: float) -> float | None:
    return tokens / _gib_hours(byte_seconds) if byte_seconds else None


def _top(rows: pd.DataFrame, column: str) -> list[dict[str, Any]]:
    ranked = rows[rows[column] > 0].nlargest(TOP_CONVERSATIONS, column)
    return [
        {
            "tenant": str(row.tenant),
            "conversation_id": str(row.conversation_id),
            "device_block_seconds": _value(row.device_block_seconds),
            "host_byte_seconds": _value(row.host_byte_seconds),
            "device_tokens_served": int(row.device_tokens_served),
            "host_tokens_served": int(row.host_tokens_served),
        }
        for row in ranked.itertuples()
    ]


def _value(x: float) -> float | None:
    return None if pd.isna(x) else float(x)


def _quantiles(values: pd.Series) -> dict[str, float | None]:
    values = values.dropna()
    if not len(values):
        return {"p50": None, "p95": None}
    return {"p50": float(values.quantile(0.5)), "p95": float(values.quantile(0.95))}


def retention(turns: pd.DataFrame) -> dict[str, Any]:
    """Fleet-wide retention cost in each place, what it bought, the per-conversation
    spread and the costliest conversations."""
    rows = by_conversation(turns)
    device_block_s = float(rows[DEVICE_BLOCK_SECONDS.name].sum())
    device_byte_s = rows["device_byte_seconds"].sum(min_count=1)
    host_byte_s = float(rows[HOST_BYTE_SECONDS.name].sum())
    device_tokens = int(rows["device_tokens_served"].sum())
    host_tokens = int(rows["host_tokens_served"].sum())
    open_copies, open_byte_s = still_held(turns)
    device_gib_h = None if pd.isna(device_byte_s) else _gib_hours(float(device_byte_s))
    return {
        "device": {
            "block_seconds": device_block_s,
            "bytes_per_block": bytes_per_block(turns),
            "gib_hours": device_gib_h,
            "tokens_served": device_tokens,
            "tokens_per_gib_hour": (
                _per_gib_hour(device_tokens, float(device_byte_s)) if device_gib_h else None
            ),
            "turns_costed": int(np.isfinite(_numbers(turns, DEVICE_BLOCK_SECONDS.name)).sum()),
        },
        "host": {
            "byte_seconds": host_byte_s,
            "gib_hours": _gib_hours(host_byte_s),
            "tokens_served": host_tokens,
            "tokens_per_gib_hour": _per_gib_hour(host_tokens, host_byte_s),
            "copies_evicted": int(np.isfinite(_numbers(turns, HOST_BYTE_SECONDS.name)).sum()),
            "copies_still_held": open_copies,
            "byte_seconds_still_held_at_least": open_byte_s,
        },
        "conversations": {
            "device_block_seconds": _quantiles(rows[DEVICE_BLOCK_SECONDS.name]),
            "host_byte_seconds": _quantiles(rows[HOST_BYTE_SECONDS.name]),
            "costliest_on_device": _top(rows, DEVICE_BLOCK_SECONDS.name),
            "costliest_on_host": _top(rows, HOST_BYTE_SECONDS.name),
        },
    }
