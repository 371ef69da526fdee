"""Percentiles that merge: a DDSketch (``ddsketch``, Datadog's) per quantity, filled a
batch at a time and merged across batches, so a report over any number of turns holds a
few kilobytes per percentile.

Guarantee (DDSketch, relative accuracy ``RELATIVE_ACCURACY``): the value it returns for
quantile q is within 1 % of the sample at rank q x (n - 1) rounded down. numpy's
quantile (the span path) interpolates between that sample and the next, so the two agree
within 1 % of the bracketing samples (``within_sketch_error``).
"""

from __future__ import annotations

import numpy as np
from ddsketch import DDSketch

RELATIVE_ACCURACY = 0.01


def new_sketch() -> DDSketch:
    return DDSketch(relative_accuracy=RELATIVE_ACCURACY)


def add_values(sketch: DDSketch, values: np.ndarray) -> None:
    """Adds the finite values: counted per bucket of the sketch in numpy, then one
    weighted add per bucket at the bucket's own value (``mapping.value(key)`` maps back
    to ``key``), so the sketch holds what adding each value would have given it;
    ``DDSketch.add`` is pure Python, about 1 us a call."""
    values = values[np.isfinite(values)]
    if not len(values):
        return
    mapping = sketch._mapping
    tiny = mapping.min_possible
    zeros = int(np.count_nonzero(np.abs(values) <= tiny))
    if zeros:
        sketch.add(0.0, zeros)
    for sign, side in ((1.0, values[values > tiny]), (-1.0, -values[values < -tiny])):
        if not len(side):
            continue
        # LogarithmicMapping.key, vectorised: a value on a bucket's edge that rounds the
        # other way lands in the neighbour bucket, within the error.
        keys = np.ceil(np.log2(side) * mapping._multiplier + mapping._offset).astype(np.int64)
        low = int(keys.min())
        counts = np.bincount(keys - low)
        at = np.flatnonzero(counts)
        add_keyed(sketch, sign, (at + low).tolist(), counts[at].tolist())


def add_keyed(sketch: DDSketch, sign: float, keys: list[int], counts: list[int]) -> None:
    """Adds ``counts[i]`` values to the bucket ``keys[i]`` of one side of the sketch
    (``sign``: 1.0 or -1.0): one weighted add at the bucket's own value. What
    ``add_values`` does with the keys it computes, and what a query that computed them
    (``bucket_key_sql``) hands back."""
    for key, count in zip(keys, counts):
        sketch.add(sign * sketch._mapping.value(key), count)


def bucket_key_sql(value: str) -> str:
    """SQL for the sketch bucket of a positive ``value`` above ``min_possible``: the
    expression ``add_values`` evaluates in numpy, with the same constants (ClickHouse's
    ``log2`` gives numpy's keys: tests/fleet/test_turn_sql.py checks bucket edges)."""
    mapping = new_sketch()._mapping
    return f"toInt64(ceil(log2({value}) * {mapping._multiplier!r} + {mapping._offset!r}))"


def zero_bound() -> float:
    """The largest magnitude the sketch counts as zero."""
    return new_sketch()._mapping.min_possible


def sketch_state(sketch: DDSketch) -> dict[str, object]:
    """The sketch's buckets as plain data (JSON): each side's first key and the counts
    from there on, what ``sketch_from_state`` rebuilds the same quantiles from."""

    def buckets(store) -> list:
        if not store.count:
            return [0, []]
        low, high = store.min_key - store.offset, store.max_key - store.offset
        return [store.min_key, store.bins[low : high + 1]]

    return {
        "zero": sketch._zero_count,
        "positive": buckets(sketch._store),
        "negative": buckets(sketch._negative_store),
    }


def sketch_from_state(state: dict) -> DDSketch:
    """A sketch with ``sketch_state``'s buckets: the lowest and highest bucket added at
    their values (which map back to them) size the store once, the counts between are
    set in place (one ``add`` a bucket grew the store a bucket at a time: 1 s for a
    month's tallies)."""
    sketch = new_sketch()
    if state["zero"]:
        sketch.add(0.0, state["zero"])
    for sign, side, store in (
        (1.0, "positive", sketch._store),
        (-1.0, "negative", sketch._negative_store),
    ):
        first, counts = state[side]
        keys = [i for i, count in enumerate(counts) if count]
        if not keys:
            continue
        for at in dict.fromkeys((keys[0], keys[-1])):
            sketch.add(sign * sketch._mapping.value(first + at), counts[at])
        between = counts[keys[0] + 1 : keys[-1]]
        start = first + keys[0] + 1 - store.offset
        store.bins[start : start + len(between)] = between
        added = sum(between)
        store.count += added
        sketch._count += added
    return sketch


def remove(sketch: DDSketch, removed: DDSketch) -> None:
    """Takes ``removed``'s values out of ``sketch`` (they were added to it): each bucket
    count less ``removed``'s, so its quantiles are those of the values left."""
    sketch._zero_count -= removed._zero_count
    sketch._count -= removed._count
    for store, gone in (
        (sketch._store, removed._store),
        (sketch._negative_store, removed._negative_store),
    ):
        if gone.count:
            for key in range(gone.min_key, gone.max_key + 1):
                store.bins[key - store.offset] -= gone.bins[key - gone.offset]
            store.count -= gone.count


def merged(sketches) -> DDSketch:
    out = new_sketch()
    for sketch in sketches:
        out.merge(sketch)
    return out


def quantile(sketch: DDSketch, q: float) -> float | None:
    value = sketch.get_quantile_value(q)
    return None if value is None else float(value)


def p50_p95(sketch: DDSketch) -> tuple[float | None, float | None]:
    return quantile(sketch, 0.5), quantile(sketch, 0.95)


def within_sketch_error(estimate: float, values: np.ndarray, q: float) -> bool:
    """Whether ``estimate`` of quantile ``q`` of ``values`` keeps the guarantee: within
    ``RELATIVE_ACCURACY`` of the samples that bracket numpy's interpolated quantile."""
    ordered = np.sort(values[np.isfinite(values)])
    rank = q * (len(ordered) - 1)
    low, high = ordered[int(np.floor(rank))], ordered[int(np.ceil(rank))]
    slack = RELATIVE_ACCURACY * max(abs(low), abs(high)) + 1e-12
    return min(low, high) - slack <= estimate <= max(low, high) + slack


__all__ = [
    "RELATIVE_ACCURACY",
    "add_keyed",
    "add_values",
    "bucket_key_sql",
    "merged",
    "new_sketch",
    "p50_p95",
    "quantile",
    "remove",
    "sketch_from_state",
    "sketch_state",
    "within_sketch_error",
    "zero_bound",
]
