"""The prefix chain: which block counts a block-hash digest carries, and reading one.

Emitted by the connector (``connector_instrumented._digest`` builds and compares digests
on the engines' hooks), read by ``kvobs.turns.lineage`` to tie a prompt to the earlier D export
it extends. One definition of the grid for both, so that they always agree.

A digest string is ``kvobs4:<block size>:<seed>:<blocks>:<tail tokens>:<tail hex>:<hex>``
where ``<hex>`` is 16 hex digits per checkpoint (``checkpoints(blocks)``).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import lru_cache

VERSION = "kvobs4"
DENSE_BLOCKS = 64  # every block count up to here is a checkpoint
_PER_DOUBLING = 16  # beyond: this many per doubling of the block count
HEX_PER_POINT = 16


@lru_cache(maxsize=8192)
def grid_points(num_blocks: int) -> tuple[int, ...]:
    """``checkpoints()`` as a cached tuple: readers ask for the same lengths many times."""
    return tuple(checkpoints(num_blocks))


def checkpoints(num_blocks: int) -> list[int]:
    """Block counts a digest of ``num_blocks`` carries: the grid points up to it, then
    ``num_blocks`` itself. The grid is every count up to ``DENSE_BLOCKS``, then
    ``_PER_DOUBLING`` evenly spaced counts per doubling (64 < n <= 128 by 4, ...).

    >>> checkpoints(3)
    [1, 2, 3]
    >>> c = checkpoints(1000); len(c), c[63:66], c[-2:]
    (128, [64, 68, 72], [992, 1000])
    >>> set(checkpoints(1000)[:-1]) <= set(checkpoints(5000))  # one grid for every length
    True
    """
    if num_blocks <= DENSE_BLOCKS:
        return list(range(1, num_blocks + 1))
    points = list(range(1, DENSE_BLOCKS + 1))
    low = DENSE_BLOCKS
    while low < num_blocks:
        step = low // _PER_DOUBLING
        points.extend(range(low + step, min(2 * low, num_blocks) + 1, step))
        low *= 2
    if points[-1] != num_blocks:
        points.append(num_blocks)
    return points


@lru_cache(maxsize=8192)
def grid_point(num_blocks: int) -> int:
    """The largest grid point at or below ``num_blocks``: the last checkpoint that every
    longer digest also carries.

    >>> grid_point(50), grid_point(70), grid_point(72), grid_point(1000)
    (50, 68, 72, 992)
    """
    if num_blocks <= DENSE_BLOCKS:
        return num_blocks
    low = DENSE_BLOCKS
    while 2 * low < num_blocks:
        low *= 2
    step = low // _PER_DOUBLING
    return num_blocks - (num_blocks - low) % step


@dataclass(frozen=True)
class Chain:
    """A parsed digest: what a lineage match needs (no token ids, only hash prefixes)."""

    scope: str  # "<block size>:<seed>": chains of different scopes never compare
    block_size: int
    blocks: int
    tail_tokens: int
    hexed: str

    @property
    def tokens(self) -> int:
        """The tokens the chain covers: its whole blocks and the tail after them."""
        return self.blocks * self.block_size + self.tail_tokens

    def hash_at(self, i: int) -> str:
        """The hash prefix (hex) of the i-th checkpoint."""
        return self.hexed[i * HEX_PER_POINT : (i + 1) * HEX_PER_POINT]

    def common_blocks(self, other: "Chain") -> int:
        """Blocks both chains agree on, to the grid: the last shared checkpoint whose
        hashes agree. Both carry the same grid points up to the shorter one's, at the
        same positions, and hashes chain (agreement at one implies it at every earlier
        one), so a bisection over those positions finds it.

        >>> a = parse("kvobs4:16:s:3:0::" + "aa" * 8 + "bb" * 8 + "cc" * 8)
        >>> b = parse("kvobs4:16:s:2:0::" + "aa" * 8 + "bb" * 8)
        >>> c = parse("kvobs4:16:s:3:0::" + "aa" * 8 + "dd" * 8 + "cc" * 8)
        >>> a.common_blocks(b), b.common_blocks(a), a.common_blocks(c), a.common_blocks(a)
        (2, 2, 1, 3)
        """
        if other.scope != self.scope:
            return 0
        shorter = min(self.blocks, other.blocks)
        shared = grid_points(grid_point(shorter))
        if self.blocks == other.blocks:
            shared = grid_points(shorter)  # the same last block too
        lo, hi = 0, len(shared)
        while lo < hi:  # first position that disagrees
            mid = (lo + hi) // 2
            if self.hash_at(mid) == other.hash_at(mid):
                lo = mid + 1
            else:
                hi = mid
        return shared[lo - 1] if lo else 0

    def hashes(self) -> list[str]:
        """Every checkpoint's hash prefix, shortest first.

        >>> parse("kvobs4:16:s:2:0::" + "aa" * 8 + "bb" * 8).hashes()
        ['aaaaaaaaaaaaaaaa', 'bbbbbbbbbbbbbbbb']
        """
        hexed = self.hexed
        return [hexed[at : at + HEX_PER_POINT] for at in range(0, len(hexed), HEX_PER_POINT)]

    def hash_numbers(self) -> tuple[int, ...]:
        """``hashes`` as numbers (the 64 bits each prefix holds; a prefix that is not hex,
        by Python's ``hash`` of its text): what an index that only needs equal hashes to
        meet is keyed by. One conversion for the whole chain, ~6x cheaper than slicing.

        >>> parse("kvobs4:16:s:2:0::" + "00" * 7 + "0a" + "ff" * 8).hash_numbers()
        (10, 18446744073709551615)
        """
        raw = _hex_bytes(self.hexed)
        if raw is None:
            return tuple(map(_hash_number, self.hashes()))
        return struct.unpack(f">{len(raw) // 8}Q", raw)

    def key_number(self) -> int:
        """``key``'s hash as ``hash_numbers`` gives it."""
        return _hash_number(self.key()[1])

    def key(self) -> tuple[int, str]:
        """The (grid point, hash) every prompt extending this chain also carries."""
        point = grid_point(self.blocks)
        points = grid_points(self.blocks)  # the grid up to it, then the count if off it
        i = len(points) - 1 if points[-1] == point else len(points) - 2
        return point, self.hash_at(i)


def _hash_number(hashed: str) -> int:
    """One hash prefix as ``Chain.hash_numbers`` gives it."""
    raw = _hex_bytes(hashed)
    return hash(hashed) if raw is None else int.from_bytes(raw, "big")


def _hex_bytes(text: str) -> bytes | None:
    """The bytes ``text`` spells in plain hex; None for anything else (``fromhex`` also
    takes whitespace between bytes)."""
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        return None
    return raw if len(raw) * 2 == len(text) else None


def parse(digest: object) -> Chain | None:
    """A digest string as a ``Chain``; None for anything else (absent, another version,
    malformed): a reader never fails on one span's value.

    >>> c = parse("kvobs4:16:abcd:2:3:ffff:" + "aa" * 8 + "bb" * 8)
    >>> c.blocks, c.tail_tokens, c.key()
    (2, 3, (2, 'bbbbbbbbbbbbbbbb'))
    >>> parse("kvobs3:16:abcd:2:0::00"), parse(None), parse("kvobs4:x")
    (None, None, None)
    """
    if not isinstance(digest, str) or not digest.startswith(VERSION + ":"):
        return None
    try:
        _, block_size, seed, blocks, tail, _tail_hex, hexed = digest.split(":", 6)
        chain = Chain(f"{block_size}:{seed}", int(block_size), int(blocks), int(tail), hexed)
    except ValueError:
        return None
    if chain.blocks <= 0 or len(hexed) != len(grid_points(chain.blocks)) * HEX_PER_POINT:
        return None
    return chain
