"""A conversation that comes back after it left the classifier's window, recalled from
the span store's live segments: its tagged spans and every span of their traces (what
``select_conversation`` selects for ``diagnose``), so that its turns are classified over
the same spans as the batch, not from the new turn alone.

A segment holds export requests of many conversations, as JSON lines. A line is parsed
only where it names a wanted conversation (its id, as the line writes it) or, in a second
scan, one of their traces. What a line names is cut out of its text where kvobs' writers
put it (``"traceId":"..."``, the conversation id attribute's value): a split costs a
small fraction of a parse, whatever the number of ids wanted; a line laid out otherwise
(another writer) is searched for each id. So recalling reads the segments written since
the conversation began but parses only the lines that hold its spans. Run off the event
loop (``Live``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from kvobs import semconv as sc
from kvobs.emit.otlp_json import json_line, loads
from kvobs.emit.segments import segment_lines, written_since
from kvobs.sources._rows import rows as document_rows

_CID = sc.CONVERSATION_ID.key


@dataclass
class Recalled:
    spans: dict[str, list[dict]] = field(default_factory=dict)  # id -> its spans (rows)
    # When the earliest segment a recalled span came from was last written: they count as
    # received then (``SpanBuffer.held_since``: a restart replays that segment again).
    received: float | None = None
    unreadable: int = 0  # lines that named a wanted id or trace but did not parse


def recall(
    store_dir: str, since: dict[str, float], named: dict[str, str] | None = None
) -> Recalled:
    """The spans of each conversation in ``since`` (id -> when it began, Unix seconds on
    the service's clock) in the live segments written since then: its tagged spans, the
    spans ``named`` for it (span id -> conversation: those its stored turns name as
    evidence, such as the export of a turn of another conversation that one extends),
    and every span of their traces."""
    named = named or {}
    found = Recalled({cid: [] for cid in since})
    if not since:
        return found
    segments = written_since(store_dir, min(since.values()))
    ids = {json_line(cid)[0][1:-1] for cid in since}  # as a line writes them
    traces: dict[str, str] = {}  # trace id -> the wanted conversation whose trace it is
    for _, row in _matching(segments, ids, set(named), None, _SPAN_AT):
        trace = row.get("trace_id")
        owner = cid if (cid := row.get(_CID)) in since else named.get(row.get("span_id"))
        if owner is not None and trace is not None:
            traces.setdefault(trace, owner)
    seen: set[tuple] = set()
    for written, row in _matching(segments, ids, set(traces), found):
        cid = row.get(_CID)
        owner = cid if cid in since else traces.get(row.get("trace_id"))
        key = (row.get("trace_id"), row.get("span_id"))
        if owner is None or key in seen:
            continue
        seen.add(key)
        found.spans[owner].append(row)
        found.received = written if found.received is None else min(found.received, written)
    return found


def _matching(
    segments: list[tuple[str, float]],
    ids: set[str],
    traces: set[str],
    found: Recalled | None,
    traces_at: str | None = None,
):
    """(segment's time, row) of every span of the lines that name one of ``ids``
    (conversation ids, as lines write them) or ``traces`` (trace ids; span ids with
    ``traces_at`` = ``_SPAN_AT``); ``found`` counts the lines that do but do not parse."""
    traces_at = traces_at or _TRACE_AT
    # A segment expired or sealed away meanwhile is skipped: what is left is recalled.
    for written, line in segment_lines(segments, lambda _path, _error: None):
        ours = _TRACE_AT in line  # laid out as kvobs' writers lay it out
        if not (
            _names(line, _ID_AT, ids, ours) or (traces and _names(line, traces_at, traces, ours))
        ):
            continue
        try:
            request = loads(line)
        except ValueError:
            if found is not None:
                found.unreadable += 1
            continue
        for row in document_rows("otlp", request, []):
            yield written, row


# Where kvobs' writers (compact JSON) put a span's trace id and a conversation id.
_TRACE_AT = '"traceId":"'
_SPAN_AT = '"spanId":"'
_ID_AT = '{"key":"' + _CID + '","value":{"stringValue":"'
# Up to this many names a line is searched for each (bench/recall_bench.py: one search of
# a segment costs about an eighth of cutting it). A service recalls RECALL_ROUND (8)
# conversations at a time; their traces are many more.
_SEARCHED = 8
_JSON_STRING = re.compile(r'(?:[^"\\]|\\.)*')


def _names(line: str, at: str, wanted: set[str], ours: bool) -> bool:
    """Whether ``line`` names one of ``wanted`` where ``at`` leads to it (``ours``: the
    line is laid out as kvobs' writers lay it out). A few names are searched for where
    they are in the text (each search a fast scan); more, by cutting the line at ``at``
    once (a scan and a copy, whatever their number). A line laid out otherwise is
    searched for each."""
    if not ours or len(wanted) <= _SEARCHED:
        return any(name in line for name in wanted)
    # _JSON_STRING matches every text (possibly empty): the name up to its closing quote
    return any(_JSON_STRING.match(part).group() in wanted for part in line.split(at)[1:])  # type: ignore[union-attr]
