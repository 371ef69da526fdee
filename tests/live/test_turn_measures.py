"""``turn_measures.pack``: the stored record, the same bytes as a field assigned at a time."""

from __future__ import annotations

import math
import random

import numpy as np

from kvobs.live.turn_measures import ENUMS, KINDS, MEASURE_DTYPE, PRESENCE, _code, pack


def _packed_by_field(measures: dict) -> bytes:
    """The record as pack made it before (81 numpy field assignments): the reference."""
    record = np.zeros(1, MEASURE_DTYPE)
    for name, kind in KINDS.items():
        record[name] = _code(name, kind, measures.get(name))
    return record.tobytes()


def _value(name: str, kind: str, rng: random.Random):
    if rng.random() < 0.3:
        return None
    if kind == "float":
        return rng.choice([0.0, -0.0, 1e-9, 2.5, -3.75, 1e300, rng.uniform(-1e6, 1e6)])
    if kind == "int":
        return rng.choice([0, 1, -1, 2**62, -(2**63) + 1, 2**63 - 1, rng.randrange(-10**9, 10**9)])
    if kind == "bool":
        return rng.random() < 0.5
    if kind == PRESENCE:
        return True
    return rng.choice([*ENUMS[name], "not-an-enum-value", ""])


def test_pack_equals_field_by_field():
    rng = random.Random(7)
    for _ in range(300):
        measures = {name: _value(name, kind, rng) for name, kind in KINDS.items()}
        if rng.random() < 0.2:  # a row with some measures absent
            for name in rng.sample(list(KINDS), 10):
                del measures[name]
        assert pack(measures) == _packed_by_field(measures)
    assert pack({}) == _packed_by_field({})
    nan_record = np.frombuffer(pack({}), MEASURE_DTYPE)
    assert all(
        math.isnan(nan_record[name][0]) for name, kind in KINDS.items() if kind == "float"
    )
