"""kvobs collect's decoding of an export request (``collect.decode``): the stored line is
byte-identical to the reference encoding (``json_line(request_to_otlp_dict(message))``
for protobuf, ``json_line(json.loads(body))`` for JSON), replaced-string count included,
and what the live classifier takes (``Stored.request()``) gives the same rows as the
stored line read back (``loads(line)``, the service's reader), on every document in
tests/data and on fuzzed requests of odd values.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import math
import pathlib
import random
import struct

import pytest
from aiohttp.test_utils import TestClient, TestServer
from google.protobuf import descriptor as d
from google.protobuf.message import DecodeError
from google.protobuf.json_format import ParseDict
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from kvobs.emit import native
from kvobs.emit.collect import SegmentWriter, build_app, decode
from kvobs import semconv as sc
from kvobs.emit.otlp_json import json_line, loads, request_json, request_to_otlp_dict
from kvobs.live.service import Live, LiveSettings
from kvobs.sources._rows import ReadRows, rows

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"
ODD_STRINGS = ["", "a", "\u2028", "\u2029", "\x85", "\x00", "\U0001f600", "é\nx", "\ufffd",
               "kvobs.conversation_id", "1234", "true", "NaN", "\\", '"']


def _corpus() -> list[str]:
    return [line for path in sorted(DATA.glob("*.jsonl"))
            for line in path.read_text().split("\n") if line.strip()]


def _as_message(line: str) -> ExportTraceServiceRequest:
    """An OTLP-JSON line (hex ids) as the protobuf message it was made from."""
    request = json.loads(line)
    for resource_spans in request.get("resourceSpans", ()):
        for scope_spans in resource_spans.get("scopeSpans", ()):
            for span in scope_spans.get("spans", ()):
                for item in [span, *span.get("links", ())]:
                    for key in ("traceId", "spanId", "parentSpanId"):
                        if key in item:
                            item[key] = base64.b64encode(bytes.fromhex(item[key])).decode()
    return ParseDict(request, ExportTraceServiceRequest())


def _read_back(line: str):
    """What the service read before: the stored line parsed again; ``None`` where that
    raised (the request was stored and not classified)."""
    try:
        return loads(line)
    except ValueError:
        return None


def _same_rows(taken, stored_line: str) -> None:
    expected_problems: list[str] = []
    read_back = _read_back(stored_line)
    if read_back is None:
        assert taken is None
        return
    expected = rows("otlp", read_back, expected_problems)
    problems: list[str] = []
    got = rows("otlp", taken, problems)
    assert [list(row.items()) for row in got] == [list(row.items()) for row in expected]
    assert problems == expected_problems


def _taken(stored):
    try:
        return stored.request()
    except ValueError:
        return None


@contextlib.contextmanager
def _compiled(on: bool):
    """``collect.decode`` with the compiled decoder (where it is built) or without it."""
    built = native.decode
    native.decode = built if on else None
    try:
        yield
    finally:
        native.decode = built


def _check_protobuf(message: ExportTraceServiceRequest, body: bytes | None = None) -> bool:
    """Both decoders give the reference's line and the rows of that line read back;
    whether the compiled one answered (it leaves what it does not know to the other)."""
    reference = request_to_otlp_dict(message)
    direct = request_json(message)
    assert json.dumps(direct) == json.dumps(reference)  # key order included
    body = message.SerializeToString() if body is None else body
    spans = [span for rs in reference.get("resourceSpans", ())
             for ss in rs.get("scopeSpans", ()) for span in ss.get("spans", ())]
    answered = False
    for compiled in (False, True):
        with _compiled(compiled):
            stored = decode(body, is_json=False)
        assert (stored.line, stored.replaced) == json_line(reference)
        taken = _taken(stored)
        if stored.rows is not None:  # the compiled decoder's rows
            assert compiled and isinstance(taken, ReadRows) and stored.document is None
            assert len(taken) == len(spans)
            answered = True
        else:
            # the rows come from the attributes the walk read (one dict a span), not the dict
            assert len(taken.span_attributes) == len(spans)
        _same_rows(taken, stored.line)
    return answered


def _reference_json(body: bytes):
    """What the receiver did with a JSON body before: its line and count, or None (400)."""
    try:
        request = json.loads(body)
        if not isinstance(request, dict) or not isinstance(
                request.get("resourceSpans", []), list):
            return None
        return json_line(request)
    except Exception:  # noqa: BLE001 - a 400
        return None


def _check_json(body: bytes) -> None:
    reference = _reference_json(body)
    try:
        stored = decode(body, is_json=True)
    except Exception:  # noqa: BLE001
        assert reference is None, body[:200]
        return
    assert reference is not None, body[:200]
    assert (stored.line, stored.replaced) == reference
    _same_rows(_taken(stored), stored.line)


@pytest.mark.parametrize("index", range(len(_corpus())))
def test_every_recorded_request_as_protobuf_and_as_json(index):
    line = _corpus()[index]
    _check_json(line.encode())
    assert decode(line.encode(), is_json=True).document is not None  # not parsed again
    message = _as_message(line)
    assert _check_protobuf(message)  # every recorded request: the compiled decoder's
    _check_json(json.dumps(request_to_otlp_dict(message)).encode())


# --------------------------------------------------------------------- protobuf fuzz

_INTS = {
    d.FieldDescriptor.TYPE_INT64: [0, 1, -1, 2**63 - 1, -2**63, 10**15],
    d.FieldDescriptor.TYPE_FIXED64: [0, 1, 2**64 - 1, 2**63, 1_700_000_000_000_000_000],
    d.FieldDescriptor.TYPE_UINT32: [0, 1, 2**32 - 1],
    d.FieldDescriptor.TYPE_FIXED32: [0, 1, 0x100, 0x300, 2**32 - 1],
    d.FieldDescriptor.TYPE_INT32: [0, 1, -1, 2**31 - 1, -2**31],
}
_DOUBLES = [0.0, -0.0, 1.5, math.nan, math.inf, -math.inf, 1e308, 5e-324, 0.1, 2.0**70]


def _fill(message, rng: random.Random, depth: int) -> None:
    """Every field of ``message`` set or left at random, with odd values; a oneof gets
    one member; a message field may be set empty."""
    oneofs = {oneof.name: rng.choice(oneof.fields) for oneof in message.DESCRIPTOR.oneofs}
    for field in message.DESCRIPTOR.fields:
        if field.containing_oneof is not None and oneofs[field.containing_oneof.name] is not field:
            continue
        if field.containing_oneof is None and rng.random() < 0.3:
            continue
        if field.is_repeated:
            container = getattr(message, field.name)
            for _ in range(rng.choice([0, 1, 2, 3]) if depth < 4 else 0):
                if field.type == d.FieldDescriptor.TYPE_MESSAGE:
                    _fill(container.add(), rng, depth + 1)
                else:
                    container.append(_scalar(field, rng))
        elif field.type == d.FieldDescriptor.TYPE_MESSAGE:
            sub = getattr(message, field.name)
            sub.SetInParent()
            if depth < 4 and rng.random() < 0.8:
                _fill(sub, rng, depth + 1)
        else:
            setattr(message, field.name, _scalar(field, rng))


def _scalar(field, rng: random.Random):
    kind = field.type
    if kind == d.FieldDescriptor.TYPE_STRING:
        return "".join(rng.choice(ODD_STRINGS) for _ in range(rng.randrange(3)))
    if kind == d.FieldDescriptor.TYPE_BYTES:
        size = rng.choice([0, 1, 5, 8, 16, 20])
        return bytes(rng.randrange(256) for _ in range(size))
    if kind == d.FieldDescriptor.TYPE_BOOL:
        return rng.random() < 0.5
    if kind == d.FieldDescriptor.TYPE_DOUBLE:
        return rng.choice(_DOUBLES)
    if kind == d.FieldDescriptor.TYPE_ENUM:
        return rng.choice([*field.enum_type.values_by_number, 7, 99])
    return rng.choice(_INTS[kind])


def _known_attributes(message, rng: random.Random) -> None:
    """Spans carrying kvobs's own keys, odd values in them: rows read these."""
    keys = ["gen_ai.conversation.id", "kvobs.turn.index", "kvobs.role", "service.name",
            "kvobs.prompt.tokens", "gen_ai.latency.time_to_first_token", "kvobs.remote.tokens",
            "gen_ai.usage.input_tokens", "kvobs.proxy.entry.age"]
    for resource_spans in message.resource_spans:
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                for key in rng.sample(keys, 4):
                    value = span.attributes.add(key=key).value
                    choice = rng.randrange(6)
                    if choice == 0:
                        value.string_value = rng.choice(ODD_STRINGS)
                    elif choice == 1:
                        value.int_value = rng.choice(_INTS[d.FieldDescriptor.TYPE_INT64])
                    elif choice == 2:
                        value.double_value = rng.choice(_DOUBLES)
                    elif choice == 3:
                        value.bool_value = True
                    elif choice == 4:
                        value.array_value.values.add().string_value = "x"
                    # 5: an empty AnyValue
                if rng.random() < 0.5:
                    resource_spans.resource.attributes.add(key="kvobs.role").value.string_value \
                        = rng.choice(["prefill", "decode", "\u2028"])


@pytest.mark.parametrize("seed", range(150))
def test_fuzzed_protobuf_requests(seed):
    rng = random.Random(seed)
    message = ExportTraceServiceRequest()
    _fill(message, rng, 0)
    _known_attributes(message, rng)
    _check_protobuf(message)


def _scrambled(message, rng: random.Random, merged: bool = True) -> bytes:
    """``message`` in another valid encoding than protobuf's own: its fields in a random
    order (a repeated field's items keep theirs), sometimes a scalar sent twice (the last
    wins), an unknown field of each wire type, or (``merged``) a message field in two
    parts."""
    return b"".join(_chunks(message, rng, merged))


def _chunks(message, rng: random.Random, merged: bool) -> list[bytes]:
    chunks: list[tuple[float, bytes]] = []
    order = {field.number: rng.random() for field, _ in message.ListFields()}
    for field, value in message.ListFields():
        tag = field.number << 3
        if field.type == d.FieldDescriptor.TYPE_MESSAGE:
            items = value if field.is_repeated else [value]
            for item in items:
                inner = _chunks(item, rng, merged)
                # a singular message field in two parts, each a whole field: merged
                cut = rng.randrange(len(inner) + 1) if merged and not field.is_repeated \
                    and rng.random() < 0.1 else None
                for part in [inner] if cut is None else [inner[:cut], inner[cut:]]:
                    data = b"".join(part)
                    field_bytes = _varint(tag | 2) + _varint(len(data)) + data
                    chunks.append((order[field.number], field_bytes))
            continue
        alone = type(message)()
        if field.is_repeated:
            getattr(alone, field.name).extend(value)
        else:
            if rng.random() < 0.1:  # sent twice: a first value the second replaces
                other = type(message)()
                setattr(other, field.name, _scalar(field, rng))
                chunks.append((order[field.number] - 1, other.SerializeToString()))
            setattr(alone, field.name, value)
        chunks.append((order[field.number], alone.SerializeToString()))
    if rng.random() < 0.2:
        unknown = 900 + rng.randrange(50)
        chunks.append((rng.random(), rng.choice([
            _varint(unknown << 3) + _varint(rng.randrange(2**64)),
            _varint(unknown << 3 | 1) + bytes(8),
            _varint(unknown << 3 | 2) + _varint(3) + b"abc",
            _varint(unknown << 3 | 5) + bytes(4)])))
    chunks.sort(key=lambda chunk: chunk[0])  # stable: repeated items keep their order
    return [chunk for _, chunk in chunks]


@pytest.mark.parametrize("seed", range(150))
def test_requests_encoded_otherwise_decode_alike(seed):
    """Fields out of order, a scalar sent twice, a message in two parts, unknown fields:
    what upb parses, both decoders write and read alike (the compiled one answering where
    it knows the shape)."""
    rng = random.Random(seed)
    message = ExportTraceServiceRequest()
    if seed % 2:
        _fill(message, rng, 0)
        _known_attributes(message, rng)
    else:
        message = _as_message(_corpus()[seed % len(_corpus())])
    body = _scrambled(message, rng)
    parsed = ExportTraceServiceRequest()
    parsed.ParseFromString(body)
    _check_protobuf(parsed, body)


def _field(number: int, data: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def _merged_bodies() -> dict[str, bytes]:
    array = _field(5, _field(1, _field(1, b"a"))) + _field(5, _field(1, _field(1, b"b")))
    attribute = _field(1, b"kvobs.role") + _field(2, array)
    value = _field(1, b"gen_ai.conversation.id") + _field(2, _field(1, b"x")) + _field(2, b"")
    status = _field(15, _field(2, b"failed")) + _field(15, b"\x18\x02")
    resource = (_field(1, _field(1, _field(1, b"service.name") + _field(2, _field(1, b"p"))))
                + _field(1, _field(1, _field(1, b"kvobs.role") + _field(2, _field(1, b"d")))))
    ids = _field(1, bytes(16)) + _field(2, bytes(8))
    scope = _field(1, _field(1, b"kvobs")) + _field(1, _field(2, b"1.0"))

    def request(span: bytes, resource: bytes = b"", scope: bytes = b"") -> bytes:
        return _field(1, resource + _field(2, scope + _field(2, ids + span)))

    return {
        "array": request(_field(9, attribute)),
        "value": request(_field(9, value)),
        "status": request(status),
        "resource": request(b"", resource),
        "scope": request(b"", b"", scope),
    }


@pytest.mark.parametrize("case", ["array", "value", "status", "resource", "scope"])
def test_message_fields_sent_in_parts_are_merged_as_upb_merges_them(case):
    """An array value, a key's value, a span's status, a resource, a scope: each sent as
    two fields, which protobuf merges (an array's items joined, the other fields kept)."""
    body = _merged_bodies()[case]
    parsed = ExportTraceServiceRequest()
    parsed.ParseFromString(body)
    _check_protobuf(parsed, body)


@pytest.mark.parametrize("seed", range(100))
def test_damaged_bodies_are_refused_or_decoded_alike(seed):
    """A recorded request with bytes cut, flipped or added: where upb refuses the body the
    compiled decoder leaves it to the Python path (the handler's 400); where upb takes it,
    both decoders agree."""
    rng = random.Random(seed)
    body = bytearray(_as_message(_corpus()[seed % len(_corpus())]).SerializeToString())
    for _ in range(rng.randrange(1, 4)):
        at = rng.randrange(len(body))
        change = rng.randrange(3)
        if change == 0:
            del body[at:at + rng.randrange(1, 8)]
        elif change == 1:
            body[at] ^= 1 << rng.randrange(8)
        else:
            body[at:at] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 4)))
    parsed = ExportTraceServiceRequest()
    try:
        parsed.ParseFromString(bytes(body))
    except DecodeError:
        if native.decode is not None:
            assert native.decode(bytes(body)) is None
        with pytest.raises(DecodeError):
            decode(bytes(body), is_json=False)
        return
    _check_protobuf(parsed, bytes(body))


def test_the_compiled_decoder_takes_the_common_shapes():
    """Built (``pip install`` compiles it: gcc and Python's headers are set-up's), and
    answering for what engines send: every recorded request (above), the scrambled
    encodings of them, doubles of every exponent, every span kind and status."""
    assert native.decode is not None, "kvobs.emit._otlp_native was not built"
    rng = random.Random(7)
    message = ExportTraceServiceRequest()
    spans = message.resource_spans.add().scope_spans.add().spans
    for index in range(400):
        span = spans.add(name=f"s{index}", trace_id=rng.randbytes(16), span_id=rng.randbytes(8),
                         kind=index % 6, start_time_unix_nano=rng.randrange(2**64))
        span.status.code = index % 3
        value = span.attributes.add(key="gen_ai.latency.time_to_first_token").value
        value.double_value = rng.choice([-1, 1]) * rng.random() * 10.0 ** rng.randrange(-30, 30)
        span.attributes.add(key="kvobs.read.bytes").value.int_value = rng.randrange(-2**63, 2**63)
    assert _check_protobuf(message)
    for index in range(20):
        body = _scrambled(message, random.Random(index), merged=False)
        parsed = ExportTraceServiceRequest()
        parsed.ParseFromString(body)
        assert _check_protobuf(parsed, body)


def test_a_failing_compiled_decoder_leaves_every_body_to_the_python_one(monkeypatch, caplog):
    """A defect in the compiled decoder (it raises) refuses no body: the Python decoder
    takes each one, and the failure is logged once, with its traceback."""
    from kvobs.emit import collect

    def broken(body):
        raise SystemError("a defect")

    monkeypatch.setattr(native, "decode", broken)
    monkeypatch.setattr(collect, "_native_failed", False)
    message = _as_message(_corpus()[0])
    with caplog.at_level("ERROR", logger="kvobs.collect"):
        for _ in range(3):
            stored = decode(message.SerializeToString(), is_json=False)
            assert (stored.line, stored.replaced) == json_line(request_to_otlp_dict(message))
            assert stored.rows is None and stored.document is not None
    failures = [r for r in caplog.records if "compiled OTLP decoder failed" in r.message]
    assert len(failures) == 1 and failures[0].exc_info[0] is SystemError


def test_the_service_says_which_decoder_it_runs(monkeypatch):
    assert native.described() == "the compiled decoder"
    monkeypatch.setattr(native, "decode", None)
    monkeypatch.setattr(native, "_missing", "No module named 'kvobs.emit._otlp_native'")
    assert "Python decoder" in native.described()
    assert "_otlp_native" in native.described()


def test_attributes_read_while_decoding_give_the_rows_the_dict_gives():
    """Repeated keys (the last value, at the first one's place), an empty key, a value
    left unset or empty, an older key beside its new name, a value of another type than
    its key's: the rows from what the decoding read equal those of the line read back."""
    message = ExportTraceServiceRequest()
    resource_spans = message.resource_spans.add()
    resource_spans.resource.attributes.add(key="kvobs.role").value.string_value = "decode"
    spans = resource_spans.scope_spans.add().spans
    span = spans.add(name="s", trace_id=b"\x01" * 16, span_id=b"\x02" * 8)
    attributes = span.attributes
    attributes.add(key="kvobs.turn.index").value.int_value = 3
    attributes.add(key="").value.string_value = "no key"
    attributes.add(key="gen_ai.conversation.id").value.string_value = "c1"
    attributes.add(key="kvobs.turn.index").value.string_value = "4"
    attributes.add(key="kvobs.prompt.tokens").value.int_value = 7
    attributes.add(key=sc.PROMPT_TOKENS.key).value.int_value = 8
    attributes.add(key="kvobs.role")  # no value
    attributes.add(key="kvobs.tenant.digest").value.SetInParent()  # an empty value
    attributes.add(key="gen_ai.latency.time_to_first_token").value.string_value = "0.5"
    attributes.add(key=sc.STREAM.key).value.bool_value = True
    attributes.add(key="gen_ai.request.id").value.int_value = 9  # a str key
    attributes.add(key="kvobs.proxy.entry.age").value.double_value = math.nan
    attributes.add(key="unknown").value.double_value = 1.5
    other = spans.add(name="t", trace_id=b"\x01" * 16, span_id=b"\x03" * 5)  # odd id size
    other.attributes.add(key="kvobs.prompt.tokens").value.int_value = 5
    other.attributes.add(key="kvobs.prompt.tokens").value.array_value.SetInParent()
    other.status.code = 2
    _check_protobuf(message)
    got = rows("otlp", decode(message.SerializeToString(), is_json=False).request(), [])
    assert got[0]["kvobs.turn.index"] == 4 and got[0][sc.PROMPT_TOKENS.key] == 8
    assert got[1][sc.PROMPT_TOKENS.key] is None and got[1]["error"] is True


def test_an_old_instrumentation_library_spans_field_is_read_as_the_reference_reads_it():
    """OTLP < 0.19's field 1000 of ResourceSpans: unknown to today's schema, left out by
    both encodings alike."""
    scope = ExportTraceServiceRequest()
    scope.resource_spans.add().scope_spans.add().spans.add(name="s", trace_id=b"\x01" * 16)
    inner = scope.resource_spans[0].scope_spans[0].SerializeToString()
    field = _varint((1000 << 3) | 2) + _varint(len(inner)) + inner
    resource_spans = scope.resource_spans[0].SerializeToString() + field
    body = _varint((1 << 3) | 2) + _varint(len(resource_spans)) + resource_spans
    message = ExportTraceServiceRequest()
    message.ParseFromString(body)
    _check_protobuf(message)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def test_invalid_utf8_in_a_protobuf_string_is_refused_as_before():
    message = ExportTraceServiceRequest()
    message.resource_spans.add().scope_spans.add().spans.add(name="ab")
    body = message.SerializeToString().replace(b"ab", b"\xff\xfe")
    with pytest.raises(DecodeError):
        ExportTraceServiceRequest().ParseFromString(body)
    with pytest.raises(DecodeError):  # the handler's 400
        decode(body, is_json=False)


# ------------------------------------------------------------------------ JSON fuzz

def _span(**fields) -> dict:
    return {"traceId": "ab" * 16, "spanId": "cd" * 8, "name": "kvobs.proxy.turn",
            "startTimeUnixNano": "1000", "endTimeUnixNano": "2000", **fields}


def _body(*spans, resource=None, key="scopeSpans") -> bytes:
    resource_spans = {key: [{"spans": list(spans)}]}
    if resource is not None:
        resource_spans["resource"] = {"attributes": resource}
    return json.dumps({"resourceSpans": [resource_spans]}).encode()


def _attr(key, value) -> dict:
    return {"key": key, "value": value}


ODD_JSON_BODIES = [
    _body(_span(attributes=[_attr("gen_ai.conversation.id", {"stringValue": "c\ud800"})])),
    _body(_span(name="\u2028\u2029\x85\x00")),
    _body(_span(attributes=[_attr("kvobs.turn.index", {"intValue": 2**70})])),
    _body(_span(attributes=[_attr("kvobs.turn.index", {"intValue": -(10**18) * 9})])),
    _body(_span(attributes=[_attr("kvobs.turn.index", {"intValue": 12345678901234567890})])),
    _body(_span(startTimeUnixNano=2**64 + 5)),
    _body(_span(attributes=[_attr("gen_ai.latency.time_to_first_token",
                                  {"doubleValue": float("nan")})])),
    _body(_span(attributes=[_attr("gen_ai.latency.time_to_first_token",
                                  {"doubleValue": float("inf")})])),
    _body(_span(traceId="", spanId="", parentSpanId="")),
    _body(_span(traceId="q83v", spanId="0102")),  # base64, short hex
    _body(_span(attributes=[_attr("kvobs.role", {"arrayValue": {"values": [{"intValue": "1"}]}}),
                            _attr("gen_ai.conversation.id", {"kvlistValue": {}})])),
    _body({}),
    _body(_span(), key="instrumentationLibrarySpans"),
    _body(_span(), resource=[_attr("service.name", {"stringValue": "vllm-\u2028"}),
                             _attr("kvobs.role", {"intValue": "3"})]),
    b'{"resourceSpans": [], "resourceSpans": [{"scopeSpans": []}]}',
    b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"name": "a", '
    b'"startTimeUnixNano": 1e400}]}]}]}',
    b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"name": NaN}]}]}]}',
    b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"name": "\\ud83d\\ude00 \\udc00"}]}]}]}',
    b'\xef\xbb\xbf{"resourceSpans": []}',
    '{"resourceSpans": []}'.encode("utf-16"),
    b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"name": "\xff"}]}]}]}',
    b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"name": "\xed\xa0\x80"}]}]}]}',
    b'{"resourceSpans": {}}',
    b"[]",
    b"",
    b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"startTimeUnixNano": -0, "x": 1.0}]}]}]}',
    b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"startTimeUnixNano": 1.5e3}]}]}]}',
    b'{"resourceSpans": ' + b"[" * 2000 + b"]" * 2000 + b"}",
]


@pytest.mark.parametrize("index", range(len(ODD_JSON_BODIES)))
def test_odd_json_bodies(index):
    _check_json(ODD_JSON_BODIES[index])


@pytest.mark.parametrize("seed", range(60))
def test_fuzzed_protobuf_requests_sent_as_json(seed):
    rng = random.Random(1000 + seed)
    message = ExportTraceServiceRequest()
    _fill(message, rng, 0)
    _known_attributes(message, rng)
    _check_json(json.dumps(request_to_otlp_dict(message)).encode())
    # with its doubles as JSON numbers where they are finite (the Collector's exporter)
    text = json.dumps(request_to_otlp_dict(message)).replace('"doubleValue": "NaN"',
                                                             '"doubleValue": NaN')
    _check_json(text.encode())


def test_double_bits_survive_the_line():
    """A double read from protobuf is the same double in the rows the line reads back as."""
    for bits in (0x3FB999999999999A, 0x0000000000000001, 0x7FEFFFFFFFFFFFFF):
        (value,) = struct.unpack("<d", struct.pack("<Q", bits))
        message = ExportTraceServiceRequest()
        span = message.resource_spans.add().scope_spans.add().spans.add(name="s")
        span.attributes.add(key="gen_ai.latency.time_to_first_token").value.double_value = value
        _check_protobuf(message)


# ------------------------------------------------------------------ the handler's answers

def test_the_handler_answers_as_before_and_a_classifier_error_fails_nothing(tmp_path):
    """200 with the classifier's input handed over; 400 for a body that is no request;
    503 when the store cannot be written; a classifier that raises fails no request."""
    live = Live(str(tmp_path), LiveSettings(window_s=60))
    taken: list = []
    live.classifier.add_request = lambda request, now=None: taken.append(request) or 1 / 0
    writer = SegmentWriter(str(tmp_path))
    message = _as_message(_corpus()[0])

    async def scenario():
        async with TestClient(TestServer(build_app(writer, sink=live.receive))) as client:
            def post(body, kind):
                return client.post("/v1/traces", data=body, headers={"Content-Type": kind})

            answer = await post(message.SerializeToString(), "application/x-protobuf")
            assert answer.status == 200
            answer = await post(_corpus()[0].encode(), "application/json")
            assert answer.status == 200
            answer = await post(b"\xff\x00 not protobuf", "application/x-protobuf")
            assert answer.status == 400
            answer = await post(b'{"resourceSpans": {}}', "application/json")
            assert answer.status == 400
            writer.append = _full_disk
            answer = await post(message.SerializeToString(), "application/x-protobuf")
            assert answer.status == 503

    asyncio.run(scenario())
    # the classifier was handed the protobuf body's rows, then the JSON body's document
    assert isinstance(taken[0], ReadRows) == (native.decode is not None)
    assert [rows("otlp", t, []) for t in taken] == [
        rows("otlp", request_json(message), []), rows("otlp", json.loads(_corpus()[0]), [])]
    assert json.dumps(taken[1]) == json.dumps(json.loads(_corpus()[0]))


def _full_disk(text: str) -> None:
    raise OSError(28, "No space left on device")
