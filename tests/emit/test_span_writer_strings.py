"""The span writer never loses a neighbour's data (issue 24, item 8).

A string value in a span is written so that it reads back as it was, or, when it is not
valid Unicode (a lone surrogate: a header decoded with surrogateescape), replaced by
U+FFFD and counted; either way every other span of its batch is written and read. A
line break other than "\\n" inside a string (U+2028, U+2029, U+0085) once cut a line, and
the batch of other tenants' spans it carried, in two for the reader."""

from __future__ import annotations

import json
import logging
import random
import urllib.request

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanContext
from test_collect import receiver  # noqa: F401 - the fixture

from kvobs import semconv as sc
from kvobs.emit.otlp_json import OtlpJsonFileExporter, json_line
from kvobs.emit.segments import LiveSegmentWriter
from kvobs.emit.setup import configure_tracing, flush, span_losses
from kvobs.sources import open_source
from kvobs.sources._decode import documents

ODD = "conv\u2028one\u2029two\x85three"  # every raw line break JSON leaves unescaped
# str.splitlines()'s line breaks, every one of them
BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"


def _spans(values: list[dict]) -> list[ReadableSpan]:
    """One finished span per dict of attributes, as the proxy's tracer makes them."""
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "kvobs-proxy"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("kvobs")
    for attributes in values:
        tracer.start_span(sc.SPAN_PROXY_TURN.name, attributes=attributes).end()
    return list(memory.get_finished_spans())


def _tenant(i: int, conversation: str | None = None, model: str = "m",
            agent: str = "curl/8") -> dict:
    return {sc.CONVERSATION_ID.key: conversation or f"c{i}", sc.TURN_INDEX.key: 1,
            sc.TENANT_DIGEST.key: f"t{i}", sc.REQUEST_MODEL.key: model,
            sc.USER_AGENT: agent}


def _export(store, spans) -> OtlpJsonFileExporter:
    exporter = OtlpJsonFileExporter(LiveSegmentWriter(str(store), "kvobs-proxy"))
    assert exporter.export(spans).name == "SUCCESS"
    return exporter


def _attributes(store) -> list[dict]:
    """Every span's attributes as the store's files hold them (any key, not only the
    ones the span table keeps), read by the sources' own decoder."""
    problems: list[str] = []
    out = []
    for path in sorted((store / sc.STORE_LIVE_DIR).iterdir()):
        for _, document in documents(str(path), problems):
            for resource_spans in document["resourceSpans"]:
                for scope_spans in resource_spans["scopeSpans"]:
                    for span in scope_spans["spans"]:
                        out.append({a["key"]: a["value"].get("stringValue")
                                    for a in span.get("attributes", ())})
    assert problems == []
    return out


def _lines(store) -> list[bytes]:
    (path,) = (store / sc.STORE_LIVE_DIR).iterdir()
    data = path.read_bytes()
    text = data.decode()
    # no raw line break but each line's last "\n": a reader splitting at every Unicode
    # line break (str.splitlines) gets the same lines
    assert text.splitlines() == text.split("\n")[:-1] and text.endswith("\n")
    return data.splitlines()


def test_a_line_break_in_one_tenants_values_loses_no_other_tenants_spans(tmp_path):
    store = tmp_path / "store"
    tenants = [_tenant(i) for i in range(10)]
    tenants[3] = _tenant(3, ODD, model="llama\u2028" + BREAKS, agent="ua\u2029\x85")
    exporter = _export(store, _spans(tenants))
    assert len(_lines(store)) == 1  # one batch, one line
    source = open_source(str(store))
    spans = source.spans()
    assert sorted(spans[sc.CONVERSATION_ID.key]) == sorted([ODD] + [f"c{i}" for i in
                                                                   range(10) if i != 3])
    assert source.problems == []
    odd = spans[spans[sc.CONVERSATION_ID.key] == ODD].iloc[0]
    assert odd[sc.REQUEST_MODEL.key] == "llama\u2028" + BREAKS  # round-trips
    agents = [a[sc.USER_AGENT] for a in _attributes(store)]
    assert agents.count("ua\u2029\x85") == 1 and agents.count("curl/8") == 9
    assert (exporter.encoding_losses, exporter.replaced_values) == (0, 0)


def test_a_lone_surrogate_is_replaced_and_counted_and_its_batch_written(tmp_path, caplog):
    store = tmp_path / "store"
    bad = b"Mozilla \xff\xfe".decode("utf-8", "surrogateescape")  # a non-UTF-8 header
    tenants = [_tenant(i) for i in range(5)]
    tenants[2] = _tenant(2, agent=bad)
    tenants[4][sc.SERVER_ADDRESS] = "host\udc80"  # a Host header, the same way
    with caplog.at_level(logging.DEBUG, logger="kvobs.emit"):
        exporter = _export(store, _spans(tenants))
    assert (exporter.encoding_losses, exporter.replaced_values) == (2, 2)
    spans = open_source(str(store)).spans()
    assert sorted(spans[sc.CONVERSATION_ID.key]) == [f"c{i}" for i in range(5)]
    attributes = {a[sc.CONVERSATION_ID.key]: a for a in _attributes(store)}
    assert attributes["c2"][sc.USER_AGENT] == "Mozilla \ufffd\ufffd"
    assert attributes["c4"][sc.SERVER_ADDRESS] == "host\ufffd"
    assert attributes["c0"][sc.USER_AGENT] == "curl/8"
    said = [r.getMessage() for r in caplog.records]
    assert any("not valid Unicode" in m for m in said)
    assert not any("not writable" in m for m in said)  # the real cause, not the disk's
    assert [r.levelno for r in caplog.records].count(logging.WARNING) == 1


def test_a_span_no_json_can_hold_is_left_out_alone(tmp_path):
    store = tmp_path / "store"
    spans = _spans([_tenant(i) for i in range(3)])
    broken = ReadableSpan(name="broken", context=SpanContext(1, 2, False),
                          kind="not a span kind", resource=spans[0].resource)
    exporter = _export(store, spans[:1] + [broken] + spans[1:])
    assert exporter.encoding_losses == 1
    assert sorted(open_source(str(store)).spans()[sc.CONVERSATION_ID.key]) == \
        ["c0", "c1", "c2"]


def test_encoding_losses_are_span_losses_of_the_tracer(tmp_path, monkeypatch):
    for variable in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT",
                     "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(variable, raising=False)
    tracer = configure_tracing(sc.Service.PROXY, str(tmp_path / "store"))
    for i, agent in enumerate(["ok", "bad\ud800", "ok"]):
        tracer.start_span(sc.SPAN_PROXY_TURN.name, attributes=_tenant(i, agent=agent)).end()
    flush(tracer)
    losses = span_losses(tracer)
    assert losses == {"queue-full": 0, "export-failed": 0, "encoding": 1}
    assert set(losses) == set(sc.TELEMETRY_DROP_REASONS)
    assert len(open_source(str(tmp_path / "store")).spans()) == 3


def test_a_write_failure_says_its_cause(tmp_path, caplog):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="kvobs.emit"):
        exporter = OtlpJsonFileExporter(LiveSegmentWriter(str(blocked / "store"), "p"))
        assert exporter.export(_spans([_tenant(0)])).name == "FAILURE"
    assert exporter.encoding_losses == 0
    assert any("not writable" in r.getMessage() for r in caplog.records)


def test_an_older_writers_line_with_raw_separators_is_read_whole(tmp_path):
    """A file an older writer wrote: U+2028 and the others raw inside strings."""
    request = json.loads(json_line({"resourceSpans": []})[0])
    spans = []
    for i, conversation in enumerate([ODD, "c1", "c2"]):
        spans.append({"traceId": f"{i + 1:032x}", "spanId": f"{i + 1:016x}",
                      "name": sc.SPAN_PROXY_TURN.name, "startTimeUnixNano": "1",
                      "endTimeUnixNano": "2", "attributes": [
                          {"key": sc.CONVERSATION_ID.key,
                           "value": {"stringValue": conversation}}]})
    request["resourceSpans"] = [{"resource": {}, "scopeSpans": [{"spans": spans[:2]}]}]
    other = {"resourceSpans": [{"resource": {}, "scopeSpans": [{"spans": spans[2:]}]}]}
    path = tmp_path / "old.otlp.jsonl"
    path.write_text(json.dumps(request, ensure_ascii=False) + "\n"
                    + json.dumps(other, ensure_ascii=False) + "\r\n", encoding="utf-8")
    assert "\u2028" in path.read_text()  # raw, as orjson wrote it
    source = open_source(str(path))
    assert sorted(source.spans()[sc.CONVERSATION_ID.key]) == sorted([ODD, "c1", "c2"])
    assert source.problems == []


def test_collect_writes_the_same_way(receiver, caplog):  # noqa: F811
    url, store = receiver
    caplog.set_level(logging.WARNING, logger="kvobs.collect")
    attributes = [{"key": sc.CONVERSATION_ID.key, "value": {"stringValue": ODD}},
                  {"key": sc.USER_AGENT, "value": {"stringValue": "ua\ud800"}}]
    spans = [{"traceId": "ab" * 16, "spanId": f"{i:016x}", "name": "s",
              "attributes": attributes if i == 1 else []} for i in range(1, 4)]
    body = json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": spans}]}]})
    assert "\\ud800" in body  # JSON may say a lone surrogate
    request = urllib.request.Request(url, data=body.encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=5) as answer:
        assert answer.status == 200
    assert len(_lines(store)) == 1
    attributes = [a for a in _attributes(store) if a]
    assert attributes == [{sc.CONVERSATION_ID.key: ODD, sc.USER_AGENT: "ua\ufffd"}]
    assert len(open_source(str(store)).spans()) == 3
    assert any("1 string value(s) not valid Unicode" in r.getMessage()
               for r in caplog.records)  # counted and said


# ---------------------------------------------------------------------------- fuzzing
SPECIAL = (BREAKS + "\x00\x01\x1f\x7f\x80\x9f\xa0\"\\/\ufeff\ufffd\uffff\U0010ffff"
           "\U0001f600\ud800\udbff\udc00\udfff")


def _string(rng: random.Random) -> str:
    chars = []
    for _ in range(rng.randrange(0, 12)):
        roll = rng.random()
        if roll < 0.4:
            chars.append(rng.choice(SPECIAL))
        elif roll < 0.6:
            chars.append(chr(rng.randrange(0x80)))
        else:
            chars.append(chr(rng.randrange(0x110000)))  # surrogates included
    return "".join(chars)


def _expected(value: str) -> str:
    """What reads back: a surrogate pair held as two code points is its character, a
    lone surrogate U+FFFD; anything else as written."""
    out, i = [], 0
    while i < len(value):
        code = ord(value[i])
        after = ord(value[i + 1]) if i + 1 < len(value) else 0
        if 0xD800 <= code < 0xDC00 and 0xDC00 <= after < 0xE000:
            out.append(chr(0x10000 + ((code - 0xD800) << 10) + (after - 0xDC00)))
            i += 2
            continue
        out.append("\ufffd" if 0xD800 <= code < 0xE000 else value[i])
        i += 1
    return "".join(out)


def test_fuzzed_strings_round_trip_through_writer_and_reader(tmp_path):
    rng = random.Random(20240824)
    store = tmp_path / "store"
    exporter = OtlpJsonFileExporter(LiveSegmentWriter(str(store), "kvobs-proxy"))
    written: dict[str, tuple[str, str]] = {}  # conversation id -> (model, agent)
    for batch in range(40):
        tenants = []
        for i in range(25):
            key = f"{batch}-{i}:"  # unique prefix: the row is found by it
            values = (key + _string(rng), _string(rng), _string(rng))
            tenants.append(_tenant(0, values[0], values[1], values[2]))
            written[_expected(values[0])] = (_expected(values[1]), _expected(values[2]))
        assert exporter.export(_spans(tenants)).name == "SUCCESS"
    assert len(_lines(store)) == 40
    spans = open_source(str(store)).spans()
    read = dict(zip(spans[sc.CONVERSATION_ID.key], spans[sc.REQUEST_MODEL.key]))
    assert read == {conversation: model for conversation, (model, _) in written.items()}
    agents = {a[sc.CONVERSATION_ID.key]: a[sc.USER_AGENT] for a in _attributes(store)}
    assert agents == {conversation: agent for conversation, (_, agent) in written.items()}
    assert exporter.replaced_values > 0  # the cases include lone surrogates


def test_json_line_keeps_the_fast_path_output_where_nothing_is_odd():
    value = {"a": ["é", 1, 2.5, None, True], "b": "\u2014 \u201c\u201d"}  # e2 80 9x
    line, replaced = json_line(value)
    assert (json.loads(line), replaced) == (value, 0)
    assert "\\u" not in line  # no escape where none is needed
