"""Client input: the body read whole (up to a size, within a time), parsed and checked
before any engine is called.

Everything here raises ``InputError`` (a 4xx with a bounded ``reason``): input the proxy
would choke on later (a lone surrogate it cannot encode, JSON nested deeper than it can
serialize, a field of the wrong shape that the prefix guard reads) is refused up front,
so no engine does work for a request that cannot be answered.
"""

from __future__ import annotations

import asyncio
import json
import math
import zlib
from typing import Any, Mapping, TypeGuard, TypeVar

import aiohttp
from aiohttp import http_exceptions, web

from kvobs.proxy._identity import InputError

# Deeper JSON than any OpenAI request needs (tool schemas nest a few dozen levels at most);
# well under the interpreter's recursion limit, so the body can always be re-serialized.
MAX_DEPTH = 100
_READ_CHUNK = 1 << 16
# Refusals that leave the body unread: the connection is closed after the answer.
UNREAD_BODY_REASONS = frozenset(
    ("body-too-large", "body-timeout", "bad-body", "unsupported-encoding")
)
# Content-Encoding values the proxy decodes (the server's own decoding is off:
# RUNNER_OPTIONS' auto_decompress=False, so a broken body is the proxy's 400, not a
# traceback in aiohttp's log). wbits: zlib's gzip header, zlib's; raw deflate is tried
# when a "deflate" body has no zlib header.
_CODINGS = {"gzip": 31, "x-gzip": 31, "deflate": 15}


def _too_large(limit: int) -> InputError:
    return InputError(413, "body-too-large", f"request body larger than {limit} bytes")


def content_encodings(value: str | None) -> list[str]:
    """The codings applied to a body, first applied first; 415 for one the proxy cannot
    decode.

    >>> content_encodings("gzip"), content_encodings(None), content_encodings("identity")
    (['gzip'], [], [])
    >>> content_encodings("br")
    Traceback (most recent call last):
    ...
    kvobs.proxy._identity.InputError: unsupported Content-Encoding: br (gzip and deflate are)
    """
    codings = [c.strip().lower() for c in (value or "").split(",")]
    codings = [c for c in codings if c and c != "identity"]
    for coding in codings:
        if coding not in _CODINGS:
            raise InputError(
                415,
                "unsupported-encoding",
                f"unsupported Content-Encoding: {coding[:40]} (gzip and deflate are)",
            )
    return codings


def _bad_body() -> InputError:
    return InputError(400, "bad-body", "request body is incomplete or badly encoded")


def _inflate(data: bytes, coding: str, limit: int) -> bytes:
    """One coding undone, at most ``limit`` bytes out (a bomb is a 413, not a full
    memory); gzip members one after another are one body."""
    out: list[bytes] = []
    size = 0
    wbits = _CODINGS[coding]
    while data:
        decoder = zlib.decompressobj(wbits)
        try:
            chunk = decoder.decompress(data, limit + 1 - size)
        except zlib.error:
            if wbits != 15 or out:
                raise _bad_body() from None
            wbits = -15  # "deflate" sent as raw deflate, as some clients do
            continue
        size += len(chunk)
        if size > limit or decoder.unconsumed_tail:
            raise _too_large(limit)
        if not decoder.eof:
            raise _bad_body()
        out.append(chunk)
        data = decoder.unused_data if wbits == 31 else b""
        if data and wbits != 31:
            raise _bad_body()
    return b"".join(out)


async def read_body(request: web.Request, limit: int, timeout_s: float) -> bytes:
    """The whole body, however it arrives (many TCP writes, chunked, compressed): 413
    beyond ``limit`` bytes (declared or not, compressed or decoded), 408 when it takes
    longer than ``timeout_s``, 415 for a Content-Encoding other than gzip or deflate,
    400 when the client's framing or encoding is broken."""
    codings = content_encodings(request.headers.get("Content-Encoding"))
    if request.content_length is not None and request.content_length > limit:
        raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            while chunk := await request.content.read(_READ_CHUNK):
                size += len(chunk)
                if size > limit:
                    raise _too_large(limit)
                chunks.append(chunk)
    except TimeoutError:
        raise InputError(
            408, "body-timeout", f"request body not received within {timeout_s:g} s"
        ) from None
    except (
        http_exceptions.HttpProcessingError,
        web.RequestPayloadError,
        aiohttp.ClientError,
        ConnectionError,
    ):
        raise _bad_body() from None
    raw = b"".join(chunks)
    for coding in reversed(codings):
        raw = _inflate(raw, coding, limit)
    return raw


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):  # 1e999: a number no JSON can carry on
        raise _non_finite(text)
    return value


def _non_finite(text: str) -> InputError:
    return InputError(
        400,
        "non-finite-number",
        f"request body holds a non-finite number ({text[:20]}): JSON has no NaN or Infinity",
    )


def parse_body(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object whose fields the proxy reads have the shapes it expects.

    >>> parse_body(b'{"prompt": "hi", "stream": true}')
    {'prompt': 'hi', 'stream': True}
    >>> parse_body(b'{"temperature": NaN}')
    Traceback (most recent call last):
    ...
    kvobs.proxy._identity.InputError: request body holds a non-finite number (NaN): JSON has no NaN or Infinity
    >>> parse_body(b'{"prompt": "\\\\ud800"}')
    Traceback (most recent call last):
    ...
    kvobs.proxy._identity.InputError: request body holds a lone surrogate (invalid Unicode)
    """
    try:
        # json.loads' own decoding of bytes (UTF-8, -16 or -32), with one decoder made once
        body = _DECODER.decode(raw.decode(json.detect_encoding(raw), "surrogatepass"))
    except RecursionError:
        raise _too_deep() from None
    except InputError:
        raise
    except ValueError:  # UnicodeDecodeError included
        raise InputError(400, "bad-json", "request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise InputError(400, "not-an-object", "request body must be a JSON object")
    _check_depth(body)  # O(objects and arrays): a few for a chat body, not its text
    if b"\\ud" in raw or b"\\uD" in raw:  # a surrogate escape: strings checked only then
        _check_unicode(body)
    _check_fields(body)
    return body


def _reject_constant(name: str) -> None:
    raise _non_finite(name)  # NaN, Infinity, -Infinity: Python's JSON extensions


# NaN, Infinity, -Infinity and numbers past a double (1e999) are refused, not parsed.
_DECODER = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite)


def check_headers(headers: Mapping[str, str], names: tuple[str | None, ...]) -> None:
    """Header values the proxy reads must be text it can encode (aiohttp hands invalid
    UTF-8 on as lone surrogates)."""
    for name in names:
        value = headers.get(name) if name else None
        if value is not None and not _encodable(value):
            raise InputError(400, "bad-header", f"header {name} is not valid UTF-8")


def _too_deep() -> InputError:
    return InputError(400, "too-deep", f"request body nested deeper than {MAX_DEPTH} levels")


def _check_depth(body: Any) -> None:
    level = [body]
    for _ in range(MAX_DEPTH):
        below = []
        for value in level:
            for child in value.values() if type(value) is dict else value:
                if type(child) is dict or type(child) is list:
                    below.append(child)
        if not below:
            return
        level = below
    raise _too_deep()


def _encodable(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_unicode(body: Any) -> None:
    stack = [body]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            if not _encodable(value):
                raise InputError(
                    400, "bad-unicode", "request body holds a lone surrogate (invalid Unicode)"
                )
        elif isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)


def _bad(field: str, expected: str) -> InputError:
    return InputError(400, "bad-field", f"'{field}' must be {expected}")


def _optional_str(value: Any) -> bool:
    return value is None or isinstance(value, str)


def _check_fields(body: dict[str, Any]) -> None:
    if "stream" in body and not isinstance(body["stream"], bool):
        raise _bad("stream", "a boolean")
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list):
            raise _bad("messages", "an array")
        for i, message in enumerate(messages):
            _check_message(message, f"messages[{i}]")
    if "prompt" in body:
        prompt = body["prompt"]
        if isinstance(prompt, list):
            if not all(isinstance(p, (str, int, list)) and not isinstance(p, bool) for p in prompt):
                raise _bad("prompt", "a string, or an array of strings or token ids")
        elif not isinstance(prompt, str):
            raise _bad("prompt", "a string, or an array of strings or token ids")


def _check_message(message: Any, where: str) -> None:
    if not isinstance(message, dict):
        raise _bad(where, "an object")
    _check_strings(
        message, ("role", "tool_call_id", "reasoning_content", "reasoning", "name"), where
    )
    content = message.get("content")
    if not (_optional_str(content) or isinstance(content, list)):
        raise _bad(f"{where}.content", "a string or an array of content parts")
    calls = message.get("tool_calls")
    if not _present(calls, list, f"{where}.tool_calls", "an array"):
        return
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        if not isinstance(call, dict):
            raise _bad(at, "an object")
        function = call.get("function")
        if _present(function, dict, f"{at}.function", "an object"):
            _check_strings(function, ("name", "arguments"), f"{at}.function")


_Kind = TypeVar("_Kind")


def _present(value: Any, kind: type[_Kind], where: str, expected: str) -> TypeGuard[_Kind]:
    """False when absent (null); a 400 when present with another type."""
    if value is None:
        return False
    if not isinstance(value, kind):
        raise _bad(where, expected)
    return True


def _check_strings(value: dict[str, Any], keys: tuple[str, ...], where: str) -> None:
    for key in keys:
        if not _optional_str(value.get(key)):
            raise _bad(f"{where}.{key}", "a string")
