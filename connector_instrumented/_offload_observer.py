"""Scheduler-side observer of vLLM's offloading connector (host copy path).

Facts come from three places, none of which carries a turn's identity on its own:
- the offloading manager (wrapped per instance, its type unchanged): which request's
  blocks a store prepares and completes, which keys a store evicts, which it refuses,
  and which lookup missed a key it had evicted (a copy wanted after its eviction);
- the worker's per-job copy results (bytes, seconds), carried to the scheduler in
  ``KvobsOffloadingWorkerMetadata`` and matched to the scheduler's job table (req id,
  keys, store or load) before upstream drops the job;
- the connector's own hooks: the lookup (L, tier hit, tokens accepted) and the finish
  (prompt and output lengths).

Each request's identity is its ``kv_transfer_params`` correlation keys. Spans go to the
``SpanSink`` off the hook; counters go to an ``OffloadingConnectorStats`` that rides
vLLM's stats to the engine's ``/metrics``. Nothing here may raise into vLLM: the facade
runs every call under ``Guard``.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.kv_offload.base import LookupResult

from kvobs import semconv as sc

from ._offload_stats import HostStats
from ._telemetry import Guard, SpanSink, raw_correlation

# Keys whose owner we remember for eviction ages; beyond this the oldest are forgotten
# (their eviction is still counted, without an owner). Evicted keys are remembered as
# many, so a later prompt that misses one is told apart from one asking for new tokens.
MAX_OWNED_KEYS = 1 << 20


@dataclass
class _Copy:
    """What one request put in the tier (or tried to)."""

    req_id: str
    correlation: tuple | None
    pending: set = field(default_factory=set)
    refused: set = field(default_factory=set)
    blocks: int = 0
    saved_end: int = 0
    bytes: int = 0
    seconds: float = 0.0
    first_at: float | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    closed: bool = False


@dataclass
class _Lookup:
    request: Any
    correlation: tuple | None
    local: int
    hit: int
    accepted: int = 0
    at: float = 0.0
    admitted: bool = False  # blocks allocated: the lookup that counted
    wanted_evicted: bool = False  # the tier's hit stopped at a key it had evicted


class OffloadObserver:
    """Turns the offloading connector's scheduler-side facts into host-path spans."""

    def __init__(self, connector_scheduler: Any, sink: SpanSink, copy_engine: str):
        self.guard = Guard("offloading connector")
        self._sched = connector_scheduler
        self._sink = sink
        self._copy_engine = copy_engine
        self._copies: dict[str, _Copy] = {}
        self._owners: dict[Any, tuple[str, tuple | None, float]] = {}
        self._lookups: dict[str, _Lookup] = {}
        self._evicted_keys: dict[Any, None] = {}  # insertion-ordered: oldest first
        self._wanted_evicted: set[str] = set()  # req ids whose lookup missed one
        self.stats = HostStats()
        self._wrap_manager(connector_scheduler.manager)

    # ------------------------------------------------------------------ manager hooks

    def _wrap_manager(self, manager: Any) -> None:
        prepare_store = manager.prepare_store
        complete_store = manager.complete_store
        on_request_finished = manager.on_request_finished
        reset_cache = manager.reset_cache
        lookup = manager.lookup
        guard = self.guard

        # Each wrapper passes on whatever it is given: vLLM's tiering manager calls its own
        # lookup and on_request_finished back with exclude_tier_idx= (from a secondary
        # tier's facade, e.g. p2p serving a peer).
        def observed_prepare_store(keys, req_context, *args, **kwargs):
            out = prepare_store(keys, req_context, *args, **kwargs)
            try:
                self.on_prepare_store(keys, req_context, out)
            except Exception:  # noqa: BLE001
                guard.failed("prepare_store")
            return out

        def observed_complete_store(keys, req_context, *args, **kwargs):
            result = complete_store(keys, req_context, *args, **kwargs)
            try:
                success = kwargs.get("success", args[0] if args else True)
                self.on_complete_store(keys, req_context, success)
            except Exception:  # noqa: BLE001
                guard.failed("complete_store")
            return result

        def observed_on_request_finished(req_context, *args, **kwargs):
            result = on_request_finished(req_context, *args, **kwargs)
            try:
                self.on_closed(req_context.req_id)
            except Exception:  # noqa: BLE001
                guard.failed("on_request_finished")
            return result

        def observed_reset_cache(*args, **kwargs):
            result = reset_cache(*args, **kwargs)
            self._owners.clear()
            self._evicted_keys.clear()  # emptied on purpose, not evicted
            return result

        def observed_lookup(key, req_context, *args, **kwargs):
            result = lookup(key, req_context, *args, **kwargs)
            try:  # per looked-up key: a dict probe on a miss only
                if (
                    result == LookupResult.MISS
                    and key in self._evicted_keys
                    and req_context.req_id in self._sched._req_status
                ):
                    # this engine's own request (a peer's lookup is never admitted here)
                    self._wanted_evicted.add(req_context.req_id)
            except Exception:  # noqa: BLE001
                guard.failed("lookup")
            return result

        for name, wrapper in (
            ("prepare_store", observed_prepare_store),
            ("complete_store", observed_complete_store),
            ("on_request_finished", observed_on_request_finished),
            ("reset_cache", observed_reset_cache),
            ("lookup", observed_lookup),
        ):
            # Only a method its class defines: a stand-in built per instance (upstream's
            # unit tests use a MagicMock manager and set side effects on its attributes)
            # is left exactly as it is, so those tests see upstream behaviour.
            if callable(getattr(type(manager), name, None)):
                setattr(manager, name, wrapper)

    def _copy(self, req_id: str, params: Any) -> _Copy:
        copy = self._copies.get(req_id)
        if copy is None:
            copy = self._copies[req_id] = _Copy(req_id, raw_correlation(params))
        return copy

    def on_prepare_store(self, keys, req_context, out) -> None:
        copy = self._copy(req_context.req_id, req_context.kv_transfer_params)
        if out is None:
            copy.refused.update(keys)
            return
        now = time.time()
        if copy.first_at is None:
            copy.first_at = now
        copy.pending.update(out.keys_to_store)
        if out.evicted_keys:
            self._evicted(out.evicted_keys, req_context.req_id, now)

    def on_complete_store(self, keys, req_context, success: bool) -> None:
        copy = self._copies.get(req_context.req_id)
        if copy is None:
            return
        now = time.time()
        position = req_context.get_offload_key_position
        owners = self._owners
        for key in keys:
            copy.pending.discard(key)
            if not success:
                copy.refused.add(key)
                continue
            copy.refused.discard(key)
            self._evicted_keys.pop(key, None)  # in the tier again
            copy.blocks += 1
            end = position(key)
            if end is not None and end > copy.saved_end:
                copy.saved_end = end
            if key not in owners:
                if len(owners) >= MAX_OWNED_KEYS:
                    del owners[next(iter(owners))]
                owners[key] = (copy.req_id, copy.correlation, now)
        self._maybe_save(copy)

    def on_closed(self, req_id: str) -> None:
        copy = self._copies.get(req_id)
        if copy is not None:
            copy.closed = True
            self._maybe_save(copy)

    def _evicted(self, keys, by_req_id: str, now: float) -> None:
        # owner req id ("" when forgotten) -> [correlation, blocks, ages]
        by_owner: dict[str, list] = {}
        evicted = self._evicted_keys
        for key in keys:
            if len(evicted) >= MAX_OWNED_KEYS:
                del evicted[next(iter(evicted))]
            evicted[key] = None
            req_id, correlation, stored_at = self._owners.pop(key, ("", None, None))
            entry = by_owner.setdefault(req_id, [correlation, 0, []])
            entry[1] += 1
            if stored_at is not None:
                entry[2].append(now - stored_at)
        for req_id, (correlation, blocks, ages) in by_owner.items():
            self.stats.evicted(blocks, max(ages) if ages else None)
            if not self._sink.enabled(sc.SPAN_HOST_EVICT):
                continue
            attrs = {sc.HOST_BLOCKS.key: blocks, sc.HOST_EVICTED_BY.key: by_req_id}
            if req_id:
                attrs[sc.REQUEST_ID.key] = req_id
            if ages:
                attrs[sc.HOST_EVICTED_AGE_MIN.key] = min(ages)
                attrs[sc.HOST_EVICTED_AGE_MAX.key] = max(ages)
            self._sink.emit_fields(sc.SPAN_HOST_EVICT, correlation, None, attrs, now, now)

    # ------------------------------------------------------------------ connector hooks

    def on_match(self, request: Any, num_computed_tokens: int, result: Any) -> None:
        hit = result[0] if isinstance(result, tuple) else result
        wanted_evicted = request.request_id in self._wanted_evicted
        self._wanted_evicted.discard(request.request_id)
        if hit is None:  # the connector asked to be asked again
            return
        self._lookups[request.request_id] = _Lookup(
            request,
            raw_correlation(request.kv_transfer_params, request),
            num_computed_tokens,
            int(hit),
            at=time.time(),
            wanted_evicted=wanted_evicted,
        )

    def on_alloc(self, request: Any, num_external_tokens: int) -> None:
        lookup = self._lookups.get(request.request_id)
        if lookup is not None:
            lookup.accepted = int(num_external_tokens)
            lookup.admitted = True

    def on_meta(self, hit_sources: Any) -> None:
        """Emit the step's lookups; ``hit_sources(request, tokens)`` is upstream's split."""
        if not self._lookups:
            return
        # A request not admitted this step (no room) is looked up again: only the lookup
        # of its admission is its turn's.
        admitted = [(r, lookup) for r, lookup in self._lookups.items() if lookup.admitted]
        for req_id, lookup in admitted:
            del self._lookups[req_id]
            tiers: Counter = Counter()
            if lookup.accepted:
                for source, tokens in hit_sources(lookup.request, lookup.accepted).items():
                    tiers[_tier(source)] += tokens
            for tier, tokens in tiers.items():
                self.stats.loaded_tokens(tier, tokens)
            outcome = _outcome(lookup)
            self.stats.looked_up(outcome)
            if not self._sink.enabled(sc.SPAN_HOST_LOOKUP):
                continue
            request = lookup.request
            attrs = {
                sc.REQUEST_ID.key: req_id,
                sc.PROMPT_TOKENS.key: int(request.num_prompt_tokens),
                sc.HOST_LOCAL_TOKENS.key: lookup.local,
                sc.HOST_HIT_TOKENS.key: lookup.hit,
                sc.HOST_ACCEPTED_TOKENS.key: lookup.accepted,
                sc.HOST_HIT_HOST.key: tiers.pop(sc.HostTier.HOST.value, 0),
                sc.HOST_HIT_P2P.key: tiers.pop(sc.HostTier.P2P.value, 0),
                sc.HOST_HIT_OTHER.key: sum(tiers.values()),
                sc.HOST_LOOKUP_OUTCOME.key: outcome,
            }
            self._sink.emit_fields(
                sc.SPAN_HOST_LOOKUP, lookup.correlation, None, attrs, lookup.at, lookup.at
            )

    def on_finished(self, request: Any) -> None:
        self._lookups.pop(request.request_id, None)  # finished without admission
        self._wanted_evicted.discard(request.request_id)
        copy = self._copy(request.request_id, request.kv_transfer_params)
        copy.prompt_tokens = int(request.num_prompt_tokens)
        copy.output_tokens = int(request.num_output_tokens)

    def on_job_results(self, results: list) -> None:
        """Per-job copy results from the worker, before upstream retires the jobs."""
        jobs = self._sched._jobs
        merged: dict[int, list] = {}  # job id -> [bytes, seconds, end]: ranks summed
        for job_id, num_bytes, seconds, end_at in results:
            entry = merged.setdefault(job_id, [0, 0.0, 0.0])
            entry[0] += num_bytes
            entry[1] = max(entry[1], seconds)
            entry[2] = max(entry[2], end_at)
        for job_id, (num_bytes, seconds, end_at) in merged.items():
            status = jobs.get(job_id)
            if status is None:
                continue
            if status.is_store:
                copy = self._copies.get(status.req_id)
                if copy is not None:
                    copy.bytes += num_bytes
                    copy.seconds += seconds
                continue
            self._loaded(status, num_bytes, seconds, end_at)

    def _loaded(self, status: Any, num_bytes: int, seconds: float, end_at: float) -> None:
        req_status = self._sched._req_status.get(status.req_id)
        context = req_status.req_context if req_status is not None else None
        tiers: Counter = Counter()
        if context is not None:
            source = self._sched.manager.get_load_source
            for key in status.keys:
                tiers[_tier(source(key, context))] += 1
        tier = tiers.most_common(1)[0][0] if tiers else sc.HostTier.OTHER.value
        self.stats.load(tier)
        if not self._sink.enabled(sc.SPAN_HOST_LOAD):
            return
        attrs = {
            sc.REQUEST_ID.key: status.req_id,
            sc.HOST_BYTES.key: int(num_bytes),
            sc.HOST_BLOCKS.key: len(status.keys),
            sc.HOST_DURATION.key: float(seconds),
            sc.HOST_TIER.key: tier,
            sc.HOST_COPY_ENGINE.key: self._copy_engine,
        }
        params = context.kv_transfer_params if context is not None else None
        self._sink.emit_fields(
            sc.SPAN_HOST_LOAD, raw_correlation(params), None, attrs, end_at - seconds, end_at
        )

    # ------------------------------------------------------------------ save span

    def _maybe_save(self, copy: _Copy) -> None:
        if not copy.closed or copy.pending:
            return
        del self._copies[copy.req_id]
        prompt = copy.prompt_tokens
        covers = prompt is not None and copy.saved_end > prompt
        incomplete = bool(copy.refused)
        self.stats.saved(covers, incomplete)
        if not self._sink.enabled(sc.SPAN_HOST_SAVE):
            return
        now = time.time()
        attrs = {
            sc.REQUEST_ID.key: copy.req_id,
            sc.HOST_BLOCKS.key: copy.blocks,
            sc.HOST_SAVED_TOKENS.key: copy.saved_end,
            sc.HOST_BYTES.key: copy.bytes,
            sc.HOST_DURATION.key: copy.seconds,
            sc.HOST_COVERS_RESPONSE.key: covers,
            sc.HOST_SAVE_INCOMPLETE.key: incomplete,
            sc.HOST_REFUSED_BLOCKS.key: len(copy.refused),
            sc.HOST_COPY_ENGINE.key: self._copy_engine,
        }
        if prompt is not None:
            attrs[sc.HOST_PROMPT_TOKENS.key] = prompt
            attrs[sc.HOST_OUTPUT_TOKENS.key] = copy.output_tokens or 0
        self._sink.emit_fields(
            sc.SPAN_HOST_SAVE,
            copy.correlation,
            None,
            attrs,
            copy.first_at or now,
            now,
            error=f"host save incomplete: {len(copy.refused)} blocks refused"
            if incomplete
            else None,
        )

    def take_stats(self):
        return self.stats.take()


def _outcome(lookup: _Lookup) -> str:
    if lookup.wanted_evicted:
        return sc.HostLookupOutcome.EVICTED.value
    if lookup.accepted:
        return sc.HostLookupOutcome.HIT.value
    return sc.HostLookupOutcome.MISS.value


def _tier(source: Any) -> str:
    value = getattr(source, "value", source)
    return value if value in _TIERS else sc.HostTier.OTHER.value


_TIERS = frozenset(t.value for t in sc.HostTier)
