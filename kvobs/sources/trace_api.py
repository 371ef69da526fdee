"""Spans from a trace store's HTTP API: Grafana Tempo or Jaeger (query service).

``tempo+http://HOST:3200[/PREFIX]?...`` and ``jaeger+http://HOST:16686[/PREFIX]?...``
(``+https`` for TLS) with, in the query string:

- ``trace=ID`` (repeatable): these traces (Tempo ``GET /api/traces/ID``, Jaeger
  ``GET /api/traces/ID``);
- else a search over a time range, each trace found then read whole: ``since=1h``
  (default; also ``30m``, ``7d``, seconds) or ``start=``/``end=`` (Unix seconds),
  ``limit=`` traces (default 1000); Tempo: ``q=`` a TraceQL query (default ``{}``: every
  trace); Jaeger: ``service=`` (repeatable; default every service ``/api/services``
  lists).

The answers are OTLP JSON (Tempo: ``batches``, ids in base64) and Jaeger's trace JSON
(``data``: spans with tags, processes), read by the same rows as span files.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Iterator

from kvobs.sources import SourceError
from kvobs.sources._rows import rows
from kvobs.sources.otlp_json import DocumentSource

SCHEMES = ("tempo+http://", "tempo+https://", "jaeger+http://", "jaeger+https://")
DEFAULT_SINCE_S = 3600
DEFAULT_LIMIT = 1000
TIMEOUT_S = 60
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_MICROS = 1_000_000


def seconds(text: str) -> float:
    """``90``, ``90s``, ``30m``, ``24h``, ``7d`` as seconds (ValueError otherwise)."""
    text = text.strip()
    unit = _UNITS.get(text[-1:]) if text[-1:].isalpha() else 1
    if unit is None:
        raise ValueError(text)
    value = float(text[:-1] if text[-1:].isalpha() else text)
    if not value >= 0 or value == float("inf"):
        raise ValueError(text)
    return value * unit


class TraceApiSource(DocumentSource):
    """A ``SpanSource`` over Tempo's or Jaeger's HTTP query API."""

    def __init__(self, url: str):
        super().__init__()
        parsed = urllib.parse.urlparse(url)
        self.kind, _, scheme = parsed.scheme.partition("+")
        if self.kind not in ("tempo", "jaeger") or scheme not in ("http", "https"):
            raise SourceError(f"{url}: not a tempo+http(s):// or jaeger+http(s):// URL")
        if not parsed.hostname:
            raise SourceError(f"{url}: no host")
        self.base = f"{scheme}://{parsed.netloc}{parsed.path.rstrip('/')}"
        self.location = f"{self.kind}+{self.base}"
        query = urllib.parse.parse_qs(parsed.query)
        self.trace_ids = query.get("trace", [])
        self.query_text = query.get("q", ["{}"])[0]
        self.services = query.get("service", [])
        try:
            now = time.time()
            self.end = float(query["end"][0]) if "end" in query else now
            self.start = (float(query["start"][0]) if "start" in query
                          else self.end - seconds(query.get("since", [str(DEFAULT_SINCE_S)])[0]))
            self.limit = int(query.get("limit", [DEFAULT_LIMIT])[0])
        except ValueError as error:
            raise SourceError(f"{url}: bad time range or limit ({error})") from error

    # ----------------------------------------------------------------- HTTP

    def _get(self, path: str, params: dict | None = None, missing_ok: bool = False):
        url = self.base + path + ("?" + urllib.parse.urlencode(params, doseq=True)
                                  if params else "")
        request = urllib.request.Request(url, headers={"Accept": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:  # noqa: S310
                body = response.read()
        except urllib.error.HTTPError as error:
            if missing_ok and error.code == 404:
                return None
            text = error.read().decode("utf-8", errors="replace").strip()[:300]
            raise SourceError(f"{self.location}: {path}: HTTP {error.code} {error.reason}"
                              f"{': ' + text if text else ''}") from error
        except (urllib.error.URLError, OSError) as error:
            reason = getattr(error, "reason", error)
            raise SourceError(f"{self.location}: cannot connect ({reason})") from error
        try:
            return json.loads(body)
        except (ValueError, RecursionError) as error:
            raise SourceError(f"{self.location}: {path}: not JSON ({error})") from error

    def check(self) -> None:
        """Raise ``SourceError`` unless the API answers (commands fail with a message)."""
        self._found_trace_ids()

    # ----------------------------------------------------------------- documents

    def _found_trace_ids(self) -> list[str]:
        if self.trace_ids:
            return list(self.trace_ids)
        if self._ids is None:
            self._ids = (self._tempo_search() if self.kind == "tempo"
                         else self._jaeger_search())
        return self._ids

    _ids: list[str] | None = None
    _jaeger_traces: dict | None = None

    def _tempo_search(self) -> list[str]:
        answer = self._get("/api/search", {"q": self.query_text, "start": int(self.start),
                                           "end": int(self.end) + 1, "limit": self.limit})
        return [t["traceID"] for t in (answer or {}).get("traces") or () if "traceID" in t]

    def _jaeger_search(self) -> list[str]:
        """Jaeger's search answers whole traces: kept, so each is fetched once."""
        services = self.services or (self._get("/api/services") or {}).get("data") or []
        self._jaeger_traces = {}
        for service in services:
            answer = self._get("/api/traces", {
                "service": service, "start": int(self.start * _MICROS),
                "end": int(self.end * _MICROS), "limit": self.limit})
            for trace in (answer or {}).get("data") or ():
                if isinstance(trace, dict):  # a trace touching two services comes twice
                    self._jaeger_traces.setdefault(trace.get("traceID"), trace)
        return list(self._jaeger_traces)

    def _rows(self) -> Iterator[dict]:
        for trace_id in self._found_trace_ids():
            where = f"{self.location} trace {trace_id}"
            if self._jaeger_traces and trace_id in self._jaeger_traces:
                document = {"data": [self._jaeger_traces[trace_id]]}
            else:
                path = f"/api/traces/{urllib.parse.quote(str(trace_id), safe='')}"
                params = ({"start": int(self.start), "end": int(self.end) + 1}
                          if self.kind == "tempo" and not self.trace_ids else None)
                document = self._get(path, params, missing_ok=True)
            if document is None:
                self.problems.append(f"{where}: not found")
                continue
            yield from rows(where, document, self.problems)
