"""Worker-side observer: facts only the worker has, recorded, never emitted here.

Per read: when it was requested and when it really started (the difference is the
connection set-up: the NIXL handshake the first time a worker reads from an engine),
whether it was declined as expired, how many bytes NIXL moved for it (NIXL's own
per-transfer telemetry, the same numbers behind ``vllm:nixl_bytes_transferred``), its
duration, how much of that came after the last poll that still saw it in flight (a
completion is only seen when the worker polls, after each model step: a long prefill
step holds it; NIXL's own ``xferDuration`` is measured at that poll too), and the
remaining TTL on this process's clock. Per release of retained blocks: expired or read.
The records ride to the scheduler in the connector stats (see ``_scheduler_observer``).

Hooks are instance-level wraps of the upstream worker that always call the original
exactly once and return its result untouched; the wrapper's own code is guarded.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from kvobs import semconv as sc

from . import _compat
from ._telemetry import Guard


@dataclass
class _Read:
    first_wall: float
    first_mono: float
    blocks: int
    start_wall: float | None = None
    start_mono: float | None = None
    ttl: float | None = None
    declined: bool = False
    nbytes: int = 0
    pending_mono: float | None = None  # the last poll that saw it in flight began here


# vLLM's ``_log_failure`` types that mean the read itself failed.
_READ_FAILURES = frozenset(
    {"handshake_failed", "transfer_setup_failed", "transfer_failed", "transfer_exception"}
)


class WorkerObserver:
    def __init__(
        self, worker: Any, bidirectional: bool, completion: str = _compat.COMPLETION_RESULTS
    ):
        _compat.require(worker, _compat.WORKER_HOOKS + (completion,), type(worker).__name__)
        if completion == _compat.COMPLETION_LEGACY:
            _compat.require(worker, _compat.WORKER_HOOKS_LEGACY_COMPLETION, type(worker).__name__)
        if bidirectional:
            _compat.require(worker, _compat.WORKER_HOOKS_BIDIRECTIONAL, type(worker).__name__)
        wrapper = getattr(worker, "nixl_wrapper", None)
        _compat.require(wrapper, ("get_xfer_telemetry",), "the NIXL wrapper")
        self.guard = Guard("worker")
        self._worker = worker
        self._reads: dict[str, _Read] = {}
        self._bytes_by_handle: dict[int, int] = {}
        self._errors: dict[str, str] = {}
        self._expired_now: dict[str, int] | None = None
        self._declined_now = False
        self.raw_reads: list[list] = []
        self.raw_releases: list[list] = []
        self._wrap(worker, completion, self._completions)
        self._wrap(worker, "_read_blocks_for_req", self._read_blocks_for_req)
        self._wrap(wrapper, "get_xfer_telemetry", self._get_xfer_telemetry)
        if hasattr(worker, "_is_turn2_read_expired"):
            self._wrap(worker, "_is_turn2_read_expired", self._is_turn2_read_expired)
        if hasattr(worker, "_reap_expired_send_leases"):
            self._wrap(worker, "_reap_expired_send_leases", self._reap)
        if hasattr(worker, "_log_failure"):
            self._wrap(worker, "_log_failure", self._log_failure)

    @staticmethod
    def _wrap(obj: Any, name: str, wrapper) -> None:
        original = getattr(obj, name)
        setattr(obj, name, lambda *a, **k: wrapper(original, *a, **k))

    # ------------------------------------------------------------------ hooks

    def on_start_load(self, metadata: Any) -> None:
        reqs = getattr(metadata, "reqs_to_recv", None)
        if not reqs:
            return
        now_wall, now_mono = time.time(), time.perf_counter()
        for req_id, meta in reqs.items():
            groups = meta.local_block_ids
            blocks = sum(len(g) for g in groups)
            # Notify-only entries (full local hit, aborted cleanup) are not reads.
            if blocks or getattr(meta, "awaiting_kvs", False):
                self._reads.setdefault(req_id, _Read(now_wall, now_mono, blocks))

    def _read_blocks_for_req(self, original, req_id, meta, *args, **kwargs):
        ready = False
        ttl = None
        t_wall, t_mono = time.time(), time.perf_counter()
        try:
            remote = meta.remote
            ready = remote.engine_id in self._worker._remote_agents
            offsets = getattr(self._worker, "_engine_clock_offset", None)
            if ready and remote.blocks_expiry_time is not None and offsets is not None:
                offset = offsets.get(remote.engine_id)
                if offset is not None:
                    ttl = remote.blocks_expiry_time - offset - t_mono
        except Exception:  # noqa: BLE001
            self.guard.failed("read start")
        self._declined_now = False
        result = original(req_id, meta, *args, **kwargs)
        try:
            read = self._reads.get(req_id)
            if read is not None and ready and read.start_mono is None:
                read.start_wall, read.start_mono, read.ttl = t_wall, t_mono, ttl
                read.declined = self._declined_now
        except Exception:  # noqa: BLE001
            self.guard.failed("read start")
        return result

    def _is_turn2_read_expired(self, original, *args, **kwargs):
        expired = original(*args, **kwargs)
        self._declined_now = bool(expired)
        return expired

    def _get_xfer_telemetry(self, original, handle, *args, **kwargs):
        res = original(handle, *args, **kwargs)
        try:
            if res is not None:
                self._bytes_by_handle[handle] = int(res.totalBytes)
        except Exception:  # noqa: BLE001
            self.guard.failed("telemetry")
        return res

    def _log_failure(self, original, *args, **kwargs):
        try:
            req_id = kwargs.get("req_id")
            if req_id is not None and req_id not in self._errors:
                self._errors[req_id] = str(kwargs.get("failure_type") or "unknown")
        except Exception:  # noqa: BLE001
            self.guard.failed("failure")
        return original(*args, **kwargs)

    def _reap(self, original, done_sending, *args, **kwargs):
        try:
            before = set(done_sending)
            counts = dict(self._worker.consumer_notification_counts_by_req)
        except Exception:  # noqa: BLE001
            self.guard.failed("release")
            return original(done_sending, *args, **kwargs)
        result = original(done_sending, *args, **kwargs)
        try:
            self._expired_now = {r: counts.get(r, 0) for r in set(done_sending) - before}
        except Exception:  # noqa: BLE001
            self.guard.failed("release")
        return result

    def _completions(self, original, *args, **kwargs):
        polled = time.perf_counter()
        try:
            handles = (
                {r: list(h) for r, h in self._worker._recving_transfers.items()}
                if self._reads
                else {}
            )
        except Exception:  # noqa: BLE001
            self.guard.failed("results")
            handles = {}
        self._expired_now = None
        results = original(*args, **kwargs)
        try:
            self._after_results(results, handles, polled)
        except Exception:  # noqa: BLE001
            self.guard.failed("results")
        return results

    def _after_results(self, results: Any, handles: dict, polled: float) -> None:
        if isinstance(results, tuple):  # legacy (finished_sending, finished_recving)
            # No failure set on this API: a read failed when the worker logged a failure
            # of the read itself for it (not of a notification or a release).
            sending, recving = results[0] or set(), results[1] or set()
            failed = {r for r, kind in self._errors.items() if kind in _READ_FAILURES}
        else:
            sending = results.finished_sending
            recving = results.finished_recving
            failed = getattr(results, "failed_recving", None) or set()
        if self._bytes_by_handle:
            for req_id, req_handles in handles.items():
                read = self._reads.get(req_id)
                if read is not None:
                    read.nbytes += sum(self._bytes_by_handle.pop(h, 0) for h in req_handles)
            self._bytes_by_handle.clear()
        for req_id in handles.keys() - set(recving):
            read = self._reads.get(req_id)
            if read is not None and read.start_mono is not None:
                read.pending_mono = polled  # still in flight at this poll
        if recving:
            now = time.perf_counter()
            for req_id in recving:
                read = self._reads.pop(req_id, None)
                if read is None:
                    continue
                if read.declined:
                    outcome = sc.ReadOutcome.DECLINED_EXPIRED
                elif req_id in failed:
                    outcome = sc.ReadOutcome.FAILED
                else:
                    outcome = sc.ReadOutcome.DONE
                # Set-up: from the read's request to its start (the handshake, when
                # the holder was not connected yet); unknown when it never started.
                setup: float | None = None
                start_wall: float | None = read.first_wall
                start_mono = read.first_mono
                if read.start_mono is not None:
                    start_wall, start_mono = read.start_wall, read.start_mono
                    setup = read.start_mono - read.first_mono
                # Unobserved: since the read started, or since a poll last saw it.
                seen = max(start_mono, read.pending_mono or start_mono)
                self.raw_reads.append(
                    [
                        req_id,
                        outcome.value,
                        read.nbytes,
                        read.blocks,
                        start_wall,
                        now - start_mono,
                        read.ttl,
                        self._errors.pop(req_id, None),
                        setup,
                        now - seen,
                    ]
                )
        if sending:
            expired = self._expired_now
            if expired is not None:
                for req_id in sending:
                    if req_id in expired:
                        self.raw_releases.append(
                            [req_id, sc.ReleaseReason.EXPIRED.value, expired[req_id]]
                        )
                    else:
                        self.raw_releases.append([req_id, sc.ReleaseReason.READ.value, 1])
        if len(self._errors) > 1024:  # failures logged for requests that never read
            self._errors.clear()

    def take(self) -> tuple[list, list]:
        reads, releases = self.raw_reads, self.raw_releases
        self.raw_reads, self.raw_releases = [], []
        return reads, releases
