"""A conversation that comes back after it left the classifier's window, recalled from
the span store's live segments: its tagged spans and every span of their traces (what
``select_conversation`` selects for ``diagnose``), so that its turns are classified over
the same spans as the batch, not from the new turn alone.

A segment holds export requests of many conversations, as JSON lines. A line is parsed
only where it names a wanted conversation (its id, as the line writes it) or, in a second
scan, one of their traces (ids are hex in the line): a substring search costs a small
fraction of a parse, so recalling reads the segments written since the conversation began
but parses only its own lines. Run off the event loop (``Live``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvobs import semconv as sc
from kvobs.emit.otlp_json import json_line, loads
from kvobs.emit.segments import written_since
from kvobs.sources._rows import rows as document_rows

_CID = sc.CONVERSATION_ID.key


@dataclass
class Recalled:
    spans: dict[str, list[dict]] = field(default_factory=dict)  # id -> its spans (rows)
    # When the earliest segment a recalled span came from was last written: they count as
    # received then (``SpanBuffer.held_since``: a restart replays that segment again).
    received: float | None = None
    unreadable: int = 0  # lines that named a wanted id or trace but did not parse


def recall(store_dir: str, since: dict[str, float]) -> Recalled:
    """The spans of each conversation in ``since`` (id -> when it began, Unix seconds on
    the service's clock) in the live segments written since it began."""
    found = Recalled({cid: [] for cid in since})
    if not since:
        return found
    segments = written_since(store_dir, min(since.values()))
    needles = {cid: json_line(cid)[0][1:-1] for cid in since}
    traces: dict[str, str] = {}  # trace id -> the wanted conversation whose trace it is
    for _, row in _matching(segments, needles.values(), found):
        if (cid := row.get(_CID)) in needles and row.get("trace_id") is not None:
            traces.setdefault(row["trace_id"], cid)
    seen: set[tuple] = set()
    for written, row in _matching(segments, [*needles.values(), *traces], found):
        cid = row.get(_CID)
        owner = cid if cid in needles else traces.get(row.get("trace_id"))
        key = (row.get("trace_id"), row.get("span_id"))
        if owner is None or key in seen:
            continue
        seen.add(key)
        found.spans[owner].append(row)
        found.received = written if found.received is None else min(found.received, written)
    return found


def _matching(segments: list[tuple[str, float]], needles, found: Recalled):
    """(segment's time, row) of every span of the lines holding one of ``needles``."""
    needles = list(needles)
    for path, written in segments:
        try:
            with open(path, encoding="utf-8", errors="replace") as handle:
                for line in handle:
                    if not any(needle in line for needle in needles):
                        continue
                    try:
                        request = loads(line)
                    except ValueError:
                        found.unreadable += 1
                        continue
                    for row in document_rows("otlp", request, []):
                        yield written, row
        except OSError:
            continue  # expired or sealed away meanwhile: what is left is recalled
