"""Worker-side observer (fake worker), stats plumbing, Prometheus metrics, options."""

from __future__ import annotations

import doctest
import functools
import time
from collections import defaultdict
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

import _harness as h
from connector_instrumented import _digest, _stats as st
from connector_instrumented._compat import MissingHookError
from connector_instrumented._options import Options
from connector_instrumented._worker_observer import WorkerObserver
from kvobs import semconv as sc


class FakeWrapper:
    def __init__(self):
        self.bytes = {}

    def get_xfer_telemetry(self, handle):
        return SimpleNamespace(totalBytes=self.bytes[handle])


class FakeWorker:
    """The slice of upstream's pull worker the observer hooks, with the same flow."""

    def __init__(self, expired=False):
        self.nixl_wrapper = FakeWrapper()
        self._recving_transfers = {}
        self._recving_metadata = {}
        self._remote_agents = {"d": {}}
        self._engine_clock_offset = {"d": 100.0}  # D's clock runs 100 s ahead
        self._reqs_to_send = {}
        self.consumer_notification_counts_by_req = defaultdict(int)
        self.expired = expired
        self.done = set()
        self.failed = set()
        self.next_handle = 1

    def _is_turn2_read_expired(self, meta):
        return self.expired

    def _read_blocks_for_req(self, req_id, meta):
        self._recving_metadata[req_id] = meta
        if self._is_turn2_read_expired(meta):
            self.failed.add(req_id)
            return
        handle, self.next_handle = self.next_handle, self.next_handle + 1
        self.nixl_wrapper.bytes[handle] = 1000 * len(meta.local_block_ids[0])
        self._recving_transfers[req_id] = [handle]

    def _reap_expired_send_leases(self, done_sending):
        now = time.perf_counter()
        for req_id in [r for r, e in self._reqs_to_send.items() if now >= e]:
            del self._reqs_to_send[req_id]
            done_sending.add(req_id)

    def get_transfer_results(self):
        recving = set()
        for req_id in list(self._recving_transfers):
            if req_id in self.done:
                for handle in self._recving_transfers.pop(req_id):
                    self.nixl_wrapper.get_xfer_telemetry(handle)
                recving.add(req_id)
        recving |= self.failed
        sending = {"read-by-p"} if "read-by-p" in self.done else set()
        self._reap_expired_send_leases(sending)
        results = SimpleNamespace(finished_sending=sending, finished_recving=recving,
                                  failed_recving=set(self.failed))
        self.failed = set()
        return results


def meta(blocks=3, expiry=130.0):
    remote = SimpleNamespace(engine_id="d", blocks_expiry_time=time.perf_counter() + expiry)
    return SimpleNamespace(local_block_ids=(list(range(blocks)),), remote=remote,
                           awaiting_kvs=True)


def test_worker_records_a_done_read():
    worker = FakeWorker()
    obs = WorkerObserver(worker, bidirectional=True)
    m = meta(blocks=3, expiry=130.0)
    obs.on_start_load(SimpleNamespace(reqs_to_recv={"r1": m}))
    worker._read_blocks_for_req("r1", m)
    assert worker.get_transfer_results().finished_recving == set()
    worker.done.add("r1")
    results = worker.get_transfer_results()
    assert results.finished_recving == {"r1"}
    ((req, outcome, nbytes, blocks, start, duration, ttl, error, setup, unobserved),) = \
        obs.take()[0]
    assert (req, outcome, nbytes, blocks, error) == ("r1", "done", 3000, 3, None)
    assert 0 <= unobserved <= duration
    assert ttl == pytest.approx(30.0, abs=0.5)  # 130 s on D's clock minus the offset
    assert 0 <= duration < 1 and start == pytest.approx(time.time(), abs=5)
    assert 0 <= setup < 0.05  # D was connected: the read started when it was asked for


def test_worker_records_what_it_did_not_watch_at_a_read_s_end():
    """A completion is seen only at a poll (after each model step): a read seen in
    flight, then a 0.3 s step without a poll, then done, was unobserved for that step;
    one polled again right before it is seen done was unobserved for almost nothing."""
    def read_held_for(step_s: float, poll_before_done: bool) -> tuple[float, float]:
        worker = FakeWorker()
        obs = WorkerObserver(worker, bidirectional=True)
        m = meta(blocks=2)
        obs.on_start_load(SimpleNamespace(reqs_to_recv={"r1": m}))
        worker._read_blocks_for_req("r1", m)
        worker.get_transfer_results()  # a poll: still in flight
        time.sleep(step_s)  # P computes; nobody looks
        if poll_before_done:
            worker.get_transfer_results()
        worker.done.add("r1")
        worker.get_transfer_results()
        (record,) = obs.take()[0]
        return record[5], record[9]  # duration, unobserved

    duration, unobserved = read_held_for(0.3, poll_before_done=False)
    assert unobserved >= 0.3 and duration - unobserved < 0.05
    duration, unobserved = read_held_for(0.3, poll_before_done=True)
    assert duration >= 0.3 and unobserved < 0.05


def test_worker_records_connection_setup_before_a_first_read():
    """Upstream starts a NIXL handshake when the holder is not connected and calls
    ``_read_blocks_for_req`` again once it is: the wait in between is the set-up."""
    worker = FakeWorker()
    worker._remote_agents = {}  # not connected yet
    obs = WorkerObserver(worker, bidirectional=True)
    m = meta(blocks=2)
    obs.on_start_load(SimpleNamespace(reqs_to_recv={"r1": m}))
    worker._read_blocks_for_req("r1", m)  # not ready: handshake in flight
    time.sleep(0.05)
    worker._remote_agents = {"d": {}}  # handshake done
    worker._read_blocks_for_req("r1", m)
    worker.done.add("r1")
    worker.get_transfer_results()
    ((*_, setup, _unobserved),) = obs.take()[0]
    assert 0.05 <= setup < 1


def test_worker_records_a_declined_read():
    worker = FakeWorker(expired=True)
    obs = WorkerObserver(worker, bidirectional=True)
    m = meta(expiry=102.0)
    obs.on_start_load(SimpleNamespace(reqs_to_recv={"r2": m}))
    worker._read_blocks_for_req("r2", m)
    worker.get_transfer_results()
    ((_, outcome, nbytes, *_rest),) = obs.take()[0]
    assert (outcome, nbytes) == ("declined-expired", 0)


def test_worker_records_release_reasons():
    worker = FakeWorker()
    obs = WorkerObserver(worker, bidirectional=True)
    worker._reqs_to_send["expired"] = time.perf_counter() - 1
    worker.done.add("read-by-p")
    worker.get_transfer_results()
    assert sorted(obs.take()[1]) == [["expired", "expired", 0], ["read-by-p", "read", 1]]


def test_missing_hook_fails_loudly():
    worker = FakeWorker()
    del worker._recving_transfers
    with pytest.raises(MissingHookError, match="_recving_transfers"):
        WorkerObserver(worker, bidirectional=True)


def test_worker_stats_through_connector_stats(model_dir):
    """Worker raw records + upstream NIXL stats travel as one stats object."""
    from connector_instrumented.connector import _as_kvobs
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlKVConnectorStats

    upstream = NixlKVConnectorStats()
    upstream.record_kv_expired_req()
    ours = _as_kvobs(upstream)
    ours.data[st.RAW_READS].append(["r", "done", 1, 1, 0.0, 0.1, None, None])
    other = st.KvobsConnectorStats()
    other.add(st.PULL_DECISIONS, "pull")
    merged = ours.aggregate(other)
    assert merged.data["num_kv_expired_reqs"] == [1]
    assert merged.data[st.PULL_DECISIONS] == ["pull"]
    assert not merged.is_empty()
    assert "kvobs pull decisions" in merged.reduce()


def _registry_types(registry):
    return {Counter: functools.partial(Counter, registry=registry),
            Gauge: functools.partial(Gauge, registry=registry),
            Histogram: functools.partial(Histogram, registry=registry)}


def test_prometheus_metrics_initialised_and_observed(model_dir):
    registry = CollectorRegistry()
    metrics = st.KvobsPromMetrics(h.make_config(model_dir), _registry_types(registry),
                                  ["model_name", "engine"], {0: ["tiny", "0"]})
    value = registry.get_sample_value
    labels = {"model_name": "tiny", "engine": "0"}
    assert value("vllm:kvobs_pull_decisions_total", {**labels, "decision": "pull"}) == 0
    assert value("vllm:kvobs_remote_reads_total",
                 {**labels, "direction": "d_to_p", "outcome": "declined-expired"}) == 0
    assert value("vllm:kvobs_retained_releases_total",
                 {**labels, "reason": "expired", "was_read": "false"}) == 0
    assert value("vllm:kvobs_recomputed_tokens_total", {**labels, "reason": "fallback"}) == 0
    stats = st.KvobsConnectorStats()
    stats.add(st.PULL_DECISIONS, "pull")
    stats.add(st.READS, ["d_to_p", "done"])
    stats.add(st.READ_BYTES, ["d_to_p", 2_000_000])
    stats.add(st.READ_DURATION, ["d_to_p", 0.004])
    stats.add(st.REMAINING_TTL, 25.0)
    stats.add(st.RETAINED_BLOCKS, 7)
    stats.add(st.RETAINED_BLOCKS, 4)
    stats.add(st.RECOMPUTED_TOKENS, ["suffix", 8])
    stats.add(st.STUCK_WAITS, 1)
    stats.record_kv_expired_req()  # upstream's metric still works
    metrics.observe(stats.data, 0)
    assert value("vllm:kvobs_pull_decisions_total", {**labels, "decision": "pull"}) == 1
    assert value("vllm:kvobs_remote_reads_total",
                 {**labels, "direction": "d_to_p", "outcome": "done"}) == 1
    assert value("vllm:kvobs_remote_read_bytes_sum", {**labels, "direction": "d_to_p"}) == 2e6
    assert value("vllm:kvobs_remaining_ttl_at_read_seconds_count", labels) == 1
    assert value("vllm:kvobs_retained_blocks", labels) == 4
    assert value("vllm:kvobs_recomputed_tokens_total", {**labels, "reason": "suffix"}) == 8
    assert value("vllm:kvobs_stuck_remote_waits_total", labels) == 1
    assert value("vllm:nixl_num_kv_expired_reqs_total", labels) == 1
    for metric in (sc.M_READS, sc.M_PULL_DECISIONS, sc.M_RETAINED_BYTES, sc.M_RELEASES,
                   sc.M_RETAINED_BLOCK_SECONDS, sc.M_REUSED_TOKENS, sc.M_PREFIX_MISMATCH,
                   sc.M_DECLINED_EXPIRED, sc.M_STUCK_PREVENTED, sc.M_TELEMETRY_ERRORS):
        base = metric.name[:-len("_total")] if metric.name.endswith("_total") else metric.name
        assert base in {m.name for m in registry.collect()}, base


def test_build_classmethods(model_dir):
    from connector_instrumented import KvobsNixlConnector

    data = st.KvobsConnectorStats().data
    assert isinstance(KvobsNixlConnector.build_kv_connector_stats(data),
                      st.KvobsConnectorStats)
    off = KvobsNixlConnector.build_prom_metrics(
        h.make_config(model_dir, {"kvobs_telemetry": False}),
        _registry_types(CollectorRegistry()), ["model_name", "engine"], {0: ["t", "0"]})
    assert not isinstance(off, st.KvobsPromMetrics)


# --------------------------------------------------------------------------- options


def test_options_defaults_and_overrides():
    assert Options.from_extra_config({}, environ={}) == Options()
    opts = Options.from_extra_config(
        {"kvobs_role": "Decode", "kvobs_prefix_guard": "false", "kvobs_fix_stuck_waits": 0,
         "kvobs_stuck_after_s": 5}, environ={})
    assert (opts.role, opts.prefix_guard, opts.fix_stuck_waits, opts.stuck_after_s) == (
        sc.Service.DECODE, False, False, 5.0)
    assert Options.from_extra_config({}, environ={"KVOBS_ROLE": "prefill"}).role \
        is sc.Service.PREFILL
    assert Options.from_extra_config({"kvobs_role": "decode"},
                                     environ={"KVOBS_ROLE": "prefill"}).role is sc.Service.DECODE
    with pytest.raises(ValueError, match="kvobs_role"):
        Options.from_extra_config({"kvobs_role": "router"}, environ={})
    with pytest.raises(ValueError, match="kvobs_prefix_guard"):
        Options.from_extra_config({"kvobs_prefix_guard": "maybe"}, environ={})


class LegacyWorker(FakeWorker):
    """A worker of a vLLM whose facade calls ``get_finished`` (no failure set: failed
    reads are known from ``_log_failure``)."""

    def __init__(self):
        super().__init__()
        self.logged = []

    def _log_failure(self, failure_type=None, req_id=None, **kwargs):
        self.logged.append((failure_type, req_id))

    def get_finished(self):
        results = FakeWorker.get_transfer_results(self)
        return results.finished_sending, results.finished_recving

    get_transfer_results = None  # the method this vLLM never calls


def test_completion_method_follows_the_facade():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from connector_instrumented import _compat

    assert _compat.completion_method() == "get_transfer_results"  # vLLM 0.32's facade

    class LegacyFacade(KVConnectorBase_V1):
        pass

    assert _compat.completion_method(LegacyFacade) == "get_finished"


def test_legacy_completion_path_records_done_failed_and_releases():
    worker = LegacyWorker()
    obs = WorkerObserver(worker, bidirectional=False, completion="get_finished")
    m1, m2 = meta(blocks=2), meta(blocks=1)
    obs.on_start_load(SimpleNamespace(reqs_to_recv={"ok": m1, "bad": m2}))
    worker._read_blocks_for_req("ok", m1)
    worker._read_blocks_for_req("bad", m2)
    worker._log_failure(failure_type="transfer_failed", req_id="bad")
    worker._log_failure(failure_type="notification_failed", req_id="ok")  # read is fine
    worker.done |= {"ok", "bad", "read-by-p"}
    assert worker.get_finished()[1] == {"ok", "bad"}
    reads, releases = obs.take()
    outcomes = sorted((r[0], r[1], r[2], r[7]) for r in reads)
    assert outcomes == [("bad", "failed", 1000, "transfer_failed"),
                        ("ok", "done", 2000, "notification_failed")]
    assert releases == [["read-by-p", "read", 1]]


def test_legacy_completion_path_needs_the_failure_log():
    class WithoutFailureLog(FakeWorker):
        get_finished = LegacyWorker.get_finished

    with pytest.raises(MissingHookError, match="_log_failure"):
        WorkerObserver(WithoutFailureLog(), bidirectional=False, completion="get_finished")


def test_digest_doctests():
    result = doctest.testmod(_digest)
    assert result.failed == 0 and result.attempted > 0


@pytest.mark.parametrize("blocks", [1, 5, 64, 65, 100, 1000])
@pytest.mark.parametrize("width", [32, 16, 24])
def test_digest_matches_its_checkpoint_definition(blocks, width):
    """The gathered prefixes are exactly the 8-byte prefixes at ``checkpoints()``."""
    import hashlib

    from kvobs.prefix_chain import checkpoints

    hashes, prev = [], b"seed"
    for i in range(blocks):
        prev = hashlib.sha256(prev + i.to_bytes(4, "little")).digest()[:width]
        hashes.append(prev)
    digest = _digest.encode(hashes, blocks * 16 + 3, 16, "abcd")
    expected = "".join(hashes[n - 1][:8].hex() for n in checkpoints(blocks))
    assert digest == f"kvobs4:16:abcd:{blocks}:0::{expected}"  # no token ids: no tail
    assert _digest.compare(digest, hashes, 16, "abcd", blocks * 16 + 3) == (
        sc.PrefixEvidence.MATCH, checkpoints(blocks)[-1] * 16)
    # P's history diverges at block k: the longest verified prefix is the last
    # checkpoint before k, found by bisection.
    k = blocks // 2
    other = hashes[:k] + [bytes(width)] * (blocks - k)
    points = checkpoints(blocks)
    verified = max([c for c in points if c <= k], default=0)
    evidence, matched = _digest.compare(digest, other, 16, "abcd", blocks * 16)
    assert (evidence, matched) == (sc.PrefixEvidence.MISMATCH, verified * 16)


# --------------------------------------------------------------------------- span sink


def test_span_sink_full_queue_drops_and_counts_without_blocking():
    """Hooks only queue facts; a full queue drops (counted), never waits for the builder."""
    from kvobs.emit.spans import Correlation

    from connector_instrumented._telemetry import SpanSink

    capture = h.SpanCapture()
    sink = SpanSink(sc.Service.PREFILL, tracer_factory=capture.factory, max_queue=4)
    corr = Correlation(conversation_id="c", turn=2)
    with sink._build_lock:  # the builder thread is stuck: nothing leaves the queue
        t0 = time.perf_counter()
        for i in range(10):
            sink.emit(sc.SPAN_RECOMPUTE, corr, {sc.RECOMPUTED_TOKENS.key: i},
                      1000.0 + i, 1000.5 + i)
        elapsed = time.perf_counter() - t0
        assert sink.dropped == 6 and sink.errors == 6
        assert capture.exporter.get_finished_spans() == ()
    assert elapsed < 0.5, elapsed
    sink.flush()
    spans = capture.exporter.get_finished_spans()
    assert [s.attributes[sc.RECOMPUTED_TOKENS.key] for s in spans] == [0, 1, 2, 3]
    # timestamps are the hook's, not the builder's
    assert [(s.start_time, s.end_time) for s in spans] == [
        (int((1000.0 + i) * 1e9), int((1000.5 + i) * 1e9)) for i in range(4)]
    assert all(s.attributes[sc.CONVERSATION_ID.key] == "c" for s in spans)
    # the builder thread drains on its own once free
    sink.emit(sc.SPAN_RECOMPUTE, corr, {sc.RECOMPUTED_TOKENS.key: 99}, None, None)
    deadline = time.monotonic() + 5
    while len(capture.exporter.get_finished_spans()) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    last = capture.exporter.get_finished_spans()[-1]
    assert last.attributes[sc.RECOMPUTED_TOKENS.key] == 99 and sink.errors == 6
