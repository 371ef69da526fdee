"""Token-level evidence: a compact digest of the block hashes vLLM already computes.

vLLM hashes every full block of ``hash_block_size`` tokens for prefix caching, chaining
each hash over its parent (``request.block_hashes``). A hash at block ``n`` therefore
fingerprints the whole prefix ``[0, n * block_size)``. D exports the first 8 bytes of the
hashes at up to ``MAX_CHECKPOINTS`` block counts (every block for short prefixes, an even
stride plus the last block for long ones); P finds the longest prefix that still agrees.

Format (a string, so that it survives any JSON hop)::

    kvobs2:<hash_block_size>:<seed fingerprint>:<blocks>:<16 hex per checkpoint>

The checkpoints follow from ``<blocks>`` (``checkpoints()``), so only the hash prefixes
travel, concatenated: cheap to build on D's hook and to probe on P's.

>>> hashes = [bytes([i]) * 32 for i in range(1, 6)]
>>> d = encode(hashes, num_tokens=5 * 16 + 3, block_size=16, seed="abcd")
>>> d.split(":")[:4]
['kvobs2', '16', 'abcd', '5']
>>> compare(d, hashes, block_size=16, seed="abcd", limit_tokens=83)
(<PrefixEvidence.MATCH: 'match'>, 80)
>>> other = hashes[:2] + [b"x" * 32] * 3
>>> compare(d, other, block_size=16, seed="abcd", limit_tokens=83)
(<PrefixEvidence.MISMATCH: 'mismatch'>, 32)
>>> compare(d, hashes, block_size=16, seed="other", limit_tokens=83)[0].value
'incomparable'
"""

from __future__ import annotations

import hashlib
from bisect import bisect_left
from functools import lru_cache
from typing import Sequence

from kvobs.semconv import PrefixEvidence

VERSION = "kvobs2"
_HEX = 2 * 8  # hex digits of one hash prefix
MAX_CHECKPOINTS = 64
_PREFIX_BYTES = 8


def seed_fingerprint() -> str | None:
    """Fingerprint of this process's NONE_HASH (covers seed and hash algorithm).

    Two engines can compare block hashes only when their fingerprints agree (sha256
    default: yes; xxhash without a shared PYTHONHASHSEED: no).
    """
    try:
        from vllm.v1.core import kv_cache_utils
        none_hash = kv_cache_utils.NONE_HASH
    except Exception:  # noqa: BLE001  (not initialised in this process)
        return None
    return hashlib.sha256(bytes(none_hash)).hexdigest()[:8]


@lru_cache(maxsize=4096)
def _checkpoints(num_blocks: int) -> tuple[int, ...]:
    return tuple(checkpoints(num_blocks))


def checkpoints(num_blocks: int) -> list[int]:
    """Block counts a digest carries.

    >>> checkpoints(3)
    [1, 2, 3]
    >>> c = checkpoints(1000); len(c) <= MAX_CHECKPOINTS + 1, c[:2], c[-1]
    (True, [16, 32], 1000)
    """
    if num_blocks <= MAX_CHECKPOINTS:
        return list(range(1, num_blocks + 1))
    stride = -(-num_blocks // MAX_CHECKPOINTS)
    points = list(range(stride, num_blocks + 1, stride))
    if points[-1] != num_blocks:
        points.append(num_blocks)
    return points


def encode(block_hashes: Sequence[bytes], num_tokens: int, block_size: int,
           seed: str | None) -> str | None:
    """Digest of the full blocks covering ``num_tokens`` (None if there are none)."""
    num_blocks = min(len(block_hashes), num_tokens // block_size)
    if num_blocks <= 0 or not seed:
        return None
    prefixes = b"".join([block_hashes[n - 1][:_PREFIX_BYTES]
                         for n in _checkpoints(num_blocks)])
    return f"{VERSION}:{block_size}:{seed}:{num_blocks}:{prefixes.hex()}"


class _Agrees:
    """Monotone predicate over checkpoints: False while P's hash matches D's.

    Reads only the entries the binary search probes: a hook must stay cheap."""

    def __init__(self, counts, hexed, hashes):
        self._counts, self._hexed, self._hashes = counts, hexed, hashes

    def __len__(self):
        return len(self._counts)

    def __getitem__(self, i):
        theirs = self._hexed[i * _HEX:(i + 1) * _HEX]
        return self._hashes[self._counts[i] - 1][:_PREFIX_BYTES].hex() != theirs


def compare(digest: str | None, block_hashes: Sequence[bytes], block_size: int,
            seed: str | None, limit_tokens: int) -> tuple[PrefixEvidence, int]:
    """Compare D's digest with P's hashes over ``[0, limit_tokens)``.

    Returns the evidence and the number of tokens verified to match (a multiple of
    ``block_size``; on a mismatch, the longest prefix still verified).
    """
    if not digest:
        return PrefixEvidence.ABSENT, 0
    version, d_block_size, d_seed, d_blocks, hexed = digest.split(":", 4)
    if version != VERSION:
        raise ValueError(f"unknown digest version {version!r}")
    if int(d_block_size) != block_size or not seed or d_seed != seed:
        return PrefixEvidence.INCOMPARABLE, 0
    counts = _checkpoints(int(d_blocks))
    if len(hexed) != len(counts) * _HEX:
        raise ValueError("digest checkpoints do not match its block count")
    usable = min(len(block_hashes), limit_tokens // block_size)
    n = bisect_left(counts, usable + 1)  # checkpoints P can check
    if n == 0:
        return PrefixEvidence.INCOMPARABLE, 0
    # Chained hashes: agreement at a checkpoint implies agreement at all earlier ones.
    first_bad = bisect_left(_Agrees(counts[:n], hexed, block_hashes), True)
    matched = counts[first_bad - 1] * block_size if first_bad else 0
    if first_bad == n:
        return PrefixEvidence.MATCH, matched
    return PrefixEvidence.MISMATCH, matched
