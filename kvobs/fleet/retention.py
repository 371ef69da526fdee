"""Retention cost: what keeping each turn's KV for a later turn cost on D (device blocks x
seconds held) and in the host tier (bytes x seconds held), and what each bought (tokens a
later turn took from it instead of computing), per conversation and fleet-wide.

The per-turn costs are the turn columns ``device_block_seconds`` and ``host_byte_seconds``
(``kvobs.turns.schema.RETENTION``, derived in ``kvobs.turns.correlate``); this module only sums
them. Device block-seconds become byte-seconds with the bytes per block D's reads moved
(no read: unknown, left out), so the two places compare in GiB-hours.
"""

from __future__ import annotations

from dataclasses import dataclass
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
    per_block = read_bytes_per_block(turns)
    return float(np.median(per_block)) if len(per_block) else None


def read_bytes_per_block(turns: pd.DataFrame) -> np.ndarray:
    """Bytes per block of each of D's done reads (what ``bytes_per_block`` is the median
    of; a sketch of them gives it over batches)."""
    done = (turns["read_outcome"] == ReadOutcome.DONE.value).fillna(False).to_numpy(bool)
    per_block = _numbers(turns, "read_bytes")[done] / _numbers(turns, "read_blocks")[done]
    return per_block[np.isfinite(per_block)]


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


@dataclass
class RetentionSums:
    """The fleet-wide retention figures' sums over some turns; ``+`` merges two sets of
    turns (batches), ``totals`` gives the report's "device" and "host" sections."""

    device_block_s: float = 0.0
    device_costed: int = 0
    device_tokens: int = 0
    host_byte_s: float = 0.0
    host_costed: int = 0
    host_tokens: int = 0
    # Host copies saved and never seen evicted (``still_held``): how many, their bytes,
    # their bytes x (save end - reference) in ns, and the recording's end.
    open_copies: int = 0
    open_bytes: float = 0.0
    open_bytes_since_ns: float = 0.0
    reference_ns: float | None = None
    recording_end_ns: float = -np.inf

    @classmethod
    def of(cls, turns: pd.DataFrame) -> RetentionSums:
        costs = per_turn(turns)
        device = costs[DEVICE_BLOCK_SECONDS.name].to_numpy(float)
        host = costs[HOST_BYTE_SECONDS.name].to_numpy(float)
        saved = _numbers(turns, "host_saved_bytes")
        open_ = np.isfinite(saved) & ~np.isfinite(host)
        since = _numbers(turns, "host_save_end_ns")[open_]
        saved, since = saved[open_][np.isfinite(since)], since[np.isfinite(since)]
        reference = float(since[0]) if len(since) else None
        ends = np.concatenate([_numbers(turns, name) for name in _RECORDING_ENDS])
        return cls(
            float(np.nansum(device)),
            int(np.isfinite(device).sum()),
            int(costs["device_tokens_served"].sum()),
            float(np.nansum(host)),
            int(np.isfinite(host).sum()),
            int(costs["host_tokens_served"].sum()),
            int(open_.sum()),
            float(saved.sum()),
            float((saved * (since - reference)).sum()) if reference is not None else 0.0,
            reference,
            float(np.nanmax(ends)) if np.isfinite(ends).any() else -np.inf,
        )

    def __add__(self, other: RetentionSums) -> RetentionSums:
        reference = self.reference_ns if self.reference_ns is not None else other.reference_ns
        shift = (
            0.0
            if other.reference_ns is None or reference is None
            else other.reference_ns - reference
        )
        return RetentionSums(
            self.device_block_s + other.device_block_s,
            self.device_costed + other.device_costed,
            self.device_tokens + other.device_tokens,
            self.host_byte_s + other.host_byte_s,
            self.host_costed + other.host_costed,
            self.host_tokens + other.host_tokens,
            self.open_copies + other.open_copies,
            self.open_bytes + other.open_bytes,
            self.open_bytes_since_ns + other.open_bytes_since_ns + shift * other.open_bytes,
            reference,
            max(self.recording_end_ns, other.recording_end_ns),
        )

    def __neg__(self) -> RetentionSums:
        """What adding takes some turns' sums out again (their recording end cannot be
        taken out: a caller checks it is not the latest)."""
        return RetentionSums(
            -self.device_block_s,
            -self.device_costed,
            -self.device_tokens,
            -self.host_byte_s,
            -self.host_costed,
            -self.host_tokens,
            -self.open_copies,
            -self.open_bytes,
            -self.open_bytes_since_ns,
            self.reference_ns,
            -np.inf,
        )

    def still_held(self) -> tuple[int, float]:
        """Host copies saved and never seen evicted, and their bytes x seconds from the
        save until the recording's end: a lower bound of what they cost (held for longer
        still). The end is the latest instant recorded, so never before a save's end."""
        if not self.open_copies or self.reference_ns is None:
            return self.open_copies, 0.0
        to_end = self.recording_end_ns - self.reference_ns
        return self.open_copies, (self.open_bytes * to_end - self.open_bytes_since_ns) / 1e9

    def totals(self, per_block: float | None) -> dict[str, Any]:
        """The report's ``device`` and ``host`` sections, ``per_block`` the bytes one
        retained block weighs (``bytes_per_block``)."""
        device_gib_h = (
            _gib_hours(self.device_block_s * per_block)
            if per_block and self.device_costed
            else None
        )
        open_copies, open_byte_s = self.still_held()
        return {
            "device": {
                "block_seconds": self.device_block_s,
                "bytes_per_block": per_block,
                "gib_hours": device_gib_h,
                "tokens_served": self.device_tokens,
                "tokens_per_gib_hour": (
                    _per_gib_hour(self.device_tokens, self.device_block_s * per_block)
                    if per_block and device_gib_h
                    else None
                ),
                "turns_costed": self.device_costed,
            },
            "host": {
                "byte_seconds": self.host_byte_s,
                "gib_hours": _gib_hours(self.host_byte_s),
                "tokens_served": self.host_tokens,
                "tokens_per_gib_hour": _per_gib_hour(self.host_tokens, self.host_byte_s),
                "copies_evicted": self.host_costed,
                "copies_still_held": open_copies,
                "byte_seconds_still_held_at_least": open_byte_s,
            },
        }


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
    return {
        **RetentionSums.of(turns).totals(bytes_per_block(turns)),
        "conversations": {
            "device_block_seconds": _quantiles(rows[DEVICE_BLOCK_SECONDS.name]),
            "host_byte_seconds": _quantiles(rows[HOST_BYTE_SECONDS.name]),
            "costliest_on_device": _top(rows, DEVICE_BLOCK_SECONDS.name),
            "costliest_on_host": _top(rows, HOST_BYTE_SECONDS.name),
        },
    }
