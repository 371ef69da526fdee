"""The proxy's decisions (kvobs/proxy/decide.py) as a case table: every lookup outcome and
every miss reason, the tenant and anonymous policy, inference, fallback, expiry and
store. No I/O: each case is a call and its answer."""

from __future__ import annotations

import ast
import inspect

import pytest

from kvobs import semconv as sc
from kvobs.proxy import decide
from kvobs.proxy._digest import history_digest
from kvobs.proxy._identity import ANONYMOUS
from kvobs.proxy.store import Begun, Entry

LO, MR = sc.LookupOutcome, sc.MissReason
NOW = 1000.0
HISTORY = {"messages": [{"role": "user", "content": "q1"}]}
ANSWER = {"role": "assistant", "content": "a1"}
DIGEST = history_digest(HISTORY, ANSWER, None)
NEXT = {"messages": [*HISTORY["messages"], ANSWER, {"role": "user", "content": "q2"}]}
REWRITTEN = {"messages": [{"role": "user", "content": "other"}, ANSWER,
                          {"role": "user", "content": "q2"}]}


def stored(expires_at=NOW + 100, params=None, digest=DIGEST, ended_at=NOW - 5):
    return Entry(turn=1, params=params if params is not None else {"remote_block_ids": [1]},
                 expires_at=expires_at, stored_at=NOW - 10, ended_at=ended_at,
                 digest=digest, stored_turn=1)


# (case, body, kwargs of decide.lookup, outcome, turn, miss reason)
LOOKUPS = [
    ("hit", NEXT, dict(has_id=True, refused=None, asked=True,
                       begun=Begun(2, stored())), LO.HIT, 2, None),
    ("stale: past the entry's expiry", NEXT, dict(
        has_id=True, refused=None, asked=True, begun=Begun(2, stored(expires_at=NOW))),
     LO.STALE, 2, None),
    ("stale: no expiry", NEXT, dict(
        has_id=True, refused=None, asked=True,
        begun=Begun(2, Entry(turn=1, params={"x": 1}, digest=DIGEST))), LO.STALE, 2, None),
    ("prefix mismatch: history rewritten", REWRITTEN, dict(
        has_id=True, refused=None, asked=True, begun=Begun(2, stored())),
     LO.PREFIX_MISMATCH, 2, None),
    ("miss: never seen", HISTORY, dict(has_id=True, refused=None, asked=True,
                                       begun=Begun(1, None)), LO.MISS, 1, MR.NEVER_SEEN),
    ("miss: never seen, history says turn 2", NEXT, dict(
        has_id=True, refused=None, asked=True, begun=Begun(1, None)),
     LO.MISS, 2, MR.NEVER_SEEN),
    ("miss: evicted", NEXT, dict(has_id=True, refused=None, asked=True,
                                 begun=Begun(1, None, evicted=True)), LO.MISS, 2, MR.EVICTED),
    ("miss: not stored", NEXT, dict(
        has_id=True, refused=None, asked=True,
        begun=Begun(2, Entry(turn=1, ended_at=NOW - 1))), LO.MISS, 2, MR.NOT_STORED),
    ("miss: store unavailable", NEXT, dict(has_id=True, refused=None, asked=True,
                                           begun=None), LO.MISS, 2, MR.STORE_UNAVAILABLE),
    ("miss: anonymous with an id", NEXT, dict(has_id=True, refused=MR.ANONYMOUS, asked=False,
                                              begun=None), LO.MISS, 2, MR.ANONYMOUS),
    ("miss: tenant past the new-tenant bound", NEXT, dict(
        has_id=True, refused=MR.TENANT_LIMITED, asked=False, begun=None),
     LO.MISS, 2, MR.TENANT_LIMITED),
    ("no id", HISTORY, dict(has_id=False, refused=None, asked=False, begun=None),
     LO.NO_ID, 1, MR.NEVER_SEEN),
    ("no id, anonymous: nothing inferred", NEXT, dict(
        has_id=False, refused=MR.ANONYMOUS, asked=False, begun=None),
     LO.NO_ID, 2, MR.ANONYMOUS),
]


@pytest.mark.parametrize("case, body, kw, outcome, turn, reason", LOOKUPS,
                         ids=[c[0] for c in LOOKUPS])
def test_lookup(case, body, kw, outcome, turn, reason):
    result = decide.lookup(body, NOW, **kw)
    assert (result.outcome, result.turn, result.miss_reason) == (outcome, turn, reason)
    assert result.params_sent is (outcome is LO.HIT)
    assert result.attributes()[sc.LOOKUP_MISS_REASON.key] == reason


def test_the_table_covers_every_outcome_and_miss_reason():
    assert {c[3] for c in LOOKUPS} == set(LO)
    assert {c[5] for c in LOOKUPS} - {None} == set(MR)


def test_lookup_measures_the_entry():
    result = decide.lookup(NEXT, NOW, has_id=True, refused=None, asked=True,
                           begun=Begun(2, stored()))
    assert (result.gap_s, result.age_s, result.remaining_s) == (5.0, 10.0, 100.0)
    clock_skew = decide.lookup(NEXT, NOW, has_id=True, refused=None, asked=True,
                               begun=Begun(2, stored(ended_at=NOW + 3)))
    assert clock_skew.gap_s == 0.0


@pytest.mark.parametrize("tenant, policy, admitted, reason", [
    (ANONYMOUS, "isolated", True, MR.ANONYMOUS),
    (ANONYMOUS, "shared", True, None),
    ("0123456789abcdef", "isolated", True, None),
    ("0123456789abcdef", "isolated", False, MR.TENANT_LIMITED),
    (ANONYMOUS, "isolated", False, MR.ANONYMOUS),
])
def test_tenant_and_anonymous_policy(tenant, policy, admitted, reason):
    assert decide.refusal(tenant, policy, admitted) == reason


@pytest.mark.parametrize("known, admitted_in_window, limit, admit", [
    (True, 5, 5, True), (False, 4, 5, True), (False, 5, 5, False), (False, 99, 0, True)])
def test_new_tenant_bound(known, admitted_in_window, limit, admit):
    assert decide.admit_tenant(known, admitted_in_window, limit) is admit


@pytest.mark.parametrize("has_id, infer_on, refused, infer", [
    (False, True, None, True), (True, True, None, False), (False, False, None, False),
    (False, True, MR.ANONYMOUS, False), (False, True, MR.TENANT_LIMITED, False)])
def test_conversation_inference(has_id, infer_on, refused, infer):
    assert decide.should_infer(has_id, infer_on, refused) is infer


def test_new_conversation_is_named_as_kvobs_names_an_idless_turn():
    assert decide.new_conversation_id("ab" * 16) == sc.ANONYMOUS_PREFIX + "ab" * 16


@pytest.mark.parametrize("params_sent, kind, status, body, fallback, reason", [
    (True, "http-error", 500, b"KV blocks expired", True, "read-declined"),
    (True, "http-error", 503, b"NIXL transfer failed", True, "read-failed"),
    (True, "http-error", 500, b"", True, "prefill-error"),
    (False, "http-error", 500, b"expired", False, None),
    (True, "http-error", 400, b"bad", False, None),
    (True, "timeout", 504, None, False, None),
    (True, "unreachable", 502, None, False, None)])
def test_fallback(params_sent, kind, status, body, fallback, reason):
    assert decide.falls_back(params_sent, kind, status) is fallback
    if fallback:
        assert decide.fallback_reason(body).value == reason


def test_prefill_params():
    keys = {sc.KTP_REQUEST_ID: "r"}
    hit = decide.prefill_params({"remote_block_ids": [1], "do_remote_decode": False}, keys)
    assert hit == {"remote_block_ids": [1], "do_remote_decode": True,
                   "do_remote_prefill": False, sc.KTP_REQUEST_ID: "r"}
    miss = decide.prefill_params(None, keys)
    assert miss["remote_block_ids"] is None and miss["do_remote_decode"] is True


@pytest.mark.parametrize("params, expected", [
    ({"remote_blocks_expiry_time": 50.0, "remote_block_ids": [3]}, (50.0, 480.0)),
    ({"remote_blocks_expiry_time": 50.0, "remote_block_ids": [3], sc.KTP_DECODE_TTL: 150},
     (50.0, 150.0)),
    ({"remote_blocks_expiry_time": 50.0, "remote_block_ids": []}, None),
    ({"remote_blocks_expiry_time": 50.0, "remote_block_ids": [[], []]}, None),
    ({"remote_blocks_expiry_time": True, "remote_block_ids": [3]}, None),
    ({"remote_block_ids": [3]}, None)])
def test_decode_expiry(params, expected):
    assert decide.decode_expiry(params, 480.0) == expected


@pytest.mark.parametrize("d_expiry, max_life, fixed, expected", [
    (600.0, None, None, 590.0), (600.0, 50.0, None, 150.0), (108.0, None, None, None),
    (None, None, None, None), (600.0, None, 450.0, 550.0), (None, None, 450.0, None)])
def test_entry_expiry(d_expiry, max_life, fixed, expected):
    assert decide.entry_expiry(100.0, d_expiry, margin_s=10.0, max_lifetime_s=max_life,
                               fixed_lifetime_s=fixed) == expected


@pytest.mark.parametrize("usable, previous, action", [
    (True, None, "stored"), (True, Entry(stored_turn=0), "stored"),
    (True, Entry(stored_turn=3), "refreshed"), (False, Entry(stored_turn=3), "skipped")])
def test_store_action(usable, previous, action):
    assert decide.store_action(usable, previous) == action


def test_stored_params_drop_the_turns_keys_and_name_d():
    params = {**{key: 1 for key in sc.CORRELATION_KEYS}, sc.KTP_REQUEST_ID: "r",
              sc.KTP_DECODE_TTL: 150, "remote_host": "10.0.0.1"}
    assert decide.stored_params(params, "d-host") == {sc.KTP_DECODE_TTL: 150,
                                                      "remote_host": "d-host"}
    assert decide.stored_params(params, None)["remote_host"] == "10.0.0.1"


@pytest.mark.parametrize("kind, status, has_body, answer", [
    ("http-error", 422, True, (True, 422)), ("http-error", 404, False, (False, 502)),
    ("http-error", 500, True, (False, 502)), ("timeout", 504, False, (False, 504)),
    ("unreachable", 502, False, (False, 502)), ("disconnected", 502, False, (False, 502))])
def test_upstream_answer(kind, status, has_body, answer):
    assert decide.upstream_answer(kind, status, has_body) == answer


def test_decide_does_no_io():
    """Nothing in the module awaits, and it imports no network, file or clock module."""
    tree = ast.parse(inspect.getsource(decide))
    assert not [n for n in ast.walk(tree) if isinstance(n, (ast.AsyncFunctionDef, ast.Await))]
    imported = {alias.name.split(".")[0] for node in ast.walk(tree)
                if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module}
    assert not imported & {"aiohttp", "asyncio", "redis", "socket", "time", "os", "io",
                           "opentelemetry", "prometheus_client", "logging"}
