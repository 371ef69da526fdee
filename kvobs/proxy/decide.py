"""The proxy's decisions, as pure functions: no I/O, no clock, no state of their own.

Each takes what the I/O around it found (the store's answer, the engines' params, the
request's identity, the time) and returns what to do. ``turn`` and ``legs`` call them;
``tests/proxy/test_proxy_decide.py`` holds their case table (every lookup outcome and
every miss reason).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvobs import semconv as sc

from kvobs.proxy._digest import extends
from kvobs.proxy._identity import ANONYMOUS
from kvobs.proxy.store import Begun, Entry

LO = sc.LookupOutcome
MR = sc.MissReason
_TURN_KEYS = frozenset((*sc.CORRELATION_KEYS, sc.KTP_REQUEST_ID))

# ---------------------------------------------------------------------- tenants


def isolated(tenant: str, anonymous_policy: str) -> bool:
    """A client without a credential, while anonymous clients share nothing.

    >>> isolated(ANONYMOUS, "isolated"), isolated(ANONYMOUS, "shared"), isolated("ab", "isolated")
    (True, False, False)
    """
    return tenant == ANONYMOUS and anonymous_policy == "isolated"


def admit_tenant(known: bool, admitted_in_window: int, limit: int) -> bool:
    """Whether a tenant's turn may use the store: a known tenant always, a new one while
    fewer than ``limit`` new tenants came in this window (0: no bound).

    >>> admit_tenant(True, 9, 1), admit_tenant(False, 0, 1), admit_tenant(False, 1, 1)
    (True, True, False)
    >>> admit_tenant(False, 10**6, 0)
    True
    """
    return known or limit <= 0 or admitted_in_window < limit


def refusal(tenant: str, anonymous_policy: str, admitted: bool) -> sc.MissReason | None:
    """Why the store must not be asked for this turn at all (None: it may be).

    >>> refusal(ANONYMOUS, "isolated", True).value, refusal("ab", "isolated", False).value
    ('anonymous', 'tenant-limited')
    >>> refusal(ANONYMOUS, "shared", True) is None
    True
    """
    if isolated(tenant, anonymous_policy):
        return MR.ANONYMOUS
    if not admitted:
        return MR.TENANT_LIMITED
    return None


# ---------------------------------------------------------------------- conversation


def history_turn(body: dict[str, Any]) -> int | None:
    """Turn index a chat request's own history implies: 1 + assistant messages.

    >>> history_turn({"messages": [{"role": "user"}, {"role": "assistant"}, {"role": "user"}]})
    2
    >>> history_turn({"prompt": "abc"}) is None
    True
    """
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    return 1 + sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "assistant")


def should_infer(has_id: bool, infer_on: bool, refused: sc.MissReason | None) -> bool:
    """An id-less request looks for the conversation it continues (tenant-scoped)."""
    return not has_id and infer_on and refused is None


def new_conversation_id(trace_id: str, span_id: str | None = None) -> str:
    """The name kvobs gives an id-less turn (``anonymous:<trace id>``), so a later id-less
    turn can continue it. A turn in the client's trace, which the client's other turns
    may share, is named by its span too (``anonymous:<trace id>.<span id>``): two new
    conversations in one client trace are two conversations.

    >>> new_conversation_id("ab" * 16, "cd" * 8)
    'anonymous:abababababababababababababababab.cdcdcdcdcdcdcdcd'
    """
    return sc.ANONYMOUS_PREFIX + trace_id + (f".{span_id}" if span_id else "")


def trace_and_span(traceparent: str, shared: bool) -> tuple[str, str | None]:
    """A W3C ``traceparent``'s trace id, and its span id when the trace is ``shared``
    (the client's): what ``new_conversation_id`` names a new conversation by.

    >>> trace_and_span("00-" + "ab" * 16 + "-" + "cd" * 8 + "-01", False)
    ('abababababababababababababababab', None)
    """
    _, trace_id, span_id, *_ = traceparent.split("-")
    return trace_id, span_id if shared else None


# ---------------------------------------------------------------------- lookup


@dataclass(slots=True)
class Lookup:
    outcome: sc.LookupOutcome
    turn: int
    miss_reason: sc.MissReason | None = None
    gap_s: float | None = None  # since the previous turn ended
    age_s: float | None = None  # of the stored params
    remaining_s: float | None = None  # until the stored params' expiry

    @property
    def params_sent(self) -> bool:
        return self.outcome is LO.HIT

    def attributes(self) -> dict[str, Any]:
        return {
            sc.LOOKUP_OUTCOME.key: self.outcome,
            sc.PARAMS_SENT.key: self.params_sent,
            sc.LOOKUP_MISS_REASON.key: self.miss_reason,
            sc.INTER_TURN_GAP.key: self.gap_s,
            sc.ENTRY_AGE.key: self.age_s,
            sc.ENTRY_REMAINING_TTL.key: self.remaining_s,
        }


def lookup(
    body: dict[str, Any],
    now: float,
    *,
    has_id: bool,
    refused: sc.MissReason | None,
    asked: bool,
    begun: Begun | None,
) -> Lookup:
    """The turn's outcome, index and miss reason.

    ``has_id``: the turn has a conversation (sent, or inferred); ``refused``: why the
    store was not asked (``refusal``); ``asked``: the store was asked; ``begun``: its
    answer (None when it gave none). A chat history says which turn this is even when the
    store forgot the conversation (restart, eviction, a replica without shared state)."""
    from_history = history_turn(body) or 1
    if refused is not None:
        return Lookup(LO.MISS if has_id else LO.NO_ID, from_history, refused)
    if not has_id:
        # With inference on, the new id starts a conversation a later id-less turn may
        # continue; the turn itself has nothing to look up.
        return Lookup(LO.NO_ID, from_history, MR.NEVER_SEEN)
    if not asked or begun is None:  # the store could not say: no reuse this turn
        return Lookup(LO.MISS, from_history, MR.STORE_UNAVAILABLE)
    turn = max(begun.turn, from_history)
    previous = begun.previous
    gap = None
    if previous is not None and previous.ended_at is not None:
        gap = max(0.0, now - previous.ended_at)
    if previous is None or previous.params is None:
        reason = (
            MR.NOT_STORED
            if previous is not None
            else MR.EVICTED
            if begun.evicted
            else MR.NEVER_SEEN
        )
        return Lookup(LO.MISS, turn, reason, gap)
    age = max(0.0, now - previous.stored_at) if previous.stored_at is not None else None
    remaining = previous.expires_at - now if previous.expires_at is not None else None
    if previous.expires_at is None or now >= previous.expires_at:
        outcome = LO.STALE
    elif not extends(previous.digest, body):
        outcome = LO.PREFIX_MISMATCH
    else:
        outcome = LO.HIT
    return Lookup(outcome, turn, None, gap, age, remaining)


# ---------------------------------------------------------------------- prefill


def prefill_params(params: dict[str, Any] | None, keys: dict[str, Any]) -> dict[str, Any]:
    """P's ``kv_transfer_params``: D's stored params on a hit, else upstream's explicit
    form (every ``remote_*`` None); the turn's correlation keys on both."""
    if params:
        ktp = {**params, "do_remote_decode": True, "do_remote_prefill": False}
    else:
        ktp = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        }
    ktp.update(keys)
    return ktp


def falls_back(params_sent: bool, kind: str, status: int) -> bool:
    """P failed a request that carried params with a 5xx: retry once without them.

    >>> falls_back(True, "http-error", 500), falls_back(False, "http-error", 500)
    (True, False)
    >>> falls_back(True, "http-error", 400), falls_back(True, "timeout", 504)
    (False, False)
    """
    return params_sent and kind == "http-error" and status >= 500


def fallback_reason(body: bytes | None) -> sc.FallbackReason:
    """What P's error body says; vLLM 0.32 answers a generic 500 for both a declined and
    a failed read, so the proxy says only what it knows (P's read span says the rest).

    >>> [fallback_reason(b).value for b in (b"blocks expired", b"NIXL transfer", None)]
    ['read-declined', 'read-failed', 'prefill-error']
    """
    text = (body or b"")[:4096].lower()
    if b"expired" in text or b"declin" in text:
        return sc.FallbackReason.READ_DECLINED
    if b"kv load" in text or b"transfer" in text or b"nixl" in text:
        return sc.FallbackReason.READ_FAILED
    return sc.FallbackReason.PREFILL_ERROR


def upstream_answer(kind: str, status: int, has_body: bool) -> tuple[bool, int]:
    """A failed leg's answer to the client: (pass the engine's answer through, status).
    An engine's 4xx is the client's fault and passes through; a timeout is 504, the rest
    502.

    >>> upstream_answer("http-error", 400, True), upstream_answer("http-error", 500, True)
    ((True, 400), (False, 502))
    >>> upstream_answer("timeout", 504, False), upstream_answer("unreachable", 502, False)
    ((False, 504), (False, 502))
    """
    if kind == "http-error" and 400 <= status < 500 and has_body:
        return True, status
    return False, 504 if kind == "timeout" else 502


# ---------------------------------------------------------------------- store and expiry


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def has_blocks(params: dict[str, Any]) -> bool:
    """D kept blocks for this history.

    >>> has_blocks({"remote_block_ids": [1]}), has_blocks({"remote_block_ids": [[], []]})
    (True, False)
    """
    blocks = params.get("remote_block_ids")
    if not blocks:
        return False
    return any(bool(group) for group in blocks) if isinstance(blocks[0], list) else True


def decode_expiry(params: dict[str, Any], default_ttl_s: float) -> tuple[float, float] | None:
    """D's ``remote_blocks_expiry_time`` (on D's clock) and its TTL, when D kept blocks.

    >>> decode_expiry({"remote_blocks_expiry_time": 90.0, "remote_block_ids": [1]}, 480)
    (90.0, 480)
    >>> decode_expiry({"remote_block_ids": [1]}, 480) is None
    True
    """
    expiry_d = _number(params.get("remote_blocks_expiry_time"))
    if expiry_d is None or not has_blocks(params):
        return None
    return expiry_d, _number(params.get(sc.KTP_DECODE_TTL)) or default_ttl_s


def entry_expiry(
    answered_wall: float,
    d_expiry_wall: float | None,
    *,
    margin_s: float,
    max_lifetime_s: float | None,
    fixed_lifetime_s: float | None,
) -> float | None:
    """When the entry stops being offered: ``margin_s`` before D's blocks expire (on the
    proxy's clock), capped by ``max_lifetime_s``; upstream's fixed life when set. None:
    nothing usable (no expiry, or already within the margin).

    >>> entry_expiry(100.0, 580.0, margin_s=7, max_lifetime_s=None, fixed_lifetime_s=None)
    573.0
    >>> entry_expiry(100.0, 580.0, margin_s=7, max_lifetime_s=60, fixed_lifetime_s=None)
    160.0
    >>> entry_expiry(100.0, 105.0, margin_s=7, max_lifetime_s=None, fixed_lifetime_s=None)
    >>> entry_expiry(100.0, None, margin_s=7, max_lifetime_s=None, fixed_lifetime_s=300)
    """
    if d_expiry_wall is None:
        return None
    if fixed_lifetime_s is not None:
        return answered_wall + fixed_lifetime_s
    expires = d_expiry_wall - margin_s
    if max_lifetime_s is not None:
        expires = min(expires, answered_wall + max_lifetime_s)
    return expires if expires > answered_wall else None


def stored_params(params: dict[str, Any], decode_host: Any | None) -> dict[str, Any]:
    """D's params as the store keeps them: the turn's own correlation keys go (the next
    turn's replace them), D's facts stay; ``remote_host`` is D's HTTP host when given.

    >>> stored_params({"kvobs_turn_index": 2, "remote_host": "x", "a": 1}, "d1")
    {'remote_host': 'd1', 'a': 1}
    """
    kept = {k: v for k, v in params.items() if k not in _TURN_KEYS}
    if decode_host is not None:
        kept["remote_host"] = decode_host
    return kept


def store_action(usable: bool, previous: Entry | None) -> str:
    """``stored`` (first params of the conversation), ``refreshed`` or ``skipped``.

    >>> store_action(True, None), store_action(True, Entry(stored_turn=1)), store_action(False, None)
    ('stored', 'refreshed', 'skipped')
    """
    if not usable:
        return "skipped"
    return "refreshed" if previous is not None and previous.stored_turn > 0 else "stored"
