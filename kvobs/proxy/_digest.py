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
from typing import Any, Iterable, TypeGuard

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
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            function = {}
        out.append([function.get("name"), function.get("arguments")])
    return out


def _message_repr(message: Any) -> bytes:
    if not isinstance(message, dict):
        return json.dumps(message, sort_keys=True, ensure_ascii=False).encode()
    reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
    item = [
        message.get("role"),
        str(reasoning) + _content_text(message.get("content")),
        _tool_calls(message.get("tool_calls")),
        message.get("tool_call_id"),
    ]
    return json.dumps(item, ensure_ascii=False, separators=(",", ":")).encode()


class Prefixes:
    """A history as what a digest covers: hashed at any lengths in one pass.

    ``history_digest`` hashes the whole covered history with it, ``extends`` one prefix
    and ``Prefixes.hashes`` many (the proxy's conversation inference): one hashing, so
    their digests agree by construction. Kinds: ``m`` messages (count: messages), ``s`` a
    prompt string (count: characters), ``t`` token ids (count: ids).

    >>> p = Prefixes("s", "abcd")
    >>> p.hashes([2, 4, 9]) == {2: Prefixes("s", "ab").hashes([2])[2],
    ...                         4: Prefixes("s", "abcd").hashes([4])[4]}
    True
    """

    __slots__ = ("kind", "items", "size")

    def __init__(self, kind: str, items: str | list):
        self.kind, self.items, self.size = kind, items, len(items)

    @classmethod
    def of(cls, body: dict[str, Any]) -> "Prefixes | None":
        """The request's own history (what a later turn's prompt is matched with)."""
        messages = body.get("messages")
        if isinstance(messages, list):
            return cls("m", messages)
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return cls("s", prompt)
        if _token_ids(prompt):
            return cls("t", prompt)
        return None

    def hashes(self, counts: Iterable[int]) -> dict[int, str]:
        """SHA-256 of the first ``n`` items for each ``n`` in ``counts`` that fits:
        one pass over the history, a hash copy per count."""
        sha = hashlib.sha256(b"[" if self.kind == "t" else b"")
        out: dict[int, str] = {}
        done = 0
        for n in sorted({c for c in counts if 0 <= c <= self.size}):
            self._feed(sha, done, n)
            done = n
            final = sha.copy()
            if self.kind == "t":
                final.update(b"]")
            out[n] = final.hexdigest()
        return out

    def _feed(self, sha, start: int, stop: int) -> None:
        if self.kind == "s":
            assert isinstance(self.items, str)  # kind "s": a prompt string
            sha.update(self.items[start:stop].encode("utf-8", "surrogatepass"))
        elif self.kind == "m":
            for message in self.items[start:stop]:
                encoded = _message_repr(message)
                sha.update(len(encoded).to_bytes(8, "little"))
                sha.update(encoded)
        else:  # json.dumps of the id list, element by element
            for i in range(start, stop):
                sha.update((", " if i else "").encode() + json.dumps(self.items[i]).encode())

    def digest(self) -> Digest:
        """The digest of the whole history."""
        return {"k": self.kind, "n": self.size, "h": self.hashes([self.size])[self.size]}


def _token_ids(prompt: Any) -> TypeGuard[list[int]]:
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(t, int) for t in prompt)


def history_digest(
    body: dict[str, Any], response_message: dict[str, Any] | None, response_text: str | None
) -> Digest | None:
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
    >>> t = history_digest({"prompt": [1, 2]}, None, "x")
    >>> extends(t, {"prompt": [1, 2, 3]}), extends(t, {"prompt": [1, 3]})
    (True, False)
    """
    messages = body.get("messages")
    if isinstance(messages, list):
        if response_message is None:
            return None
        return Prefixes("m", [*messages, response_message]).digest()
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        if response_text is None:
            return None
        return Prefixes("s", prompt + response_text).digest()
    if _token_ids(prompt):
        return Prefixes("t", prompt).digest()
    return None


def extends(digest: Digest | None, body: dict[str, Any]) -> bool:
    """True when ``body``'s history starts with exactly what ``digest`` covers."""
    if not digest or not isinstance(digest.get("n"), int):
        return False
    prefixes = Prefixes.of(body)
    if prefixes is None or prefixes.kind != digest.get("k"):
        return False
    count = digest["n"]
    return prefixes.hashes([count]).get(count) == digest.get("h")


# --------------------------------------------------------------------------- inference
# A stored digest as one string, ``kind:count:sha256``: what the proxy indexes a
# conversation by (per tenant) so that a request without a conversation id can be matched
# with the conversation whose covered history it extends.


def fingerprint(digest: Digest | None) -> str | None:
    """
    >>> fingerprint({"k": "s", "n": 4, "h": "ab12"})
    's:4:ab12'
    """
    if not digest or not isinstance(digest.get("n"), int):
        return None
    return f"{digest.get('k')}:{digest['n']}:{digest.get('h')}"


def extended(prefixes: Prefixes, fingerprints: Iterable[str]) -> list[str]:
    """The fingerprints ``prefixes`` extends, longest first. Cost: one pass over the
    history plus one hash copy per distinct candidate length.

    >>> a = fingerprint(history_digest({"prompt": "ab"}, None, "cd"))
    >>> b = fingerprint(history_digest({"prompt": "abcd"}, None, "ef"))
    >>> other = fingerprint(history_digest({"prompt": "zz"}, None, "cd"))
    >>> extended(Prefixes.of({"prompt": "abcdefgh"}), [a, other, b]) == [b, a]
    True
    >>> extended(Prefixes.of({"prompt": "abc"}), [a, b])
    []
    """
    wanted: dict[int, set[str]] = {}
    for fp in fingerprints:
        kind, _, rest = fp.partition(":")
        count, _, sha = rest.partition(":")
        if kind == prefixes.kind and count.isdigit() and int(count) <= prefixes.size:
            wanted.setdefault(int(count), set()).add(sha)
    hashes = prefixes.hashes(wanted)
    return [
        f"{prefixes.kind}:{n}:{hashes[n]}"
        for n in sorted(wanted, reverse=True)
        if hashes[n] in wanted[n]
    ]
