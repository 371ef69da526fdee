"""Run a scenario's turns against a live testbed, as a multi-turn agent would.

The runner is a client only: it talks to the proxy over HTTP, keeps each conversation's
history (H + R + T), and records what the client saw (status, TTFT, latency) in
``results.json``. Diagnosis comes from the telemetry, never from this file; the runner
only records the scenario's expectations next to what happened so tests can compare.
"""

from __future__ import annotations

import gc
import json
import random
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Protocol

from kvobs.semconv import TRACE_ID_HEADER
from kvobs.testbed.loads import MODEL_NAME, Load, decode_load, prefill_load, random_text
from kvobs.testbed.scenario import (
    KVOBS_PROXY,
    ConversationSpec,
    Scenario,
    TurnSpec,
    conversation_label,
)

RESULTS_FILE = "results.json"
# What a misbehaving client might send: another engine's blocks. The proxy must drop it.
INJECTED_PARAMS = {
    "do_remote_decode": True,
    "remote_engine_id": "not-yours",
    "remote_block_ids": [[0, 1, 2]],
    "remote_request_id": "forged",
    "remote_host": "127.0.0.1",
    "remote_port": 1,
    "remote_num_tokens": 384,
}


# The API key of a conversation without a tenant: clients in production have one, and the
# kvobs proxy gives anonymous clients no reuse at all (--anonymous-tenant isolated).
DEFAULT_API_KEY = "sk-testbed"


class Testbed(Protocol):
    safe_token_ids: list[int]

    @property
    def proxy_url(self) -> str:
        """Where the scenario's turns go (read-only: the stack derives it)."""

    def act(self, action: str) -> None:
        """Run a scenario action (``kvobs.testbed.scenario.ACTIONS``)."""

    def set_link(self, delay_ms: float, rate_mbit: float) -> None:
        """Shape the P<->D link (no-op without a network namespace)."""

    def engine_url(self, role: str) -> str:
        """Base URL of the prefill or decode engine's own API server."""


@dataclass
class TurnResult:
    conversation_id: str
    turn: int
    status: int
    ok: bool
    stream: bool
    sent_conversation_id: bool
    prompt_chars: int
    completion_chars: int
    ttft_s: float | None  # streamed turns only: first text; None for a non-streamed answer
    latency_s: float
    started_at: float
    expect: str | None = None
    error: str | None = None
    trace_id: str | None = None  # the proxy's answer header: names the turn to kvobs
    tenant: str | None = None  # the scenario's tenant name (the API key sent)

    @property
    def label(self) -> str:
        return conversation_label(self.conversation_id, self.tenant)


@dataclass
class _Conversation:
    spec: ConversationSpec
    rng: random.Random
    history: str = ""  # completions: the prompt text so far (H + R)
    messages: list[dict[str, str]] = field(default_factory=list)  # chat: the messages
    last_response: str = ""
    next_turn: int = 1
    due: float | None = None  # None: waiting for the conversations it runs after
    results: list[TurnResult] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.next_turn > len(self.spec.turns)

    @property
    def turn(self) -> TurnSpec:
        return self.spec.turns[self.next_turn - 1]


def _new_input(conversation: _Conversation, turn: TurnSpec) -> str:
    if conversation.next_turn == conversation.spec.own_text_from:
        conversation.rng.seed(f"{conversation.spec.id}:{conversation.next_turn}")
    first = conversation.next_turn == 1
    return random_text(
        conversation.rng, conversation.spec.system_tokens if first else turn.append_tokens
    )


def _prompt(conversation: _Conversation, turn: TurnSpec, new_input: str) -> str:
    history = conversation.history
    if turn.rewrite_history == "strip-last-response" and conversation.last_response:
        history = history[: len(history) - len(conversation.last_response)]
    elif turn.rewrite_history == "truncate-head":
        history = history[len(history) // 4 :]
    return history + new_input


def _messages(conversation: _Conversation, turn: TurnSpec, new_input: str) -> list[dict[str, str]]:
    messages = [dict(m) for m in conversation.messages]
    if turn.rewrite_history == "strip-last-response" and messages:
        messages[-1]["content"] = ""  # e.g. reasoning stripped from the last answer
    elif turn.rewrite_history == "truncate-head":
        messages = messages[2:]
    return messages + [{"role": "user", "content": new_input}]


def _request(
    conversation: _Conversation,
    turn: TurnSpec,
    new_input: str,
    safe_ids: list[int],
    conversation_id: bool = True,
) -> tuple[str, dict[str, Any], bool, int]:
    """(path, body, stream, prompt characters) of the next turn; ``conversation_id``
    False: never a conversation id (behind a router that knows none)."""
    stream = conversation.spec.stream if turn.stream is None else turn.stream
    body: dict[str, Any] = {
        "model": MODEL_NAME,
        "max_tokens": turn.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": stream,
    }
    if not turn.unstable_output:
        body["allowed_token_ids"] = safe_ids
    if conversation.spec.endpoint == "chat":
        body["messages"] = _messages(conversation, turn, new_input)
        path, size = "/v1/chat/completions", sum(len(m["content"]) for m in body["messages"])
    else:
        body["prompt"] = _prompt(conversation, turn, new_input)
        path, size = "/v1/completions", len(body["prompt"])
    if conversation_id and not turn.no_conversation_id:
        body["conversation_id"] = conversation.spec.id
    if turn.inject_params:
        body["kv_transfer_params"] = INJECTED_PARAMS
    return path, body, stream, size


def _completion_text(payload: dict[str, Any]) -> str:
    choice = (payload.get("choices") or [{}])[0]
    if "text" in choice:
        return choice.get("text") or ""
    message = choice.get("message") or choice.get("delta") or {}
    return message.get("content") or ""


def _send(
    url: str,
    body: dict[str, Any],
    stream: bool,
    timeout_s: float,
    api_key: str | None = None,
    on_first_token: Callable[[], None] | None = None,
) -> tuple[int, str, float | None, str | None, str | None]:
    """POST and read the answer: (status, completion text, TTFT, error, trace id);
    ``on_first_token`` is called when a streamed answer's first text arrives."""
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    start = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            trace_id = response.headers.get(TRACE_ID_HEADER)
            if not stream:  # the client sees no first token, only the whole answer
                payload = json.loads(response.read())
                return response.status, _completion_text(payload), None, None, trace_id
            text, ttft, error = [], None, None
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    error = str(event["error"].get("message", event["error"]))[:200]
                    break
                piece = _completion_text(event)
                if piece and ttft is None:
                    ttft = time.monotonic() - start
                    if on_first_token is not None:
                        on_first_token()
                text.append(piece)
            return response.status, "".join(text), ttft, error, trace_id
    except urllib.error.HTTPError as http_error:
        return (
            http_error.code,
            "",
            None,
            http_error.read().decode(errors="replace")[:200],
            http_error.headers.get(TRACE_ID_HEADER),
        )
    except (urllib.error.URLError, OSError, ValueError) as error:
        return 0, "", None, f"{type(error).__name__}: {error}"[:200], None


def _due(waiting: tuple[float, _Conversation]) -> float:
    return waiting[0]


def next_due_turn(
    conversations: list[_Conversation], now: float, turn_estimate_s: float
) -> tuple[_Conversation | None, float]:
    """The conversation whose turn goes next, or None and when to ask again.

    A conversation's later turn runs against a deadline (D's TTL counts from its previous
    turn) while a first turn has none, so later turns go first: one that falls due before
    a first turn sent now would end (``turn_estimate_s``, the longest turn so far) is
    waited for. On a slow machine this keeps every gap near its ``gap_s`` instead of
    queueing later turns behind every conversation's first turn."""
    waiting = [(c.due, c) for c in conversations if not c.done and c.due is not None]
    later = min(((due, c) for due, c in waiting if c.next_turn > 1), key=_due, default=None)
    if later is not None and later[0] <= now + turn_estimate_s:
        return later[1], later[0]
    first = min(((due, c) for due, c in waiting if c.next_turn == 1), key=_due, default=None)
    if first is not None and first[0] <= now:
        return first[1], first[0]
    wake = [first[0]] if first is not None else []
    if later is not None:
        wake.append(later[0] - turn_estimate_s)
    if not wake:
        raise RuntimeError("no turn can become due: every conversation left waits on another")
    return None, min(wake)


def together_with(
    conversations: list[_Conversation], conversation: _Conversation
) -> list[_Conversation]:
    """The conversations whose next turn goes with ``conversation``'s (its ``together``
    label), itself first; just itself when the turn has none."""
    label = conversation.turn.together
    if not label:
        return [conversation]
    return [conversation] + [
        c for c in conversations
        if c is not conversation and not c.done and c.turn.together == label
    ]  # fmt: skip


def together_ready(conversations: list[_Conversation], conversation: _Conversation) -> bool:
    """Whether ``conversation``'s next turn may be picked: it goes alone, or every
    conversation with a turn of its ``together`` label has reached that turn and it is
    due (not waiting on other conversations)."""
    if conversation.done or not conversation.turn.together:
        return True
    label = conversation.turn.together
    members = [
        c for c in conversations if any(t.together == label for t in c.spec.turns)
    ]  # fmt: skip
    return all(not c.done and c.turn.together == label and c.due is not None for c in members)


class ScenarioClient:
    """A scenario's client, one turn at a time: ``step()`` waits until the next due turn
    (conversations interleave on one clock), sends it and returns what the client saw.
    ``run_scenario`` steps it to the end; a caller that needs to act between turns
    (watch, measure, interleave) steps it itself."""

    def __init__(self, scenario: Scenario, testbed: Testbed, timeout_s: float = 120.0, log=print):
        self.testbed, self.timeout_s, self.log = testbed, timeout_s, log
        # Conversation ids are a kvobs proxy field: behind another router (vllm-router)
        # the client sends none, as a client of that router would; kvobs must cope.
        self.conversation_ids = scenario.engines.router == KVOBS_PROXY
        self.conversations = [
            _Conversation(spec, random.Random(f"{scenario.seed}:{spec.text_seed or spec.id}"))
            for spec in scenario.conversations
        ]
        self._release(time.monotonic())

    @property
    def done(self) -> bool:
        return all(c.done for c in self.conversations)

    @property
    def results(self) -> list[TurnResult]:
        return [r for c in self.conversations for r in c.results]

    def _release(self, now: float) -> None:
        """Make due the first turns whose ``after`` conversations have all ended."""
        ended = {c.spec.label for c in self.conversations if c.done}
        for conversation in self.conversations:
            if conversation.due is None and ended.issuperset(conversation.spec.after):
                conversation.due = now + conversation.turn.gap_s

    def step(self) -> list[TurnResult]:
        """Wait for the next due turn and send it (with the turns of other conversations
        it goes ``together`` with, at once); returns what the client saw of each."""
        conversation = None
        while conversation is None:
            longest = max((r.latency_s for r in self.results), default=0.0)
            eligible = [c for c in self.conversations if together_ready(self.conversations, c)]
            conversation, at = next_due_turn(eligible, time.monotonic(), longest)
            time.sleep(max(0.0, at - time.monotonic()))
        batch = together_with(self.conversations, conversation)
        time.sleep(max(0.0, max(c.due or 0.0 for c in batch) - time.monotonic()))
        prepared = [self._prepare(c) for c in batch]
        # The client is the instrument the timeline is checked against: no collection of
        # a long test process's garbage may land inside a measured turn. Only the young
        # generations are collected before it: a full collection of a long test
        # session's heap took seconds per turn in CI, which stretched every
        # conversation's gaps towards D's TTL.
        gc.collect(1)
        gc.disable()
        try:
            if len(prepared) == 1:
                prepared[0].send()
            else:  # every turn of the batch in flight at once, each on its own thread
                threads = [threading.Thread(target=t.send, daemon=True) for t in prepared]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
        finally:
            gc.enable()
        return [self._finish(t) for t in prepared]

    def _prepare(self, conversation: _Conversation) -> "_Turn":
        turn = conversation.turn
        for action in turn.before:
            self.log(
                f"[scenario] {action} before {conversation.spec.label} turn "
                f"{conversation.next_turn}"
            )
            self.testbed.act(action)
        new_input = _new_input(conversation, turn)
        path, body, stream, size = _request(
            conversation, turn, new_input, self.testbed.safe_token_ids, self.conversation_ids
        )
        loads: list[Load] = []
        timers: list[threading.Timer] = []
        at_first_token: list[threading.Timer] = []
        # A load with a delay lands while P (or D) holds this turn: started by a timer
        # when the turn is sent (or when its first token arrives); without one it is in
        # the engine before the turn.
        for load, delay_s, settle_s, on_first_token in (
            (
                prefill_load(self.testbed, turn, conversation.rng),
                turn.prefill_load_delay_s,
                0.05,
                False,
            ),
            (
                decode_load(self.testbed, turn, conversation.rng, self.testbed.safe_token_ids),
                turn.decode_load_delay_s,
                0.2,
                turn.decode_load_at_first_token,
            ),
        ):
            if load is None:
                continue
            loads.append(load)
            if delay_s or on_first_token:
                timer = threading.Timer(delay_s, load.start, kwargs={"wait": False})
                (at_first_token if on_first_token else timers).append(timer)
            else:  # each in the engine (D: generating), then a moment to settle
                load.start(settle_s=settle_s)
        api_key = (
            None if conversation.spec.anonymous else conversation.spec.tenant or DEFAULT_API_KEY
        )
        return _Turn(
            conversation, self.testbed.proxy_url + path, body, stream, size, api_key,
            self.timeout_s, loads, timers, at_first_token,
        )  # fmt: skip

    def _finish(self, sent: "_Turn") -> TurnResult:
        for timer in sent.timers + sent.at_first_token:
            if timer.ident is not None:  # started: a failed turn never saw its first token
                timer.join()  # the load starts even after a short turn, then ends with it
        for load in sent.loads:
            load.join()
        conversation, body = sent.conversation, sent.body
        status, text, ttft, error, trace_id = sent.answer
        result = TurnResult(
            conversation.spec.id,
            conversation.next_turn,
            status,
            status == 200 and error is None,
            sent.stream,
            "conversation_id" in body,
            sent.size,
            len(text),
            ttft,
            sent.latency_s,
            sent.started_at,
            conversation.turn.expect,
            error,
            trace_id,
            conversation.spec.tenant,
        )
        conversation.results.append(result)
        self.log(
            f"[scenario] {result.label} turn {result.turn}: status {status} "
            f"ttft {ttft if ttft is None else round(ttft * 1000)} ms latency "
            f"{round(sent.latency_s * 1000)} ms" + (f" error {error}" if error else "")
        )
        if "messages" in body:
            conversation.messages = body["messages"] + [{"role": "assistant", "content": text}]
        else:
            conversation.history = body["prompt"] + text
        conversation.last_response = text
        conversation.next_turn += 1
        if conversation.done:
            self._release(time.monotonic())
        else:
            conversation.due = time.monotonic() + conversation.turn.gap_s
        return result


@dataclass
class _Turn:
    """One turn on its way: the request, what runs beside it, and (once ``send``
    returned) what the client saw."""

    conversation: _Conversation
    url: str
    body: dict[str, Any]
    stream: bool
    size: int
    api_key: str | None
    timeout_s: float
    loads: list[Load]
    timers: list[threading.Timer]
    at_first_token: list[threading.Timer]
    answer: tuple = ()
    started_at: float = 0.0
    latency_s: float = 0.0

    def send(self) -> None:
        self.started_at = time.time()
        begin = time.monotonic()
        for timer in self.timers:
            timer.start()
        self.answer = _send(
            self.url, self.body, self.stream, self.timeout_s, self.api_key, self._first_token
        )
        self.latency_s = time.monotonic() - begin

    def _first_token(self) -> None:
        for timer in self.at_first_token:
            timer.start()


def run_scenario(
    scenario: Scenario, testbed: Testbed, timeout_s: float = 120.0, log=print
) -> list[TurnResult]:
    """Run every turn; conversations interleave on one clock, one request at a time
    (but for turns sent ``together``)."""
    client = ScenarioClient(scenario, testbed, timeout_s, log)
    while not client.done:
        client.step()
    return client.results


def write_results(out_dir: str, scenario: Scenario, results: list[TurnResult]) -> str:
    import os

    path = os.path.join(out_dir, RESULTS_FILE)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(
            {"scenario": scenario.name, "turns": [asdict(r) for r in results]}, handle, indent=2
        )
    return path
