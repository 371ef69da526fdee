"""Column tests over a turn table (pandas, categorical-aware): what the timeline, the
verdict rules and the latency causes decide with.

Every rule decides over a whole table at once, so one definition serves one
conversation (``kvobs diagnose``) and a million turns (``kvobs report``) alike. A column
the table does not have reads as missing on every row (a fleet table carries fewer
columns than diagnose's).
"""

from __future__ import annotations

import numpy as np
import pandas as pd


def _absent(turns: pd.DataFrame, column: str) -> bool:
    return column not in turns


def eq(turns: pd.DataFrame, column: str, value: str) -> np.ndarray:
    if _absent(turns, column):
        return np.zeros(len(turns), bool)
    values = turns[column]
    if isinstance(values.dtype, pd.CategoricalDtype):
        if value not in values.cat.categories:
            return np.zeros(len(values), bool)
        return values.cat.codes.to_numpy() == values.cat.categories.get_loc(value)
    return (values == value).fillna(False).to_numpy(bool)


def isin(turns: pd.DataFrame, column: str, values) -> np.ndarray:
    out = np.zeros(len(turns), bool)
    for value in values:
        out |= eq(turns, column, value)
    return out


def null(turns: pd.DataFrame, column: str) -> np.ndarray:
    if _absent(turns, column):
        return np.ones(len(turns), bool)
    return turns[column].isna().to_numpy(bool)


def present(turns: pd.DataFrame, column: str) -> np.ndarray:
    return ~null(turns, column)


def num(turns: pd.DataFrame, column: str) -> np.ndarray:
    if _absent(turns, column):
        return np.full(len(turns), np.nan)
    return pd.to_numeric(turns[column], errors="coerce").to_numpy(float, na_value=np.nan)


def flag(turns: pd.DataFrame, column: str) -> np.ndarray:
    if _absent(turns, column):
        return np.zeros(len(turns), bool)
    return turns[column].astype("boolean").fillna(False).to_numpy(bool)


def none(turns: pd.DataFrame) -> np.ndarray:
    return np.zeros(len(turns), bool)


class Cached:
    """The same tests, each column converted once: the timeline reads some columns
    several times over millions of rows."""

    def __init__(self, turns: pd.DataFrame):
        self.turns = turns
        self._num: dict[str, np.ndarray] = {}
        self._present: dict[str, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.turns)

    def __contains__(self, column: str) -> bool:
        return column in self.turns

    def num(self, column: str) -> np.ndarray:
        if column not in self._num:
            self._num[column] = num(self.turns, column)
        return self._num[column]

    def present(self, column: str) -> np.ndarray:
        if column not in self._present:
            self._present[column] = present(self.turns, column)
        return self._present[column]

    def eq(self, column: str, value: str) -> np.ndarray:
        return eq(self.turns, column, value)
