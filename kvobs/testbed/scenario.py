"""Scenario files: what the testbed runs (format in docs/scenarios.md).

A scenario is TOML: one engine configuration (engines start once per scenario) and
conversations whose turns are scheduled on one clock: turn k of a conversation starts
``gap_s`` after turn k-1 ended, turns of different conversations interleave while others
wait, and requests go one at a time so timings stay clean on two cores.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import tomllib

from kvobs.semconv import LatencyCause, Verdict

FAILURE_POLICIES = ("fail", "recompute")
REWRITES = ("strip-last-response", "truncate-head")
ACTIONS = ("restart-proxy", "kill-decode", "restart-decode")


class ScenarioError(ValueError):
    """The scenario file is invalid; the message names the field."""


@dataclass(frozen=True)
class EngineSettings:
    ttl_s: float = 30.0  # decoder_kv_blocks_ttl
    threshold: int = 64  # kv_recompute_threshold
    prefill_prefix_caching: bool = False
    failure_policy: str = "fail"  # kv_load_failure_policy
    link_delay_ms: float = 0.0  # >0: D in a network namespace, UCX over TCP, netem delay
    link_rate_mbit: float = 0.0  # >0: netem rate limit on the same link
    prefix_guard: bool = True  # connector's block-hash guard
    proxy_fixed_lifetime_s: float = 0.0  # >0: upstream-style fixed proxy entry life


@dataclass(frozen=True)
class TurnSpec:
    append_tokens: int = 200  # new tool/user input T (one byte = one token)
    gap_s: float = 0.0  # wait after the previous turn of this conversation ended
    max_tokens: int = 16  # R
    stream: bool | None = None  # None: the conversation's default
    no_conversation_id: bool = False
    before: tuple[str, ...] = ()  # actions run right before this turn (ACTIONS)
    rewrite_history: str | None = None  # REWRITES
    unstable_output: bool = False  # no allowed_token_ids: output may not re-tokenize
    inject_params: bool = False  # the client sends its own (bogus) kv_transfer_params
    # Background load started right before the turn, straight at one engine (no proxy,
    # no conversation): it competes with the turn for that engine's steps.
    prefill_load: int = 0  # concurrent long prompts sent to P (P queueing)
    prefill_load_tokens: int = 3000  # their length
    decode_load: int = 0  # concurrent requests sent to D (D contention): before the
    #                       turn, or for a streamed turn at its first token (they then
    #                       share D's steps with its decode)
    decode_load_prompt_tokens: int = 64  # their prompt (D computes it itself)
    decode_load_tokens: int = 400  # tokens each generates
    expect: str | None = None  # expected verdict (tests and the demo check it)
    expect_cause: str | None = None  # expected latency cause (kvobs/causes.py) among
    #                                  the turn's diagnosed causes


def conversation_label(conversation_id: str, tenant: str | None) -> str:
    """Unique in a scenario: the id, prefixed by the tenant when it has one (two tenants
    may use one conversation id)."""
    return f"{tenant}/{conversation_id}" if tenant else conversation_id


@dataclass(frozen=True)
class ConversationSpec:
    id: str
    turns: tuple[TurnSpec, ...]
    stream: bool = False
    system_tokens: int = 300  # the first prompt's length
    endpoint: str = "completions"  # completions | chat
    text_seed: str | None = None  # random text seed (default: the id); share it to fork
    tenant: str | None = None  # sent as the API key (Authorization: Bearer <tenant>)

    @property
    def label(self) -> str:
        return conversation_label(self.id, self.tenant)


@dataclass(frozen=True)
class Scenario:
    name: str
    engines: EngineSettings
    conversations: tuple[ConversationSpec, ...]
    description: str = ""
    seed: int = 0

    @property
    def expectations(self) -> dict[tuple[str, int], str]:
        return {(c.label, i): t.expect for c in self.conversations
                for i, t in enumerate(c.turns, 1) if t.expect}

    @property
    def cause_expectations(self) -> dict[tuple[str, int], str]:
        return {(c.label, i): t.expect_cause for c in self.conversations
                for i, t in enumerate(c.turns, 1) if t.expect_cause}


def _build(cls, raw: dict[str, Any], where: str, **overrides):
    known = {f.name for f in fields(cls)}
    unknown = set(raw) - known - set(overrides)
    if unknown:
        raise ScenarioError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
    values = {**raw, **overrides}
    try:
        return cls(**values)
    except TypeError as error:
        raise ScenarioError(f"{where}: {error}") from None


def _turn(raw: dict[str, Any], where: str) -> TurnSpec:
    before = raw.get("before", ())
    before = (before,) if isinstance(before, str) else tuple(before)
    turn = _build(TurnSpec, raw, where, before=before)
    for action in turn.before:
        if action not in ACTIONS:
            raise ScenarioError(f"{where}.before: {action!r} not one of {ACTIONS}")
    if turn.rewrite_history is not None and turn.rewrite_history not in REWRITES:
        raise ScenarioError(f"{where}.rewrite_history: not one of {REWRITES}")
    if turn.expect is not None and turn.expect not in {v.value for v in Verdict}:
        raise ScenarioError(f"{where}.expect: {turn.expect!r} is not a verdict")
    causes = {c.value for c in LatencyCause}
    if turn.expect_cause is not None and turn.expect_cause not in causes:
        raise ScenarioError(f"{where}.expect_cause: {turn.expect_cause!r} is not one of "
                            f"{sorted(causes)}")
    if min(turn.prefill_load, turn.decode_load) < 0 or min(
            turn.prefill_load_tokens, turn.decode_load_tokens,
            turn.decode_load_prompt_tokens) < 1:
        raise ScenarioError(f"{where}: loads >= 0 and their token counts >= 1")
    if turn.append_tokens < 1 or turn.max_tokens < 1 or turn.gap_s < 0:
        raise ScenarioError(f"{where}: append_tokens, max_tokens >= 1 and gap_s >= 0")
    return turn


def parse(text: str, origin: str = "<scenario>") -> Scenario:
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ScenarioError(f"{origin}: {error}") from None
    engines = _build(EngineSettings, raw.pop("engines", {}), "engines")
    if engines.failure_policy not in FAILURE_POLICIES:
        raise ScenarioError(f"engines.failure_policy: not one of {FAILURE_POLICIES}")
    conversations = []
    for n, conv in enumerate(raw.pop("conversations", []), 1):
        where = f"conversations[{n}]"
        turns = tuple(_turn(t, f"{where}.turns[{i}]")
                      for i, t in enumerate(conv.pop("turns", []), 1))
        if not turns:
            raise ScenarioError(f"{where}: no turns")
        conversations.append(_build(ConversationSpec, conv, where, turns=turns))
    if not conversations:
        raise ScenarioError(f"{origin}: no conversations")
    labels = [c.label for c in conversations]
    if len(labels) != len(set(labels)):
        raise ScenarioError(f"{origin}: conversation ids must be unique per tenant")
    return _build(Scenario, raw, origin, engines=engines, conversations=tuple(conversations))


def load(path: str) -> Scenario:
    try:
        with open(path, encoding="utf-8") as handle:
            return parse(handle.read(), path)
    except OSError as error:
        raise ScenarioError(f"{path}: {error.strerror}") from None
