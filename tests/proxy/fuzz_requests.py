"""Seeded generator of bad requests for the proxy: bad JSON, wrong types, deep and huge
bodies, invalid UTF-8 and lone surrogates, bad headers, odd encodings, chunking, slow
clients and early disconnects. Each case is the raw bytes a client writes (in parts,
with pauses), so one generator drives both the CI fuzz test and bench/proxy_fuzz.py."""

from __future__ import annotations

import gzip
import json
import random
import zlib
from dataclasses import dataclass
from typing import Any, Iterator

from rawclient import chunked, request_head

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
KEY = ("Authorization", "Bearer sk-fuzz")


@dataclass
class Case:
    kind: str
    parts: list[bytes]
    pause_s: float = 0.0
    read: bool = True  # False: the client leaves without reading the answer


def _value(rng: random.Random, depth: int = 0) -> Any:
    """A random JSON value of a random type."""
    pick = rng.randrange(10 if depth < 3 else 7)
    if pick == 0:
        return None
    if pick == 1:
        return rng.choice([True, False])
    if pick == 2:
        return rng.choice([0, -1, 1, 2**63, -2**70, 7])
    if pick == 3:
        return rng.choice([0.5, -1e308, 1e-300, 3.0])
    if pick in (4, 5, 6):
        return rng.choice(["", "x", "user", "assistant", "tool", "\u0000", "é" * 3,
                           "😀", "a" * rng.randrange(1, 300)])
    if pick in (7, 8):
        return [_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(["a", "role", "content", "function", "type", "text", ""]):
            _value(rng, depth + 1) for _ in range(rng.randrange(4))}


def _base(rng: random.Random) -> tuple[str, dict[str, Any]]:
    if rng.random() < 0.6:
        messages = [{"role": "user", "content": "hello"}]
        if rng.random() < 0.5:
            messages += [{"role": "assistant", "content": "hi", "tool_calls": [
                {"id": "t1", "type": "function",
                 "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "t1", "content": "42"}]
        body: dict[str, Any] = {"model": "m", "messages": messages}
        path = CHAT
    else:
        body = {"model": "m", "prompt": "once upon a time"}
        path = COMPLETIONS
    if rng.random() < 0.5:
        body["stream"] = True
    if rng.random() < 0.5:
        body["conversation_id"] = f"fuzz-{rng.randrange(50)}"
    return path, body


# Where a wrong-typed value goes (a path of keys and indexes into the base body).
_FIELDS = [("messages",), ("prompt",), ("stream",), ("conversation_id",), ("model",),
           ("messages", 0), ("messages", 0, "content"), ("messages", 0, "role"),
           ("messages", 1, "tool_calls"), ("messages", 1, "tool_calls", 0),
           ("messages", 1, "tool_calls", 0, "function"),
           ("messages", 1, "tool_calls", 0, "function", "arguments"),
           ("messages", 1, "tool_calls", 0, "function", "name"),
           ("messages", 2, "tool_call_id"), ("messages", 1, "reasoning_content"),
           ("max_tokens",), ("kv_transfer_params",), ("stream_options",), ("n",)]


def _set(body: Any, path: tuple, value: Any) -> None:
    for key in path[:-1]:
        try:
            body = body[key]
        except (KeyError, IndexError, TypeError):
            return
    try:
        body[path[-1]] = value
    except (IndexError, TypeError):
        pass


def _mutate_body(rng: random.Random, path: str, body: dict[str, Any]) -> tuple[str, bytes]:
    raw = json.dumps(body).encode()
    kind = rng.choice(["truncate", "flip", "garbage", "wrong-type", "wrong-type", "deep",
                       "surrogate", "invalid-utf8", "encoding", "huge", "numbers",
                       "not-object", "empty", "nul", "duplicate-keys"])
    if kind == "truncate":
        return kind, raw[:rng.randrange(len(raw))]
    if kind == "flip":
        data = bytearray(raw)
        for _ in range(rng.randrange(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        return kind, bytes(data)
    if kind == "garbage":
        return kind, rng.randbytes(rng.randrange(1, 300))
    if kind == "wrong-type":
        for _ in range(rng.randrange(1, 3)):
            _set(body, rng.choice(_FIELDS), _value(rng))
        return kind, json.dumps(body).encode()
    if kind == "deep":
        depth = rng.choice([rng.randrange(90, 110), rng.randrange(110, 1000),
                            rng.randrange(1000, 20000)])
        opener, closer = rng.choice([(b"[", b"]"), (b'{"a":', b"}")])
        nested = opener * depth + b"1" + closer * depth
        if rng.random() < 0.1:
            nested = opener * depth  # never closed
        return kind, raw[:-1] + b', "x": ' + nested + b"}"
    if kind == "surrogate":
        escape = rng.choice([b"\\ud800", b"\\udfff", b"\\uDBFF", b"\\ud83d", b"\\ude00x",
                             b"\\ud83d\\ud83d"])
        target = rng.choice([b'"hello', b'"once', b'"fuzz-', b'"m"', b'"role', b'"user'])
        if target in raw:
            i = raw.index(target) + 1
            return kind, raw[:i] + escape + raw[i:]
        return kind, raw[:-1] + b', "' + escape + b'": 1}'
    if kind == "invalid-utf8":
        i = raw.index(b'"model"') + 1
        return kind, raw[:i] + rng.choice([b"\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"\x80",
                                           b"\xf4\x90\x80\x80"]) + raw[i:]
    if kind == "encoding":
        text = json.dumps(body, ensure_ascii=False) + "é😀"
        text = text[:-3] + "é😀" + text[-3:] if text.endswith('"}') else text
        encoding = rng.choice(["utf-16", "utf-16-le", "utf-32", "latin-1", "utf-8-sig",
                               "cp1252"])
        return kind, text.encode(encoding, "replace")
    if kind == "huge":
        size = rng.choice([FUZZ_MAX_BODY + rng.randrange(1, 5000), FUZZ_MAX_BODY - 200,
                           FUZZ_MAX_BODY * 3])
        filler = rng.choice([b'"' + b"a" * size + b'"', b"[" + b"1," * (size // 2) + b"1]"])
        return kind, raw[:-1] + b', "x": ' + filler + b"}"
    if kind == "numbers":
        number = rng.choice([b"1e999999", b"-0", b"NaN", b"Infinity", b"-Infinity",
                             b"9" * 5000, b"0x10", b"01", b"1.", b".5"])
        return kind, raw[:-1] + b', "max_tokens": ' + number + b"}"
    if kind == "not-object":
        return kind, rng.choice([b"[]", b"null", b"1", b'"x"', b"true", b"[{}]",
                                 json.dumps([body]).encode()])
    if kind == "empty":
        return kind, rng.choice([b"", b" ", b"\n", b"{}"])
    if kind == "nul":
        return kind, raw.replace(b"hello", b"he\\u0000llo").replace(b"m\"", b"\x00\"", 1)
    # duplicate keys: the last wins in json.loads
    return kind, raw[:-1] + b', "messages": 5, "prompt": [], "stream": "no"}'


FUZZ_MAX_BODY = 64 * 1024


def _headers(rng: random.Random) -> tuple[str, list[tuple[str, Any]]]:
    """Headers, most of them ordinary, some of them bad."""
    headers: list[tuple[str, Any]] = [("Content-Type", "application/json")]
    if rng.random() < 0.7:
        headers.append(KEY)
    if rng.random() > 0.25:
        return "plain", headers
    kind = rng.choice(["bad-utf8-session", "bad-utf8-key", "empty-bearer", "long-session",
                       "huge-header", "odd-content-type", "traceparent", "many-headers",
                       "ctl-chars"])
    if kind == "bad-utf8-session":
        headers.append(("X-Session-ID", rng.choice([b"\xff\xfe", b"ab\xc3", b"\xed\xa0\x80"])))
    elif kind == "bad-utf8-key":
        headers = [h for h in headers if h[0] != "Authorization"]
        headers.append(("Authorization", b"Bearer \xff" + rng.randbytes(4)))
    elif kind == "empty-bearer":
        headers.append(("Authorization", rng.choice(["Bearer ", "Bearer", "", "Basic x"])))
    elif kind == "long-session":
        headers.append(("X-Session-ID", "s" * rng.choice([257, 4000])))
    elif kind == "huge-header":
        headers.append(("X-Junk", "j" * rng.choice([9000, 70000])))
    elif kind == "odd-content-type":
        headers[0] = ("Content-Type", rng.choice(["text/plain", "", "multipart/form-data",
                                                  "application/json; charset=latin-1"]))
    elif kind == "traceparent":
        headers.append(("traceparent", rng.choice([
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "garbage",
            "00-00000000000000000000000000000000-0000000000000000-01", "ff-" + "a" * 60])))
    elif kind == "many-headers":
        headers += [(f"X-H{i}", "v") for i in range(rng.choice([50, 150]))]
    else:
        headers.append(("X-Session-ID", "a\tb"))
    return kind, headers


def _transport(rng: random.Random, path: str, headers: list, body: bytes) -> tuple[str, Case]:
    """How the client sends it: at once, in pieces, chunked, compressed, cut short."""
    pick = rng.random()
    if pick < 0.55:
        return "content-length", Case("", [request_head(path, headers, length=len(body))
                                           + body])
    kind = rng.choice(["split-slow", "chunked", "chunked-slow", "gzip", "deflate",
                       "bad-gzip", "unknown-encoding", "short-length", "long-length",
                       "bad-chunks", "unfinished-chunks", "disconnect-mid-body",
                       "disconnect-after-request", "no-length", "bad-length",
                       "both-lengths", "http10", "bad-method", "unknown-path"])
    if kind == "split-slow":
        cut = sorted(rng.sample(range(1, max(2, len(body))), min(3, max(1, len(body) - 1))))
        pieces = [body[a:b] for a, b in zip([0, *cut], [*cut, len(body)])]
        return kind, Case("", [request_head(path, headers, length=len(body)), *pieces],
                          pause_s=rng.choice([0.001, 0.01, 0.05]))
    if kind in ("chunked", "chunked-slow"):
        size = rng.choice([1, 7, 100, 4096])
        pieces = [body[i:i + size] for i in range(0, len(body), size)][:200]
        parts = [request_head(path, headers, chunked=True),
                 b"".join(chunked(pieces)) if kind == "chunked" else None]
        if kind == "chunked-slow":
            parts = [parts[0], *chunked(pieces[:20])]
        return kind, Case("", parts, pause_s=0.005 if kind == "chunked-slow" else 0)
    if kind in ("gzip", "deflate", "bad-gzip", "unknown-encoding"):
        if kind == "gzip":
            data, encoding = gzip.compress(body, mtime=0), "gzip"
        elif kind == "deflate":
            data, encoding = zlib.compress(body), "deflate"
        elif kind == "bad-gzip":
            data, encoding = gzip.compress(body, mtime=0)[:-6] + b"broken", "gzip"
        else:
            data, encoding = body, rng.choice(["br", "zstd", "x-unknown", "gzip, gzip"])
        return kind, Case("", [request_head(path, [*headers, ("Content-Encoding", encoding)],
                                            length=len(data)) + data])
    if kind == "short-length":
        return kind, Case("", [request_head(path, headers, length=len(body) // 2) + body])
    if kind == "long-length":  # the client never sends the rest: the body timeout
        return kind, Case("", [request_head(path, headers, length=len(body) + 10) + body])
    if kind == "bad-chunks":
        return kind, Case("", [request_head(path, headers, chunked=True) + rng.choice([
            b"zz\r\nabc\r\n0\r\n\r\n", b"5\r\nab\r\n0\r\n\r\n", b"-1\r\nx\r\n0\r\n\r\n",
            b"3;ext=1\r\nabc\r\n0\r\n\r\n", b"ffffffffffffffff\r\nx\r\n"])])
    if kind == "unfinished-chunks":
        return kind, Case("", [request_head(path, headers, chunked=True)
                               + chunked([body[:50]])[0]])
    if kind == "disconnect-mid-body":
        return kind, Case("", [request_head(path, headers, length=len(body))
                               + body[:len(body) // 2]], read=False)
    if kind == "disconnect-after-request":
        return kind, Case("", [request_head(path, headers, length=len(body)) + body],
                          read=False)
    if kind == "no-length":
        return kind, Case("", [request_head(path, headers) + body])
    if kind == "bad-length":
        value = rng.choice(["-1", "abc", "1 1", "99999999999999999999", "+5"])
        return kind, Case("", [request_head(path, [*headers, ("Content-Length", value)])
                               + body])
    if kind == "both-lengths":
        return kind, Case("", [request_head(path, [*headers, ("Transfer-Encoding",
                                                               "chunked")],
                                            length=len(body)) + body])
    if kind == "http10":
        head = request_head(path, headers, length=len(body)).replace(b"HTTP/1.1", b"HTTP/1.0")
        return kind, Case("", [head + body])
    if kind == "bad-method":
        method = rng.choice(["GET", "PUT", "DELETE", "PATCH", "get", "FOO"])
        return kind, Case("", [request_head(path, headers, length=len(body), method=method)
                               + body])
    return kind, Case("", [request_head(path + rng.choice(["x", "/", "/../admin"]), headers,
                                        length=len(body)) + body])


def cases(seed: int, count: int) -> Iterator[Case]:
    rng = random.Random(seed)
    for _ in range(count):
        path, body = _base(rng)
        body_kind, raw = _mutate_body(rng, path, body) if rng.random() < 0.8 else \
            ("valid", json.dumps(body).encode())
        header_kind, headers = _headers(rng)
        transport_kind, case = _transport(rng, path, headers, raw)
        case.kind = f"{body_kind}/{header_kind}/{transport_kind}"
        yield case
