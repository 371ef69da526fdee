"""What one turn carries between the proxy's modules: the facts gathered during the turn
(``TurnState``) and a failed engine leg (``UpstreamError``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from opentelemetry.context import Context

from kvobs import semconv as sc

from kvobs.proxy._guard import Budget


class UpstreamError(Exception):
    """An engine leg failed before the client got any byte of its answer."""

    def __init__(
        self,
        role: str,
        kind: str,
        error: sc.ProxyError,
        status: int = 502,
        body: bytes | None = None,
    ):
        super().__init__(f"{role} {kind}")
        self.role, self.kind, self.error, self.status, self.body = role, kind, error, status, body


@dataclass
class TurnState:
    """Facts gathered during one turn, turned into span attributes and metrics at the end."""

    stream: bool
    request_id: str
    start_wall: float
    start_perf: float
    store_budget: Budget  # what the turn may still wait on the store
    conversation_id: str | None = None  # the client's, or the one the proxy gave it
    turn: int | None = None
    outcome: sc.LookupOutcome = sc.LookupOutcome.NO_ID
    miss_reason: sc.MissReason | None = None
    params_sent: bool = False
    prompt_tokens: int | None = None
    output_tokens: int | None = None  # D's usage, when its answer carries one
    model: str | None = None  # the client's "model"
    response_id: str | None = None  # D's answer "id", as the client gets it
    prefill_s: float | None = None
    decode_s: float | None = None
    ttft_s: float | None = None  # streamed turns only: D's first bytes at the proxy
    # The turn continues the client's trace, which other turns may share: a new
    # conversation id then names the turn's span too (decide.new_conversation_id).
    client_trace: bool = False
    # Timeline marks (wall clock, unix s): see sc.Phase and kvobs/timeline.py.
    p_sent: float | None = None
    p_retry_sent: float | None = None
    p_answered: float | None = None
    d_sent: float | None = None
    d_first_output: float | None = None
    d_answered: float | None = None
    source: sc.ParamsSource = sc.ParamsSource.NONE
    error: sc.ProxyError | None = None
    fallback: sc.FallbackReason | None = None
    decode_host: str | None = None
    store_failure: sc.StoreFailure | None = None  # the params publisher's
    client: Any = None  # the client's StreamResponse once a stream has started
    http_context: Context | None = None  # the SERVER span's: its legs' CLIENT spans' parent
    # The turn's ``kvobs.shard``, from P's answer (the proxy has no block hashes), and
    # the kvobs spans that ended before it came (``_turn_spans``).
    shard: str | None = None
    held_spans: list = field(default_factory=list)
