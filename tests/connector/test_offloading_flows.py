"""KvobsOffloadingConnector in a real vLLM Scheduler with vLLM's own CPU offloading manager.

The worker is played by the test: each step completes the copy jobs the scheduler's
metadata names and reports per-job bytes as ``KvobsOffloadingWorkerMetadata`` (what the
connector's worker side sends). Block: 16 tokens of 128 bytes (the harness's KV spec).
"""

from __future__ import annotations

import time

import _harness as h
import prometheus_client
import pytest
from prometheus_client import CollectorRegistry
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import TransferStats

from connector_instrumented.offloading import (
    KvobsOffloadingConnector,
    KvobsOffloadingWorkerMetadata,
)
from kvobs import semconv as sc

BLOCK_BYTES = 128
CHUNK_BYTES = 4096  # one chunk per block after upstream's alignment


def offload_config(model_dir, chunks: int, prompt_only: bool = False, **extra):
    return h.make_config(model_dir, {
        "spec_name": "KvobsHostCopySpec", "spec_module_path": "connector_instrumented.host_copy",
        "cpu_bytes_to_use": CHUNK_BYTES * chunks, "offload_prompt_only": prompt_only,
        "kvobs_role": "decode", **extra},
        connector="KvobsOffloadingConnector", module="connector_instrumented.offloading")


def params(conversation: str, turn: int) -> dict:
    return {sc.KTP_CONVERSATION_ID: conversation, sc.KTP_TURN_INDEX: turn}


def run(scheduler, reqs, *, max_steps: int = 200, stats: list | None = None
        ) -> dict[int, int]:
    """Step until ``reqs`` finish and no copy is pending; returns job id -> bytes.

    ``stats`` collects the connector stats each step hands the front-end."""
    for req in reqs:
        scheduler.add_request(req)
    copied: dict[int, int] = {}
    connector = scheduler.connector
    for _ in range(max_steps):
        so = scheduler.schedule()
        meta = so.kv_connector_metadata
        jobs = {**meta.store_jobs, **meta.load_jobs}
        done = {job_id: 1 for job_id in jobs}
        results = []
        transfer = TransferStats()
        for job_id, job in jobs.items():
            is_store = job_id in meta.store_jobs
            blocks = len(job.dst_spec.block_ids if is_store else job.src_spec.block_ids)
            copied[job_id] = blocks * BLOCK_BYTES
            (transfer.store if is_store else transfer.load).record(copied[job_id], 0.002)
            results.append([job_id, copied[job_id], 0.002, time.time()])
        kv = {}
        if done:
            kv["kv_connector_worker_meta"] = KvobsOffloadingWorkerMetadata(
                completed_jobs=done, transfer_stats=transfer, kvobs_jobs=results)
            kv["finished_recving"] = {job.req_id for job in meta.load_jobs.values()}
        running = [scheduler.requests[r] for r in so.num_scheduled_tokens]
        output = h.runner_output(running, **kv) if running else h.empty_output(**kv)
        for out in scheduler.update_from_output(so, output).values():
            data = out.scheduler_stats and out.scheduler_stats.kv_connector_stats
            if data and stats is not None:
                stats.append(data)
        # The step after a finish signals it to the manager (finished_req_ids).
        if all(r.is_finished() for r in reqs) and not connector.scheduler._jobs \
                and not scheduler.has_requests():
            break
    else:
        raise AssertionError("requests did not finish")
    return copied


def attrs(span) -> dict:
    return dict(span.attributes)


@pytest.fixture
def make(model_dir):
    def build(chunks: int = 64, num_blocks: int = 100, **kw):
        config = offload_config(model_dir, chunks, **kw)
        return h.make_scheduler(config, num_blocks=num_blocks)
    return build


def test_save_covers_response_then_host_hit_after_device_eviction(make, spans):
    scheduler = make()
    prompt = list(range(100, 160))  # 60 tokens: 3 full blocks
    first = h.make_request(prompt, params("c1", 1), max_tokens=20)
    run(scheduler, [first])
    (save,) = spans.spans(sc.SPAN_HOST_SAVE)
    a = attrs(save)
    assert a[sc.CONVERSATION_ID.key] == "c1" and a[sc.TURN_INDEX.key] == 1
    # 60 + 20 tokens, the last never committed: 79 -> 4 full blocks = 64 tokens > 60
    assert (a[sc.HOST_BLOCKS.key], a[sc.HOST_SAVED_TOKENS.key]) == (4, 64)
    assert a[sc.HOST_COVERS_RESPONSE.key] is True
    assert a[sc.HOST_BYTES.key] == 4 * BLOCK_BYTES
    assert a[sc.HOST_SAVE_INCOMPLETE.key] is False
    assert a[sc.HOST_COPY_ENGINE.key] == sc.CopyEngine.HOST_MEMCPY.value

    assert scheduler.reset_prefix_cache()  # the device blocks are gone, the host copy stays
    second = h.make_request(prompt + [7] * 19 + list(range(300, 340)), params("c1", 2))
    copied = run(scheduler, [second])
    (load,) = spans.spans(sc.SPAN_HOST_LOAD)
    a = attrs(load)
    assert a[sc.TURN_INDEX.key] == 2 and a[sc.HOST_TIER.key] == sc.HostTier.HOST.value
    assert a[sc.HOST_BLOCKS.key] == 4 and a[sc.HOST_BYTES.key] == 4 * BLOCK_BYTES
    assert a[sc.HOST_BYTES.key] in copied.values()
    lookup = [attrs(s) for s in spans.spans(sc.SPAN_HOST_LOOKUP)
              if s.attributes[sc.TURN_INDEX.key] == 2][-1]
    assert (lookup[sc.HOST_LOCAL_TOKENS.key], lookup[sc.HOST_HIT_TOKENS.key],
            lookup[sc.HOST_ACCEPTED_TOKENS.key], lookup[sc.HOST_HIT_HOST.key]) == (0, 64, 64, 64)


def test_prompt_only_copy_lacks_response(make, spans):
    scheduler = make(prompt_only=True)
    run(scheduler, [h.make_request(list(range(100, 160)), params("c2", 1), max_tokens=20)])
    (save,) = spans.spans(sc.SPAN_HOST_SAVE)
    a = attrs(save)
    assert (a[sc.HOST_BLOCKS.key], a[sc.HOST_SAVED_TOKENS.key]) == (3, 48)
    assert a[sc.HOST_COVERS_RESPONSE.key] is False
    assert (a[sc.HOST_PROMPT_TOKENS.key], a[sc.HOST_OUTPUT_TOKENS.key]) == (60, 20)


def test_small_tier_evicts_with_age_and_owner(make, spans):
    scheduler = make(chunks=4)
    run(scheduler, [h.make_request(list(range(100, 164)), params("old", 1), max_tokens=1)])
    time.sleep(0.05)
    run(scheduler, [h.make_request(list(range(500, 564)), params("new", 1), max_tokens=1)])
    evicts = [attrs(s) for s in spans.spans(sc.SPAN_HOST_EVICT)]
    assert evicts and all(e[sc.CONVERSATION_ID.key] == "old" for e in evicts)
    assert sum(e[sc.HOST_BLOCKS.key] for e in evicts) == 4
    assert min(e[sc.HOST_EVICTED_AGE_MIN.key] for e in evicts) >= 0.05
    assert all(e[sc.HOST_EVICTED_BY.key] for e in evicts)


def test_no_space_is_an_incomplete_save(make, spans):
    scheduler = make(chunks=2)  # 4 blocks to store, room for 2: all refused
    run(scheduler, [h.make_request(list(range(100, 164)), params("c3", 1), max_tokens=1)])
    (save,) = spans.spans(sc.SPAN_HOST_SAVE)
    a = attrs(save)
    assert a[sc.HOST_SAVE_INCOMPLETE.key] is True and a[sc.HOST_REFUSED_BLOCKS.key] == 4
    assert a[sc.HOST_BLOCKS.key] == 0
    assert save.status.description == "host save incomplete: 4 blocks refused"


def test_metrics_on_the_engine_registry(make, spans, model_dir):
    scheduler = make()
    stats: list = []
    run(scheduler, [h.make_request(list(range(100, 160)), params("c4", 1), max_tokens=20)],
        stats=stats)

    prom, get = engine_metrics(model_dir)
    labels = {"model_name": "m", "engine": "0"}
    assert get("vllm:kvobs_host_loads_total", {**labels, "tier": "p2p"}) == 0
    for data in stats:
        prom.observe(data)
    assert get("vllm:kvobs_host_saves_total", {**labels, "covers_response": "true"}) == 1
    assert get("vllm:kv_offload_store_bytes_total", labels) == 4 * BLOCK_BYTES


def engine_metrics(model_dir):
    """The connector's Prometheus metrics on a fresh registry: (metrics, sample getter)."""
    registry = CollectorRegistry()
    types = {prometheus_client.Counter: _bind(prometheus_client.Counter, registry),
             prometheus_client.Gauge: _bind(prometheus_client.Gauge, registry),
             prometheus_client.Histogram: _bind(prometheus_client.Histogram, registry)}
    prom = KvobsOffloadingConnector.build_prom_metrics(
        offload_config(model_dir, 64), types, ["model_name", "engine"], {0: ["m", "0"]})
    return prom, registry.get_sample_value


def _bind(cls, registry):
    class Bound(cls):
        def __init__(self, *args, **kwargs):
            kwargs.pop("multiprocess_mode", None)
            super().__init__(*args, registry=registry, **kwargs)
    return Bound


def test_multiconnector_rebuilds_kvobs_stats_by_class_name():
    """The API server rebuilds MultiConnector sub-stats by class name: ours must resolve."""
    import connector_instrumented.connector  # noqa: F401  (registers KvobsNixlConnector)
    from connector_instrumented._offload_stats import HostStats
    from connector_instrumented._stats import KvobsConnectorStats
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats,
    )

    host = HostStats()
    host.saved(covers_response=True, incomplete=False)
    rebuilt = MultiConnector.build_kv_connector_stats({
        "KvobsOffloadingConnector": host.take().data,
        "KvobsNixlConnector": KvobsConnectorStats().data})
    assert isinstance(rebuilt["KvobsOffloadingConnector"], OffloadingConnectorStats)
    assert rebuilt["KvobsOffloadingConnector"].reduce() == {
        "vllm:kvobs_host_saves_total:('true',)": 1}
    assert isinstance(rebuilt["KvobsNixlConnector"], KvobsConnectorStats)


def test_telemetry_off_is_upstream(make, spans):
    scheduler = make(kvobs_telemetry=False)
    connector = scheduler.connector
    manager = connector.scheduler.manager
    assert connector._kvobs_obs is None
    assert "prepare_store" not in vars(manager)  # the manager is not wrapped
    run(scheduler, [h.make_request(list(range(100, 160)), params("off", 1), max_tokens=20)])
    assert spans.spans() == []


def test_observer_failure_never_reaches_vllm(make, spans, monkeypatch):
    from connector_instrumented._offload_observer import OffloadObserver

    def broken(self, *args):
        raise RuntimeError("telemetry bug")

    monkeypatch.setattr(OffloadObserver, "on_meta", broken)
    monkeypatch.setattr(OffloadObserver, "on_prepare_store", broken)
    scheduler = make()
    request = h.make_request(list(range(100, 160)), params("bug", 1), max_tokens=20)
    copied = run(scheduler, [request])
    assert request.is_finished()
    assert scheduler.connector._kvobs_obs.guard.errors > 0
    assert sum(copied.values()) == 4 * BLOCK_BYTES  # the copy was made all the same


def test_one_lookup_span_per_admission(make, spans):
    """A request that waits for room is looked up at every try; only its admission counts."""
    scheduler = make(num_blocks=12)  # 11 usable blocks: one 100-token request at a time
    a = h.make_request(list(range(100, 200)), params("a", 1), max_tokens=20)
    b = h.make_request(list(range(300, 400)), params("b", 1), max_tokens=20)
    run(scheduler, [a, b])
    lookups = [attrs(s) for s in spans.spans(sc.SPAN_HOST_LOOKUP)]
    assert sorted(x[sc.CONVERSATION_ID.key] for x in lookups) == ["a", "b"]


def test_lookup_that_wants_an_evicted_copy_says_so(make, spans, model_dir):
    """Turn 2 of a conversation whose host copy a newer request pushed out: its lookup
    stops at a key the tier evicted (outcome evicted), unlike a first look at new tokens
    (miss) or a copy still there (hit)."""
    scheduler = make(chunks=4)
    stats: list = []
    old = list(range(100, 164))
    run(scheduler, [h.make_request(old, params("old", 1), max_tokens=1)], stats=stats)
    run(scheduler, [h.make_request(list(range(500, 564)), params("new", 1), max_tokens=1)],
        stats=stats)
    assert scheduler.reset_prefix_cache()  # the device blocks are gone too
    run(scheduler, [h.make_request(old + list(range(700, 716)), params("old", 2),
                                   max_tokens=1)], stats=stats)
    outcome = {(a[sc.CONVERSATION_ID.key], a[sc.TURN_INDEX.key]):
               a[sc.HOST_LOOKUP_OUTCOME.key]
               for a in map(attrs, spans.spans(sc.SPAN_HOST_LOOKUP))}
    assert outcome == {("old", 1): "miss", ("new", 1): "miss", ("old", 2): "evicted"}
    prom, get = engine_metrics(model_dir)
    for data in stats:
        prom.observe(data)
    labels = {"model_name": "m", "engine": "0"}
    assert [get(sc.M_HOST_LOOKUPS.name, {**labels, "outcome": o.value})
            for o in sc.HostLookupOutcome] == [0, 1, 2]  # hit, evicted, miss


def test_lookup_outcome_hit_when_the_copy_is_there(make, spans):
    scheduler = make()
    prompt = list(range(100, 160))
    run(scheduler, [h.make_request(prompt, params("c5", 1), max_tokens=20)])
    assert scheduler.reset_prefix_cache()
    run(scheduler, [h.make_request(prompt + [7] * 30, params("c5", 2))])
    (second,) = [attrs(s) for s in spans.spans(sc.SPAN_HOST_LOOKUP)
                 if s.attributes[sc.TURN_INDEX.key] == 2]
    assert second[sc.HOST_LOOKUP_OUTCOME.key] == "hit"


def test_wrapped_manager_passes_on_what_the_tiering_manager_adds(spans):
    """vLLM's tiering manager calls its own lookup and on_request_finished back with
    ``exclude_tier_idx=`` (a secondary tier's facade): the wrappers must pass it on, and a
    peer's lookup (not one of this engine's requests) marks nothing."""
    from types import SimpleNamespace

    from vllm.v1.kv_offload.base import LookupResult

    from connector_instrumented._offload_observer import OffloadObserver
    from connector_instrumented._telemetry import SpanSink

    calls = []

    class TieringLikeManager:  # the keyword-only arguments of TieringOffloadingManager
        def lookup(self, key, req_context, *, exclude_tier_idx=None):
            calls.append(("lookup", exclude_tier_idx))
            return LookupResult.MISS

        def on_request_finished(self, req_context, *, exclude_tier_idx=None):
            calls.append(("finished", exclude_tier_idx))

        def prepare_store(self, keys, req_context):
            return None

        def complete_store(self, keys, req_context, success=True):
            pass

        def reset_cache(self):
            return True

    manager = TieringLikeManager()
    observer = OffloadObserver(SimpleNamespace(manager=manager, _req_status={"mine": 1}),
                               SpanSink(sc.Service.DECODE), "host-memcpy")
    observer._evicted_keys["k"] = None
    mine, peer = SimpleNamespace(req_id="mine"), SimpleNamespace(req_id="peer")
    assert manager.lookup("k", peer, exclude_tier_idx=1) is LookupResult.MISS
    assert manager.lookup("k", mine) is LookupResult.MISS
    manager.on_request_finished(peer, exclude_tier_idx=1)
    assert calls == [("lookup", 1), ("lookup", None), ("finished", 1)]
    assert observer._wanted_evicted == {"mine"}
    assert observer.guard.errors == 0


def test_refused_save_diagnosed_on_the_next_turn(make, spans, tmp_path):
    """The spans the connector emits when the tier has no room for turn 1 (2 chunks, 4
    blocks to store: vLLM's manager refuses the store), read back by kvobs: turn 2 found
    nothing in the tier and is host-save-incomplete, with the refused blocks as evidence.
    (The testbed's engines cannot refuse: their tier holds 5x their KV cache.)"""
    from kvobs.diagnose import diagnose
    from kvobs.emit.otlp_json import spans_to_otlp_json
    from kvobs.sources import open_source

    scheduler = make(chunks=2)
    prompt = list(range(100, 164))
    run(scheduler, [h.make_request(prompt, params("refused", 1), max_tokens=1)])
    assert scheduler.reset_prefix_cache()  # turn 2 must come from the tier, or recompute
    run(scheduler, [h.make_request(prompt + list(range(300, 340)), params("refused", 2))])
    live = tmp_path / sc.STORE_LIVE_DIR
    live.mkdir()
    (live / "connector.otlp.jsonl").write_text(spans_to_otlp_json(spans.spans()) + "\n")

    first, second = diagnose(open_source(str(tmp_path)), "refused").turns
    assert first.finding.verdict is sc.Verdict.FIRST_TURN
    assert second.finding.verdict is sc.Verdict.HOST_SAVE_INCOMPLETE, second.finding
    evidence = second.finding.evidence
    assert evidence["prev_host_refused_blocks"] == 4
    assert evidence["host_accepted_tokens"] == 0 and evidence["prev_host_saved_tokens"] == 0
