"""Live segments of the embedded store: rotation, a size cap and retention.

Every writer of ``DIR/spans/`` (a process's span exporter, ``kvobs collect``) appends
OTLP-JSON lines to its own active segment, ``<name>-<pid>.otlp.jsonl``. The active
segment is sealed, renamed ``<name>-<pid>.<UTC stamp>.otlp.jsonl`` (still read like any
live segment, and moved to parquet by ``kvobs store compact``), once it holds
``segment_bytes`` or is ``segment_age_s`` old; a new one is started. After each rotation,
and at most once a minute otherwise, the writer sweeps the directory: sealed segments
older than ``retention_s`` are deleted, then the oldest sealed segments until all live
segments together fit in ``max_bytes``. Active segments (any writer's) are never
deleted: a writer's own rotation bounds them, so between sweeps the live segments may
exceed ``max_bytes`` by up to ``segment_bytes`` per writer. Deletions are logged with
what they cost.

Limits come from the environment (one set for every kvobs process writing the store):

- ``KVOBS_STORE_SEGMENT_BYTES`` (default 64 MiB), ``KVOBS_STORE_SEGMENT_AGE`` (seconds,
  default 3600): when a segment is sealed;
- ``KVOBS_STORE_MAX_BYTES`` (default 4 GiB; 0: no cap): all live segments together;
- ``KVOBS_STORE_RETENTION`` (seconds, default 7 days; 0: kept until compacted).

Appends go through one lock per writer; the sweep runs in the appending thread (the
span export thread or the receiver's), never on a request path. Each append also holds
the segment file's ``flock`` and writes only if the active name still names that file;
whoever seals a segment (its writer rotating, ``kvobs store compact`` taking an idle one,
``seal``) renames it under the same lock, so no append ever lands in a sealed segment:
after a seal the writer starts a new active segment.

A segment is *rotated away* (``is_rotated``: no writer appends to it any more) when it is
sealed, or when its name is one the OpenTelemetry Collector's file exporter gives a
rotated backup (``collector-2026-01-02T03-04-05.678.jsonl``).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator

from kvobs.semconv import STORE_LIVE_DIR

_LOG = logging.getLogger("kvobs.emit")
SUFFIX = ".otlp.jsonl"
_SEALED = re.compile(r"\.\d{8}T\d{9}(?:-\d+)?" + re.escape(SUFFIX) + "$")
# lumberjack's backup name, which the Collector's file exporter rotates with:
# <name>-<UTC time>.<ext>, maybe gzip'd
_COLLECTOR_BACKUP = re.compile(
    r"-\d{4}-\d{2}-\d{2}T\d{2}-\d{2}-\d{2}\.\d{3}"
    r"(?:\.[A-Za-z0-9]+)?(?:\.gz)?$"
)
_SWEEP_EVERY_S = 60.0

ENV_SEGMENT_BYTES = "KVOBS_STORE_SEGMENT_BYTES"
ENV_SEGMENT_AGE = "KVOBS_STORE_SEGMENT_AGE"
ENV_MAX_BYTES = "KVOBS_STORE_MAX_BYTES"
ENV_RETENTION = "KVOBS_STORE_RETENTION"


@dataclass(frozen=True)
class SegmentLimits:
    segment_bytes: int = 64 * 2**20
    segment_age_s: float = 3600.0
    max_bytes: int = 4 * 2**30  # 0: no cap
    retention_s: float = 7 * 86400.0  # 0: no retention limit

    @classmethod
    def from_env(cls) -> "SegmentLimits":
        """Limits from ``KVOBS_STORE_*``; a value that is not a number is an error that
        names the variable (a deployer's typo must not silently disable the cap)."""
        default = cls()
        values = {}
        for field, variable, kind in (
            ("segment_bytes", ENV_SEGMENT_BYTES, int),
            ("segment_age_s", ENV_SEGMENT_AGE, float),
            ("max_bytes", ENV_MAX_BYTES, int),
            ("retention_s", ENV_RETENTION, float),
        ):
            raw = os.environ.get(variable, "").strip()
            if not raw:
                values[field] = getattr(default, field)
                continue
            try:
                value = kind(float(raw)) if kind is int else kind(raw)
            except ValueError:
                raise ValueError(f"{variable}={raw!r}: not a number") from None
            if value < 0:
                raise ValueError(f"{variable}={raw!r}: must not be negative")
            values[field] = value
        if values["segment_bytes"] <= 0 or values["segment_age_s"] <= 0:
            raise ValueError(f"{ENV_SEGMENT_BYTES} and {ENV_SEGMENT_AGE} must be positive")
        return cls(**values)


def is_sealed(name: str) -> bool:
    return bool(_SEALED.search(name))


def is_active(name: str) -> bool:
    """A kvobs writer's active segment (``LiveSegmentWriter``), which ``seal`` can take."""
    return name.endswith(SUFFIX) and not is_sealed(name)


def is_rotated(name: str) -> bool:
    """Whether no writer appends to the live file ``name`` any more (module doc)."""
    return is_sealed(name) or bool(_COLLECTOR_BACKUP.search(name))


def _lock(handle) -> None:
    """The segment's exclusive lock; a filesystem without locks (some FUSE mounts) only
    loses the seal's guarantee, never the append."""
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
    except OSError as error:
        if error.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            raise


def _names(handle, path: str) -> bool:
    """Whether ``path`` still names the open file ``handle`` (no one sealed it)."""
    try:
        return os.path.samestat(os.fstat(handle.fileno()), os.stat(path))
    except FileNotFoundError:
        return False


def seal(path: str, now: float) -> str | None:
    """Rename the active segment ``path`` to its sealed name, under the lock appends take:
    no append lands in it afterwards. Returns the sealed path; None when ``path`` is
    gone or was sealed meanwhile."""
    try:
        handle = open(path, "rb")
    except FileNotFoundError:
        return None
    with handle:
        _lock(handle)
        if not _names(handle, path):
            return None
        stem = path[: -len(SUFFIX)]
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + f"{int(now * 1000) % 1000:03d}"
        sealed = f"{stem}.{stamp}{SUFFIX}"
        n = 0
        while os.path.exists(sealed):  # two seals within a millisecond
            n += 1
            sealed = f"{stem}.{stamp}-{n}{SUFFIX}"
        os.replace(path, sealed)
        return sealed


class LiveSegmentWriter:
    """Appends lines to this process's active segment in ``store_dir/spans``; rotates,
    caps and expires the live segments (module doc). ``append`` raises OSError when the
    store cannot be written (the caller counts the loss)."""

    def __init__(
        self, store_dir: str, name: str, limits: SegmentLimits | None = None, clock=time.time
    ):
        self.directory = os.path.join(store_dir, STORE_LIVE_DIR)
        self._stem = f"{name}-{os.getpid()}"
        self.path = os.path.join(self.directory, self._stem + SUFFIX)
        if limits is None:
            try:
                limits = SegmentLimits.from_env()
            except ValueError as error:  # telemetry never stops the host: said, not silent
                _LOG.error("span store limits: %s; using the defaults", error)
                limits = SegmentLimits()
        self.limits = limits
        self._clock = clock
        self._lock = threading.Lock()
        self._bytes: int | None = None  # of the active segment; None: not looked at yet
        self._opened_at = 0.0
        self._swept_at = 0.0

    def makedirs(self) -> None:
        os.makedirs(self.directory, exist_ok=True)

    def append(self, text: str) -> None:
        """Append ``text`` (whole lines) to the active segment."""
        data = text.encode("utf-8")
        with self._lock:
            now = self._clock()
            if self._bytes is None:
                self._adopt(now)
            elif self._bytes and (
                self._bytes + len(data) > self.limits.segment_bytes
                or now - self._opened_at >= self.limits.segment_age_s
            ):
                self._rotate(now)
            self._write(data, now)
            if now - self._swept_at >= _SWEEP_EVERY_S:
                self._sweep(now)

    def _adopt(self, now: float) -> None:
        """Continue an active segment left by an earlier process with this pid (a
        container restart), or start one."""
        self.makedirs()
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            self._bytes, self._opened_at = 0, now
            return
        self._bytes, self._opened_at = stat.st_size, min(now, stat.st_mtime)

    def _write(self, data: bytes, now: float) -> None:
        """Append under the segment's lock, to the file the active name names: a segment
        sealed by someone else meanwhile (a compaction) is left alone, a new one begun."""
        for attempt in range(3):  # sealed between open and lock: open the new one
            with open(self.path, "ab") as handle:
                _lock(handle)
                # a filesystem whose inodes are not stable must not spin the exporter
                if _names(handle, self.path) or attempt == 2:
                    size = os.fstat(handle.fileno()).st_size
                    handle.write(data)
                    handle.flush()
                    break
        if size < (self._bytes or 0):  # sealed since the last append: a new segment
            self._opened_at = now
        self._bytes = size + len(data)

    def _rotate(self, now: float) -> None:
        seal(self.path, now)  # None: sealed by a compaction meanwhile, nothing to do
        self._bytes, self._opened_at = 0, now
        self._sweep(now)

    def _sweep(self, now: float) -> None:
        self._swept_at = now
        try:
            removed_files, removed_bytes = sweep(self.directory, self.limits, now)
        except OSError as error:
            _LOG.warning("span store %s: could not sweep live segments: %s", self.directory, error)
            return
        if removed_files:
            _LOG.warning(
                "span store %s: %d sealed live segment(s), %d bytes, deleted by "
                "retention or size cap (KVOBS_STORE_RETENTION, "
                "KVOBS_STORE_MAX_BYTES); compact the store to keep them",
                self.directory,
                removed_files,
                removed_bytes,
            )


def sweep(directory: str, limits: SegmentLimits, now: float) -> tuple[int, int]:
    """Delete sealed segments past retention, then the oldest ones until the live
    segments fit in ``max_bytes``. Returns (files, bytes) deleted."""
    active_bytes = 0
    sealed = []  # (mtime, size, path)
    with os.scandir(directory) as entries:
        for entry in entries:
            if not entry.name.endswith(SUFFIX):
                continue
            try:
                stat = entry.stat()
            except FileNotFoundError:  # another writer's sweep or a compaction
                continue
            if is_sealed(entry.name):
                sealed.append((stat.st_mtime, stat.st_size, entry.path))
            else:
                active_bytes += stat.st_size
    sealed.sort()
    files = removed = 0
    total = active_bytes + sum(size for _, size, _ in sealed)
    for mtime, size, path in sealed:
        expired = limits.retention_s > 0 and now - mtime > limits.retention_s
        over = limits.max_bytes > 0 and total > limits.max_bytes
        if not (expired or over):
            continue
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
        else:
            files += 1
            removed += size
        total -= size
    return files, removed


def written_since(store_dir: str, since: float) -> list[tuple[str, float]]:
    """The store's live segments written to at or after ``since`` (Unix seconds), with
    when each was last written to, oldest first: what a reader that needs the spans
    received since then reads (a restart's replay, a conversation recalled)."""
    directory = os.path.join(store_dir, STORE_LIVE_DIR)
    try:
        names = [n for n in os.listdir(directory) if n.endswith(SUFFIX)]
    except FileNotFoundError:
        return []
    stamped = []
    for name in names:
        try:
            stamped.append((os.path.getmtime(os.path.join(directory, name)), name))
        except OSError:
            continue  # sealed or expired meanwhile
    return [(os.path.join(directory, n), mtime) for mtime, n in sorted(stamped) if mtime >= since]


def segment_lines(
    segments: list[tuple[str, float]], unreadable: Callable[[str, OSError], None]
) -> Iterator[tuple[float, str]]:
    """Each line of ``segments`` (``written_since``'s), with when its segment was last
    written to; a segment that cannot be read (expired or sealed away meanwhile) is given
    to ``unreadable`` and skipped, the others read on."""
    for path, written in segments:
        try:
            with open(path, encoding="utf-8", errors="replace") as handle:
                for line in handle:
                    yield written, line
        except OSError as error:
            unreadable(path, error)
