"""Prefix guard: a digest of the history D's KV covers, checked against the next request.

D's KV covers the prompt it decoded from plus what it generated. The next turn may only
reuse it if its history *extends* that text. The digest is text-level (role, content,
reasoning, tool calls) - the token-level check belongs to the engines. Nothing here keeps
text: only a count and a SHA-256.

Chat: the covered history is the request's messages plus the assistant message D
produced (reasoning first, then content). A client that strips reasoning or rewrites an
earlier message no longer extends it. Completions: the prompt string plus the generated
text, compared as a string prefix; token-id prompts cover the prompt ids only.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

Digest = dict[str, Any]  # {"k": kind, "n": count, "h": sha256 hex}


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                parts.append(str(part.get("text", "")))
            else:
                parts.append(json.dumps(part, sort_keys=True, ensure_ascii=False))
        return "".join(parts)
    return json.dumps(content, sort_keys=True, ensure_ascii=False)


def _tool_calls(calls: Any) -> list:
    if not isinstance(calls, list):
        return []
    out = []
    for call in calls:
        function = call.get("function", {}) if isinstance(call, dict) else {}
        out.append([function.get("name"), function.get("arguments")])
    return out


def _message_repr(message: Any) -> bytes:
    if not isinstance(message, dict):
        return json.dumps(message, sort_keys=True, ensure_ascii=False).encode()
    reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
    item = [message.get("role"), str(reasoning) + _content_text(message.get("content")),
            _tool_calls(message.get("tool_calls")), message.get("tool_call_id")]
    return json.dumps(item, ensure_ascii=False, separators=(",", ":")).encode()


def _chain(messages: list) -> str:
    sha = hashlib.sha256()
    for message in messages:
        encoded = _message_repr(message)
        sha.update(len(encoded).to_bytes(8, "little"))
        sha.update(encoded)
    return sha.hexdigest()


def history_digest(body: dict[str, Any], response_message: dict[str, Any] | None,
                   response_text: str | None) -> Digest | None:
    """Digest of what D's KV covers after this turn, or None when it cannot be told.

    >>> d = history_digest({"messages": [{"role": "user", "content": "hi"}]},
    ...                    {"role": "assistant", "content": "yo"}, None)
    >>> d["k"], d["n"]
    ('m', 2)
    >>> extends(d, {"messages": [{"role": "user", "content": "hi"},
    ...             {"role": "assistant", "content": "yo"}, {"role": "user", "content": "?"}]})
    True
    >>> extends(d, {"messages": [{"role": "user", "content": "HI"},
    ...             {"role": "assistant", "content": "yo"}, {"role": "user", "content": "?"}]})
    False
    >>> c = history_digest({"prompt": "ab"}, None, "cd")
    >>> extends(c, {"prompt": "abcdef"}), extends(c, {"prompt": "abXdef"})
    (True, False)
    """
    messages = body.get("messages")
    if isinstance(messages, list):
        if response_message is None:
            return None
        covered = [*messages, response_message]
        return {"k": "m", "n": len(covered), "h": _chain(covered)}
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        if response_text is None:
            return None
        text = prompt + response_text
        return {"k": "s", "n": len(text), "h": hashlib.sha256(text.encode()).hexdigest()}
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return {"k": "t", "n": len(prompt),
                "h": hashlib.sha256(json.dumps(prompt).encode()).hexdigest()}
    return None


def extends(digest: Digest | None, body: dict[str, Any]) -> bool:
    """True when ``body``'s history starts with exactly what ``digest`` covers."""
    if not digest:
        return False
    kind, count = digest.get("k"), digest.get("n")
    if not isinstance(count, int):
        return False
    if kind == "m":
        messages = body.get("messages")
        if not isinstance(messages, list) or len(messages) < count:
            return False
        return _chain(messages[:count]) == digest.get("h")
    prompt = body.get("prompt")
    if kind == "s":
        if not isinstance(prompt, str) or len(prompt) < count:
            return False
        return hashlib.sha256(prompt[:count].encode()).hexdigest() == digest.get("h")
    if kind == "t":
        if not isinstance(prompt, list) or len(prompt) < count:
            return False
        return hashlib.sha256(json.dumps(prompt[:count]).encode()).hexdigest() == digest.get("h")
    return False
