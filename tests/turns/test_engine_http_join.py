"""The engines' HTTP front-door spans (kvobs.emit.engine_http) joined to the request they
time: by vLLM's request id and the request's arrival inside the span, never guessed."""

from __future__ import annotations

from kvobs import semconv as sc
from kvobs.sources._frame import table_from_rows
from kvobs.turns.correlate import engine_http_roles

S = 1_000_000_000
T0 = 1_700_000_000 * S


def _request(name, rid, arrived_s, **extra):
    return {"name": name, "trace_id": f"t-{rid}", "span_id": f"s-{rid}",
            "start_ns": T0 + int(arrived_s * S), "end_ns": T0 + int((arrived_s + 0.1) * S),
            sc.REQUEST_ID.key: rid, sc.REQUEST_ARRIVED_AT.key: T0 / S + arrived_s, **extra}


def _http(vllm_id, start_s, end_s, span_id):
    return {"name": sc.ENGINE_HTTP_SPAN, "trace_id": f"h-{span_id}", "span_id": span_id,
            "start_ns": T0 + int(start_s * S), "end_ns": T0 + int(end_s * S),
            sc.VLLM_REQUEST_ID.key: vllm_id}


def _joined(rows):
    table = engine_http_roles(table_from_rows(rows))
    return {r["span_id"]: r for r in table.to_pylist()}


def test_one_id_on_p_and_d_is_told_apart_by_which_arrival_the_span_holds():
    """A router may send P and D one X-Request-Id: P's front door holds P's arrival, D's
    holds D's; each takes its request's role, internal id and keys."""
    rows = [
        _request(sc.SPAN_PREFILL_REQUEST.name, "chatcmpl-x-1a2b3c4d", 0.010,
                 **{sc.CONVERSATION_ID.key: "c", sc.TURN_INDEX.key: 2}),
        _request(sc.SPAN_DECODE_REQUEST.name, "chatcmpl-x-9f8e7d6c", 0.210,
                 **{sc.REMOTE_REQUEST_ID.key: "chatcmpl-x-1a2b3c4d"}),
        _http("chatcmpl-x", 0.0, 0.150, "hp"),
        _http("chatcmpl-x", 0.200, 0.600, "hd"),
    ]
    out = _joined(rows)
    assert out["hp"]["name"] == sc.SPAN_PREFILL_HTTP.name
    assert out["hp"][sc.REQUEST_ID.key] == "chatcmpl-x-1a2b3c4d"
    assert (out["hp"][sc.CONVERSATION_ID.key], out["hp"][sc.TURN_INDEX.key]) == ("c", 2)
    assert out["hd"]["name"] == sc.SPAN_DECODE_HTTP.name
    assert out["hd"][sc.REQUEST_ID.key] == "chatcmpl-x-9f8e7d6c"
    assert out["hd"][sc.REMOTE_REQUEST_ID.key] == "chatcmpl-x-1a2b3c4d"


def test_d_arriving_before_p_s_answer_has_left_is_still_d_s():
    """vllm-router sends D the request while P's answer is still leaving P (one
    X-Request-Id for both): P's span then holds D's arrival too, which D's own span,
    started later, claims. A completion's engine requests carry its prompt's index."""
    rows = [
        _request(sc.SPAN_PREFILL_REQUEST.name, "cmpl-r-0-1a2b3c4d", 0.002),
        _request(sc.SPAN_DECODE_REQUEST.name, "cmpl-r-0-9f8e7d6c", 0.4132),
        _http("cmpl-r", 0.0, 0.4137, "hp"),
        _http("cmpl-r", 0.4131, 0.9, "hd"),
    ]
    out = _joined(rows)
    assert out["hp"][sc.REQUEST_ID.key] == "cmpl-r-0-1a2b3c4d"
    assert out["hd"][sc.REQUEST_ID.key] == "cmpl-r-0-9f8e7d6c"
    assert out["hd"]["name"] == sc.SPAN_DECODE_HTTP.name


def test_a_span_holding_two_requests_or_none_is_left_unjoined():
    rows = [
        # a client reusing one X-Request-Id for two requests that overlap
        _request(sc.SPAN_PREFILL_REQUEST.name, "chatcmpl-dup-00000001", 0.010),
        _request(sc.SPAN_PREFILL_REQUEST.name, "chatcmpl-dup-00000002", 0.020),
        _http("chatcmpl-dup", 0.0, 0.5, "both"),
        # the request arrived after the span ended: another request of that id
        _request(sc.SPAN_PREFILL_REQUEST.name, "chatcmpl-late-00000003", 2.0),
        _http("chatcmpl-late", 0.0, 0.5, "outside"),
        _http("chatcmpl-nobody", 0.0, 0.5, "alone"),
        _http(None, 0.0, 0.5, "no-id"),
    ]
    out = _joined(rows)
    for span_id in ("both", "outside", "alone", "no-id"):
        assert out[span_id]["name"] == sc.ENGINE_HTTP_SPAN, span_id
        assert out[span_id][sc.REQUEST_ID.key] is None, span_id

