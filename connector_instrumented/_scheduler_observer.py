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
from collections.abc import Sequence
from typing import Any

from kvobs import semconv as sc
from kvobs.emit.spans import shard_key

from . import _digest, _stats as st
from ._options import Options
from ._telemetry import Deferred, Guard, SpanSink, first_block, raw_correlation

_REQUIRED_REMOTE = frozenset(
    ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")
)
_RECOMPUTE_FOR = {
    sc.PullDecision.NO_PARAMS: sc.RecomputeReason.NO_PARAMS,
    sc.PullDecision.INVALID: sc.RecomputeReason.INVALID,
    sc.PullDecision.LOCAL_HIT: sc.RecomputeReason.SUFFIX,
    sc.PullDecision.BELOW_THRESHOLD: sc.RecomputeReason.BELOW_THRESHOLD,
    sc.PullDecision.PREFIX_MISMATCH: sc.RecomputeReason.PREFIX_MISMATCH,
    sc.PullDecision.PULL: sc.RecomputeReason.SUFFIX,
}
_WATCHDOG_PERIOD_S = 1.0

# Span attributes as constant key tuples: the hook queues only the values, the sink's
# builder thread zips them into the dict (see _telemetry).
# Every span ends with the request id, the role and the engine's identity (which engine,
# since when, at which side channel): a restart shows as a new id at the same endpoint.
_IDS = (
    sc.REQUEST_ID.key,
    sc.ROLE.key,
    sc.ENGINE_ID.key,
    sc.ENGINE_STARTED_AT.key,
    sc.ENGINE_ENDPOINT.key,
)
_RECOMPUTE_KEYS = (
    sc.RECOMPUTE_REASON.key,
    sc.RECOMPUTED_TOKENS.key,
    sc.PROMPT_TOKENS.key,
    sc.LOCAL_HIT_TOKENS.key,
) + _IDS
_STUCK_KEYS = (
    sc.STUCK_REASON.key,
    sc.STUCK_FIXED.key,
    sc.STUCK_WAITED.key,
    sc.OFFERED_TOKENS.key,
    sc.REMOTE_ENGINE_ID.key,
) + _IDS
_DECISION_KEYS = (
    sc.PROMPT_TOKENS.key,
    sc.LOCAL_HIT_TOKENS.key,
    sc.REMOTE_TOKENS.key,
    sc.CANDIDATE_TOKENS.key,
    sc.THRESHOLD.key,
    sc.PULL_DECISION.key,
    sc.PREFIX_EVIDENCE.key,
    sc.PREFIX_MATCHED_TOKENS.key,
    sc.PREFIX_GUARD.key,
    sc.OFFERED_TOKENS.key,
    sc.REMOTE_ENGINE_ID.key,
    sc.REMOTE_REQUEST_ID.key,
    sc.PREFIX_LINEAGE.key,
) + _IDS
_READ_KEYS = (
    sc.READ_DIRECTION.key,
    sc.READ_OUTCOME.key,
    sc.READ_BYTES.key,
    sc.READ_BLOCKS.key,
    sc.READ_DURATION.key,
    sc.REMAINING_TTL_AT_READ.key,
    sc.READ_ERROR.key,
    sc.REMOTE_ENGINE_ID.key,
    sc.READ_SETUP.key,
    sc.REMOTE_REQUEST_ID.key,
    sc.READ_UNOBSERVED.key,
) + _IDS
_REQUEST_KEYS = (
    sc.REQUEST_ARRIVED_AT.key,
    sc.REQUEST_SCHEDULED_AT.key,
    sc.REQUEST_ALLOCATED_AT.key,
    sc.REQUEST_KV_READY_AT.key,
    sc.REQUEST_FIRST_TOKEN_AT.key,
    sc.PROMPT_TOKENS.key,
    sc.OUTPUT_TOKENS.key,
    sc.REMOTE_REQUEST_ID.key,
) + _IDS
_EXPORT_KEYS = (
    sc.EXPORT_BLOCKS.key,
    sc.EXPORT_TOKENS.key,
    sc.EXPORT_EXPIRES_AT.key,
    sc.TTL.key,
    sc.PREFIX_LINEAGE.key,
    sc.REMOTE_REQUEST_ID.key,
) + _IDS
_RELEASE_KEYS = (
    sc.RELEASE_REASON.key,
    sc.RELEASE_READ_COUNT.key,
    sc.HELD_DURATION.key,
    sc.EXPORT_BLOCKS.key,
) + _IDS
# Enum members and their values as module constants: on the hook path an Enum class
# attribute costs ~50 ns and ``.value`` ~80 ns, a global ~10 ns.
_D_TO_P, _P_TO_D = sc.ReadDirection.D_TO_P, sc.ReadDirection.P_TO_D
_DONE, _FAILED = sc.ReadOutcome.DONE, sc.ReadOutcome.FAILED
_DECLINED = sc.ReadOutcome.DECLINED_EXPIRED
_FAILED_V, _DECLINED_V = _FAILED.value, _DECLINED.value
_MATCH, _MISMATCH = sc.PrefixEvidence.MATCH, sc.PrefixEvidence.MISMATCH
_PREFIX_MISMATCH = sc.PullDecision.PREFIX_MISMATCH
_R_GUARDED, _R_SUFFIX = sc.RecomputeReason.PREFIX_MISMATCH, sc.RecomputeReason.SUFFIX
_R_EXPIRED, _R_READ = sc.ReleaseReason.EXPIRED, sc.ReleaseReason.READ
_EXPIRED = _R_EXPIRED.value
_KTP_DIGEST, _KTP_TTL = sc.KTP_BLOCK_DIGEST, sc.KTP_DECODE_TTL
_KTP_SHARD, _KTP_TENANT = sc.KTP_SHARD, sc.KTP_TENANT
_CORR_KEYS = sc.CORRELATION_KEYS
_SPANS = (
    sc.SPAN_RECOMPUTE,
    sc.SPAN_STUCK,
    sc.SPAN_PULL_DECISION,
    sc.SPAN_READ,
    sc.SPAN_EXPORT,
    sc.SPAN_RELEASE,
    sc.SPAN_PREFILL_REQUEST,
    sc.SPAN_DECODE_REQUEST,
    sc.SPAN_HANDOFF,
)


class _Req:
    """What the scheduler knows about one request that may read remote KV.

    A plain class with class-level defaults (not a dataclass): one is made on the
    matching hook of every request with params, and only the first fields differ."""

    prompt = 0  # N
    local = 0  # L
    remote = 0  # C, as D advertised it
    candidate = 0  # M
    offered = 0  # what the connector told the scheduler
    decision: sc.PullDecision | None = None
    evidence: sc.PrefixEvidence | None = None
    matched: int | None = None
    guarded = False
    decided = False
    stuck_reason: sc.StuckReason | None = None  # predicted: no read will be queued
    prevented = False  # kvobs_fix_stuck_waits answered (0, False) instead
    wait_since: float | None = None  # monotonic, while WAITING_FOR_REMOTE_KVS
    wait_since_wall: float | None = None
    read_queued = False
    stuck_reported = False
    finished = False
    # Timeline marks (wall clock; ``first_wall`` is when the scheduler first tried it).
    arrived: float | None = None  # vLLM's arrival_time
    allocated: float | None = None
    kv_ready: float | None = None
    first_token: float | None = None
    request: Any = None  # D only: the vLLM request, while its first token is awaited
    remote_request: str | None = None  # the other role's request id (remote_request_id)
    lineage: Any = None  # P only: its prompt's block-hash chain, built off the hook

    def __init__(
        self,
        correlation: tuple | None,
        direction: sc.ReadDirection,
        first_wall: float,
        remote_engine: str | None = None,
    ):
        self.correlation = correlation  # raw_correlation(params), parsed off the hook
        self.direction = direction
        self.first_wall = first_wall
        self.remote_engine = remote_engine
        self.raw: list = []


class SchedulerObserver:
    def __init__(
        self,
        scheduler: Any,
        vllm_config: Any,
        kv_cache_config: Any,
        options: Options,
        sink: SpanSink,
    ):
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
        self._hash_block_size = int(
            getattr(kv_cache_config, "hash_block_size", None) or self._block_size
        )
        groups = (
            getattr(kv_cache_config, "transfer_groups", None)
            or getattr(kv_cache_config, "kv_cache_groups", None)
            or []
        )
        self._bytes_per_block = [_group_block_bytes(g) for g in groups]
        self._role_of = {span.name: self._role_attr(span) for span in _SPANS}
        self._engine = (
            str(getattr(scheduler, "engine_id", "") or ""),
            time.time(),
            f"{getattr(scheduler, 'side_channel_host', '')}:"
            f"{getattr(scheduler, 'side_channel_port', '')}",
        )
        self._single_group = len(groups) <= 1 and not getattr(scheduler, "_is_hma_required", False)
        self._seed: str | None = None
        self._reqs: dict[str, _Req] = {}
        self._unchecked: set[str] = set()  # offered async this step: read queued?
        self._waiting: dict[str, _Req] = {}  # in WAITING_FOR_REMOTE_KVS (watchdog)
        self._first_pending: dict[str, _Req] = {}  # D: KV arrived, first token not yet
        # req id -> (raw correlation, blocks, bytes, export wall time, export monotonic
        # time, expiry on the monotonic clock): a plain tuple, as a NamedTuple's __new__
        # is one more Python call on D's request_finished.
        self._retained: dict[str, tuple] = {}
        self._retained_blocks = 0
        self._retained_bytes = 0
        self._last_watchdog = 0.0
        self._errors_reported = 0
        self._losses_reported: dict[str, int] = {}
        self._losses_due = 0.0  # monotonic: span losses are looked at once a second
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

    def _correlation(self, params: Any, span: sc.SpanName, request: Any) -> tuple | None:
        """The request's raw correlation values, or None when no span will carry them."""
        if not self._sink.enabled(span):
            return None
        return raw_correlation(params, request)

    def _role_attr(self, span: sc.SpanName) -> str:
        service = self._options.role or span.service
        return "prefill" if service is sc.Service.PREFILL else "decode"

    def _emit(
        self,
        span: sc.SpanName,
        req_id: str,
        correlation: tuple | None,
        keys: tuple,
        values: tuple,
        start: float,
        end: float,
        error: str | None = None,
    ) -> None:
        """Queue a span: ``values`` match ``keys`` less the trailing ids added here."""
        if not self._sink.enabled(span):
            return
        self._sink.emit_fields(
            span,
            correlation,
            keys,
            values + (req_id, self._role_of[span.name]) + self._engine,
            start,
            end,
            error,
        )

    def _recompute(self, req_id: str, r: _Req, reason: sc.RecomputeReason, tokens: int) -> None:
        tokens = max(0, tokens)
        self._add(st.RECOMPUTED_TOKENS, [reason._value_, tokens])
        now = time.time()
        self._emit(
            sc.SPAN_RECOMPUTE,
            req_id,
            r.correlation,
            _RECOMPUTE_KEYS,
            (reason, tokens, r.prompt, r.local),
            now,
            now,
        )

    def _stuck(self, req_id: str, r: _Req, reason: sc.StuckReason, fixed: bool) -> None:
        r.stuck_reported = True
        self._add(st.STUCK_PREVENTED if fixed else st.STUCK_WAITS, 1)
        now = time.time()
        since = r.wait_since_wall or now
        self._emit(
            sc.SPAN_STUCK,
            req_id,
            r.correlation,
            _STUCK_KEYS,
            (reason, fixed, now - since, r.offered, r.remote_engine),
            since,
            now,
            error=None
            if fixed
            else f"{self._role_of[sc.SPAN_STUCK.name]}: stuck ({reason._value_})",
        )

    def _gauges(self) -> None:
        data = self._stats.data
        data[st.RETAINED_BLOCKS].append(self._retained_blocks)
        data[st.RETAINED_BYTES].append(self._retained_bytes)
        self._stats_dirty = True

    # ------------------------------------------------------------------ P: decision

    def before_match(self, request: Any, num_computed_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params:
            return
        req_id = request.request_id
        if params.get("do_remote_prefill"):  # D side: it will read P's prefill
            if req_id not in self._reqs:
                handoff = self._reqs[req_id] = _Req(
                    self._correlation(params, sc.SPAN_STUCK, request),
                    _P_TO_D,
                    time.time(),
                    params.get("remote_engine_id"),
                )
                handoff.arrived = request.arrival_time
                handoff.prompt = request.num_prompt_tokens
                handoff.request = request  # until it finishes: its first token is watched
                handoff.remote_request = params.get("remote_request_id")
            return
        if not params.get("do_remote_decode"):
            return
        r = self._reqs.get(req_id)
        if r is None:
            r = self._reqs[req_id] = _Req(
                (*map(params.get, _CORR_KEYS), first_block(request))  # raw_correlation
                if self._sink.enabled(sc.SPAN_PULL_DECISION)
                else None,
                _D_TO_P,
                time.time(),
            )
        if r.decided or params.get("_remote_blocks_processed"):
            return  # re-admission (failed read, preemption): decided already
        r.arrived = request.arrival_time
        r.prompt = prompt = request.num_prompt_tokens
        r.local = num_computed_tokens
        r.remote = remote = int(params.get("remote_num_tokens") or 0)
        limit = min(remote, prompt)
        r.candidate = max(0, limit - num_computed_tokens)
        r.remote_engine = params.get("remote_engine_id")
        r.remote_request = params.get("remote_request_id")
        if r.correlation is not None or self._sink.enabled(sc.SPAN_PULL_DECISION):
            # Which earlier D export this prompt extends, whatever router sent it: the
            # prompt's chain on the same grid as D's digest (kvobs.turns.lineage), built by the
            # span builder: the prompt's hashes do not change while the span waits.
            r.lineage = Deferred(
                _digest.encode,
                request.block_hashes,
                prompt,
                self._hash_block_size,
                self._seed or self._seed_fp(),
            )
        if not params.get("remote_block_ids"):
            r.decision = sc.PullDecision.NO_PARAMS
            return
        if not params.keys() >= _REQUIRED_REMOTE:
            r.decision = sc.PullDecision.INVALID
            return
        evidence, matched = _digest.compare(
            params.get(_KTP_DIGEST),
            request.block_hashes,
            self._hash_block_size,
            self._seed or self._seed_fp(),
            limit,
            request.prompt_token_ids,
        )
        r.evidence = evidence
        if evidence is _MATCH:
            r.matched = matched
        elif evidence is _MISMATCH:
            r.matched = matched
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
        if r is None or r.direction is not _D_TO_P:
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
        if r.allocated is None:
            r.allocated = time.time()
        if num_external_tokens > 0:
            r.wait_since = time.perf_counter()
            r.wait_since_wall = time.time()
            r.read_queued = False
            r.stuck_reported = False
            self._unchecked.add(req_id)
            self._waiting[req_id] = r
        if r.direction is not _D_TO_P:
            return
        if not r.decided:
            r.decided = True
            decision = r.decision
            if decision is None:
                r.decision = decision = self._decide(r)
            self._add(st.PULL_DECISIONS, decision._value_)
            if decision is _PREFIX_MISMATCH:
                self._add(st.PREFIX_MISMATCHES, 1)
            self._emit(
                sc.SPAN_PULL_DECISION,
                req_id,
                r.correlation,
                _DECISION_KEYS,
                (
                    r.prompt,
                    r.local,
                    r.remote,
                    r.candidate,
                    self._threshold,
                    decision,
                    r.evidence,
                    r.matched,
                    r.guarded,
                    num_external_tokens,
                    r.remote_engine,
                    r.remote_request,
                    r.lineage,
                ),
                r.first_wall,
                r.allocated,
            )
            r.lineage = None
            if num_external_tokens == 0 and not r.prevented:
                self._recompute(req_id, r, _RECOMPUTE_FOR[decision], r.prompt - r.local)
        if r.prevented:
            r.prevented = False
            self._stuck(req_id, r, r.stuck_reason or sc.StuckReason.NOT_QUEUED, True)
            self._recompute(
                req_id,
                r,
                sc.RecomputeReason.FALLBACK,
                request.num_prompt_tokens - request.num_computed_tokens,
            )

    # ------------------------------------------------------------------ per step

    def _first_tokens(self) -> None:
        """Mark the first token of D requests whose KV arrived: the first step that
        gave them an output token (seen after that step's output was applied)."""
        now = None
        for req_id, r in list(self._first_pending.items()):
            if r.request.num_output_tokens > 0:
                r.first_token = now = now or time.time()
                del self._first_pending[req_id]

    def on_meta(self, meta: Any) -> None:
        if self._first_pending:
            self._first_tokens()
        if self._unchecked:
            queued = getattr(meta, "reqs_to_recv", {})
            for req_id in self._unchecked:
                r = self._reqs.get(req_id)
                if r is None or r.wait_since is None:
                    continue
                if req_id in queued:
                    r.read_queued = True
                elif not r.stuck_reported:  # offered async, nothing will ever read it
                    self._stuck(req_id, r, r.stuck_reason or sc.StuckReason.NOT_QUEUED, False)
            self._unchecked.clear()
        if not self._waiting:
            return
        now = time.perf_counter()
        if now - self._last_watchdog < _WATCHDOG_PERIOD_S:
            return
        self._last_watchdog = now
        limit = self._options.stuck_after_s
        for req_id, r in self._waiting.items():
            if not r.stuck_reported and r.wait_since is not None and now - r.wait_since > limit:
                self._stuck(req_id, r, sc.StuckReason.WAIT_TIMEOUT, False)

    def on_output(self, output: Any) -> None:
        # Called every step, usually with little in it: test before touching anything.
        if self._first_pending:
            self._first_tokens()
        stats = _own_stats(getattr(output, "kv_connector_stats", None))
        raw_releases: Sequence[list] = ()
        if stats is not None:
            data = stats.data
            raw_reads = data.get(st.RAW_READS)
            if raw_reads:
                for record in raw_reads:
                    r = self._reqs.get(record[0])
                    if r is not None:
                        r.raw.append(record)
                data[st.RAW_READS] = []  # consumed: keep them off the front-end
            raw_releases = data.get(st.RAW_RELEASES) or ()
            if raw_releases:
                data[st.RAW_RELEASES] = []
        finished = output.finished_recving
        if finished:
            failed = getattr(output, "failed_recving", None) or ()
            for req_id in finished:
                r = self._reqs.get(req_id)
                if r is not None:
                    self._read_done(req_id, r, req_id in failed)
        if self._retained and output.finished_sending:
            retained = self._retained
            for req_id in output.finished_sending:
                if req_id in retained:
                    self._release(req_id, [rec for rec in raw_releases if rec[0] == req_id])

    def _read_done(self, req_id: str, r: _Req, failed: bool) -> None:
        records, r.raw = r.raw, []
        r.wait_since = None
        self._waiting.pop(req_id, None)
        outcome = _FAILED if failed else _DONE
        nbytes, blocks, start, duration, ttl, error, setup = 0, 0, None, 0.0, None, None, None
        in_flight = None  # the longest a worker's share is known to have been in flight
        for _, rec_outcome, rbytes, rblocks, rstart, rdur, rttl, rerror, *more in records:
            rsetup = more[0] if more else None
            if rsetup is not None and (setup is None or rsetup > setup):
                setup = rsetup
            if len(more) > 1 and more[1] is not None and rdur is not None:
                known = max(0.0, rdur - more[1])
                in_flight = known if in_flight is None else max(in_flight, known)
            if rec_outcome == _DECLINED_V:
                outcome = _DECLINED
            elif rec_outcome == _FAILED_V and outcome is _DONE:
                outcome = _FAILED
            nbytes += rbytes or 0
            blocks = max(blocks, rblocks or 0)
            start = rstart if start is None else min(start, rstart)
            duration = max(duration, rdur or 0.0)
            ttl = rttl if ttl is None or (rttl is not None and rttl < ttl) else ttl
            error = error or rerror
        if not records:
            self.guard.failed("read without worker record")  # counted as a dropped fact
        direction = r.direction._value_
        done = outcome is _DONE
        read_span = sc.SPAN_READ if r.direction is _D_TO_P else sc.SPAN_HANDOFF
        failure = (
            None if done else read_failure(self._role_of[read_span.name], direction, outcome, error)
        )
        data = self._stats.data  # what _add does, without a call per fact
        self._stats_dirty = True
        data[st.READS].append([direction, outcome._value_])
        if done:
            data[st.READ_BYTES].append([direction, nbytes])
            data[st.READ_DURATION].append([direction, duration])
        if setup is not None:
            data[st.READ_SETUP].append([direction, setup])
        if ttl is not None:
            data[st.REMAINING_TTL].append(max(0.0, ttl))
        if outcome is _DECLINED:
            data[st.DECLINED_EXPIRED].append(1)
        now = time.time()
        if done:
            r.kv_ready = now
        if start is None:
            start = now - duration
        unobserved = None if in_flight is None else max(0.0, duration - in_flight)
        self._emit(
            read_span,
            req_id,
            r.correlation,
            _READ_KEYS,
            (
                direction,
                outcome,
                nbytes,
                blocks,
                duration,
                ttl,
                error,
                r.remote_engine,
                setup,
                r.remote_request,
                unobserved,
            ),
            start,
            start + duration,
            error=failure,
        )
        if r.direction is _D_TO_P:
            if done:
                data[st.REUSED_TOKENS].append(r.offered)
                self._recompute(
                    req_id,
                    r,
                    _R_GUARDED if r.guarded else _R_SUFFIX,
                    r.prompt - r.local - r.offered,
                )
            # Failed/declined: with policy "recompute" the request is re-admitted and
            # the recompute (or the stuck wait) is reported then; with "fail" it errors.
        else:  # D pulled P's KV: the hand-off; its first token comes next
            if done and r.request is not None and r.first_token is None:
                self._first_pending[req_id] = r
        if r.finished:
            self._reqs.pop(req_id, None)

    # ------------------------------------------------------------------ D: retention

    def on_finished(self, request: Any, result: tuple) -> tuple:
        req_id = request.request_id
        r = self._reqs.get(req_id)
        if r is not None:
            self._request_done(req_id, request, r)
            if r.wait_since is not None and r.read_queued:
                r.finished = True  # read still in flight: keep until it reports
            else:
                self._reqs.pop(req_id, None)
                self._waiting.pop(req_id, None)
                self._unchecked.discard(req_id)
        delay_free, out = result
        if out and out.get("do_remote_prefill"):  # P's answer: for the proxy's spans
            tenant = (request.kv_transfer_params or {}).get(_KTP_TENANT)
            shard = shard_key(tenant, first_block(request))
            if shard is not None:
                out[_KTP_SHARD] = shard
        if not (
            delay_free
            and out
            and out.get("do_remote_decode")
            and out.get("remote_blocks_expiry_time") is not None
        ):
            return result
        self._export(request, out)
        return result

    def _request_done(self, req_id: str, request: Any, r: _Req) -> None:
        """The request's timeline span: P's ends at its first token (P's only one in
        P/D), D's at its last. A request that ends without a token (an error, an
        abort) has no timeline to give: its turn's phases say so."""
        if self._first_pending:
            self._first_pending.pop(req_id, None)
        r.request = None
        outputs = request.num_output_tokens
        if not outputs:
            return
        now = time.time()
        span = sc.SPAN_PREFILL_REQUEST if r.direction is _D_TO_P else sc.SPAN_DECODE_REQUEST
        start = r.arrived if r.arrived is not None else r.first_wall
        self._emit(
            span,
            req_id,
            r.correlation,
            _REQUEST_KEYS,
            (
                r.arrived,
                r.first_wall,
                r.allocated,
                r.kv_ready,
                r.first_token or now,
                r.prompt,
                outputs,
                r.remote_request,
            ),
            start,
            now,
        )

    def _export(self, request: Any, out: dict) -> None:
        req_id = request.request_id
        groups: Sequence[Sequence[int]] = out.get("remote_block_ids") or ()
        per_block = self._bytes_per_block
        if len(groups) == 1:  # one KV cache group: the common case, no generators
            blocks = len(groups[0])
            nbytes = blocks * per_block[0] if per_block else 0
        else:
            blocks = sum(map(len, groups))
            nbytes = sum(
                len(g) * (per_block[i] if i < len(per_block) else 0) for i, g in enumerate(groups)
            )
        tokens = int(out.get("remote_num_tokens") or 0)
        digest = _digest.encode(
            request.block_hashes,
            tokens,
            self._hash_block_size,
            self._seed or self._seed_fp(),
            request.all_token_ids,
        )
        if digest is not None:
            out[_KTP_DIGEST] = digest
        if self._ttl:
            out[_KTP_TTL] = self._ttl  # lets the proxy end its entry in time
        params = request.kv_transfer_params
        if self._publisher is not None:
            proxy_request_id = (params or {}).get(sc.KTP_REQUEST_ID)
            if isinstance(proxy_request_id, str):
                self._publisher.publish(proxy_request_id, dict(out))
        now_wall, now_mono = time.time(), time.perf_counter()
        expiry_mono = float(out["remote_blocks_expiry_time"])
        spans = self._sink.enabled(sc.SPAN_EXPORT)
        correlation = raw_correlation(params, request) if spans and params else None
        self._retained[req_id] = (correlation, blocks, nbytes, now_wall, now_mono, expiry_mono)
        self._retained_blocks += blocks
        self._retained_bytes += nbytes
        data = self._stats.data  # _gauges(), inline
        data[st.RETAINED_BLOCKS].append(self._retained_blocks)
        data[st.RETAINED_BYTES].append(self._retained_bytes)
        self._stats_dirty = True
        if spans:
            self._sink.emit_fields(
                sc.SPAN_EXPORT,
                correlation,
                _EXPORT_KEYS,
                (
                    blocks,
                    tokens,
                    now_wall + (expiry_mono - now_mono),
                    self._ttl,
                    digest,
                    (params or {}).get("remote_request_id"),
                    req_id,
                    self._role_of[sc.SPAN_EXPORT.name],
                )
                + self._engine,
                now_wall,
                now_wall,
            )

    def _release(self, req_id: str, records) -> None:
        correlation, kept_blocks, kept_bytes, export_wall, export_mono, expiry_mono = (
            self._retained.pop(req_id)
        )
        now_wall, now_mono = time.time(), time.perf_counter()
        if records:
            expired, read_count = False, 0
            for rec in records:  # one per TP rank: usually one
                expired = expired or rec[1] == _EXPIRED
                read_count = max(read_count, int(rec[2] or 0))
        else:  # no worker record (hook unavailable): infer from the deadline
            expired = now_mono >= expiry_mono
            read_count = 0
        reason = _R_EXPIRED if expired else _R_READ
        was_read = not expired or read_count > 0
        held = now_mono - export_mono
        self._retained_blocks -= kept_blocks
        self._retained_bytes -= kept_bytes
        self._gauges()
        self._add(st.RETAINED_BLOCK_SECONDS, kept_blocks * held)
        self._add(st.RELEASES, [reason._value_, "true" if was_read else "false"])
        self._emit(
            sc.SPAN_RELEASE,
            req_id,
            correlation,
            _RELEASE_KEYS,
            (reason, read_count, held, kept_blocks),
            export_wall,
            now_wall,
        )

    # ------------------------------------------------------------------ stats

    def take_stats(self) -> st.KvobsConnectorStats | None:
        errors = self.guard.errors + self._sink.errors
        if errors > self._errors_reported:
            self._add(st.TELEMETRY_ERRORS, errors - self._errors_reported)
            self._errors_reported = errors
        now = time.monotonic()
        if now >= self._losses_due:
            self._losses_due = now + 1.0
            for reason, lost in self._sink.losses().items():
                reported = self._losses_reported.get(reason, 0)
                if lost > reported:
                    self._add(st.TELEMETRY_DROPPED, [reason, lost - reported])
                    self._losses_reported[reason] = lost
        if not self._stats_dirty:  # every fact goes through _add: no key scan per step
            return None
        self._stats_dirty = False
        return self._stats.clone_and_reset()


def read_failure(role: str, direction: str, outcome: Any, error: str | None) -> str:
    """The ERROR status description of a read that failed or was declined: the cause
    (the transfer's error, as the read's ``kvobs.read.error`` has it), never request data.

    >>> read_failure("prefill", "d_to_p", "failed", "nixl-transfer-error")
    'prefill: KV read d_to_p failed: nixl-transfer-error'
    """
    outcome = getattr(outcome, "_value_", outcome)
    return f"{role}: KV read {direction} {outcome}" + (f": {error}" if error else "")


def _group_block_bytes(group: Any) -> int:
    try:
        spec = group.kv_cache_spec
        return int(spec.page_size_bytes) * len(group.layer_names)
    except Exception:  # noqa: BLE001
        return 0


def _own_stats(stats: Any) -> "st.KvobsConnectorStats | None":
    """This connector's worker stats in a step's output: the stats themselves, or under
    vLLM's MultiConnector (``MultiKVConnectorStats``, one entry per connector class) the
    entry that is ours. Without it D's hand-off spans lost the worker's bytes there."""
    if stats is None or isinstance(stats, st.KvobsConnectorStats):
        return stats
    entries = getattr(stats, "data", None)
    if isinstance(entries, dict):
        for entry in entries.values():
            if isinstance(entry, st.KvobsConnectorStats):
                return entry
    return None
