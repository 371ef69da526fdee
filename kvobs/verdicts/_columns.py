"""Column tests over a turn table (pandas, categorical-aware): what rules decide with.

Every rule decides over a whole table at once, so one definition serves one
conversation (``kvobs diagnose``) and a million turns (``kvobs report``) alike.
"""

from __future__ import annotations

import numpy as np
import pandas as pd


def eq(turns: pd.DataFrame, column: str, value: str) -> np.ndarray:
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
    return turns[column].isna().to_numpy(bool)


def present(turns: pd.DataFrame, column: str) -> np.ndarray:
    return ~null(turns, column)


def num(turns: pd.DataFrame, column: str) -> np.ndarray:
    return pd.to_numeric(turns[column], errors="coerce").to_numpy(float, na_value=np.nan)


def flag(turns: pd.DataFrame, column: str) -> np.ndarray:
    return turns[column].astype("boolean").fillna(False).to_numpy(bool)


def none(turns: pd.DataFrame) -> np.ndarray:
    return np.zeros(len(turns), bool)
