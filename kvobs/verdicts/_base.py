"""What every verdict rule shares: the turn it reads, the finding it returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import math
import sys

import numpy as np

from kvobs import semconv as sc
from kvobs.semconv import Verdict
from kvobs.settings import SLOW_TRANSFER_FACTOR


@dataclass(frozen=True)
class Needs:
    """Evidence a rule needs on some rows: ``where`` marks the rows that lack it."""

    where: np.ndarray
    column: str
    span: sc.SpanName
    # Why the evidence is not enough when the span is there (``semconv.LineageGap``);
    # empty: the span is missing.
    reason: str = ""


@dataclass(frozen=True)
class Context:
    """Source-wide facts some rules weigh a turn against."""

    prefill_tokens_per_s: float | None = None  # measured P compute rate
    read_slo_s: float | None = None  # optional read-latency SLO
    slow_transfer_factor: float = SLOW_TRANSFER_FACTOR.default
    # Typical decode seconds per output token (the causes weigh a turn's decode by it).
    decode_s_per_token: float | None = None


@dataclass(frozen=True)
class Finding:
    verdict: Verdict
    remedy: str
    evidence: dict[str, Any] = field(default_factory=dict)
    rule: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict.value,
            "evidence": self.evidence,
            "remedy": self.remedy,
            "rule": self.rule,
        }


_PLAIN_TYPES = (str, int, bool)
_PLAIN_OR_NONE = frozenset((str, int, bool, type(None)))


def _plain(value: Any) -> Any:
    """pandas/numpy scalars to plain Python; every kind of missing to None."""
    kind = type(value)
    if kind in _PLAIN_TYPES:  # most of what rules read: no conversion, never missing
        return value
    if value is None or (kind is float and math.isnan(value)):
        return None
    if kind is float:
        return value
    pandas = sys.modules.get("pandas")  # its missing values exist only once it is loaded
    if pandas is not None and pandas.api.types.is_scalar(value) and pandas.isna(value):
        return None
    return value.item() if hasattr(value, "item") else value


class Turn(Mapping):
    """Read-only view of one correlated turn row; absent values read as None. Values are
    made plain as they are read: a rule, the timeline and the causes read a few of a
    row's ~200 columns."""

    def __init__(self, row: Mapping[str, Any]):
        self._row = row

    @classmethod
    def of_plain(cls, row: dict[str, Any]) -> "Turn":
        """A row whose values are plain already, every missing one None (``Columns.records``
        with ``plain``): read with the dict's own ``get``, which gives what ``get`` would.
        The timeline, the rules, the causes and the JSON read a turn ~90 times; a Python
        call each was a sixth of classifying it."""
        turn = cls(row)
        turn.get = row.get  # type: ignore[method-assign, assignment]
        return turn

    def __getitem__(self, column: str) -> Any:
        return _plain(self._row[column])

    def __iter__(self):
        return iter(self._row)

    def __len__(self) -> int:
        return len(self._row)

    @property
    def index(self) -> int:
        return int(self.get("turn"))

    def get(self, column: str, default: Any = None) -> Any:
        value = self._row.get(column, default)
        # What rules read is mostly plain already, or absent, or a float (NaN: missing):
        # no call for those.
        kind = type(value)
        if kind in _PLAIN_OR_NONE:
            return value
        if kind is float:
            return None if value != value else value
        return _plain(value)

    def pick(self, *columns: str) -> dict[str, Any]:
        """Evidence: the named columns that have a value."""
        get = self.get
        return {c: value for c in columns if (value := get(c)) is not None}

    def as_dict(self) -> dict[str, Any]:
        return {key: _plain(value) for key, value in self._row.items()}
