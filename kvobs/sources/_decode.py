"""What a span file holds, found from its bytes, never from its name.

A file is decompressed when it starts with gzip's or zstd's magic number (the Collector's
``compression: zstd`` compresses the whole stream), then read as:

- JSON: one object per line (the Collector file exporter, kvobs's store), or one
  document, pretty-printed or not (an OTLP request, Tempo's or Jaeger's trace JSON);
- length-prefixed messages: a 4-byte big-endian size before each message (the file
  exporter's ``format: proto``, and its legacy per-message zstd compression, for JSON
  too); each message is OTLP protobuf or JSON;
- one OTLP protobuf message (``TracesData`` / ``ExportTraceServiceRequest``: one wire
  layout), e.g. an OTLP/HTTP request body saved to a file.

``documents`` yields ``(where, document)`` with ``where`` a ``file:line`` (JSON lines) or
``file:#n`` (the n-th message); what cannot be read is reported in ``problems`` and
skipped, the rest of the file still read.
"""

from __future__ import annotations

import io
import json
import zlib
from typing import Iterator

GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_PREFIX = 4  # bytes of the file exporter's message size


def documents(path: str, problems: list[str]) -> Iterator[tuple[str, object]]:
    """The trace documents of one file, in order."""
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except OSError as error:
        problems.append(f"{path}: cannot read ({error.strerror or error})")
        return
    yield from _contents(data, path, problems, depth=0)


def _contents(data: bytes, path: str, problems: list[str], depth: int
              ) -> Iterator[tuple[str, object]]:
    if data[:2] == GZIP_MAGIC or data[:4] == ZSTD_MAGIC:
        if depth:  # compressed twice: not what any exporter writes (a zip bomb, maybe)
            problems.append(f"{path}: skipped (compressed twice)")
            return
        data = _decompressed(data, path, problems)
        yield from _contents(data, path, problems, depth + 1)
        return
    start = data.lstrip()[:1]
    if not start:
        return  # an empty file (a segment just created): nothing to read, nothing lost
    if start in (b"{", b"["):
        yield from _json(data, path, problems)
        return
    frames = _frames(data, path, problems)
    if frames is not None:
        for number, payload in enumerate(frames, 1):
            document = _message(payload, f"{path}:#{number}", problems)
            if document is not None:
                yield f"{path}:#{number}", document
        return
    document = _proto(data, path, problems)
    if document is not None:
        yield path, document


def _decompressed(data: bytes, path: str, problems: list[str]) -> bytes:
    """Every byte that decompresses; a truncated or corrupt tail is reported."""
    if data[:2] == GZIP_MAGIC:
        out, rest = [], data
        while rest[:2] == GZIP_MAGIC:  # concatenated members (gzip -c a b > c)
            inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
            try:
                out.append(inflater.decompress(rest))
            except zlib.error as error:
                problems.append(f"{path}: corrupt gzip data ({error}); read what precedes")
                break
            if not inflater.eof:
                problems.append(f"{path}: truncated gzip data; read what precedes")
                break
            rest = inflater.unused_data
        return b"".join(out)
    import zstandard

    out = io.BytesIO()
    reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data),
                                                        read_across_frames=True)
    try:
        while chunk := reader.read(1 << 20):
            out.write(chunk)
    except zstandard.ZstdError as error:
        problems.append(f"{path}: corrupt or truncated zstd data ({error}); read what "
                        "precedes")
    return out.getvalue()


def _json(data: bytes, path: str, problems: list[str]) -> Iterator[tuple[str, object]]:
    text = data.decode("utf-8", errors="replace")
    # "\n" only: str.splitlines() also breaks at U+0085, U+2028, U+2029 (and \x0b, \x0c,
    # \x1c-\x1e), which a JSON string may hold raw (older kvobs writers, orjson): that cut
    # a line, and every span of its batch, in two. A "\r" left by CRLF is whitespace.
    lines = text.split("\n")
    first = next((line for line in lines if line.strip()), "")
    try:
        json.loads(first)
        as_lines = True
    except (ValueError, RecursionError):
        as_lines = False
    if not as_lines:  # pretty-printed: one document over many lines
        try:
            yield f"{path}:1", json.loads(text)
            return
        except (ValueError, RecursionError) as error:
            whole = error  # or JSON lines whose first line is corrupt: read line by line
    found = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            found.append((f"{path}:{number}", json.loads(line)))
        except (ValueError, RecursionError) as error:
            found.append((f"{path}:{number}", error))
    if not as_lines and len(found) > 1 and not any(isinstance(d, (dict, list))
                                                   for _, d in found):
        # not one line is a document: a damaged document, said once, not line by line
        problems.append(f"{path}: skipped corrupt JSON document ({short(whole)})")
        return
    for where, document in found:
        if isinstance(document, Exception):
            problems.append(f"{where}: skipped corrupt line ({short(document)})")
        else:
            yield where, document


def _frames(data: bytes, path: str, problems: list[str]) -> list[bytes] | None:
    """Length-prefixed messages, or None when the first size does not fit the file (the
    file is not framed). A truncated last message is reported."""
    frames, offset = [], 0
    while offset < len(data):
        if len(data) - offset < _PREFIX:
            size = None
        else:
            size = int.from_bytes(data[offset:offset + _PREFIX], "big")
        if size is None or offset + _PREFIX + size > len(data):
            if not frames:
                return None
            problems.append(f"{path}:#{len(frames) + 1}: truncated message at byte "
                            f"{offset}; read what precedes")
            break
        frames.append(data[offset + _PREFIX:offset + _PREFIX + size])
        offset += _PREFIX + size
    return frames


def _message(payload: bytes, where: str, problems: list[str]) -> object | None:
    if payload[:4] == ZSTD_MAGIC:  # the file exporter's legacy per-message compression
        import zstandard

        try:
            payload = zstandard.ZstdDecompressor().decompressobj().decompress(payload)
        except zstandard.ZstdError as error:
            problems.append(f"{where}: skipped corrupt zstd message ({short(error)})")
            return None
    if payload.lstrip()[:1] in (b"{", b"["):
        try:
            return json.loads(payload.decode("utf-8", errors="replace"))
        except (ValueError, RecursionError) as error:
            problems.append(f"{where}: skipped corrupt JSON message ({short(error)})")
            return None
    return _proto(payload, where, problems)


def _proto(payload: bytes, where: str, problems: list[str]) -> dict | None:
    """An OTLP protobuf traces message as an OTLP-JSON dict."""
    from google.protobuf.json_format import MessageToDict
    from google.protobuf.message import DecodeError
    from opentelemetry.proto.trace.v1.trace_pb2 import TracesData

    message = TracesData()
    try:
        message.ParseFromString(payload)
    except (DecodeError, RecursionError, ValueError) as error:
        problems.append(f"{where}: skipped (neither JSON, OTLP protobuf, gzip nor zstd: "
                        f"{short(error)})")
        return None
    if not message.resource_spans:
        problems.append(f"{where}: skipped (no spans: not an OTLP traces message)")
        return None
    return MessageToDict(message)  # ids in base64, as Tempo's JSON: the rows read both


def short(error: BaseException) -> str:
    return str(error).splitlines()[0][:120] if str(error) else type(error).__name__
