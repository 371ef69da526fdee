"""Spans from a trace store's HTTP API: Grafana Tempo or Jaeger (query service).

``tempo+http://[USER:PASSWORD@]HOST:3200[/PREFIX]?...`` and
``jaeger+http://[USER:PASSWORD@]HOST:16686[/PREFIX]?...`` (``+https`` for TLS) with, in
the query string:

- ``trace=ID`` (repeatable): these traces (Tempo ``GET /api/traces/ID``, Jaeger
  ``GET /api/traces/ID``);
- else a search over a time range, each trace found then read whole: ``since=1h``
  (default; as ``kvobs report --since``: ``30min``, ``1h30m``, ``7d``, an ISO-8601
  instant; a bare number is seconds) or ``start=``/``end=`` (Unix seconds), ``limit=``
  traces (default 1000); Tempo: ``q=`` a TraceQL query (default ``{}``: every trace);
  Jaeger: ``service=`` (repeatable; default every service ``/api/services`` lists);
- ``timeout=`` the most one answer may take, whole (default 60 s; a server that trickles
  its answer is cut off there: ``_http``);
- Tempo: ``tenant=`` the ``X-Scope-OrgID`` header of a multi-tenant Tempo (else
  ``KVOBS_TEMPO_TENANT``).

Credentials: ``USER:PASSWORD@`` in the URL (basic auth; taken out of the host name), else
a bearer token from ``KVOBS_TEMPO_TOKEN`` / ``KVOBS_JAEGER_TOKEN``, else basic auth from
``KVOBS_TEMPO_USER`` and ``KVOBS_TEMPO_PASSWORD`` / ``KVOBS_JAEGER_USER`` and
``KVOBS_JAEGER_PASSWORD`` (``ENV``). Never shown in messages.

The answers are OTLP JSON (Tempo: ``batches``, ids in base64; Jaeger v2's ``/api/v3``:
``{"result": {"resourceSpans": ...}}``, one per line) and Jaeger's trace JSON (``data``:
spans with tags, processes), read by the same rows as span files. An answer of any other
shape is a source error naming the shape it has (exit 2).
"""

from __future__ import annotations

import base64
import json
import os
import time
import urllib.parse
from typing import Iterator

from kvobs._progress import progress
from kvobs.sources import _http
from kvobs.sources._decode import bounded_problems
from kvobs.sources._errors import SourceError
from kvobs.sources._rows import document_kind, rows
from kvobs.sources.otlp_json import DocumentSource

SCHEMES = ("tempo+http://", "tempo+https://", "jaeger+http://", "jaeger+https://")
DEFAULT_SINCE_S = 3600
DEFAULT_LIMIT = 1000
_MICROS = 1_000_000
# The environment's credentials and tenant, per API (``ENV[kind][what]``).
ENV = {
    "tempo": {
        "user": "KVOBS_TEMPO_USER",
        "password": "KVOBS_TEMPO_PASSWORD",
        "token": "KVOBS_TEMPO_TOKEN",
        "tenant": "KVOBS_TEMPO_TENANT",
    },
    "jaeger": {
        "user": "KVOBS_JAEGER_USER",
        "password": "KVOBS_JAEGER_PASSWORD",
        "token": "KVOBS_JAEGER_TOKEN",
    },
}
TENANT_HEADER = "X-Scope-OrgID"


def seconds(text: str) -> float:
    """A duration as seconds (``_parsed``); ValueError otherwise, or for an instant."""
    parsed = _parsed(text)
    if not isinstance(parsed, float):
        raise ValueError(f"{text!r} is an instant, not a duration")
    return parsed


def _parsed(text: str):
    """Seconds for a duration, the instant itself for an ISO-8601 instant: a bare number
    is seconds, anything else what ``kvobs report --since`` takes
    (``kvobs.fleet.since.parse_since``: ``30min``, ``1h30m``, ``7d``). ValueError
    otherwise, saying what is accepted."""
    try:
        value = float(text)
    except ValueError:
        from kvobs.fleet.since import parse_since  # pandas: only for a duration's text

        parsed = parse_since(text)
        return parsed.total_seconds() if hasattr(parsed, "total_seconds") else parsed
    if not 0 <= value < float("inf"):
        raise ValueError(f"{text!r} is not a duration")
    return value


def _start(since: str, end: float) -> float:
    """``since=``: a duration back from ``end``, or an ISO-8601 instant."""
    parsed = _parsed(since)
    return end - parsed if isinstance(parsed, float) else parsed.value / 1e9


def shape(value: object) -> str:
    """What a JSON value is, in a few words, for a message."""
    if isinstance(value, dict):
        keys = ", ".join(sorted(map(str, value))[:6]) + (", ..." if len(value) > 6 else "")
        return f"an object with keys {keys}" if value else "an empty object"
    if isinstance(value, list):
        return f"a list of {len(value)} item(s)"
    if isinstance(value, str):
        return f"a string ({value[:40]!r})"
    if value is None:
        return "null"
    return f"{type(value).__name__} {value!r}"[:60]


class TraceApiSource(DocumentSource):
    """A ``SpanSource`` over Tempo's or Jaeger's HTTP query API."""

    def __init__(self, url: str):
        super().__init__()
        parsed = urllib.parse.urlparse(url)
        self.kind, _, scheme = parsed.scheme.partition("+")
        if self.kind not in ("tempo", "jaeger") or scheme not in ("http", "https"):
            raise SourceError(f"{url}: not a tempo+http(s):// or jaeger+http(s):// URL")
        host = parsed.netloc.rpartition("@")[2]  # credentials are no part of the name
        shown = f"{self.kind}+{scheme}://{host}{parsed.path}"
        try:
            parsed.port  # noqa: B018 (raises on a port that is no number)
        except ValueError as error:
            raise SourceError(f"{shown}: {error}") from error
        if not parsed.hostname:
            raise SourceError(f"{shown}: no host")
        self.base = f"{scheme}://{host}{parsed.path.rstrip('/')}"
        self.location = f"{self.kind}+{self.base}"
        query = urllib.parse.parse_qs(parsed.query)
        self.trace_ids = query.get("trace", [])
        self.query_text = query.get("q", ["{}"])[0]
        self.services = query.get("service", [])
        try:
            self.end = float(query["end"][0]) if "end" in query else time.time()
            self.start = (
                float(query["start"][0])
                if "start" in query
                else _start(query.get("since", [str(DEFAULT_SINCE_S)])[0], self.end)
            )
            self.limit = int(query.get("limit", [DEFAULT_LIMIT])[0])
            self.timeout_s = (
                seconds(query["timeout"][0]) if "timeout" in query else _http.TOTAL_TIMEOUT_S
            )
            if not self.timeout_s > 0:
                raise ValueError("timeout=0: no answer could arrive")
        except ValueError as error:
            raise SourceError(f"{shown}: bad time range, limit or timeout ({error})") from error
        self.headers = {"Accept": "application/json"}
        env = ENV[self.kind]
        tenant = query.get("tenant", [os.environ.get(env.get("tenant", ""), "")])[0]
        if tenant:
            self.headers[TENANT_HEADER] = tenant
        self.secret_headers = _auth(parsed, env)

    # ----------------------------------------------------------------- HTTP

    def _get(self, path: str, params: dict | None = None, missing_ok: bool = False):
        url = (
            self.base + path + ("?" + urllib.parse.urlencode(params, doseq=True) if params else "")
        )
        try:
            answer = _http.get(url, self.headers, self.secret_headers, self.timeout_s)
        except TimeoutError as error:
            raise SourceError(
                f"{self.location}: {path}: {error} (timeout= in the URL sets it)"
            ) from error
        except OSError as error:
            reason = getattr(error, "reason", error)
            raise SourceError(f"{self.location}: cannot connect ({reason})") from error
        if missing_ok and answer.status == 404:
            return None
        if not 200 <= answer.status < 300:
            text = answer.body.decode("utf-8", errors="replace").strip()
            hint = (
                " (credentials: USER:PASSWORD@ in the URL, or "
                f"{' / '.join(ENV[self.kind][k] for k in ('token', 'user'))})"
                if answer.status in (401, 403)
                else ""
            )
            raise SourceError(
                f"{self.location}: {path}: HTTP {answer.status} "
                f"{answer.reason}{': ' + text if text else ''}{hint}"
            )
        return _json(answer.body, f"{self.location}: {path}")

    def _expect(self, path: str, answer: object, what: str) -> SourceError:
        return SourceError(f"{self.location}: {path} answered {shape(answer)}, not {what}")

    def check(self) -> None:
        """Raise ``SourceError`` unless the API answers (commands fail with a message)."""
        self._found_trace_ids()

    # ----------------------------------------------------------------- documents

    def _found_trace_ids(self) -> list[str]:
        if self.trace_ids:
            return list(self.trace_ids)
        if self._ids is None:
            self._ids = self._tempo_search() if self.kind == "tempo" else self._jaeger_search()
        return self._ids

    _ids: list[str] | None = None
    _jaeger_traces: dict | None = None

    def _tempo_search(self) -> list[str]:
        answer = self._get(
            "/api/search",
            {
                "q": self.query_text,
                "start": int(self.start),
                "end": int(self.end) + 1,
                "limit": self.limit,
            },
        )
        what = 'Tempo\'s search answer ({"traces": [{"traceID": ...}]})'
        if not isinstance(answer, dict) or not ({"traces", "metrics"} & set(answer)):
            raise self._expect("/api/search", answer, what)
        traces = answer.get("traces")
        traces = [] if traces is None else traces
        if not isinstance(traces, list) or not all(
            isinstance(t, dict) and isinstance(t.get("traceID"), str) for t in traces
        ):
            raise self._expect("/api/search", traces, what + ": traces")
        return [t["traceID"] for t in traces]

    def _jaeger_data(self, path: str, params: dict | None, what: str, good) -> list:
        """The ``data`` list of a Jaeger answer, ``good(item)`` for each item."""
        answer = self._get(path, params)
        what = f'Jaeger\'s answer ({{"data": [{what}, ...]}})'
        if not isinstance(answer, dict) or "data" not in answer:
            raise self._expect(path, answer, what)
        data = [] if answer["data"] is None else answer["data"]
        if not isinstance(data, list) or not all(good(item) for item in data):
            raise self._expect(path, data, what + ": data")
        return data

    def _jaeger_search(self) -> list[str]:
        """Jaeger's search answers whole traces: kept, so each is fetched once."""
        services = self.services or self._jaeger_data(
            "/api/services", None, "SERVICE", lambda item: isinstance(item, str)
        )
        self._jaeger_traces = {}
        for service in services:
            for trace in self._jaeger_data(
                "/api/traces",
                {
                    "service": service,
                    "start": int(self.start * _MICROS),
                    "end": int(self.end * _MICROS),
                    "limit": self.limit,
                },
                '{"traceID": ...}',
                lambda item: isinstance(item, dict) and isinstance(item.get("traceID"), str),
            ):
                # a trace touching two services comes twice
                self._jaeger_traces.setdefault(trace.get("traceID"), trace)
        return list(self._jaeger_traces)

    def _rows(self) -> Iterator[dict]:
        found = self._found_trace_ids()
        # One request per trace (up to limit=, 1000 by default): seconds to minutes.
        with progress(f"reading traces from {self.location}", len(found)) as shown:
            for trace_id in found:
                yield from self._trace_rows(trace_id)
                shown.advance()

    def _trace_rows(self, trace_id: str) -> Iterator[dict]:
        """One trace's rows (none, reported, when the API no longer has it)."""
        where = f"{self.location} trace {trace_id}"
        if self._jaeger_traces and trace_id in self._jaeger_traces:
            document = {"data": [self._jaeger_traces[trace_id]]}
        else:
            path = f"/api/traces/{urllib.parse.quote(str(trace_id), safe='')}"
            params = (
                {"start": int(self.start), "end": int(self.end) + 1}
                if self.kind == "tempo" and not self.trace_ids
                else None
            )
            document = self._get(path, params, missing_ok=True)
        if document is None:
            self.problems.append(f"{where}: not found")
            return
        if document_kind(document) is None:
            raise self._expect(path, document, "a trace (OTLP, Tempo or Jaeger JSON)")
        with bounded_problems(self.problems, where) as found:
            yield from rows(where, document, found)


def _auth(parsed: urllib.parse.ParseResult, env: dict[str, str]) -> dict[str, str]:
    """The ``Authorization`` header: the URL's user and password, else the environment's
    token, else its user and password (``ENV``); none without credentials."""
    user = urllib.parse.unquote(parsed.username or "")
    password = urllib.parse.unquote(parsed.password or "")
    if not user:
        token = os.environ.get(env["token"])
        if token:
            return {"Authorization": f"Bearer {token}"}
        user, password = os.environ.get(env["user"], ""), os.environ.get(env["password"], "")
    if not user:
        return {}
    basic = base64.b64encode(f"{user}:{password}".encode()).decode("ascii")
    return {"Authorization": f"Basic {basic}"}


def _json(body: bytes, where: str) -> object:
    """One JSON document, or the lines of a stream (Jaeger's ``/api/v3``: one
    ``{"result": ...}`` per line) as a list."""
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as error:
        lines = [line for line in body.split(b"\n") if line.strip()]
        if len(lines) > 1:
            try:
                return [json.loads(line) for line in lines]
            except (ValueError, RecursionError):
                pass
        raise SourceError(f"{where}: not JSON ({error})") from error
