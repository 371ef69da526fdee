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

Damage a crash or a copy leaves is read past, in time linear in the file: a UTF-8 byte
order mark is dropped; runs of NUL bytes (a file preallocated, or blocks never written
before a crash) are skipped, wherever they sit, in one warning per file (each run used to
be read as millions of empty messages); decompression stops at
``MAX_DECOMPRESSED_BYTES``. The warnings one file (or one trace of a trace API) can add
are bounded by ``bounded_problems``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import stat
import zlib
from typing import Iterator

GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
UTF8_BOM = b"\xef\xbb\xbf"
_PREFIX = 4  # bytes of the file exporter's message size
# Beyond this a compressed file is read no further (a decompression bomb: 872 KB of
# gzip'd NULs is 870 MB). Above what kvobs can parse anyway: a span file is read whole,
# and its JSON takes several times its size in memory.
MAX_DECOMPRESSED_BYTES = 1 << 30
# Warnings kept per file (the rest counted in one line): a file of a million corrupt
# lines must not make a million strings.
MAX_PROBLEMS_PER_FILE = 100
_CHUNK = 1 << 20
_ZEROS = bytes(_CHUNK)
# How many frames after a NUL run must chain for the reader to resume there.
_RESYNC_FRAMES = 4


def documents(path: str, problems: list[str]) -> Iterator[tuple[str, object]]:
    """The trace documents of one file, in order."""
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except OSError as error:
        problems.append(f"{path}: cannot read ({error.strerror or error})")
        return
    yield from _contents(data, path, problems, depth=0)


_KINDS = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISDIR, "a directory"),
)


def is_regular(path: str, problems: list[str] | None = None) -> bool:
    """Whether ``path`` is a regular file (or a link to one): what every directory
    listing of a source keeps. Anything else is reported and skipped: opening a FIFO
    blocks until something writes to it (a FIFO named ``*.parquet`` in ``compacted/``
    hung ``turns`` and ``report``). A file gone meanwhile is skipped silently."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return False
    except OSError as error:
        if problems is not None:
            problems.append(f"{path}: cannot read ({error.strerror or error})")
        return False
    if stat.S_ISREG(mode):
        return True
    if problems is not None:
        kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
        problem = f"{path}: skipped (not a regular file: {kind})"
        if problem not in problems:  # a store is listed more than once per command
            problems.append(problem)
    return False


class _Bounded(list):
    """A file's problems: the first ``limit`` kept, the rest only counted."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit, self.dropped = limit, 0

    def append(self, problem: str) -> None:
        if len(self) < self.limit:
            super().append(problem)
        else:
            self.dropped += 1


@contextlib.contextmanager
def bounded_problems(problems: list[str], where: str) -> Iterator[list[str]]:
    """A list for the problems of one file (or one trace) ``where``: at most
    ``MAX_PROBLEMS_PER_FILE`` reach ``problems``, then one line counts the rest."""
    local = _Bounded(MAX_PROBLEMS_PER_FILE)
    try:
        yield local
    finally:
        problems.extend(local)
        if local.dropped:
            problems.append(f"{where}: {local.dropped} more problem(s) not listed")


def _contents(
    data: bytes, path: str, problems: list[str], depth: int
) -> Iterator[tuple[str, object]]:
    if data[:2] == GZIP_MAGIC or data[:4] == ZSTD_MAGIC:
        if depth:  # compressed twice: not what any exporter writes (a zip bomb, maybe)
            problems.append(f"{path}: skipped (compressed twice)")
            return
        data = _decompressed(data, path, problems)
        yield from _contents(data, path, problems, depth + 1)
        return
    if data[:3] == UTF8_BOM:  # Windows editors and PowerShell's redirection write one
        data = data[3:]
    start = data.lstrip()[:1]
    if not start:
        return  # an empty file (a segment just created): nothing to read, nothing lost
    if start in (b"{", b"["):
        yield from _json(data, path, problems)
        return
    notes: list[str] = []
    frames = _frames(data, path, notes)
    if start == b"\x00" and not frames and _after_nuls(data)[:1] in (b"{", b"["):
        yield from _json(data, path, problems)  # JSON lines after a NUL block
        return
    problems.extend(notes)
    if frames is not None:
        for number, payload in enumerate(frames, 1):
            document = _message(payload, f"{path}:#{number}", problems)
            if document is not None:
                yield f"{path}:#{number}", document
        return
    document = _proto(data, path, problems)
    if document is not None:
        yield path, document


def _after_nuls(data: bytes) -> bytes:
    """The start of ``data`` after its leading NULs and whitespace (a few bytes)."""
    end = _nuls_end(data, 0)
    return data[end : end + 64].lstrip()


def _nuls_end(data: bytes, offset: int) -> int:
    """Where the run of NULs at ``offset`` ends: compared a chunk at a time (memcmp), at
    memory speed (a regular expression scanned ~50 MB/s)."""
    while True:
        piece = data[offset : offset + _CHUNK]
        if len(piece) == _CHUNK and piece == _ZEROS:
            offset += _CHUNK
            continue
        return offset + len(piece) - len(piece.lstrip(b"\x00"))


def _decompressed(data: bytes, path: str, problems: list[str]) -> bytes:
    """Every byte that decompresses, up to ``MAX_DECOMPRESSED_BYTES``; a truncated or
    corrupt tail, or the bound, is reported."""
    limit = MAX_DECOMPRESSED_BYTES
    out = _Output()
    if data[:2] == GZIP_MAGIC:
        rest = data
        while rest[:2] == GZIP_MAGIC and len(out) <= limit:  # concatenated members
            inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
            pending = rest
            try:
                while not inflater.eof and len(out) <= limit:
                    chunk = inflater.decompress(pending, _CHUNK)
                    pending = inflater.unconsumed_tail
                    out.write(chunk)
                    if not chunk and not pending:
                        break
            except zlib.error as error:
                problems.append(f"{path}: corrupt gzip data ({error}); read what precedes")
                break
            if len(out) > limit:
                break
            if not inflater.eof:
                problems.append(f"{path}: truncated gzip data; read what precedes")
                break
            rest = inflater.unused_data
    else:
        import zstandard

        reader = zstandard.ZstdDecompressor().stream_reader(
            io.BytesIO(data), read_across_frames=True
        )
        try:
            while len(out) <= limit and (chunk := reader.read(_CHUNK)):
                out.write(chunk)
        except zstandard.ZstdError as error:
            problems.append(f"{path}: corrupt or truncated zstd data ({error}); read what precedes")
    if len(out) > limit:
        problems.append(
            f"{path}: decompresses to more than {limit} bytes; read what "
            "precedes (a decompression bomb, or a file to split)"
        )
    if out.dropped:
        problems.append(
            f"{path}: skipped {out.dropped} NUL byte(s) while decompressing (whole MiB of them)"
        )
    return out.getvalue()[:limit]


class _Output(io.BytesIO):
    """Decompressed bytes; ``len`` counts every one. A whole chunk of NULs right after
    NULs is counted, not kept: the run it extends is still a run, skipped the same way
    (``_contents``), and a bomb of NULs costs time, not memory. (No OTLP message holds a
    MiB of NULs.)"""

    def __init__(self) -> None:
        super().__init__()
        self.dropped = 0

    def write(self, chunk) -> int:
        if (
            len(chunk) == _CHUNK
            and chunk == _ZEROS
            and self.tell() >= _PREFIX
            and self.getbuffer()[-_PREFIX:] == _ZEROS[:_PREFIX]
        ):
            self.dropped += len(chunk)
            return len(chunk)
        return super().write(chunk)

    def __len__(self) -> int:
        return self.tell() + self.dropped


def _json(data: bytes, path: str, problems: list[str]) -> Iterator[tuple[str, object]]:
    if b"\x00" in data:  # never in JSON (a string escapes it): damage, dropped whole
        nuls = data.count(b"\x00")
        data = data.translate(None, b"\x00")  # 25x faster than replace()
        problems.append(
            f"{path}: skipped {nuls} NUL byte(s) (blocks never written, or a preallocated file)"
        )
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
    if not as_lines and len(found) > 1 and not any(isinstance(d, (dict, list)) for _, d in found):
        # not one line is a document: a damaged document, said once, not line by line
        problems.append(f"{path}: skipped corrupt JSON document ({short(whole)})")
        return
    for where, document in found:
        if isinstance(document, Exception):
            problems.append(f"{where}: skipped corrupt line ({short(document)})")
        else:
            yield where, document


def _size(data: bytes, offset: int) -> int | None:
    """The message size at ``offset``, or None when no size fits the data there."""
    if len(data) - offset < _PREFIX:
        return None
    size = int.from_bytes(data[offset : offset + _PREFIX], "big")
    return size if offset + _PREFIX + size <= len(data) else None


# How a message the file exporter frames begins: OTLP protobuf's first field (1, a
# length-delimited ``resource_spans``), JSON, or zstd's magic number.
_MESSAGE_STARTS = (b"\x0a", b"{", b"[", b" ", b"\n", ZSTD_MAGIC[:1])


def _chains(data: bytes, start: int) -> bool:
    """Whether a message starts at ``start``: it, and the next ``_RESYNC_FRAMES``
    messages, begin as messages do and fit the data up to its end or a NUL run, and it
    reads as a message (parsed: once per NUL run, mostly)."""
    offset = start
    for _ in range(_RESYNC_FRAMES):
        size = _size(data, offset)
        # no size fits, or an empty message (a NUL run), or bytes no message starts with
        if not size or data[offset + _PREFIX : offset + _PREFIX + 1] not in _MESSAGE_STARTS:
            return False
        offset += _PREFIX + size
        if offset == len(data) or _size(data, offset) == 0:  # the end, or a NUL run
            break
    # and it reads as a message: a chain can land inside a later NUL run by chance
    size = _size(data, start)
    assert size  # the chain above began with it
    return _message(data[start + _PREFIX : start + _PREFIX + size], "", []) is not None


def _frames(data: bytes, path: str, problems: list[str]) -> list[bytes] | None:
    """Length-prefixed messages, or None when the first size does not fit the file (the
    file is not framed). A run of NULs where a size is due (no exporter writes an empty
    message) is skipped to the first message that chains after it (``_chains``); one
    line reports the NULs. A truncated last message is reported."""
    frames: list[bytes] = []
    offset, nuls, runs = 0, 0, 0
    while offset < len(data):
        size = _size(data, offset)
        if size == 0:
            end = _nuls_end(data, offset)
            # The next message's size may begin with NULs of the run.
            resume = next(
                (at for at in range(max(end - _PREFIX + 1, offset), end) if _chains(data, at)), end
            )
            nuls, runs, offset = nuls + resume - offset, runs + 1, resume
            continue
        if size is None:
            if not frames and not runs:
                return None
            problems.append(
                f"{path}:#{len(frames) + 1}: truncated message at byte {offset}; read what precedes"
            )
            break
        frames.append(data[offset + _PREFIX : offset + _PREFIX + size])
        offset += _PREFIX + size
    if runs and not frames and offset < len(data):
        return None  # NULs, then no message: maybe text (``_contents``)
    if runs:
        problems.append(
            f"{path}: skipped {nuls} NUL byte(s) in {runs} run(s) (blocks "
            "never written, or a preallocated file)"
        )
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
        problems.append(
            f"{where}: skipped (neither JSON, OTLP protobuf, gzip nor zstd: {short(error)})"
        )
        return None
    if not message.resource_spans:
        problems.append(f"{where}: skipped (no spans: not an OTLP traces message)")
        return None
    return MessageToDict(message)  # ids in base64, as Tempo's JSON: the rows read both


def short(error: BaseException) -> str:
    return str(error).splitlines()[0][:120] if str(error) else type(error).__name__
