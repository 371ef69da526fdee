"""Seeded span-file fuzzing for the readers and the turns pipeline (tests/sources/
test_fuzz_readers.py runs 10,000 cases in CI, bench/reader_fuzz.py as many as asked).

A case is one span file: a conversation's turns (proxy turn, pull decision, recompute,
read, export spans; the recompute tokens known), written in one of the shapes real
producers write (``trace_formats``), then damaged: ill-typed or out-of-range values,
unreadable spans, corrupt, truncated or deeply nested lines, lines delivered twice, and
for some files bytes cut or flipped. The oracle (``check_case``, ``check_batch``):

- no exception, no hang (the caller bounds time);
- every input span is read, or the line/message/span that held it is reported;
- a value the generator made unusable reads as null and is reported for its span;
- the span table holds each (trace id, span id) once, and the duplicates dropped are
  exactly the ones reported;
- the turns pipeline (pandas ``turns``/``diagnose`` path and the fleet's Arrow path, on
  the files and on a compacted store with a segment copied) sums each turn's recomputed
  tokens over distinct spans: never a double count.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import re
import shutil
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from kvobs import semconv as sc
from kvobs.sources.otlp_json import OtlpJsonSource, read_rows
from trace_formats import framed, jaeger, to_proto, with_base64_ids, zstd

SPANS = (sc.SPAN_PROXY_TURN, sc.SPAN_PULL_DECISION, sc.SPAN_RECOMPUTE, sc.SPAN_READ,
         sc.SPAN_EXPORT)
KEYS = {sc.CONVERSATION_ID.key, sc.TURN_INDEX.key, sc.TENANT_DIGEST.key}
PROTECTED = KEYS | {sc.RECOMPUTED_TOKENS.key}  # what the double-count oracle sums by
_BY_TYPE = defaultdict(list)
for _attribute in sc.ATTRIBUTES.values():
    if _attribute.key not in PROTECTED:
        _BY_TYPE[_attribute.type].append(_attribute.key)
# (OTLP AnyValue, whether the reader must null it), per semconv type
BAD_VALUES = {
    "int": [({"intValue": "1e30"}, True), ({"intValue": str(2**70)}, True),
            ({"intValue": 1.5}, True), ({"intValue": "abc"}, True),
            ({"intValue": [1]}, True), ({"boolValue": True}, True),
            ({"doubleValue": "inf"}, True), ({"intValue": "12"}, False)],
    "float": [({"doubleValue": "inf"}, True), ({"doubleValue": "nan"}, True),
              ({"doubleValue": "1e400"}, True), ({"stringValue": "fast"}, True),
              ({"doubleValue": {"a": 1}}, True), ({"intValue": "3"}, False)],
    "str": [({"stringValue": "\ud800"}, True), ({"intValue": 12}, True),
            ({"stringValue": ["x"]}, True), ({"stringValue": "é\u2028ok"}, False)],
    "bool": [({"stringValue": "yes"}, True), ({"intValue": 1}, True),
             ({"boolValue": "TRUE"}, False)],
}
BAD_TIMES = [("inf", True), ("1e30", True), (-5, False), ("abc", True), (1.5e18, False),
             (None, False), (str(2**64), True), ([1], True)]
UNREADABLE_SPANS = [5, "x", [], None, {"status": "bad"}, {"attributes": 7}]
FORMATS = ["lines"] * 10 + ["document", "proto", "zstd-lines", "zstd-proto", "gzip",
                            "tempo", "jaeger", "jaeger-v3", "bom-lines"]
NUL_RUNS = 0.1  # of lines and proto cases: NUL blocks (never written before a crash)
STORE_CASES = 100  # cases of a batch also compacted into a store (compaction is slow)
_DUPLICATE = re.compile(r"^(\d+) duplicate span\(s\)")


@dataclass
class Case:
    path: str
    fmt: str
    spans: list[tuple[str, str, str]] = field(default_factory=list)  # (trace, span, where)
    nulled: list[tuple[str, str, str]] = field(default_factory=list)  # (span, key, "")
    unreadable_wheres: set[str] = field(default_factory=set)  # where spans may be lost
    recomputed: dict[tuple[str, int, str], int] = field(default_factory=dict)
    byte_damaged: bool = False


def _hex(rng: random.Random, nbytes: int) -> str:
    return f"{rng.getrandbits(8 * nbytes):0{2 * nbytes}x}"


def _good_value(rng: random.Random, type_: str) -> dict:
    if type_ == "int":
        return {"intValue": str(rng.randint(0, 10**6))}
    if type_ == "float":
        return {"doubleValue": rng.random() * 10}
    if type_ == "bool":
        return {"boolValue": rng.random() < 0.5}
    return {"stringValue": rng.choice(["hit", "miss", "done", "failed", "pull", "a b"])}


def _requests(rng: random.Random, case_id: str, case: Case, damage: bool):
    """One OTLP request per turn: the turn's spans by service, some damaged."""
    cid, tenant = f"fz-{case_id}", rng.choice(["t0", "t1"])
    requests, start = [], 1_700_000_000_000_000_000 + rng.randint(0, 10**15)
    for turn in range(1, rng.randint(1, 3) + 1):
        trace = _hex(rng, 16)
        by_service = defaultdict(list)
        for span_name in SPANS:
            if span_name is not sc.SPAN_PROXY_TURN and rng.random() < 0.15:
                continue
            span_id = _hex(rng, 8)
            attributes = [
                {"key": sc.CONVERSATION_ID.key, "value": {"stringValue": cid}},
                {"key": sc.TURN_INDEX.key, "value": {"intValue": str(turn)}},
                {"key": sc.TENANT_DIGEST.key, "value": {"stringValue": tenant}}]
            if span_name is sc.SPAN_RECOMPUTE:
                tokens = rng.randint(1, 2000)
                attributes.append({"key": sc.RECOMPUTED_TOKENS.key,
                                   "value": {"intValue": str(tokens)}})
                case.recomputed[(cid, turn, span_id)] = tokens
            for _ in range(rng.randint(0, 4)):
                type_ = rng.choice(sorted(_BY_TYPE))
                attributes.append({"key": rng.choice(_BY_TYPE[type_]),
                                   "value": _good_value(rng, type_)})
            span = {"traceId": trace, "spanId": span_id, "name": span_name.name,
                    "kind": 1, "startTimeUnixNano": str(start),
                    "endTimeUnixNano": str(start + rng.randint(0, 10**9)),
                    "attributes": attributes, "status": {}}
            start += rng.randint(1, 10**9)
            by_service[span_name.service.value].append(span)
        requests.append({"resourceSpans": [
            {"resource": {"attributes": [{"key": "service.name",
                                          "value": {"stringValue": service}}]},
             "scopeSpans": [{"scope": {"name": "kvobs"}, "spans": spans}]}
            for service, spans in by_service.items()]})
    return requests


def _damage_values(rng: random.Random, requests: list[dict], case: Case) -> dict:
    """Bad values and unreadable spans, in place; returns {span_id: its request}."""
    unreadable = {}
    for request in requests:
        for resource_spans in request["resourceSpans"]:
            spans = resource_spans["scopeSpans"][0]["spans"]
            for index, span in enumerate(spans):
                roll = rng.random()
                if roll < 0.04:
                    unreadable[span["spanId"]] = request
                    spans[index] = rng.choice(UNREADABLE_SPANS)
                elif roll < 0.25:
                    editable = [a for a in span["attributes"] if a["key"] not in PROTECTED]
                    if editable and rng.random() < 0.7:
                        item = rng.choice(editable)
                        type_ = sc.ATTRIBUTES[item["key"]].type
                        item["value"], must_null = rng.choice(BAD_VALUES[type_])
                        repeated = sum(a["key"] == item["key"] for a in span["attributes"])
                        if must_null and repeated == 1:
                            case.nulled.append((span["spanId"], item["key"], ""))
                    else:
                        field_name = rng.choice(["startTimeUnixNano", "endTimeUnixNano"])
                        span[field_name], must_null = rng.choice(BAD_TIMES)
                        if must_null:
                            case.nulled.append((span["spanId"],
                                                field_name.replace("TimeUnixNano", "_ns"),
                                                ""))
    return unreadable


def _span_ids(request) -> list[tuple[str, str]]:
    return [(s["traceId"], s["spanId"]) for rs in request["resourceSpans"]
            for s in rs["scopeSpans"][0]["spans"] if isinstance(s, dict) and "spanId" in s]


def make_case(rng: random.Random, case_id: str, directory: str) -> Case:
    fmt = rng.choice(FORMATS)
    path = os.path.join(directory, f"case-{case_id}")  # no extension: read by content
    case = Case(path, fmt)
    damage = fmt == "lines" and rng.random() < 0.7
    requests = _requests(rng, case_id, case, damage)
    originals = {span_id: trace for r in requests for trace, span_id in _span_ids(r)}
    unreadable = _damage_values(rng, requests, case) if damage else {}
    if rng.random() < 0.2:  # an exporter's retry: a request delivered again
        requests.insert(rng.randint(0, len(requests)), json.loads(json.dumps(
            rng.choice(requests))))
    if fmt == "lines":
        lines = [json.dumps(r) for r in requests]
        wheres = [f"{path}:{n}" for n in range(1, len(lines) + 1)]
        if damage and rng.random() < 0.3:
            index = rng.randrange(len(lines))
            lines[index] = rng.choice([
                lines[index][:rng.randint(1, max(1, len(lines[index]) - 1))],
                "{not json " + lines[index], "[" * 5000 + "]" * 5000,
                json.dumps({"resourceSpans": 5}), json.dumps(["a", 1])])
            case.unreadable_wheres.add(wheres[index])
        data = _nul_runs(rng, [(line + "\n").encode() for line in lines])
        blocks = list(zip(requests, wheres))
    elif fmt in ("document", "tempo", "jaeger"):
        merged = {"resourceSpans": [rs for r in requests for rs in r["resourceSpans"]]}
        document = {"document": merged,
                    "tempo": {"batches": with_base64_ids(merged)["resourceSpans"]},
                    "jaeger": jaeger(requests)}[fmt]
        data = json.dumps(document, indent=rng.choice([None, 2])).encode()
        blocks = [(r, f"{path}:1") for r in requests]
    elif fmt in ("jaeger-v3", "bom-lines"):  # Jaeger v2's /api/v3 stream; an editor's BOM
        lines = [json.dumps({"result": r} if fmt == "jaeger-v3" else r) for r in requests]
        data = (b"\xef\xbb\xbf" if fmt == "bom-lines" else b"") + (
            "\n".join(lines) + "\n").encode()
        blocks = [(r, f"{path}:{n}") for n, r in enumerate(requests, 1)]
    else:
        messages = [to_proto(r) for r in requests]
        blocks = [(r, f"{path}:#{n}") for n, r in enumerate(requests, 1)]
        if fmt == "zstd-lines":
            data = zstd(("\n".join(json.dumps(r) for r in requests) + "\n").encode())
            blocks = [(r, f"{path}:{n}") for n, r in enumerate(requests, 1)]
        elif fmt == "zstd-proto":
            data = framed([zstd(m) for m in messages])
        elif fmt == "gzip":
            data = gzip.compress(framed(messages))
        else:
            data = _nul_runs(rng, [framed([m]) for m in messages])
    for request, where in blocks:
        for trace, span_id in _span_ids(request):
            case.spans.append((trace, span_id, where))
        for span_id, holder in unreadable.items():
            if holder is request:
                case.spans.append((originals[span_id], span_id, f"unreadable {where}"))
    if rng.random() < 0.05:  # the file itself damaged: cut short or bytes flipped
        case.byte_damaged = True
        data = bytearray(data)
        if rng.random() < 0.5:
            data = data[:rng.randint(0, len(data))]
        else:
            for _ in range(rng.randint(1, 8)):
                data[rng.randrange(len(data))] = rng.randrange(256)
        data = bytes(data)
    with open(path, "wb") as handle:
        handle.write(data)
    return case


def _nul_runs(rng: random.Random, pieces: list[bytes]) -> bytes:
    """The pieces (lines, framed messages), for some cases with runs of NULs before,
    between and after them: every span must still be read."""
    if rng.random() >= NUL_RUNS:
        return b"".join(pieces)
    return b"".join(b"\0" * rng.choice([0, 0, 4, 5, 7, 4096, 70_000]) + piece
                    for piece in [*pieces, b""])


# ---------------------------------------------------------------------- oracle

def check_case(case: Case) -> tuple[list[dict], list[str], list[str]]:
    """Read one case: (rows, problems, oracle failures)."""
    problems: list[str] = []
    rows = list(read_rows(case.path, problems))
    failures = []
    if case.byte_damaged:
        return rows, problems, failures  # no crash is all a damaged file promises
    read = Counter((r["trace_id"], r["span_id"]) for r in rows)
    reported = "\n".join(problems)
    for trace, span_id, where in case.spans:
        if (trace, span_id) in read or where in case.unreadable_wheres:
            continue
        line = where.removeprefix("unreadable ")
        if line in case.unreadable_wheres or f"{line}: skipped a span that cannot" in reported:
            continue
        failures.append(f"{case.path}: span {span_id} ({where}) lost without a report")
    by_span = {r["span_id"]: r for r in rows}
    for span_id, key, _ in case.nulled:
        row = by_span.get(span_id)
        if row is None:
            continue
        wheres = tuple(f"{w}: span {span_id}:" for _, s, w in case.spans if s == span_id)
        if row.get(key) is not None:
            failures.append(f"{case.path}: span {span_id} {key}={row[key]!r} not nulled")
        elif not any(p.startswith(wheres) and key in p for p in problems):
            failures.append(f"{case.path}: span {span_id} {key} nulled without a report")
    for line in case.unreadable_wheres:
        if not any(p.startswith(f"{line}:") for p in problems):
            failures.append(f"{line}: damaged, not reported")
    return rows, problems, failures


def duplicates_reported(problems: list[str]) -> int:
    return sum(int(m.group(1)) for p in problems if (m := _DUPLICATE.match(p)))


def check_batch(directory: str, cases: list[Case], raw_rows: int) -> tuple[list[str], int]:
    """The span table and both turn paths over every case of a directory at once:
    (oracle failures, duplicate spans dropped)."""
    from kvobs.turns.correlate import turns_from_spans
    from kvobs.fleet import fleet_turns
    from kvobs.sources.store import StoreSource, compact

    failures = []
    source = OtlpJsonSource(directory)
    frame = source.spans()
    keyed = frame.dropna(subset=["span_id"])
    if keyed.duplicated(["trace_id", "span_id"]).any():
        failures.append(f"{directory}: a span twice in the span table")
    dropped = raw_rows - len(frame)
    if dropped != duplicates_reported(source.problems):
        failures.append(f"{directory}: {dropped} rows dropped, "
                        f"{duplicates_reported(source.problems)} reported")
    expected = _expected_recomputed(cases, frame)
    pandas_turns = turns_from_spans(frame)
    failures += _compare(directory, "turns", pandas_turns, expected)
    failures += _compare(directory, "fleet", fleet_turns(source), expected)
    # The store's Arrow path on the first cases: compacted, then one segment copied (a
    # span file twice).
    store = directory + "-store"
    os.makedirs(os.path.join(store, sc.STORE_LIVE_DIR))
    for case in cases[:STORE_CASES]:
        shutil.copy(case.path, os.path.join(store, sc.STORE_LIVE_DIR))
    compact(store, writers_stopped=True)
    compacted = sorted(os.path.join(root, name)
                       for root, _, names in os.walk(os.path.join(store, sc.STORE_COMPACTED_DIR))
                       for name in names)
    if compacted:
        shutil.copy(compacted[0], compacted[0].replace(".parquet", "-copy.parquet"))
    store_source = StoreSource(store)
    store_expected = _expected_recomputed(cases[:STORE_CASES], store_source.spans())
    failures += _compare(store, "store fleet", fleet_turns(store_source), store_expected)
    if compacted and not duplicates_reported(store_source.problems):
        failures.append(f"{store}: a copied segment's spans dropped without a report")
    return failures, dropped


def _expected_recomputed(cases: list[Case], frame) -> dict[tuple[str, int], int]:
    present = set(frame["span_id"].dropna())
    expected: dict[tuple[str, int], int] = defaultdict(int)
    for case in cases:
        if case.byte_damaged:  # a flipped digit changes a count: nothing to expect
            continue
        for (cid, turn, span_id), tokens in case.recomputed.items():
            if span_id in present:
                expected[(cid, turn)] += tokens
    return expected


def _compare(where: str, path: str, turns, expected) -> list[str]:
    failures = []
    import pandas as pd

    got = {(row.conversation_id, int(row.turn)): row.recomputed_tokens
           for row in turns[["conversation_id", "turn", "recomputed_tokens"]].itertuples()
           if pd.notna(row.recomputed_tokens)}
    for key, tokens in expected.items():
        if int(got.get(key) or 0) != tokens:
            failures.append(f"{where}: {path} turn {key}: recomputed {got.get(key)}, "
                            f"distinct spans sum to {tokens}")
    return failures
