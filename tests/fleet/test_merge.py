"""Per-span-name parts lined up by key hash: a collision is detected, never merged."""

import pyarrow as pa

from kvobs.sources._merge import align_parts, merge_parts

TYPES = {"a": pa.int64(), "b": pa.float64()}


def _keyed(hashes, checks):
    n = len(hashes)
    return pa.table({"tenant": ["t"] * n, "conversation_id": [f"c{i}" for i in range(n)],
                     "turn": list(range(1, n + 1)), "k": pa.array(hashes, pa.uint64()),
                     "k2": pa.array(checks, pa.uint64()), "a": list(range(n))})


def _part(hashes, checks, values):
    return pa.table({"k": pa.array(hashes, pa.uint64()), "k2": pa.array(checks, pa.uint64()),
                     "b": values})


def test_parts_line_up_by_hash_and_missing_turns_are_null():
    table = align_parts(_keyed([30, 10, 20], [3, 1, 2]), [_part([10, 30], [1, 3], [0.1, 0.3])],
                        TYPES)
    assert table.column("b").to_pylist() == [0.3, 0.1, None]
    assert table.column("conversation_id").to_pylist() == ["c0", "c1", "c2"]


def test_collisions_and_unknown_turns_give_none():
    keyed = _keyed([30, 10, 20], [3, 1, 2])
    assert align_parts(keyed, [_part([10], [9], [0.1])], TYPES) is None  # check differs
    assert align_parts(keyed, [_part([10, 10], [1, 9], [0.1, 0.2])], TYPES) is None
    assert align_parts(keyed, [_part([40], [4], [0.4])], TYPES) is None  # not in keyed
    assert align_parts(_keyed([10, 10], [1, 2]), [], TYPES) is None
    assert merge_parts([keyed, _keyed([10], [7])], TYPES) is None


def test_general_merge_keeps_turns_of_any_part():
    other = _keyed([40], [4]).set_column(1, "conversation_id", pa.array(["a"]))
    table = merge_parts([_keyed([30, 10], [3, 1]), other], TYPES)
    assert dict(zip(table.column("conversation_id").to_pylist(),
                    table.column("turn").to_pylist())) == {"a": 1, "c0": 1, "c1": 2}
