"""How kvobs's batch commands allocate: a fleet report makes and frees gigabytes of
column arrays, and on the 2-core VM of bench/README.md handing that memory back to the
OS and faulting it in again cost more than the report's own arithmetic.

``prefer_c_allocator``: Arrow allocates through the C library (its default, mimalloc,
returned large blocks to the OS each time: `kvobs report` over 1.35M turns spent 9-15 s
in the kernel, 2.5-4 s this way). ``keep_freed_memory``: glibc keeps freed blocks for
the next array instead of unmapping them (7-8 s instead of 10 s wall for that report).
Both leave a choice the user made alone, and do nothing where they do not apply.
"""

from __future__ import annotations

import os

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD = 1 << 30  # below it, a freed array's memory stays for reuse
_TRIM_THRESHOLD = 16 << 30  # free heap top kept rather than given back


def prefer_c_allocator() -> None:
    """Before pyarrow loads: Arrow's default pool is the C library's, unless
    ``ARROW_DEFAULT_MEMORY_POOL`` says otherwise."""
    os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "system")


def keep_freed_memory() -> bool:
    """For a process that builds one big table and exits (``kvobs report``, ``tune``,
    ``whatif``; never a server): glibc reuses freed arrays' memory instead of mapping
    fresh pages for each. False where it does not apply (another C library) or when the
    user tuned glibc (``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_``)."""
    mallopt = _mallopt()
    if mallopt is None:
        return False
    # The threshold first: a trim threshold set alone also fixes the mmap threshold at
    # its 128 KiB default, and every array is then mapped afresh (slower than neither).
    return bool(
        mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)
    )


# A batched read's arrays (a few MiB each) above this are mapped and unmapped each time.
_BATCH_MMAP_THRESHOLD = 1 << 20


def return_freed_memory() -> bool:
    """For a process that reads in bounded batches (``kvobs report`` over turn rows): a
    fixed mmap threshold of 1 MiB, so each batch's arrays go back to the OS when freed.
    glibc's default threshold grows with the largest block freed, and the batches'
    arrays then come from a heap that fragments: a report's peak grew 1.26x from 1M to
    10M turns that way, 1.10x with this (bench/README.md), for more page faults. False
    where it does not apply or the user tuned glibc, as ``keep_freed_memory``."""
    mallopt = _mallopt()
    return mallopt is not None and bool(mallopt(_M_MMAP_THRESHOLD, _BATCH_MMAP_THRESHOLD))


def _mallopt():
    """glibc's ``mallopt``; None with another C library or when the user tuned glibc
    (``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_``)."""
    if os.environ.keys() & {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"}:
        return None
    import ctypes  # here: every command imports this module, few need mallopt
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return None
