"""A raw HTTP/1.1 client on asyncio sockets: sends a request in pieces with pauses, or
chunked, or cut short, as real slow and odd clients do (aiohttp's client always sends
a well-formed body at once)."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Sequence


def request_head(path: str, headers: dict[str, str] | Sequence[tuple[str, str]] = (),
                 *, length: int | None = None, chunked: bool = False,
                 method: str = "POST") -> bytes:
    items = list(headers.items()) if isinstance(headers, dict) else list(headers)
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", "Connection: close"]
    if chunked:
        lines.append("Transfer-Encoding: chunked")
    elif length is not None:
        lines.append(f"Content-Length: {length}")
    head = "\r\n".join(lines).encode() + b"\r\n"
    for name, value in items:
        head += name.encode("latin-1") + b": " + (
            value if isinstance(value, bytes) else value.encode("utf-8", "surrogateescape")
        ) + b"\r\n"
    return head + b"\r\n"


def chunked(pieces: Sequence[bytes]) -> list[bytes]:
    """Each piece as one HTTP chunk, then the last chunk."""
    return [f"{len(p):x}\r\n".encode() + p + b"\r\n" for p in pieces if p] + [b"0\r\n\r\n"]


async def send(port: int, parts: Sequence[bytes], pause_s: float = 0.0,
               read: bool = True, timeout_s: float = 10.0) -> tuple[int | None, bytes]:
    """Writes ``parts`` (head included) with ``pause_s`` between them; returns the
    response status and its (de-chunked) body, or (None, b"") when the server closed
    without an answer. ``read=False`` closes right after the last write."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for i, part in enumerate(parts):
            if i and pause_s:
                await asyncio.sleep(pause_s)
            writer.write(part)
            await writer.drain()
        if not read:
            return None, b""
        raw = await asyncio.wait_for(_read_response(reader), timeout_s)
    except (ConnectionError, OSError):
        return None, b""
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except (ConnectionError, OSError):
            pass
    return parse_response(raw)


async def _read_response(reader: asyncio.StreamReader) -> bytes:
    """Until the response is complete (its length, its last chunk) or the server closes:
    a server may keep the connection open after answering."""
    raw = b""
    while chunk := await reader.read(65536):
        raw += chunk
        head, sep, body = raw.partition(b"\r\n\r\n")
        if not sep:
            continue
        lower = head.lower()
        if b"transfer-encoding: chunked" in lower:
            if body.endswith(b"0\r\n\r\n"):
                break
        elif b"content-length:" in lower:
            length = int(lower.split(b"content-length:")[1].split(b"\r\n")[0])
            if len(body) >= length:
                break
    return raw


def parse_response(raw: bytes) -> tuple[int | None, bytes]:
    head, sep, body = raw.partition(b"\r\n\r\n")
    if not sep:
        return None, b""
    status = int(head.split(b" ", 2)[1])
    if b"transfer-encoding: chunked" in head.lower():
        out, rest = b"", body
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line.split(b";")[0] or b"0", 16)
            if size == 0:
                break
            out, rest = out + rest[:size], rest[size + 2:]
        body = out
    return status, body


def json_body(body: bytes) -> Any:
    return json.loads(body) if body else None
