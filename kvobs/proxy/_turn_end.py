"""How a turn ends: its answer when it failed (a 500 or an SSE error event, an
engine's failure passed through or named), and the turn's span and metrics.
"""

from __future__ import annotations

import logging
import time

from aiohttp import web
from opentelemetry import trace

from kvobs import semconv as sc
from kvobs.emit.spans import Correlation, clean

from kvobs.proxy import decide
from kvobs.proxy._log import log
from kvobs.proxy._metrics import ProxyMetrics
from kvobs.proxy._relay import ClientGone, sse_error, to_client
from kvobs.proxy._state import TurnState, UpstreamError

_LOG = logging.getLogger("kvobs.proxy")
PE = sc.ProxyError


def json_error(status: int, message: str, type_: str) -> web.Response:
    body = {"error": {"message": message, "type": type_, "code": status}}
    return web.json_response(body, status=status)


async def internal_error(metrics: ProxyMetrics, state: TurnState) -> web.StreamResponse:
    """A 500 in OpenAI's error form; once a stream has started, an SSE error event
    and ``[DONE]`` end it instead."""
    metrics.internal_errors.inc()
    message = "the proxy failed to complete the request"
    client = state.client
    if client is None or not client.prepared:
        return json_error(500, message, "internal_error")
    try:
        await to_client(client.write(sse_error(message, "internal_error", 500)))
        await to_client(client.write_eof())
    except ClientGone:
        state.error = PE.CLIENT_DISCONNECTED
    return client


def upstream_failure(metrics: ProxyMetrics, error: UpstreamError, state: TurnState) -> web.Response:
    state.error = error.error
    metrics.upstream_errors.labels(error.role, error.kind).inc()
    passthrough, status = decide.upstream_answer(error.kind, error.status, bool(error.body))
    cause = f"answered {error.status}" if error.kind == "http-error" else error.kind
    log(
        _LOG,
        logging.INFO if passthrough else logging.WARNING,
        "engine failed a turn",
        role=error.role,
        cause=cause,
        status=status,
        request_id=state.request_id,
    )
    if passthrough:  # the engine refused the client's request: its answer as it is
        return web.Response(body=error.body, status=status, content_type="application/json")
    return json_error(status, f"{error.role} engine {error.kind}", "upstream_error")


def end_turn(
    metrics: ProxyMetrics, span: trace.Span, state: TurnState, correlation: Correlation
) -> None:
    turn_bucket = sc.turn_bucket(state.turn or 1)
    prompt_bucket = sc.prompt_bucket(state.prompt_tokens or 0)
    metrics.turns.labels(turn_bucket, prompt_bucket, state.outcome.value).inc()
    if state.error is None and state.d_answered is not None:
        # The turn's trace id as exemplar: a dashboard point opens the turn's trace.
        context = span.get_span_context()
        exemplar = (
            {sc.EXEMPLAR_TRACE_ID: trace.format_trace_id(context.trace_id)}
            if context.is_valid
            else None
        )
        if state.ttft_s is not None:
            metrics.ttft.labels(turn_bucket, prompt_bucket).observe(state.ttft_s, exemplar)
        metrics.latency.labels(turn_bucket, prompt_bucket).observe(
            time.perf_counter() - state.start_perf, exemplar
        )
        metrics.observe_phases(state, time.time())
    try:
        if span.is_recording():
            span.set_attributes(
                {
                    **correlation.attributes(),
                    **clean(
                        {
                            sc.STREAM.key: state.stream,
                            sc.TTFT.key: state.ttft_s,
                            sc.PREFILL_TIME.key: state.prefill_s,
                            sc.DECODE_TIME.key: state.decode_s,
                            sc.LOOKUP_OUTCOME.key: state.outcome,
                            sc.LOOKUP_MISS_REASON.key: state.miss_reason,
                            sc.PARAMS_SENT.key: state.params_sent,
                            sc.PARAMS_SOURCE.key: state.source,
                            sc.PROMPT_TOKENS.key: state.prompt_tokens,
                            sc.OUTPUT_TOKENS.key: state.output_tokens,
                            sc.REQUEST_MODEL.key: state.model,
                            sc.RESPONSE_ID.key: state.response_id,
                            sc.REQUEST_ID.key: state.request_id,
                            sc.ROLE.key: "proxy",
                            sc.PROXY_ERROR.key: state.error,
                            sc.FALLBACK_REASON.key: state.fallback,
                            sc.PREFILL_SENT_AT.key: state.p_sent,
                            sc.PREFILL_RETRY_SENT_AT.key: state.p_retry_sent,
                            sc.PREFILL_ANSWERED_AT.key: state.p_answered,
                            sc.DECODE_SENT_AT.key: state.d_sent,
                            sc.DECODE_FIRST_OUTPUT_AT.key: state.d_first_output,
                            sc.DECODE_ANSWERED_AT.key: state.d_answered,
                        }
                    ),
                }
            )
            if state.error is not None:
                # The cause (ProxyError names the role), never request text.
                span.set_status(trace.Status(trace.StatusCode.ERROR, state.error.value))
        span.end()
    except Exception:  # noqa: BLE001 - telemetry never breaks serving
        _LOG.debug("turn span failed", exc_info=True)
