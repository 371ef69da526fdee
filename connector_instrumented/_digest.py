"""Token-level evidence: a compact digest of the block hashes vLLM already computes.

vLLM hashes every full block of ``hash_block_size`` tokens for prefix caching, chaining
each hash over its parent (``request.block_hashes``). A hash at block ``n`` therefore
fingerprints the whole prefix ``[0, n * block_size)``. A digest carries the first 8 bytes
of the hashes at a fixed grid of block counts (every count up to 64, then 16 per
doubling: ``checkpoints()``) plus the last full block. The grid is the same for every
request, so two digests always share their checkpoints below the shorter one's end:
P finds the longest prefix of its prompt that agrees with D's KV (the prefix guard),
and kvobs finds which earlier D export a prompt extends from the two spans alone
(``kvobs.turns.lineage``), whatever router sits in front.

Block hashes cover full blocks only, but D's KV usually ends inside a block, and P
reads that partial block too. Its tokens are where re-tokenization bites: the last tokens
of D's output meet the next turn's text there. So the digest also carries a fingerprint
of the tail tokens (after the last full block), checked by P when its prompt covers them.

Format (a string, so that it survives any JSON hop)::

    kvobs4:<hash_block_size>:<seed fingerprint>:<blocks>:<tail tokens>:<tail hex>:<16 hex per checkpoint>

The checkpoints follow from ``<blocks>`` (``checkpoints()``), so only the hash prefixes
travel, concatenated: cheap to build on D's hook and to probe on P's. A digest of
another version (an engine on an older kvobs) compares as ``incomparable``.

>>> hashes = [bytes([i]) * 32 for i in range(1, 6)]
>>> tokens = list(range(5 * 16 + 3))
>>> d = encode(hashes, num_tokens=83, block_size=16, seed="abcd", token_ids=tokens)
>>> d.split(":")[:5]
['kvobs4', '16', 'abcd', '5', '3']
>>> compare(d, hashes, block_size=16, seed="abcd", limit_tokens=83, token_ids=tokens)
(<PrefixEvidence.MATCH: 'match'>, 83)
>>> retokenized = tokens[:81] + [7, 7]  # the same blocks, another tail
>>> compare(d, hashes, block_size=16, seed="abcd", limit_tokens=83, token_ids=retokenized)
(<PrefixEvidence.MISMATCH: 'mismatch'>, 80)
>>> other = hashes[:2] + [b"x" * 32] * 3
>>> compare(d, other, block_size=16, seed="abcd", limit_tokens=83, token_ids=tokens)
(<PrefixEvidence.MISMATCH: 'mismatch'>, 32)
>>> compare(d, hashes, block_size=16, seed="other", limit_tokens=83)[0].value
'incomparable'
>>> compare("kvobs3:16:abcd:5:0::" + "00" * 40, hashes, 16, "abcd", 83)[0].value
'incomparable'
"""

from __future__ import annotations

import hashlib
from bisect import bisect_left
from functools import lru_cache
from typing import Sequence

from kvobs.prefix_chain import DENSE_BLOCKS, VERSION, grid_points
from kvobs.semconv import PrefixEvidence

_HEX = 2 * 8  # hex digits of one hash prefix
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


def tail_fingerprint(token_ids: Sequence[int]) -> str:
    """16 hex of the tail tokens. CPython's tuple hash of ints does not depend on
    PYTHONHASHSEED; an engine pair on different hash implementations would only see a
    false mismatch, which costs a recompute of the tail, never a wrong read.

    >>> tail_fingerprint([1, 2, 3]) == tail_fingerprint([1, 2, 3]) != tail_fingerprint([1, 2])
    True
    """
    return f"{hash(tuple(token_ids)) & 0xFFFFFFFFFFFFFFFF:016x}"


def encode(
    block_hashes: Sequence[bytes],
    num_tokens: int,
    block_size: int,
    seed: str | None,
    token_ids: Sequence[int] | None = None,
) -> str | None:
    """Digest of the full blocks covering ``num_tokens`` and of the tail tokens after
    them (from ``token_ids``; no tail without them). None if there are no full blocks.

    Runs inside D's ``request_finished``. One hash function per engine means one width
    for every hash, so one join and one strided memoryview slice gather the prefixes
    in C instead of one Python slice per checkpoint."""
    num_blocks = min(len(block_hashes), num_tokens // block_size)
    if num_blocks <= 0 or not seed:
        return None
    tail = num_tokens - num_blocks * block_size
    if tail and token_ids is not None and len(token_ids) >= num_tokens:
        head = f"{VERSION}:{block_size}:{seed}:{num_blocks}:{tail}:" + tail_fingerprint(
            token_ids[num_blocks * block_size : num_tokens]
        )
    else:
        head = f"{VERSION}:{block_size}:{seed}:{num_blocks}:0:"
    width = len(block_hashes[0])
    if type(block_hashes) is list and width and not width % _PREFIX_BYTES:
        if num_blocks <= DENSE_BLOCKS:  # every block is a checkpoint
            picked = block_hashes[:num_blocks]
        else:
            picked = [block_hashes[n - 1] for n in grid_points(num_blocks)]
        joined = b"".join(picked)
        if len(joined) == width * len(picked):
            hexed = memoryview(joined).cast("Q")[:: width // _PREFIX_BYTES].tobytes().hex()
            return f"{head}:{hexed}"
    hexed = b"".join([block_hashes[n - 1][:_PREFIX_BYTES] for n in grid_points(num_blocks)]).hex()
    return f"{head}:{hexed}"


@lru_cache(maxsize=64)
def _head(block_size: int, seed: str) -> str:
    return f"{VERSION}:{block_size}:{seed}:"


_ABSENT, _INCOMPARABLE = PrefixEvidence.ABSENT, PrefixEvidence.INCOMPARABLE
_MATCH, _MISMATCH = PrefixEvidence.MATCH, PrefixEvidence.MISMATCH


def compare(
    digest: str | None,
    block_hashes: Sequence[bytes],
    block_size: int,
    seed: str | None,
    limit_tokens: int,
    token_ids: Sequence[int] | None = None,
) -> tuple[PrefixEvidence, int]:
    """Compare D's digest with P's hashes (and P's ``token_ids`` for the tail) over
    ``[0, limit_tokens)``.

    Returns the evidence and the number of tokens verified to match: full blocks, plus
    D's tail when P's prompt covers it and it agrees; on a mismatch, the longest prefix
    still verified (whole blocks).
    """
    if not digest:
        return _ABSENT, 0
    head = _head(block_size, seed) if seed else None
    if head is not None and digest.startswith(head):
        # Runs inside P's matching hook: same version, block size and seed as ours, so
        # read the counts and the hex in place instead of splitting a copy.
        colon = digest.index(":", len(head))
        d_count = int(digest[len(head) : colon])
        tail_colon = digest.index(":", colon + 1)
        d_tail = int(digest[colon + 1 : tail_colon])
        base = digest.index(":", tail_colon + 1) + 1
        d_tail_hex = digest[tail_colon + 1 : base - 1]
        hexed = digest
    else:
        version, d_block_size, d_seed, d_blocks, d_tail_blocks, d_tail_hex, hexed = digest.split(
            ":", 6
        )
        if version != VERSION:  # another kvobs on D: its checkpoints mean other counts
            return _INCOMPARABLE, 0
        if int(d_block_size) != block_size or not seed or d_seed != seed:
            return _INCOMPARABLE, 0
        d_count, d_tail, base = int(d_blocks), int(d_tail_blocks), 0
    usable = min(len(block_hashes), limit_tokens // block_size)
    if d_count <= DENSE_BLOCKS:  # checkpoints 1..d_count: no list, no bisect
        if len(hexed) - base != d_count * _HEX:
            raise ValueError("digest checkpoints do not match its block count")
        n = min(d_count, usable)  # checkpoints P can check
        last = n
        counts = None
    else:
        counts = grid_points(d_count)
        if len(hexed) - base != len(counts) * _HEX:
            raise ValueError("digest checkpoints do not match its block count")
        n = bisect_left(counts, usable + 1)
        last = counts[n - 1] if n > 0 else 0
    if n <= 0:
        return _INCOMPARABLE, 0
    # Chained hashes: agreement at a checkpoint implies agreement at all earlier ones.
    # So the last checkpoint alone decides the usual turn (one probe), and otherwise the
    # first disagreeing one is found by bisection, reading only the probed entries.
    at = base + (n - 1) * _HEX
    if block_hashes[last - 1][:_PREFIX_BYTES].hex() == hexed[at : at + _HEX]:
        verified = last * block_size
        end = verified + d_tail
        if (
            d_tail
            and last == d_count
            and token_ids is not None
            and limit_tokens >= end
            and len(token_ids) >= end
        ):
            if tail_fingerprint(token_ids[verified:end]) != d_tail_hex:
                return _MISMATCH, verified
            return _MATCH, end
        return _MATCH, verified
    if counts is None:
        counts = grid_points(d_count)
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) // 2
        at = base + mid * _HEX
        if block_hashes[counts[mid] - 1][:_PREFIX_BYTES].hex() != hexed[at : at + _HEX]:
            hi = mid
        else:
            lo = mid + 1
    matched = counts[lo - 1] * block_size if lo else 0
    return (_MATCH if lo == n else _MISMATCH), matched
