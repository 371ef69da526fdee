"""``kvobs.prefix_chain``: the hash numbers the live buffer indexes and probes with agree
with the hash text lineage compares, for any digest a span may carry."""

from __future__ import annotations

import doctest
import random

import pytest

from kvobs import prefix_chain
from kvobs.prefix_chain import HEX_PER_POINT, grid_point, grid_points, parse


def _digest(hexed: str, blocks: int) -> str:
    return f"kvobs4:16:s:{blocks}:0::{hexed}"


def test_the_module_examples_hold():
    assert doctest.testmod(prefix_chain).failed == 0


@pytest.mark.parametrize("seed", range(20))
def test_hash_numbers_are_the_hashes_read_as_numbers(seed):
    rnd = random.Random(seed)
    blocks = rnd.randint(1, 3000)
    points = len(grid_points(blocks))
    hexed = "".join(rnd.choice("0123456789abcdef") for _ in range(points * HEX_PER_POINT))
    chain = parse(_digest(hexed, blocks))
    assert chain is not None
    assert chain.hash_numbers() == tuple(int(h, 16) for h in chain.hashes())
    assert chain.hash_numbers()[grid_points(blocks).index(chain.key()[0])] == chain.key_number()


@pytest.mark.parametrize(
    "odd",
    ["zz" * 8, "aa bb cc dd ee f", "AAAAAAAAAAAAAAAA", "_" * 16, "0x" + "0" * 14],
)
def test_a_prefix_that_is_not_plain_hex_meets_the_same_prefix_only(odd):
    """A digest no connector writes (a checkpoint not hex, spaces in it): a prompt still
    probes every checkpoint of an export it extends, and a different one no more than
    the text would say."""
    good = "0123456789abcdef"
    export = parse(_digest(good + odd, 2))
    prompt = parse(_digest(good + odd + good, 3))
    other = parse(_digest(good + "1" * 16 + good, 3))
    assert export is not None and prompt is not None and other is not None
    assert export.key_number() in prompt.hash_numbers()
    assert [h == k for h, k in zip(prompt.hashes(), other.hashes())] == [
        h == k for h, k in zip(prompt.hash_numbers(), other.hash_numbers())
    ]


def test_the_key_is_the_hash_at_the_last_grid_point_of_any_length():
    for blocks in range(1, 5000):
        points = grid_points(blocks)
        chain = parse(_digest("".join(f"{i:016x}" for i in range(len(points))), blocks))
        assert chain is not None
        point, hashed = chain.key()
        assert point == grid_point(blocks) and hashed == f"{points.index(point):016x}", blocks
