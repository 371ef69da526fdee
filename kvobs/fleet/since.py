"""``--since``: how far back a fleet view looks, parsed by pandas (one parser for the CLI
and the library)."""

from __future__ import annotations

import re

import pandas as pd

# pandas deprecates the lower-case day and week units ("7d", "2w"): said the supported way.
_LOWER_UNIT = re.compile(r"(?<=[\d.\s])([dw])(?![a-z])")


def parse_since(text: str) -> pd.Timedelta | pd.Timestamp:
    """A positive duration back from the newest turn, in pandas' Timedelta syntax, or an
    ISO-8601 instant (UTC unless it names a zone). Raises ValueError saying what is
    accepted.

    >>> parse_since("1h30m"), parse_since("30min"), parse_since("7d")
    (Timedelta('0 days 01:30:00'), Timedelta('0 days 00:30:00'), Timedelta('7 days 00:00:00'))
    >>> parse_since("2026-12-01T08:00")
    Timestamp('2026-12-01 08:00:00+0000', tz='UTC')
    """
    accepted = (
        "a duration such as 90s, 30min, 1h30m, 7d, or an ISO-8601 instant such as 2026-12-01T08:00Z"
    )
    text = text.strip()
    if re.fullmatch(r"[-+]?[\d.]+", text):
        raise ValueError(f"{text!r} has no unit: {accepted}")
    try:
        delta = pd.Timedelta(_LOWER_UNIT.sub(lambda m: m.group(1).upper(), text))
    except ValueError:
        delta = None
    if delta is not None and not pd.isna(delta):
        if delta <= pd.Timedelta(0):
            raise ValueError(f"{text!r} is not a positive duration: {accepted}")
        return delta
    try:
        instant = pd.Timestamp(text)
    except ValueError:
        instant = None
    if instant is None or pd.isna(instant):
        raise ValueError(f"{text!r} is not {accepted}")
    return instant.tz_localize("UTC") if instant.tzinfo is None else instant


def since_cutoff_ns(newest_ns: int, since: str | None) -> int | None:
    """The first turn start (ns) ``since`` keeps: a duration counts back from
    ``newest_ns`` (the newest turn in the source)."""
    if not since:
        return None
    parsed = parse_since(since)
    if isinstance(parsed, pd.Timedelta):
        return int(newest_ns - parsed.value)
    return int(parsed.value)
