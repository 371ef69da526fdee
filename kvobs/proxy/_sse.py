"""D's stream as it passes: SSE lines parsed, D's params lifted out (never shown to the
client), the answer assembled for the prefix guard's digest, the GenAI facts (completion
id, usage) noted; never any text in telemetry."""

from __future__ import annotations

import json
import time
from typing import Any

from kvobs import semconv as sc

from kvobs.proxy._state import TurnState

KTP = "kv_transfer_params"
DONE = b"data: [DONE]"


def genai_value(value: Any) -> str | None:
    """A client- or engine-chosen id or model name fit for a span attribute."""
    if type(value) is not str or not value or len(value) > sc.MAX_GENAI_VALUE:
        return None
    return value


def answer_facts(answer: Any, state: TurnState) -> None:
    """The completion's id and D's usage, from its answer (or a streamed chunk)."""
    if not isinstance(answer, dict):
        return
    if state.response_id is None:
        state.response_id = genai_value(answer.get("id"))
    usage = answer.get("usage")
    if isinstance(usage, dict) and type(usage.get("completion_tokens")) is int:
        state.output_tokens = usage["completion_tokens"]


class StreamCollector:
    """Parses SSE lines as they pass: assembles the answer, lifts out D's params."""

    __slots__ = (
        "params",
        "_content",
        "_reasoning",
        "_text",
        "_tools",
        "single",
        "_chat",
        "has_output",
        "facts",
    )

    def __init__(self, facts: "TurnState"):
        self.facts = facts  # the turn's GenAI facts (answer_facts) land there
        self.params: dict[str, Any] | None = None
        self.has_output = False  # a chunk carried text, reasoning or a tool call
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._text: list[str] = []
        self._tools: dict[int, list[str]] = {}
        self.single = True
        self._chat = False

    def feed(self, lines: bytes) -> tuple[bytes, bool]:
        """Returns the bytes to forward (params removed) and whether [DONE] was seen."""
        done = False
        out = []
        for line in lines.split(b"\n")[:-1]:
            stripped = line.strip()
            if stripped == DONE:
                done = True  # held back until D's params are stored (see _decode_stream)
                continue
            if stripped.startswith(b"data: {"):
                try:
                    chunk = json.loads(stripped[6:])
                except ValueError:
                    chunk = None
                if isinstance(chunk, dict):
                    if KTP in chunk:
                        params = chunk.pop(KTP)
                        if isinstance(params, dict):
                            self.params = params
                        line = b"data: " + json.dumps(chunk).encode()
                    answer_facts(chunk, self.facts)
                    self._collect(chunk)
            out.append(line)
        return b"\n".join(out) + b"\n", done

    def _collect(self, chunk: dict[str, Any]) -> None:
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            if choice.get("index", 0) != 0:
                self.single = False
                continue
            delta = choice.get("delta")
            if isinstance(delta, dict):
                self._chat = True
                for key, sink in (
                    ("content", self._content),
                    ("reasoning_content", self._reasoning),
                    ("reasoning", self._reasoning),
                ):
                    value = delta.get(key)
                    if isinstance(value, str):
                        sink.append(value)
                        self.has_output = self.has_output or bool(value)
                for call in delta.get("tool_calls") or ():
                    if isinstance(call, dict):
                        self.has_output = True
                        slot = self._tools.setdefault(int(call.get("index", 0)), ["", ""])
                        function = call.get("function") or {}
                        slot[0] += function.get("name") or ""
                        slot[1] += function.get("arguments") or ""
            text = choice.get("text")
            if isinstance(text, str):
                self._text.append(text)
                self.has_output = self.has_output or bool(text)

    def message(self) -> dict[str, Any] | None:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self._content)}
        if self._reasoning:
            message["reasoning_content"] = "".join(self._reasoning)
        if self._tools:
            message["tool_calls"] = [
                {"function": {"name": n, "arguments": a}}
                for _, (n, a) in sorted(self._tools.items())
            ]
        return message

    def text(self) -> str:
        return "".join(self._text)

    def first_output(self, state: TurnState) -> None:
        """TTFT is the first output the client gets, not D's first bytes (a role-only or
        empty first chunk carries no token)."""
        if state.ttft_s is None and self.has_output:
            state.ttft_s = time.perf_counter() - state.start_perf
            state.d_first_output = time.time()
