"""Column tests over a turn table: what the timeline, the verdict rules and the latency
causes decide with.

Every rule decides over a whole table at once, so one definition serves one
conversation (``kvobs diagnose``) and a million turns (``kvobs report``) alike. A table
is either the fleet's pandas DataFrame (categorical-aware) or ``Columns``, the Arrow turn
rows diagnose reads without building a pandas table (this module imports no pandas;
Arrow reaches numpy through ``kvobs.turns.arrays``, which never makes pyarrow load it). The
tests below are the one place that knows both. A column the table does not
have reads as missing on every row (a fleet table carries fewer columns than
diagnose's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvobs.turns import arrays

if TYPE_CHECKING:
    import pandas as pd


@dataclass(frozen=True)
class Categories:
    """A string column by codes (-1: missing) into ``names``: what the timeline adds."""

    codes: np.ndarray
    names: list[str]


class Columns:
    """A turn table as named columns: Arrow turn rows (``correlate.derive``) and the
    numpy columns added to them (``assign``: floats, NaN missing; strings as objects,
    None missing)."""

    def __init__(self, table: pa.Table):
        self.table = table
        self.added: dict[str, np.ndarray] = {}
        self._names = frozenset(table.column_names)

    def __len__(self) -> int:
        return self.table.num_rows

    def __contains__(self, column: str) -> bool:
        return column in self.added or column in self._names

    def arrow(self, column: str) -> pa.ChunkedArray:
        values = self.table.column(column)
        if pa.types.is_dictionary(values.type):
            values = values.cast(values.type.value_type)
        return values

    def values(self, column: str) -> list[Any]:
        """A column's values as ``records`` holds them (missing: None or NaN)."""
        if column in self.added:
            return self.added[column].tolist()
        return arrays.pylist(self.table.column(column))

    def plain_values(self, column: str) -> list[Any]:
        """A column's values, every missing one None (a float column's NaN too)."""
        if column in self.added:
            added = self.added[column]
            if added.dtype.kind == "f":
                missing = np.isnan(added)
                if missing.any():
                    held = added.astype(object)
                    held[missing] = None
                    return held.tolist()
            return added.tolist()
        values = self.table.column(column)
        if pa.types.is_floating(values.type) and pc.any(pc.is_nan(values)).as_py():
            return [None if value != value else value for value in values.to_pylist()]
        return arrays.pylist(values)

    def records(self, plain: bool = False) -> list[dict[str, Any]]:
        """Rows as plain dicts (missing values None or NaN; None only when ``plain``),
        the added columns last."""
        names = self.table.column_names + list(self.added)
        read = self.plain_values if plain else self.values
        # A row starts as a copy of every column's None (a few turns' table has ~80
        # columns no row has a value in; a copy is one block, not a key at a time).
        empty = dict.fromkeys(names)
        valued = [
            name
            for name in names
            if name in self.added or self.table.column(name).null_count < len(self)
        ]
        if not valued:  # zip() of no column would give no row
            return [empty.copy() for _ in range(len(self))] if names else []
        rows = []
        for values in zip(*map(read, valued)):
            row = empty.copy()
            row.update(zip(valued, values))
            rows.append(row)
        return rows


Table = Union["pd.DataFrame", Columns]


def _absent(turns: Table, column: str) -> bool:
    """Whether the tests below read ``column`` as missing on every row: the table lacks
    it, or (Arrow rows) no row has a value, which they answer alike without converting
    it (a few turns' table has ~80 such columns)."""
    if column not in turns:
        return True
    return (
        isinstance(turns, Columns)
        and column not in turns.added
        and turns.table.column(column).null_count == len(turns)
    )


def _is_object(values: np.ndarray) -> bool:
    return values.dtype == object


def eq(turns: Table, column: str, value: str) -> np.ndarray:
    if _absent(turns, column):
        return np.zeros(len(turns), bool)
    if isinstance(turns, Columns):
        if column in turns.added:
            return np.asarray(turns.added[column] == value, bool)
        values = turns.arrow(column)
        if not (pa.types.is_string(values.type) or pa.types.is_large_string(values.type)):
            return np.zeros(len(turns), bool)
        return arrays.booleans(pc.equal(values, arrays.scalar(value, values.type)))
    values = turns[column]
    if values.dtype.name == "category":
        if value not in values.cat.categories:
            return np.zeros(len(values), bool)
        return values.cat.codes.to_numpy() == values.cat.categories.get_loc(value)
    return (values == value).fillna(False).to_numpy(bool)


def startswith(
    turns: Table, column: str, prefixes: tuple[str, ...], rows: np.ndarray | None = None
) -> np.ndarray:
    """Rows whose string value starts with one of ``prefixes`` (only among ``rows``, a
    mask, when given: the test is per value)."""
    out = np.zeros(len(turns), bool)
    if _absent(turns, column):
        return out
    where = np.flatnonzero(np.ones(len(turns), bool) if rows is None else rows)
    if isinstance(turns, Columns) and column not in turns.added:
        values = turns.arrow(column).take(arrays.array(where, pa.int64())).to_pylist()
    elif isinstance(turns, Columns):
        values = turns.added[column][where].tolist()
    else:
        values = turns[column].iloc[where].tolist()
    out[where] = [isinstance(v, str) and v.startswith(prefixes) for v in values]
    return out


def isin(turns: Table, column: str, values) -> np.ndarray:
    out = np.zeros(len(turns), bool)
    for value in values:
        out |= eq(turns, column, value)
    return out


def null(turns: Table, column: str) -> np.ndarray:
    if _absent(turns, column):
        return np.ones(len(turns), bool)
    if isinstance(turns, Columns):
        if column in turns.added:
            values = turns.added[column]
            return np.equal(values, arrays.NONE) if _is_object(values) else np.isnan(values)
        return arrays.booleans(pc.is_null(turns.arrow(column), nan_is_null=True))
    return turns[column].isna().to_numpy(bool)


def present(turns: Table, column: str) -> np.ndarray:
    return ~null(turns, column)


def num(turns: Table, column: str) -> np.ndarray:
    if _absent(turns, column):
        return np.full(len(turns), np.nan)
    if isinstance(turns, Columns):
        if column in turns.added:
            values = turns.added[column]
            return np.full(len(turns), np.nan) if _is_object(values) else values
        values = turns.arrow(column)
        if not (
            pa.types.is_integer(values.type)
            or pa.types.is_floating(values.type)
            or pa.types.is_boolean(values.type)
        ):
            return np.full(len(turns), np.nan)
        return arrays.numbers(arrays.as_type(values, pa.float64(), safe=False))
    import pandas as pd  # a DataFrame's: pandas is loaded already

    values = turns[column]
    if pd.api.types.is_numeric_dtype(values.dtype):  # booleans included
        # No to_numeric pass: over a fleet's columns it cost 3x the conversion itself.
        return values.to_numpy(np.float64, na_value=np.nan)
    return pd.to_numeric(values, errors="coerce").to_numpy(float, na_value=np.nan)


def flag(turns: Table, column: str) -> np.ndarray:
    if _absent(turns, column):
        return np.zeros(len(turns), bool)
    if isinstance(turns, Columns):
        if column in turns.added:
            return np.asarray(turns.added[column] == True, bool)  # noqa: E712 (per row)
        values = turns.arrow(column)
        if not pa.types.is_boolean(values.type):
            return np.zeros(len(turns), bool)
        return arrays.booleans(values)
    return turns[column].astype("boolean").fillna(False).to_numpy(bool)


def none(turns: Table) -> np.ndarray:
    return np.zeros(len(turns), bool)


def assign(turns: Table, columns: dict[str, np.ndarray | Categories]) -> None:
    """Add (or replace) columns in place. The arrays become the table's, uncopied (the
    caller must not change them after): an insertion copies each numpy array (0.1-0.5 s
    for the timeline's 26 columns over 1.35M turns), one frame of them stacks them into
    a block first (0.8 s)."""
    if isinstance(turns, Columns):
        for name, values in columns.items():
            if isinstance(values, Categories):
                names = np.array([*values.names, None], dtype=object)
                values = names[values.codes]  # code -1: the None at the end
            turns.added[name] = values
        return
    import warnings

    import pandas as pd  # a DataFrame's: pandas is loaded already

    with warnings.catch_warnings():
        # Fragmented by design (``correlate.to_frame`` splits blocks): consolidating a
        # fleet table would copy all of it.
        warnings.simplefilter("ignore", pd.errors.PerformanceWarning)
        for name, values in columns.items():
            turns[name] = (
                pd.Categorical.from_codes(values.codes, values.names)
                if isinstance(values, Categories)
                else pd.Series(values, index=turns.index, copy=False)
            )


def records(turns: Table) -> list[dict[str, Any]]:
    """The table's rows as dicts (``verdicts.Turn`` makes their values plain)."""
    if isinstance(turns, Columns):
        return turns.records()
    return turns.to_dict("records")


class Cached:
    """The same tests, each column converted once: the timeline reads some columns
    several times over millions of rows."""

    def __init__(self, turns: Table):
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
