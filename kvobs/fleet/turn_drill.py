"""The turns a report over turn rows lists to follow up (``kvobs.fleet.report``'s
``drill_down``, in bounded memory): the slowest faults and slow healthy turns kept over
batches (``Ranked``), then each completed from its conversation's stored rows."""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from kvobs.fleet.report import LISTED_SLOW, diagnose_command
from kvobs.live.turnstore import TurnRows
from kvobs.semconv import NOT_FAULT_VALUES


class Ranked:
    """The ``limit`` first turns by (slowest first, unmeasured last; then conversation,
    tenant, turn): ``drill_down``'s order, kept over batches in bounded memory."""

    def __init__(self, limit: int, rows: list[tuple] | None = None):
        self.limit = limit
        self.rows: list[tuple] = rows or []

    def add(self, frame: pd.DataFrame, mask: np.ndarray) -> None:
        rows = np.flatnonzero(mask)
        latency = frame["latency_s"].to_numpy(float, na_value=np.nan)
        key = np.nan_to_num(latency[rows], nan=-1.0)
        if len(rows) > self.limit:
            kth = np.partition(key, len(key) - self.limit)[len(key) - self.limit]
            rows, key = rows[key >= kth], key[key >= kth]
        if self.rows and len(self.rows) >= self.limit:
            worst = -self.rows[-1][0]
            rows, key = rows[key >= worst], key[key >= worst]
        cids, tenants, turns, verdicts = (
            frame[c].to_numpy() for c in ("conversation_id", "tenant", "turn", "verdict")
        )
        self.rows.extend(
            (
                -float(k),
                str(cids[i]),
                str(tenants[i] or ""),
                int(turns[i]),
                str(verdicts[i]),
                None if np.isnan(latency[i]) else float(latency[i]),
            )
            for i, k in zip(rows.tolist(), key.tolist())
        )
        self._keep_first()

    def merge(self, other: Ranked) -> None:
        """Adds another ranking's turns (none of them among these)."""
        self.rows.extend(other.rows)
        self._keep_first()

    def _keep_first(self) -> None:
        self.rows.sort(key=lambda row: row[:4])
        del self.rows[self.limit :]


def slow_turns(
    batches: Iterable[pa.RecordBatch], thresholds: dict[str, float | None]
) -> tuple[Ranked, int]:
    """The healthy turns at or above their scope's latency threshold (``first_turn``,
    ``later_turns``): the slowest ``LISTED_SLOW``, and how many."""
    slow, count = Ranked(LISTED_SLOW), 0
    healthy_verdicts = pa.array(sorted(NOT_FAULT_VALUES), pa.string())
    for batch in batches:
        latency = batch.column("latency_s").to_numpy(zero_copy_only=False)
        first = batch.column("turn").to_numpy(zero_copy_only=False) == 1
        threshold = np.where(
            first,
            *(
                thresholds[s] if thresholds[s] is not None else np.inf
                for s in ("first_turn", "later_turns")
            ),
        )
        healthy = pc.is_in(batch.column("verdict"), value_set=healthy_verdicts)
        mask = healthy.to_numpy(zero_copy_only=False) & (latency >= threshold)  # NaN: False
        count += int(mask.sum())
        if mask.any():  # only the slow rows become a frame (strings are dear)
            frame = batch.filter(pa.array(mask)).to_pandas()
            slow.add(frame, np.ones(len(frame), bool))
    return slow, count


def drill_rows(rows: TurnRows, chosen, source: str, read_slo_s) -> list[dict[str, Any]]:
    """The listed turns, each completed from its conversation's stored rows (looked up
    together: each file's index read once): its top cause, trace id, and whether its id
    is shared by several tenants (the command then names the tenant)."""
    stored = rows.latest_of(row[1] for row, _ in chosen)
    out = []
    for (_, cid, tenant, turn, verdict, latency), kind in chosen:
        mine = [r for r in stored[cid] if str(r.get("tenant") or "") == tenant]
        detail = next((r for r in mine if r.get("turn") == turn), {})
        causes = detail.get("causes") or []
        shared = len({str(r.get("tenant") or "") for r in stored[cid]}) > 1
        out.append(
            {
                "kind": kind,
                "conversation_id": cid,
                "tenant": tenant,
                "turn": turn,
                "verdict": verdict,
                "latency_s": latency,
                "top_cause": causes[0]["cause"] if causes else None,
                "top_cause_share": causes[0]["share"] if causes else None,
                "trace_id": detail.get("trace_id"),
                "command": diagnose_command(
                    rows.source_of(cid, source), cid, tenant if shared else None, read_slo_s
                ),
            }
        )
    return out


__all__ = ["Ranked", "drill_rows", "slow_turns"]
