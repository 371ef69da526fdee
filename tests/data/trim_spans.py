"""Trim a testbed run's span files into one OTLP-JSON-lines fixture: the span fields and
the attributes kvobs reads (``semconv.ATTRIBUTES``), ``service.name`` as the only
resource attribute; ids, numbers and enum values only (HTTP attributes such as
``url.full`` and ``user_agent.original`` are dropped).

    python tests/data/trim_spans.py RUN/spans tests/data/demo-spans.otlp.jsonl
"""

from __future__ import annotations

import glob
import json
import os
import sys

from kvobs import semconv as sc

SPAN_FIELDS = ("traceId", "spanId", "parentSpanId", "name", "startTimeUnixNano",
               "endTimeUnixNano", "status")


def _span(span: dict) -> dict:
    kept = {key: span[key] for key in SPAN_FIELDS if span.get(key) not in (None, {}, "")}
    kept["attributes"] = [a for a in span.get("attributes", ()) if a["key"] in sc.ATTRIBUTES]
    return kept


def trimmed(line: str) -> str:
    request = json.loads(line)
    return json.dumps({"resourceSpans": [{
        "resource": {"attributes": [a for a in resource["resource"]["attributes"]
                                    if a["key"] == "service.name"]},
        "scopeSpans": [{"scope": scope.get("scope", {}),
                        "spans": [_span(span) for span in scope["spans"]]}
                       for scope in resource["scopeSpans"]]}
        for resource in request["resourceSpans"]]}, separators=(",", ":"))


def main(spans_dir: str, out: str) -> None:
    with open(out, "w", encoding="utf-8") as handle:
        for path in sorted(glob.glob(os.path.join(spans_dir, "*"))):
            with open(path, encoding="utf-8") as lines:
                handle.writelines(trimmed(line) + "\n" for line in lines if line.strip())


if __name__ == "__main__":
    main(*sys.argv[1:])
