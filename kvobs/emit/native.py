"""The compiled decoder of OTLP/protobuf trace requests (``_otlp_native.c``): the store's
line and the spans' rows in one walk of the request's bytes, for ``collect.decode``.

A fast path of the Python one (``otlp_json.request_json`` then ``json_line`` for the line,
``kvobs.sources._rows`` for the rows), never a second set of rules: it gives the same line
and rows (tests/emit/test_ingest_decode.py holds them equal), and None for anything
outside the shapes it knows, where the Python path decides. ``decode`` is None where the
extension was not built (a source install without a C compiler): the Python path then
does everything, as before.
"""

from __future__ import annotations

from typing import Callable

from kvobs.emit.otlp_json import SPAN_KIND_NAMES, STATUS_CODE_NAMES
from kvobs.sources import _rows

Decode = Callable[[bytes], "tuple[str, list[dict]] | None"]


def _by_number(names: dict[int, str]) -> tuple[str, ...]:
    """An enum's names as a tuple indexed by number (OTLP's enums number from 0 on)."""
    assert sorted(names) == list(range(len(names))), names
    return tuple(names[number] for number in range(len(names)))


_missing: str | None = None  # why the compiled decoder is not there


def _configured() -> Decode | None:
    global _missing
    try:
        from kvobs.emit import _otlp_native
    except ImportError as error:
        _missing = str(error)
        return None
    _otlp_native.configure(
        *_rows.otlp_row_names(),
        _by_number(SPAN_KIND_NAMES),
        _by_number(STATUS_CODE_NAMES),
    )
    return _otlp_native.decode


decode: Decode | None = _configured()


def described() -> str:
    """Which decoder takes OTLP/protobuf requests, for the service's start-up log."""
    if decode is not None:
        return "the compiled decoder"
    return (
        f"the Python decoder (the compiled one was not built: {_missing}; "
        "reinstall kvobs where a C compiler and Python's headers are)"
    )
