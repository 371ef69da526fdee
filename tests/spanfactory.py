"""Build span sets through the real emit path: kvobs emitters -> OTel SDK -> OTLP-JSON
file exporter -> store directory. Tests then read them back with a real source.

A ``TurnSpec`` says what each component saw in one turn; ``write_conversation`` emits
the spans the proxy, P and D would have emitted, with each role's tracer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvobs import semconv as sc
from kvobs.emit.setup import configure_tracing, flush
from kvobs.emit.spans import Correlation, emit

SECOND = 1_000_000_000


@dataclass
class TurnSpec:
    lookup: str | None = "hit"  # None: proxy emitted no lookup span
    decision: str | None = "pull"  # None: P emitted no decision span
    read: str | None = None  # read outcome, None: no read span
    n: int = 1000
    local: int = 0
    remote: int = 900
    threshold: int = 64
    read_duration_s: float = 0.005
    read_unobserved_s: float | None = None  # of it, after P's worker last saw it in flight
    read_bytes: int = 2_000_000
    prefill_leg_s: float = 0.2
    ttft_s: float = 0.25
    gap_s: float = 5.0
    ttl_s: float = 30.0
    fallback: str | None = None
    params_sent: bool | None = None  # default: lookup == "hit"
    stuck: bool = False
    release: str | None = None  # release reason of this turn's D blocks
    proxy: bool = True  # proxy turn span present
    export: bool = True
    extra: dict[str, Any] = field(default_factory=dict)
    # Phase value -> seconds: emit the turn's timeline (proxy marks, P's and D's request
    # spans, the read's start, D's hand-off) so that these phases come out; unnamed
    # phases take 0 s. ``None``: no timeline spans (the turn span alone, as before).
    phases: dict[str, float] | None = None
    stream: bool = False
    output_tokens: int = 16
    omit: tuple[str, ...] = ()  # span names of the timeline not to emit
    # The engines' HTTP front doors (kvobs.emit.engine_http) timed: P's from p-sent to
    # p-answered, D's from d-sent to d-answered, each naming its request by vLLM's id.
    http: bool = False


def marks_of(spec: TurnSpec, begin_ns: int) -> dict[str, int]:
    """The timeline's marks (ns) for ``spec.phases``, by kvobs.timeline.MARKS name."""
    from kvobs.timeline import MARKS

    out = {MARKS[0].name: begin_ns}
    previous = begin_ns
    for phase, mark in zip(sc.Phase, MARKS[1:]):
        previous += int((spec.phases or {}).get(phase.value, 0.0) * SECOND)
        out[mark.name] = previous
    return out


def _emit_timeline(tracers, corr, spec: TurnSpec, index: int, cid: str, m: dict[str, int]):
    s = {name: ns / SECOND for name, ns in m.items()}
    prefill, decode = tracers[sc.Service.PREFILL], tracers[sc.Service.DECODE]
    read_done = spec.read == "done"
    if sc.SPAN_PREFILL_REQUEST.name not in spec.omit:
        emit(prefill, sc.SPAN_PREFILL_REQUEST, corr, {
            sc.REQUEST_ARRIVED_AT.key: s["p-arrived"],
            sc.REQUEST_SCHEDULED_AT.key: s["p-scheduled"],
            sc.REQUEST_ALLOCATED_AT.key: s["p-allocated"],
            sc.REQUEST_KV_READY_AT.key: s["p-kv-ready"] if read_done else None,
            sc.REQUEST_FIRST_TOKEN_AT.key: s["p-first-token"], sc.PROMPT_TOKENS.key: spec.n,
            sc.OUTPUT_TOKENS.key: 1, sc.REQUEST_ID.key: f"p-{cid}-{index}"},
             m["p-arrived"], m["p-first-token"])
    if sc.SPAN_DECODE_REQUEST.name not in spec.omit:
        emit(decode, sc.SPAN_DECODE_REQUEST, corr, {
            sc.REQUEST_ARRIVED_AT.key: s["d-arrived"],
            sc.REQUEST_SCHEDULED_AT.key: s["d-scheduled"],
            sc.REQUEST_KV_READY_AT.key: s["d-kv-ready"],
            sc.REQUEST_FIRST_TOKEN_AT.key: s["first-token"],
            sc.PROMPT_TOKENS.key: spec.n, sc.OUTPUT_TOKENS.key: spec.output_tokens,
            sc.REQUEST_ID.key: f"d-{cid}-{index}"}, m["d-arrived"], m["d-answered"])
    if spec.http:
        engine = tracers[sc.Service.ENGINE]
        for role, start, end in (("p", "p-sent", "p-answered"), ("d", "d-sent", "d-answered")):
            span = engine.start_span(sc.ENGINE_HTTP_SPAN, start_time=m[start], attributes={
                sc.VLLM_REQUEST_ID.key: f"{role}-{cid}-{index}"})
            span.end(end_time=m[end])
    if sc.SPAN_HANDOFF.name not in spec.omit:
        emit(decode, sc.SPAN_HANDOFF, corr, {
            sc.READ_DIRECTION.key: "p_to_d", sc.READ_OUTCOME.key: "done",
            sc.READ_BYTES.key: spec.read_bytes,
            sc.READ_DURATION.key: s["d-kv-ready"] - s["handoff-start"],
            sc.READ_SETUP.key: s["handoff-start"] - s["handoff-requested"]},
             m["handoff-start"], m["d-kv-ready"])


class Tracers:
    def __init__(self, store_dir: str):
        self.by_service = {s: configure_tracing(s, store_dir) for s in sc.Service}

    def __getitem__(self, service: sc.Service):
        return self.by_service[service]

    def flush(self):
        for tracer in self.by_service.values():
            flush(tracer)


def write_conversation(tracers: Tracers, conversation_id: str, turns: list[TurnSpec],
                       start_s: float = 1_700_000_000.0, tenant: str = "tenant0") -> None:
    t = int(start_s * SECOND)
    for index, spec in enumerate(turns, 1):
        if index > 1:
            t += int(spec.gap_s * SECOND)
        corr = Correlation(conversation_id, index, tenant)
        begin, end = t, t + int((spec.ttft_s + 0.1) * SECOND)
        marks = marks_of(spec, begin) if spec.phases is not None else None
        if marks is not None:
            end = marks["turn-end"]
            _emit_timeline(tracers, corr, spec, index, conversation_id, marks)
        proxy, prefill, decode = (tracers[sc.Service.PROXY], tracers[sc.Service.PREFILL],
                                  tracers[sc.Service.DECODE])
        if spec.proxy:
            attributes = {sc.STREAM.key: spec.stream, sc.TTFT.key: spec.ttft_s,
                          sc.PREFILL_TIME.key: spec.prefill_leg_s}
            if marks is not None:
                s = {name: ns / SECOND for name, ns in marks.items()}
                attributes.update({
                    sc.TTFT.key: s["first-token"] - s["turn-start"] if spec.stream else None,
                    sc.PREFILL_SENT_AT.key: s["p-sent"],
                    sc.PREFILL_RETRY_SENT_AT.key: s["p-retry-sent"] if spec.fallback else None,
                    sc.PREFILL_ANSWERED_AT.key: s["p-answered"],
                    sc.DECODE_SENT_AT.key: s["d-sent"],
                    sc.DECODE_FIRST_OUTPUT_AT.key: s["first-token"] if spec.stream else None,
                    sc.DECODE_ANSWERED_AT.key: s["d-answered"]})
            emit(proxy, sc.SPAN_PROXY_TURN, corr, attributes, begin, end)
            if spec.lookup is not None and index > 1:
                emit(proxy, sc.SPAN_PROXY_LOOKUP, corr,
                     {sc.LOOKUP_OUTCOME.key: spec.lookup,
                      sc.PARAMS_SENT.key: (spec.lookup == "hit" if spec.params_sent is None
                                           else spec.params_sent)}, begin, begin + 1000)
            if spec.fallback:
                emit(proxy, sc.SPAN_PROXY_FALLBACK, corr, {sc.FALLBACK_REASON.key: spec.fallback},
                     begin + 2000, begin + 3000)
        if spec.decision is not None:
            m = max(0, min(spec.remote, spec.n) - spec.local)
            emit(prefill, sc.SPAN_PULL_DECISION, corr,
                 {sc.PROMPT_TOKENS.key: spec.n, sc.LOCAL_HIT_TOKENS.key: spec.local,
                  sc.REMOTE_TOKENS.key: spec.remote, sc.CANDIDATE_TOKENS.key: m,
                  sc.THRESHOLD.key: spec.threshold, sc.PULL_DECISION.key: spec.decision,
                  sc.REQUEST_ID.key: f"p-{conversation_id}-{index}", **spec.extra},
                 begin + 1000, begin + 2000)
        if spec.read is not None and sc.SPAN_READ.name not in spec.omit:
            read_start = marks["read-start"] if marks is not None else begin + 2000
            setup = (marks["read-start"] - marks["read-requested"]) / SECOND if marks else None
            emit(prefill, sc.SPAN_READ, corr,
                 {sc.READ_OUTCOME.key: spec.read, sc.READ_BYTES.key: spec.read_bytes,
                  sc.READ_DURATION.key: spec.read_duration_s, sc.READ_BLOCKS.key: 50,
                  sc.REMAINING_TTL_AT_READ.key: spec.ttl_s - spec.gap_s,
                  sc.READ_SETUP.key: setup, sc.READ_UNOBSERVED.key: spec.read_unobserved_s},
                 read_start, read_start + int(spec.read_duration_s * SECOND),
                 error="prefill: KV read d_to_p failed" if spec.read == "failed" else None)
        if spec.stuck:
            emit(prefill, sc.SPAN_STUCK, corr, {}, begin + 3000, begin + 4000)
        if spec.export:
            emit(decode, sc.SPAN_EXPORT, corr,
                 {sc.EXPORT_TOKENS.key: spec.n + 10, sc.EXPORT_BLOCKS.key: (spec.n + 10) // 16,
                  sc.TTL.key: spec.ttl_s, sc.REQUEST_ID.key: f"d-{conversation_id}-{index}",
                  sc.EXPORT_EXPIRES_AT.key: end / SECOND + spec.ttl_s}, end - 1000, end)
        if spec.release:
            release_at = end + int(spec.ttl_s * SECOND)
            emit(decode, sc.SPAN_RELEASE, corr, {sc.RELEASE_REASON.key: spec.release},
                 release_at, release_at + 1000)
        t = end
    tracers.flush()


def classified_store(store_dir: str, conversations: dict[str, list[TurnSpec]]) -> str:
    """A live classifier's store: the conversations' spans under ``spans/`` and, as
    ``kvobs collect`` leaves them, their final turns under ``turns/`` (one classifier
    of a sharded tier, holding these conversations only)."""
    import glob
    import json
    import os

    from kvobs.live.classifier import Classifier
    from kvobs.live.turnstore import TurnStore

    tracers = Tracers(store_dir)
    for conversation_id, turns in conversations.items():
        write_conversation(tracers, conversation_id, turns)
    classifier = Classifier(window_s=600, grace_s=0)
    for path in sorted(glob.glob(os.path.join(store_dir, "spans", "*.otlp.jsonl"))):
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                if line.strip():
                    classifier.add_request(json.loads(line), now=100.0)
    TurnStore(store_dir, 0).write(classifier.run_pass(now=100.0).finalized, now=1_700_000_000.0)
    return store_dir
