"""Scheduler-side observer: the facts only the scheduler process has.

P side: the pull decision (N, L, C, M, threshold), the prefix guard, stuck waits, and
the read/recompute outcome once the workers report the read finished. D side: the
export of retained blocks (with the block-hash digest) and their release.

Read spans are emitted here, not in the worker: the worker's per-read facts (bytes,
duration, outcome, remaining TTL) ride to this process in the connector stats vLLM
already ships every step, while the correlation keys live on the scheduler's request.
This needs no extra channel, survives any executor (uni-process, multiprocess, Ray),
merges TP ranks once per request, and keeps prompt-side ids out of worker metadata.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kvobs import semconv as sc
from kvobs.emit.spans import Correlation

from . import _digest, _stats as st
from ._options import Options
from ._telemetry import Guard, SpanSink

_REQUIRED_REMOTE = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")
_RECOMPUTE_FOR = {
    sc.PullDecision.NO_PARAMS: sc.RecomputeReason.NO_PARAMS,
    sc.PullDecision.INVALID: sc.RecomputeReason.INVALID,
    sc.PullDecision.LOCAL_HIT: sc.RecomputeReason.SUFFIX,
    sc.PullDecision.BELOW_THRESHOLD: sc.RecomputeReason.BELOW_THRESHOLD,
    sc.PullDecision.PREFIX_MISMATCH: sc.RecomputeReason.PREFIX_MISMATCH,
    sc.PullDecision.PULL: sc.RecomputeReason.SUFFIX,
}
_WATCHDOG_PERIOD_S = 1.0
_NO_CORRELATION = Correlation()


@dataclass
class _Req:
    """What the scheduler knows about one request that may read remote KV."""

    correlation: Correlation
    direction: sc.ReadDirection
    first_wall: float
    prompt: int = 0  # N
    local: int = 0  # L
    remote: int = 0  # C, as D advertised it
    candidate: int = 0  # M
    offered: int = 0  # what the connector told the scheduler
    remote_engine: str | None = None
    decision: sc.PullDecision | None = None
    evidence: sc.PrefixEvidence | None = None
    matched: int | None = None
    guarded: bool = False
    decided: bool = False
    stuck_reason: sc.StuckReason | None = None  # predicted: no read will be queued
    prevented: bool = False  # kvobs_fix_stuck_waits answered (0, False) instead
    wait_since: float | None = None  # monotonic, while WAITING_FOR_REMOTE_KVS
    wait_since_wall: float | None = None
    read_queued: bool = False
    stuck_reported: bool = False
    finished: bool = False
    raw: list = field(default_factory=list)


@dataclass
class _Retained:
    correlation: Correlation
    blocks: int
    nbytes: int
    export_wall: float
    export_mono: float
    expiry_mono: float


class SchedulerObserver:
    def __init__(self, scheduler: Any, vllm_config: Any, kv_cache_config: Any,
                 options: Options, sink: SpanSink):
        self._sched = scheduler
        self._options = options
        self._sink = sink
        self.guard = Guard("scheduler")
        ktc = vllm_config.kv_transfer_config
        self._recompute_policy = getattr(ktc, "kv_load_failure_policy", "fail") == "recompute"
        self._threshold = int(scheduler.kv_recompute_threshold)
        self._bidirectional = bool(scheduler.is_bidirectional_kv_xfer_enabled)
        self._host_buffer = bool(scheduler.use_host_buffer)
        self._ttl = float(getattr(scheduler, "decoder_kv_blocks_ttl", 0) or 0)
        self._block_size = int(vllm_config.cache_config.block_size)
        self._hash_block_size = int(getattr(kv_cache_config, "hash_block_size", None)
                                    or self._block_size)
        groups = (getattr(kv_cache_config, "transfer_groups", None)
                  or getattr(kv_cache_config, "kv_cache_groups", None) or [])
        self._bytes_per_block = [_group_block_bytes(g) for g in groups]
        self._single_group = len(groups) <= 1 and not getattr(scheduler, "_is_hma_required",
                                                               False)
        self._seed: str | None = None
        self._reqs: dict[str, _Req] = {}
        self._unchecked: set[str] = set()  # offered async this step: read queued?
        self._waiting: dict[str, _Req] = {}  # in WAITING_FOR_REMOTE_KVS (watchdog)
        self._retained: dict[str, _Retained] = {}
        self._retained_blocks = 0
        self._retained_bytes = 0
        self._last_watchdog = 0.0
        self._errors_reported = 0
        self._stats = st.KvobsConnectorStats()
        self._stats_dirty = False  # a fact was added since the last take_stats
        self._publisher = None
        if options.params_redis_url:
            from connector_instrumented._publisher import ParamsPublisher

            self._publisher = ParamsPublisher(options.params_redis_url)

    # ------------------------------------------------------------------ helpers

    def _seed_fp(self) -> str | None:
        if self._seed is None:
            self._seed = _digest.seed_fingerprint()
        return self._seed

    def _add(self, key: str, value: Any) -> None:
        self._stats.data[key].append(value)
        self._stats_dirty = True

    def _correlation(self, params: Any, span: sc.SpanName) -> Correlation:
        """The request's correlation keys, or an empty one when no span will carry them."""
        if not self._sink.enabled(span):
            return _NO_CORRELATION
        return Correlation.from_params(params)

    def _role_attr(self, span: sc.SpanName) -> str:
        service = self._options.role or span.service
        return "prefill" if service is sc.Service.PREFILL else "decode"

    def _emit(self, span: sc.SpanName, req_id: str, correlation: Correlation,
              attributes: dict, start: float | None = None, end: float | None = None,
              error: bool = False) -> None:
        if not self._sink.enabled(span):
            return
        attributes[sc.REQUEST_ID.key] = req_id
        attributes[sc.ROLE.key] = self._role_attr(span)
        self._sink.emit(span, correlation, attributes, start, end, error)

    def _recompute(self, req_id: str, r: _Req, reason: sc.RecomputeReason,
                   tokens: int) -> None:
        tokens = max(0, tokens)
        self._add(st.RECOMPUTED_TOKENS, [reason.value, tokens])
        now = time.time()
        self._emit(sc.SPAN_RECOMPUTE, req_id, r.correlation, {
            sc.RECOMPUTE_REASON.key: reason, sc.RECOMPUTED_TOKENS.key: tokens,
            sc.PROMPT_TOKENS.key: r.prompt, sc.LOCAL_HIT_TOKENS.key: r.local,
        }, now, now)

    def _stuck(self, req_id: str, r: _Req, reason: sc.StuckReason, fixed: bool) -> None:
        r.stuck_reported = True
        self._add(st.STUCK_PREVENTED if fixed else st.STUCK_WAITS, 1)
        now = time.time()
        since = r.wait_since_wall or now
        self._emit(sc.SPAN_STUCK, req_id, r.correlation, {
            sc.STUCK_REASON.key: reason, sc.STUCK_FIXED.key: fixed,
            sc.STUCK_WAITED.key: now - since, sc.OFFERED_TOKENS.key: r.offered,
            sc.REMOTE_ENGINE_ID.key: r.remote_engine,
        }, since, now, error=not fixed)

    def _gauges(self) -> None:
        self._add(st.RETAINED_BLOCKS, self._retained_blocks)
        self._add(st.RETAINED_BYTES, self._retained_bytes)

    # ------------------------------------------------------------------ P: decision

    def before_match(self, request: Any, num_computed_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params:
            return
        req_id = request.request_id
        if params.get("do_remote_prefill"):  # D side: it will read P's prefill
            if req_id not in self._reqs:
                self._reqs[req_id] = _Req(self._correlation(params, sc.SPAN_STUCK),
                                          sc.ReadDirection.P_TO_D, time.time(),
                                          remote_engine=params.get("remote_engine_id"))
            return
        if not params.get("do_remote_decode"):
            return
        r = self._reqs.get(req_id)
        if r is None:
            r = self._reqs[req_id] = _Req(self._correlation(params, sc.SPAN_PULL_DECISION),
                                          sc.ReadDirection.D_TO_P, time.time())
        if r.decided or params.get("_remote_blocks_processed"):
            return  # re-admission (failed read, preemption): decided already
        r.prompt = request.num_prompt_tokens
        r.local = num_computed_tokens
        r.remote = int(params.get("remote_num_tokens") or 0)
        r.candidate = max(0, min(r.remote, r.prompt) - r.local)
        r.remote_engine = params.get("remote_engine_id")
        if not params.get("remote_block_ids"):
            r.decision = sc.PullDecision.NO_PARAMS
            return
        if not all(key in params for key in _REQUIRED_REMOTE):
            r.decision = sc.PullDecision.INVALID
            return
        evidence, matched = _digest.compare(
            params.get(sc.KTP_BLOCK_DIGEST), request.block_hashes, self._hash_block_size,
            self._seed_fp(), min(r.remote, r.prompt))
        r.evidence = evidence
        if evidence in (sc.PrefixEvidence.MATCH, sc.PrefixEvidence.MISMATCH):
            r.matched = matched
        if evidence is sc.PrefixEvidence.MISMATCH:
            r.decision = sc.PullDecision.PREFIX_MISMATCH
            if self._options.prefix_guard:
                self._cut_offer(params, matched)
                r.guarded = True

    def _cut_offer(self, params: dict, matched_tokens: int) -> None:
        """Make D's advertisement cover only the verified prefix (guard option).

        With one full-attention group the block list is cut to the matching KV blocks
        (the worker end-aligns remote to local blocks, so a cut list keeps them
        aligned); otherwise nothing is offered and P recomputes.
        """
        aligned = matched_tokens - matched_tokens % self._block_size
        blocks = params.get("remote_block_ids")
        if self._single_group and blocks is not None and len(blocks) == 1 and aligned > 0:
            params["remote_block_ids"] = [list(blocks[0])[: aligned // self._block_size]]
            params["remote_num_tokens"] = aligned
        else:
            params["remote_num_tokens"] = 0

    def after_match(self, request: Any, result: tuple) -> tuple:
        r = self._reqs.get(request.request_id)
        if r is None or r.direction is not sc.ReadDirection.D_TO_P:
            return result
        count, load_async = result
        params = request.kv_transfer_params
        if not (count and load_async):
            r.offered = count or 0
            return result
        # A D->P read is queued by update_state_after_alloc only in these conditions;
        # otherwise the request would wait in WAITING_FOR_REMOTE_KVS forever.
        reason = None
        if not self._bidirectional:
            reason = sc.StuckReason.BIDIRECTIONAL_DISABLED
        elif self._host_buffer:
            reason = sc.StuckReason.HOST_BUFFER
        elif params.get("_remote_blocks_processed"):
            reason = sc.StuckReason.ALREADY_PROCESSED
        r.stuck_reason = reason
        if reason is not None and self._options.fix_stuck_waits:
            r.prevented = True
            r.offered = 0
            return 0, False
        r.offered = count
        if r.decided is False and r.decision is None:
            r.decision = self._decide(r)
        return result

    def _decide(self, r: _Req) -> sc.PullDecision:
        if r.candidate == 0:
            return sc.PullDecision.LOCAL_HIT if r.local > 0 else sc.PullDecision.NO_PARAMS
        if 0 < self._threshold and r.candidate < self._threshold:
            return sc.PullDecision.BELOW_THRESHOLD
        return sc.PullDecision.PULL

    def after_alloc(self, request: Any, num_external_tokens: int) -> None:
        req_id = request.request_id
        r = self._reqs.get(req_id)
        if r is None:
            return
        if num_external_tokens > 0:
            r.wait_since = time.perf_counter()
            r.wait_since_wall = time.time()
            r.read_queued = False
            r.stuck_reported = False
            self._unchecked.add(req_id)
            self._waiting[req_id] = r
        if r.direction is not sc.ReadDirection.D_TO_P:
            return
        if not r.decided:
            r.decided = True
            if r.decision is None:
                r.decision = self._decide(r)
            self._add(st.PULL_DECISIONS, r.decision.value)
            if r.decision is sc.PullDecision.PREFIX_MISMATCH:
                self._add(st.PREFIX_MISMATCHES, 1)
            now = time.time()
            self._emit(sc.SPAN_PULL_DECISION, req_id, r.correlation, {
                sc.PROMPT_TOKENS.key: r.prompt, sc.LOCAL_HIT_TOKENS.key: r.local,
                sc.REMOTE_TOKENS.key: r.remote, sc.CANDIDATE_TOKENS.key: r.candidate,
                sc.THRESHOLD.key: self._threshold, sc.PULL_DECISION.key: r.decision,
                sc.PREFIX_EVIDENCE.key: r.evidence, sc.PREFIX_MATCHED_TOKENS.key: r.matched,
                sc.PREFIX_GUARD.key: r.guarded, sc.OFFERED_TOKENS.key: num_external_tokens,
                sc.REMOTE_ENGINE_ID.key: r.remote_engine,
            }, r.first_wall, now)
            if num_external_tokens == 0 and not r.prevented:
                self._recompute(req_id, r, _RECOMPUTE_FOR[r.decision],
                                r.prompt - r.local)
        if r.prevented:
            r.prevented = False
            self._stuck(req_id, r, r.stuck_reason or sc.StuckReason.NOT_QUEUED, True)
            self._recompute(req_id, r, sc.RecomputeReason.FALLBACK,
                            request.num_prompt_tokens - request.num_computed_tokens)

    # ------------------------------------------------------------------ per step

    def on_meta(self, meta: Any) -> None:
        if self._unchecked:
            queued = getattr(meta, "reqs_to_recv", {})
            for req_id in self._unchecked:
                r = self._reqs.get(req_id)
                if r is None or r.wait_since is None:
                    continue
                if req_id in queued:
                    r.read_queued = True
                elif not r.stuck_reported:  # offered async, nothing will ever read it
                    self._stuck(req_id, r, r.stuck_reason or sc.StuckReason.NOT_QUEUED,
                                False)
            self._unchecked.clear()
        if not self._waiting:
            return
        now = time.perf_counter()
        if now - self._last_watchdog < _WATCHDOG_PERIOD_S:
            return
        self._last_watchdog = now
        limit = self._options.stuck_after_s
        for req_id, r in self._waiting.items():
            if not r.stuck_reported and now - r.wait_since > limit:
                self._stuck(req_id, r, sc.StuckReason.WAIT_TIMEOUT, False)

    def on_output(self, output: Any) -> None:
        stats = getattr(output, "kv_connector_stats", None)
        releases: dict[str, list] = {}
        if isinstance(stats, st.KvobsConnectorStats):
            for record in stats.data.get(st.RAW_READS, ()):
                r = self._reqs.get(record[0])
                if r is not None:
                    r.raw.append(record)
            for record in stats.data.get(st.RAW_RELEASES, ()):
                releases.setdefault(record[0], []).append(record)
            stats.data[st.RAW_READS] = []  # consumed: keep them off the front-end
            stats.data[st.RAW_RELEASES] = []
        failed = getattr(output, "failed_recving", None) or ()
        for req_id in output.finished_recving or ():
            r = self._reqs.get(req_id)
            if r is not None:
                self._read_done(req_id, r, req_id in failed)
        if self._retained:
            for req_id in output.finished_sending or ():
                if req_id in self._retained:
                    self._release(req_id, releases.get(req_id, ()))

    def _read_done(self, req_id: str, r: _Req, failed: bool) -> None:
        records, r.raw = r.raw, []
        r.wait_since = None
        self._waiting.pop(req_id, None)
        outcome = sc.ReadOutcome.FAILED if failed else sc.ReadOutcome.DONE
        nbytes, blocks, start, duration, ttl, error = 0, 0, None, 0.0, None, None
        for _, rec_outcome, rbytes, rblocks, rstart, rdur, rttl, rerror in records:
            if rec_outcome == sc.ReadOutcome.DECLINED_EXPIRED.value:
                outcome = sc.ReadOutcome.DECLINED_EXPIRED
            elif rec_outcome == sc.ReadOutcome.FAILED.value and outcome is sc.ReadOutcome.DONE:
                outcome = sc.ReadOutcome.FAILED
            nbytes += rbytes or 0
            blocks = max(blocks, rblocks or 0)
            start = rstart if start is None else min(start, rstart)
            duration = max(duration, rdur or 0.0)
            ttl = rttl if ttl is None or (rttl is not None and rttl < ttl) else ttl
            error = error or rerror
        if not records:
            self.guard.failed("read without worker record")  # counted as a dropped fact
        direction = r.direction.value
        self._add(st.READS, [direction, outcome.value])
        if outcome is sc.ReadOutcome.DONE:
            self._add(st.READ_BYTES, [direction, nbytes])
            self._add(st.READ_DURATION, [direction, duration])
        if ttl is not None:
            self._add(st.REMAINING_TTL, max(0.0, ttl))
        if outcome is sc.ReadOutcome.DECLINED_EXPIRED:
            self._add(st.DECLINED_EXPIRED, 1)
        if r.direction is sc.ReadDirection.D_TO_P:
            end = time.time()
            start = start if start is not None else end - duration
            self._emit(sc.SPAN_READ, req_id, r.correlation, {
                sc.READ_DIRECTION.key: direction, sc.READ_OUTCOME.key: outcome,
                sc.READ_BYTES.key: nbytes, sc.READ_BLOCKS.key: blocks,
                sc.READ_DURATION.key: duration, sc.REMAINING_TTL_AT_READ.key: ttl,
                sc.READ_ERROR.key: error, sc.REMOTE_ENGINE_ID.key: r.remote_engine,
            }, start, start + duration, error=outcome is not sc.ReadOutcome.DONE)
            if outcome is sc.ReadOutcome.DONE:
                self._add(st.REUSED_TOKENS, r.offered)
                reason = (sc.RecomputeReason.PREFIX_MISMATCH if r.guarded
                          else sc.RecomputeReason.SUFFIX)
                self._recompute(req_id, r, reason, r.prompt - r.local - r.offered)
            # Failed/declined: with policy "recompute" the request is re-admitted and
            # the recompute (or the stuck wait) is reported then; with "fail" it errors.
        if r.finished:
            self._reqs.pop(req_id, None)

    # ------------------------------------------------------------------ D: retention

    def on_finished(self, request: Any, result: tuple) -> tuple:
        req_id = request.request_id
        r = self._reqs.get(req_id)
        if r is not None:
            if r.wait_since is not None and r.read_queued:
                r.finished = True  # read still in flight: keep until it reports
            else:
                self._reqs.pop(req_id, None)
                self._waiting.pop(req_id, None)
                self._unchecked.discard(req_id)
        delay_free, out = result
        if not (delay_free and out and out.get("do_remote_decode")
                and out.get("remote_blocks_expiry_time") is not None):
            return result
        self._export(request, out)
        return result

    def _export(self, request: Any, out: dict) -> None:
        req_id = request.request_id
        groups = out.get("remote_block_ids") or ()
        blocks = sum(len(g) for g in groups)
        nbytes = sum(len(g) * (self._bytes_per_block[i] if i < len(self._bytes_per_block)
                               else 0) for i, g in enumerate(groups))
        tokens = int(out.get("remote_num_tokens") or 0)
        digest = _digest.encode(request.block_hashes, tokens, self._hash_block_size,
                                self._seed_fp())
        if digest is not None:
            out[sc.KTP_BLOCK_DIGEST] = digest
        if self._ttl:
            out[sc.KTP_DECODE_TTL] = self._ttl  # lets the proxy end its entry in time
        proxy_request_id = (request.kv_transfer_params or {}).get(sc.KTP_REQUEST_ID)
        if self._publisher is not None and isinstance(proxy_request_id, str):
            self._publisher.publish(proxy_request_id, dict(out))
        now_wall, now_mono = time.time(), time.perf_counter()
        expiry_mono = float(out["remote_blocks_expiry_time"])
        expires_at = now_wall + (expiry_mono - now_mono)
        correlation = self._correlation(request.kv_transfer_params, sc.SPAN_EXPORT)
        self._retained[req_id] = _Retained(correlation, blocks, nbytes, now_wall, now_mono,
                                           expiry_mono)
        self._retained_blocks += blocks
        self._retained_bytes += nbytes
        self._gauges()
        self._emit(sc.SPAN_EXPORT, req_id, correlation, {
            sc.EXPORT_BLOCKS.key: blocks, sc.EXPORT_TOKENS.key: tokens,
            sc.EXPORT_EXPIRES_AT.key: expires_at, sc.TTL.key: self._ttl,
        }, now_wall, now_wall)

    def _release(self, req_id: str, records) -> None:
        kept = self._retained.pop(req_id)
        now_wall, now_mono = time.time(), time.perf_counter()
        if records:
            expired = any(rec[1] == sc.ReleaseReason.EXPIRED.value for rec in records)
            read_count = max(int(rec[2] or 0) for rec in records)
        else:  # no worker record (hook unavailable): infer from the deadline
            expired = now_mono >= kept.expiry_mono
            read_count = 0
        reason = sc.ReleaseReason.EXPIRED if expired else sc.ReleaseReason.READ
        was_read = reason is sc.ReleaseReason.READ or read_count > 0
        held = now_mono - kept.export_mono
        self._retained_blocks -= kept.blocks
        self._retained_bytes -= kept.nbytes
        self._gauges()
        self._add(st.RETAINED_BLOCK_SECONDS, kept.blocks * held)
        self._add(st.RELEASES, [reason.value, "true" if was_read else "false"])
        self._emit(sc.SPAN_RELEASE, req_id, kept.correlation, {
            sc.RELEASE_REASON.key: reason, sc.RELEASE_READ_COUNT.key: read_count,
            sc.HELD_DURATION.key: held, sc.EXPORT_BLOCKS.key: kept.blocks,
        }, kept.export_wall, now_wall)

    # ------------------------------------------------------------------ stats

    def take_stats(self) -> st.KvobsConnectorStats | None:
        errors = self.guard.errors + self._sink.errors
        if errors > self._errors_reported:
            self._add(st.TELEMETRY_ERRORS, errors - self._errors_reported)
            self._errors_reported = errors
        if not self._stats_dirty:  # every fact goes through _add: no key scan per step
            return None
        self._stats_dirty = False
        return self._stats.clone_and_reset()


def _group_block_bytes(group: Any) -> int:
    try:
        spec = group.kv_cache_spec
        return int(spec.page_size_bytes) * len(group.layer_names)
    except Exception:  # noqa: BLE001
        return 0
