"""Classified turns as the fleet's stored product: the live classifier's final rows in
hourly parquet partitions, ``DIR/turns/hour=YYYYMMDDHH/part-*.parquet``, dropped whole
when older than the retention. Every version of a turn is a row; readers keep the
latest (``latest``). A key the classifier moved a turn away from (lineage re-grouped
it) ends with a row marked ``superseded``, and readers skip it. A row is a few typed
columns to filter on plus ``detail``: the turn as ``kvobs diagnose --json`` gives it (ids
and numbers only, never text).
"""

from __future__ import annotations

import calendar
import json
import math
import os
import shutil
import time
import uuid
from collections import defaultdict
from typing import Any, Iterable

import pyarrow as pa
import pyarrow.parquet as pq

TURNS_DIR = "turns"
_PREFIX = "hour="
_HOUR_FORMAT = "%Y%m%d%H"
SCHEMA = pa.schema([
    ("tenant", pa.string()), ("conversation_id", pa.string()), ("turn", pa.int64()),
    ("version", pa.int64()), ("verdict", pa.string()), ("rule", pa.string()),
    ("trace_id", pa.string()), ("slowest_phase", pa.string()),
    ("latency_s", pa.float64()), ("ttft_s", pa.float64()),
    ("prompt_tokens", pa.int64()), ("finalized_at", pa.float64()), ("detail", pa.string()),
])
# Rows kept for a later write while the directory cannot be written (full disk); past
# this, the oldest go (counted by the caller).
MAX_PENDING = 100_000


def _number(value: Any, kind: type) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = kind(value)
    except (ValueError, OverflowError):
        return None
    return number if math.isfinite(number) else None


def record(row: dict[str, Any], finalized_at: float) -> dict[str, Any]:
    """A classifier row as the store's columns."""
    return {"tenant": str(row.get("tenant")), "conversation_id": str(row["conversation_id"]),
            "turn": int(row["turn"]), "version": int(row.get("version") or 1),
            "verdict": row.get("verdict"), "rule": row.get("rule"),
            "trace_id": row.get("trace_id"), "slowest_phase": row.get("slowest_phase"),
            "latency_s": _number(row.get("latency_s"), float),
            "ttft_s": _number(row.get("ttft_s"), float),
            "prompt_tokens": _number(row.get("prompt_tokens"), int),
            "finalized_at": finalized_at, "detail": _json(row)}


def _json(row: dict[str, Any]) -> str:
    """Strict JSON (a NaN or infinity, which JSON cannot hold, as null)."""
    try:
        return json.dumps(row, default=str, allow_nan=False, separators=(",", ":"))
    except ValueError:
        return json.dumps(_nan_free(row), default=str, separators=(",", ":"))


def _nan_free(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _nan_free(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_nan_free(v) for v in value]
    return value


class TurnStore:
    def __init__(self, directory: str, retention_s: float):
        self.directory = os.path.join(directory, TURNS_DIR)
        self.retention_s = retention_s
        self.pending: list[dict[str, Any]] = []
        self.dropped = 0  # rows lost after MAX_PENDING (a disk full for long)

    def write(self, rows: Iterable[dict[str, Any]], now: float | None = None) -> int:
        """Appends final rows (with any left from a failed write); returns the rows
        written. A failure keeps them for the next call and raises ``OSError``."""
        now = time.time() if now is None else now
        self.pending.extend(record(row, now) for row in rows)
        if len(self.pending) > MAX_PENDING:
            self.dropped += len(self.pending) - MAX_PENDING
            del self.pending[: len(self.pending) - MAX_PENDING]
        if not self.pending:
            return 0
        by_hour: dict[str, list[dict]] = defaultdict(list)
        for item in self.pending:
            by_hour[time.strftime(_HOUR_FORMAT, time.gmtime(item["finalized_at"]))].append(item)
        done: list[str] = []
        try:
            for hour, items in by_hour.items():
                partition = os.path.join(self.directory, _PREFIX + hour)
                os.makedirs(partition, exist_ok=True)
                path = os.path.join(partition,
                                    f"part-{int(now * 1000)}-{uuid.uuid4().hex[:8]}")
                # Written aside, then renamed: a reader never meets half a file.
                pq.write_table(pa.Table.from_pylist(items, schema=SCHEMA), path + ".tmp")
                os.replace(path + ".tmp", path + ".parquet")
                done.append(hour)
        finally:  # what was written leaves pending, also when a later hour failed
            self.pending = [item for hour, items in by_hour.items() if hour not in done
                            for item in items]
        return sum(len(by_hour[hour]) for hour in done)

    def partitions(self) -> list[str]:
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        return sorted(n for n in names if n.startswith(_PREFIX))

    def expire(self, now: float | None = None) -> list[str]:
        """Drops the partitions whose hour ended before the retention; returns them."""
        now = time.time() if now is None else now
        gone = []
        for name in self.partitions():
            try:
                start = calendar.timegm(time.strptime(name[len(_PREFIX):], _HOUR_FORMAT))
            except ValueError:
                continue  # not ours
            if start + 3600 < now - self.retention_s:
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
                gone.append(name)
        return gone

    def read(self, conversation_id: str | None = None) -> pa.Table:
        """Every stored row (of one conversation), all versions."""
        files = [os.path.join(self.directory, p, f) for p in self.partitions()
                 for f in sorted(os.listdir(os.path.join(self.directory, p)))
                 if f.endswith(".parquet")]
        if not files:
            return SCHEMA.empty_table()
        filters = None if conversation_id is None else [("conversation_id", "=", conversation_id)]
        tables = [pq.read_table(f, schema=SCHEMA, filters=filters) for f in files]
        return pa.concat_tables(tables)

    def finalized_since(self, since: float) -> list[dict[str, Any]]:
        """Every turn finalized at or after ``since``, at its latest version (what a
        restarted classifier resumes from)."""
        hour = time.strftime(_HOUR_FORMAT, time.gmtime(since))
        files = [os.path.join(self.directory, p, f) for p in self.partitions()
                 if p[len(_PREFIX):] >= hour
                 for f in sorted(os.listdir(os.path.join(self.directory, p)))
                 if f.endswith(".parquet")]
        best: dict[tuple, dict] = {}
        for path in files:
            table = pq.read_table(path, schema=SCHEMA, filters=[("finalized_at", ">=", since)])
            for item in table.to_pylist():
                key = (item["tenant"], item["conversation_id"], item["turn"])
                if key not in best or item["version"] >= best[key]["version"]:
                    best[key] = item
        return [detail | {"version": item["version"]} for item in best.values()
                if not (detail := json.loads(item["detail"])).get("superseded")]

    def latest(self, conversation_id: str) -> list[dict[str, Any]]:
        """The conversation's turns, each at its latest version, in turn order."""
        best: dict[tuple, tuple[int, dict]] = {}
        for item in self.read(conversation_id).to_pylist():
            key = (item["tenant"], item["turn"])
            if key not in best or item["version"] >= best[key][0]:
                best[key] = (item["version"], json.loads(item["detail"]))
        return [best[key][1] | {"version": best[key][0], "final": True}
                for key in sorted(best) if not best[key][1].get("superseded")]
