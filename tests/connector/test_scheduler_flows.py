"""Scheduler-side behaviour and spans, driven through a real vLLM Scheduler."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from opentelemetry.trace import StatusCode

import _harness as h
from connector_instrumented import _digest, _stats as st
from kvobs import semconv as sc
from kvobs.emit.spans import shard_key
from vllm.v1.request import RequestStatus

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CORR = {sc.KTP_CONVERSATION_ID: "conv-1", sc.KTP_TURN_INDEX: 2,
        sc.KTP_TRACEPARENT: f"00-{TRACE_ID}-00f067aa0ba902b7-01"}


def attrs(span):
    return dict(span.attributes)


def kv_stats(engine_outputs) -> dict:
    """The connector stats payload vLLM ships to the front-end (SchedulerStats)."""
    for outputs in engine_outputs.values():
        if outputs.scheduler_stats and outputs.scheduler_stats.kv_connector_stats:
            return outputs.scheduler_stats.kv_connector_stats
    return {}


def tokens(n, start=10):
    return [start + i % 400 for i in range(n)]


def p_turn2(scheduler, prompt, remote_tokens, **params):
    req = h.make_request(prompt, h.d_params("d-req", range(remote_tokens // h.BS + 1),
                                            remote_tokens, **CORR, **params))
    scheduler.add_request(req)
    so, eco = h.step(scheduler, None, **dict())
    return req, so, eco


def read_record(req_id, outcome="done", nbytes=4096, blocks=3, ttl=20.0):
    stats = st.KvobsConnectorStats()
    stats.add(st.RAW_READS, [req_id, outcome, nbytes, blocks, time.time() - 0.01, 0.004,
                             ttl, None if outcome == "done" else "transfer_failed"])
    return stats


# --------------------------------------------------------------------------- P side


def test_pull_decision_read_and_recompute_spans(model_dir, spans):
    scheduler = h.make_scheduler(h.make_config(model_dir))
    req, so, _ = p_turn2(scheduler, tokens(56), 48)
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert req.request_id in so.kv_connector_metadata.reqs_to_recv

    (decision,) = spans.spans(sc.SPAN_PULL_DECISION)
    assert decision.context.trace_id == int(TRACE_ID, 16)
    identity = {key: attrs(decision).pop(key) for key in (
        sc.ENGINE_ID.key, sc.ENGINE_STARTED_AT.key, sc.ENGINE_ENDPOINT.key)}
    assert identity[sc.ENGINE_ID.key] == scheduler.connector.connector_scheduler.engine_id
    assert 0 < time.time() - identity[sc.ENGINE_STARTED_AT.key] < 600
    assert identity[sc.ENGINE_ENDPOINT.key].endswith(":5600")
    # The prompt's chain: 3 full blocks of 56 tokens, the same as a D digest of them.
    assert attrs(decision)[sc.PREFIX_LINEAGE.key] == _digest.encode(
        req.block_hashes, 56, h.BS, _digest.seed_fingerprint())
    assert {k: v for k, v in attrs(decision).items() if k not in identity
            and k != sc.PREFIX_LINEAGE.key} == {
        sc.CONVERSATION_ID.key: "conv-1", sc.TURN_INDEX.key: 2,
        sc.REQUEST_ID.key: req.request_id, sc.ROLE.key: "prefill",
        sc.PROMPT_TOKENS.key: 56, sc.LOCAL_HIT_TOKENS.key: 0, sc.REMOTE_TOKENS.key: 48,
        sc.CANDIDATE_TOKENS.key: 48, sc.THRESHOLD.key: 0, sc.PULL_DECISION.key: "pull",
        sc.PREFIX_EVIDENCE.key: "absent", sc.PREFIX_GUARD.key: False,
        sc.OFFERED_TOKENS.key: 48, sc.REMOTE_ENGINE_ID.key: "decode-engine",
        sc.REMOTE_REQUEST_ID.key: "d-req", sc.SHARD.key: req.block_hashes[0][:8].hex()}

    _, eco = h.step(scheduler, None, **dict(
        finished_recving={req.request_id}, kv_connector_stats=read_record(req.request_id)))
    (read,) = spans.spans(sc.SPAN_READ)
    a = attrs(read)
    assert (a[sc.READ_OUTCOME.key], a[sc.READ_BYTES.key], a[sc.READ_BLOCKS.key],
            a[sc.READ_DIRECTION.key], a[sc.REMAINING_TTL_AT_READ.key]) == (
        "done", 4096, 3, "d_to_p", 20.0)
    assert read.context.trace_id == int(TRACE_ID, 16)
    (recompute,) = spans.spans(sc.SPAN_RECOMPUTE)
    assert attrs(recompute)[sc.RECOMPUTE_REASON.key] == "suffix"
    assert attrs(recompute)[sc.RECOMPUTED_TOKENS.key] == 8
    data = kv_stats(eco)
    assert data[st.READS] == [["d_to_p", "done"]]
    assert data[st.READ_BYTES] == [["d_to_p", 4096]]
    assert data[st.REUSED_TOKENS] == [48]
    assert data[st.RAW_READS] == []  # consumed by the scheduler, not shipped on


def test_first_turn_is_no_params_and_recompute(model_dir, spans):
    scheduler = h.make_scheduler(h.make_config(model_dir))
    req = h.make_request(tokens(40), {"do_remote_decode": True, "do_remote_prefill": False,
                                      **CORR})
    scheduler.add_request(req)
    _, eco = h.step(scheduler, h.runner_output([req]))
    (decision,) = spans.spans(sc.SPAN_PULL_DECISION)
    assert attrs(decision)[sc.PULL_DECISION.key] == "no-params"
    (recompute,) = spans.spans(sc.SPAN_RECOMPUTE)
    assert attrs(recompute)[sc.RECOMPUTE_REASON.key] == "no-params"
    assert attrs(recompute)[sc.RECOMPUTED_TOKENS.key] == 40
    assert kv_stats(eco)[st.PULL_DECISIONS] == ["no-params"]


def test_below_threshold(model_dir, spans):
    scheduler = h.make_scheduler(h.make_config(model_dir, {"kv_recompute_threshold": 64}))
    req, so, _ = p_turn2(scheduler, tokens(56), 48)
    assert req.request_id in so.num_scheduled_tokens  # computed, not parked
    (decision,) = spans.spans(sc.SPAN_PULL_DECISION)
    assert attrs(decision)[sc.PULL_DECISION.key] == "below-threshold"
    assert attrs(decision)[sc.THRESHOLD.key] == 64
    (recompute,) = spans.spans(sc.SPAN_RECOMPUTE)
    assert attrs(recompute)[sc.RECOMPUTE_REASON.key] == "below-threshold"


def _digest_of(token_ids, n_tokens):
    d_req = h.make_request(token_ids, None)
    return _digest.encode(d_req.block_hashes, n_tokens, h.BS, _digest.seed_fingerprint(),
                          token_ids)


@pytest.mark.parametrize("guard", [True, False])
def test_prefix_mismatch(model_dir, spans, guard):
    prompt = tokens(72)
    d_tokens = list(prompt)
    d_tokens[40] = 499  # D's history diverges inside block 3 (tokens 32..47)
    digest = _digest_of(d_tokens, 64)
    scheduler = h.make_scheduler(h.make_config(model_dir, {"kvobs_prefix_guard": guard}))
    req, so, eco = p_turn2(scheduler, prompt, 64, **{sc.KTP_BLOCK_DIGEST: digest})
    (decision,) = spans.spans(sc.SPAN_PULL_DECISION)
    a = attrs(decision)
    assert a[sc.PULL_DECISION.key] == "prefix-mismatch"
    assert a[sc.PREFIX_EVIDENCE.key] == "mismatch"
    assert a[sc.PREFIX_MATCHED_TOKENS.key] == 32
    assert a[sc.PREFIX_GUARD.key] is guard
    meta = so.kv_connector_metadata.reqs_to_recv[req.request_id]
    if guard:  # only the two verified blocks are read
        assert a[sc.OFFERED_TOKENS.key] == 32
        assert [len(g) for g in meta.remote.block_ids] == [2]
    else:  # upstream behaviour: all of D's (wrong) KV is read
        assert a[sc.OFFERED_TOKENS.key] == 64
        assert [len(g) for g in meta.remote.block_ids] == [5]
    assert kv_stats(eco)[st.PREFIX_MISMATCHES] == [1]


@pytest.mark.parametrize("guard", [True, False])
def test_tail_mismatch_inside_the_last_partial_block(model_dir, spans, guard):
    """D's KV ends inside a block (60 tokens: 3 full blocks + 12); the next prompt
    re-tokenized one of those 12 differently. Block hashes cover full blocks only, the
    tail fingerprint catches it: only the full blocks are read (guard on)."""
    prompt = tokens(72)
    d_tokens = list(prompt)
    d_tokens[55] = 499
    scheduler = h.make_scheduler(h.make_config(model_dir, {"kvobs_prefix_guard": guard}))
    req, so, _ = p_turn2(scheduler, prompt, 60,
                         **{sc.KTP_BLOCK_DIGEST: _digest_of(d_tokens, 60)})
    (decision,) = spans.spans(sc.SPAN_PULL_DECISION)
    a = attrs(decision)
    assert (a[sc.PULL_DECISION.key], a[sc.PREFIX_MATCHED_TOKENS.key]) == (
        "prefix-mismatch", 48)
    meta = so.kv_connector_metadata.reqs_to_recv[req.request_id]
    expected = (48, 3) if guard else (60, 4)
    assert (a[sc.OFFERED_TOKENS.key], len(meta.remote.block_ids[0])) == expected


def test_tail_match_verifies_every_remote_token(model_dir, spans):
    prompt = tokens(72)
    scheduler = h.make_scheduler(h.make_config(model_dir))
    p_turn2(scheduler, prompt, 60, **{sc.KTP_BLOCK_DIGEST: _digest_of(prompt, 60)})
    (decision,) = spans.spans(sc.SPAN_PULL_DECISION)
    assert (attrs(decision)[sc.PULL_DECISION.key],
            attrs(decision)[sc.PREFIX_MATCHED_TOKENS.key]) == ("pull", 60)


def test_prefix_match_pulls(model_dir, spans):
    prompt = tokens(72)
    scheduler = h.make_scheduler(h.make_config(model_dir))
    req, _, _ = p_turn2(scheduler, prompt, 64,
                        **{sc.KTP_BLOCK_DIGEST: _digest_of(prompt, 64)})
    (decision,) = spans.spans(sc.SPAN_PULL_DECISION)
    assert attrs(decision)[sc.PULL_DECISION.key] == "pull"
    assert attrs(decision)[sc.PREFIX_EVIDENCE.key] == "match"
    assert attrs(decision)[sc.PREFIX_MATCHED_TOKENS.key] == 64


def test_prefix_guard_cut_to_nothing_recomputes(model_dir, spans):
    prompt = tokens(72)
    d_tokens = list(prompt)
    d_tokens[3] = 499  # diverges in block 1: nothing verifiable
    scheduler = h.make_scheduler(h.make_config(model_dir))
    req, so, _ = p_turn2(scheduler, prompt, 64,
                         **{sc.KTP_BLOCK_DIGEST: _digest_of(d_tokens, 64)})
    assert req.request_id in so.num_scheduled_tokens
    (recompute,) = spans.spans(sc.SPAN_RECOMPUTE)
    assert attrs(recompute)[sc.RECOMPUTE_REASON.key] == "prefix-mismatch"
    # notify-only entry: D is told to release its blocks early, as upstream does
    assert not any(so.kv_connector_metadata.reqs_to_recv[req.request_id].local_block_ids)


# --------------------------------------------------------------------------- stuck waits


@pytest.mark.parametrize("fix", [False, True])
def test_declined_read_with_recompute_policy(model_dir, spans, fix):
    """DESIGN §6: a declined read under policy=recompute is re-offered, never read."""
    scheduler = h.make_scheduler(h.make_config(
        model_dir, {"kvobs_fix_stuck_waits": fix}, policy="recompute"))
    req, _, _ = p_turn2(scheduler, tokens(56), 48)
    h.step(scheduler, None, **dict(
        finished_recving={req.request_id}, failed_recving={req.request_id},
        kv_connector_stats=read_record(req.request_id, "declined-expired", 0, 3, -2.0)))
    (read,) = spans.spans(sc.SPAN_READ)
    assert attrs(read)[sc.READ_OUTCOME.key] == "declined-expired"
    # an ERROR status says why (#27): role, outcome, the transfer's error
    assert read.status.status_code is StatusCode.ERROR
    assert read.status.description == "prefill: KV read d_to_p declined-expired: transfer_failed"
    so, eco = h.step(scheduler, None, **dict())
    (stuck,) = spans.spans(sc.SPAN_STUCK)
    assert attrs(stuck)[sc.STUCK_REASON.key] == "already-processed"
    assert attrs(stuck)[sc.STUCK_FIXED.key] is fix
    assert (stuck.status.status_code, stuck.status.description) == (
        (StatusCode.UNSET, None) if fix
        else (StatusCode.ERROR, "prefill: stuck (already-processed)"))
    data = kv_stats(eco)
    if fix:
        assert req.request_id in so.num_scheduled_tokens  # recomputed
        assert data[st.STUCK_PREVENTED] == [1]
        (recompute,) = spans.spans(sc.SPAN_RECOMPUTE)
        assert attrs(recompute)[sc.RECOMPUTE_REASON.key] == "fallback"
    else:  # upstream: parked forever, nothing queued to read it
        assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert req.request_id not in so.kv_connector_metadata.reqs_to_recv
        assert data[st.STUCK_WAITS] == [1]
        for _ in range(3):
            h.step(scheduler, None, **dict())
        assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert len(spans.spans(sc.SPAN_STUCK)) == 1  # reported once


@pytest.mark.parametrize("fix", [False, True])
def test_p_without_bidirectional_mode(model_dir, spans, fix):
    scheduler = h.make_scheduler(h.make_config(
        model_dir, {"bidirectional_kv_xfer": False, "kvobs_fix_stuck_waits": fix}))
    req, so, _ = p_turn2(scheduler, tokens(56), 48)
    (stuck,) = spans.spans(sc.SPAN_STUCK)
    assert attrs(stuck)[sc.STUCK_REASON.key] == "bidirectional-disabled"
    assert (req.request_id in so.num_scheduled_tokens) is fix
    assert (req.status == RequestStatus.WAITING_FOR_REMOTE_KVS) is not fix


def test_watchdog_reports_long_waits(model_dir, spans):
    scheduler = h.make_scheduler(h.make_config(model_dir, {"kvobs_stuck_after_s": 0.05}))
    req, _, _ = p_turn2(scheduler, tokens(56), 48)
    time.sleep(0.06)
    _, eco = h.step(scheduler, None, **dict())
    (stuck,) = spans.spans(sc.SPAN_STUCK)
    assert attrs(stuck)[sc.STUCK_REASON.key] == "wait-timeout"
    assert attrs(stuck)[sc.STUCK_WAITED.key] >= 0.05
    assert kv_stats(eco)[st.STUCK_WAITS] == [1]


# --------------------------------------------------------------------------- D side


def _d_turn(scheduler, prompt, extra=None):
    params = {"do_remote_prefill": True, "do_remote_decode": False,
              "remote_engine_id": "prefill-engine", "remote_request_id": "p-req",
              "remote_block_ids": [list(range(len(prompt) // h.BS + 1))],
              "remote_host": "127.0.0.1", "remote_port": 1234, "tp_size": 1, **CORR,
              **(extra or {})}
    req = h.make_request(prompt, params, max_tokens=1)
    scheduler.add_request(req)
    h.step(scheduler, None, **dict())
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    h.step(scheduler, None, **dict(finished_recving={req.request_id}))
    _, eco = h.step(scheduler)
    return req, eco


def test_d_export_digest_and_release(model_dir, spans):
    scheduler = h.make_scheduler(h.make_config(model_dir, {"decoder_kv_blocks_ttl": 30}))
    prompt = tokens(50)
    req, eco = _d_turn(scheduler, prompt)
    out = eco[0].outputs[0].kv_transfer_params
    assert out["remote_blocks_expiry_time"] is not None
    assert out[sc.KTP_BLOCK_DIGEST].startswith("kvobs4:16:")
    (export,) = spans.spans(sc.SPAN_EXPORT)
    a = attrs(export)
    assert a[sc.EXPORT_TOKENS.key] == out["remote_num_tokens"] == 50
    assert a[sc.EXPORT_BLOCKS.key] == sum(len(g) for g in out["remote_block_ids"])
    assert a[sc.EXPORT_EXPIRES_AT.key] == pytest.approx(time.time() + 30, abs=1)
    assert a[sc.CONVERSATION_ID.key] == "conv-1" and a[sc.ROLE.key] == "decode"
    # The span carries D's digest as the lineage chain, and the P request it pulled from.
    assert a[sc.PREFIX_LINEAGE.key] == out[sc.KTP_BLOCK_DIGEST]
    assert a[sc.REMOTE_REQUEST_ID.key] == req.kv_transfer_params["remote_request_id"]
    assert a[sc.REMOTE_REQUEST_ID.key]
    assert kv_stats(eco)[st.RETAINED_BLOCKS] == [a[sc.EXPORT_BLOCKS.key]]
    # P of the next turn verifies D's digest against its own prompt: a match, the
    # partial block's two tokens included; a re-tokenized tail is a mismatch after the
    # last full block.
    for p_prompt, expected in ((prompt + [5, 6], ("match", 50)),
                               (prompt[:49] + [7, 5, 6], ("mismatch", 48))):
        evidence, matched = _digest.compare(
            out[sc.KTP_BLOCK_DIGEST], h.make_request(p_prompt, None).block_hashes,
            h.BS, _digest.seed_fingerprint(), 50, p_prompt)
        assert (evidence.value, matched) == expected

    release = st.KvobsConnectorStats()
    release.add(st.RAW_RELEASES, [req.request_id, "read", 1])
    _, eco = h.step(scheduler, None, **dict(finished_sending={req.request_id},
                                              kv_connector_stats=release))
    (rel,) = spans.spans(sc.SPAN_RELEASE)
    assert attrs(rel)[sc.RELEASE_REASON.key] == "read"
    data = kv_stats(eco)
    assert data[st.RELEASES] == [["read", "true"]]
    assert data[st.RETAINED_BLOCKS] == [0]
    assert scheduler.requests == {}


def test_d_release_expired_never_read(model_dir, spans):
    scheduler = h.make_scheduler(h.make_config(model_dir))
    req, _ = _d_turn(scheduler, tokens(50))
    release = st.KvobsConnectorStats()
    release.add(st.RAW_RELEASES, [req.request_id, "expired", 0])
    _, eco = h.step(scheduler, None, **dict(finished_sending={req.request_id},
                                              kv_connector_stats=release))
    (rel,) = spans.spans(sc.SPAN_RELEASE)
    assert attrs(rel)[sc.RELEASE_REASON.key] == "expired"
    assert attrs(rel)[sc.RELEASE_READ_COUNT.key] == 0
    assert kv_stats(eco)[st.RELEASES] == [["expired", "false"]]


# --------------------------------------------------------------------------- parity, safety


def _run_flows(model_dir, connector, module, extra):
    """Turn-1 D export then turn-2 P pull; returns what the scheduler did."""
    trace = []
    scheduler = h.make_scheduler(h.make_config(model_dir, extra, connector=connector,
                                               module=module))
    d_req, eco = _d_turn(scheduler, tokens(50))
    out = dict(eco[0].outputs[0].kv_transfer_params)
    trace.append(sorted(k for k in out if not k.startswith("kvobs_")))
    for i, (prompt_len, remote) in enumerate(((56, 48), (60, 16), (20, 48), (50, 48))):
        start = 10 if i == 3 else 100 + 7 * i  # the last one hits D's local cache
        req, so, _ = p_turn2(scheduler, tokens(prompt_len, start), remote)
        meta = so.kv_connector_metadata
        trace.append((req.status, req.num_computed_tokens,
                      [(v.local_block_ids, v.remote.block_ids)
                       for v in meta.reqs_to_recv.values()]))
        h.step(scheduler, None, **dict(finished_recving={req.request_id}))
        h.step(scheduler)
        trace.append((req.status, req.num_computed_tokens))
    return trace


@pytest.mark.parametrize("extra", [{}, {"kvobs_telemetry": False}])
def test_same_scheduling_as_upstream(model_dir, spans, extra):
    ours = _run_flows(model_dir, h.CLASS, h.MODULE, extra)
    upstream = _run_flows(model_dir, "NixlConnector", None, {})
    assert ours == upstream


def test_telemetry_off_is_upstream(model_dir, spans):
    scheduler = h.make_scheduler(h.make_config(model_dir, {"kvobs_telemetry": False}))
    assert scheduler.connector._kvobs_sched is None
    _, eco = _d_turn(scheduler, tokens(50))
    assert sc.KTP_BLOCK_DIGEST not in eco[0].outputs[0].kv_transfer_params
    assert spans.spans() == []


def test_telemetry_failures_never_reach_vllm(model_dir, spans, monkeypatch):
    from connector_instrumented._scheduler_observer import SchedulerObserver

    def boom(*args, **kwargs):
        raise RuntimeError("telemetry bug")

    for name in ("before_match", "after_match", "after_alloc", "on_meta", "on_output",
                 "on_finished"):
        monkeypatch.setattr(SchedulerObserver, name, boom)
    scheduler = h.make_scheduler(h.make_config(model_dir))
    req, _, eco = p_turn2(scheduler, tokens(56), 48)
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS  # upstream result
    assert kv_stats(eco)[st.TELEMETRY_ERRORS][0] >= 3


def test_lost_spans_reach_the_engines_metrics_by_reason(model_dir, tmp_path):
    """#10: an engine whose span store cannot be written loses spans (export-failed), and
    says so on its /metrics: the losses ride the connector stats to the front-end's
    vllm:kvobs_telemetry_dropped_spans_total{reason}, once each (deltas, not totals)."""
    from prometheus_client import CollectorRegistry

    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    scheduler = h.make_scheduler(h.make_config(
        model_dir, {"decoder_kv_blocks_ttl": 30, "kvobs_store": str(blocked / "store")}))
    obs = scheduler.connector._kvobs_sched
    _d_turn(scheduler, tokens(50))
    obs._sink.flush()  # the spans built and exported (and failed) now
    lost = obs._sink.losses()
    assert lost["export-failed"] >= 1 and lost["queue-full"] == 0
    obs._losses_due = 0.0  # looked at once a second: now
    stats = obs.take_stats()
    assert stats.data[st.TELEMETRY_DROPPED] == [["export-failed", lost["export-failed"]]]
    obs._losses_due = 0.0
    again = obs.take_stats()  # nothing new lost: nothing reported twice
    assert again is None or not again.data[st.TELEMETRY_DROPPED]
    registry = CollectorRegistry()
    from test_worker_stats_options import _registry_types

    metrics = st.KvobsPromMetrics(h.make_config(model_dir), _registry_types(registry),
                                  ["model_name", "engine"], {0: ["m", "0"]})
    metrics.observe(stats.data, 0)
    value = registry.get_sample_value
    labels = {"model_name": "m", "engine": "0"}
    assert value("vllm:kvobs_telemetry_dropped_spans_total",
                 {**labels, "reason": "export-failed"}) == lost["export-failed"]
    assert value("vllm:kvobs_telemetry_dropped_spans_total",
                 {**labels, "reason": "queue-full"}) == 0


def test_shutdown_exports_queued_spans_before_upstreams_shutdown(model_dir, spans,
                                                                  monkeypatch):
    """SIGTERM reaches the connector as shutdown() (EngineCore.shutdown -> Scheduler);
    upstream's part may block (it joins its handshake listener without a timeout) until
    the process manager's SIGKILL: the turn's spans are exported before it starts."""
    from connector_instrumented import _telemetry

    monkeypatch.setattr(_telemetry, "_BUILD_INTERVAL_S", 3600.0)  # the builder sleeps
    scheduler = h.make_scheduler(h.make_config(model_dir, {"decoder_kv_blocks_ttl": 30}))
    connector = scheduler.connector
    _d_turn(scheduler, tokens(50))
    exported_before = []
    monkeypatch.setattr(type(connector.connector_scheduler), "shutdown",
                        lambda self: exported_before.append(  # no flush here
                            [s.name for s in spans.exporter.get_finished_spans()]))
    connector.shutdown()
    (names,) = exported_before
    assert sc.SPAN_EXPORT.name in names and sc.SPAN_DECODE_REQUEST.name in names


def test_worker_records_reach_the_spans_under_multiconnector(model_dir, spans):
    """Under vLLM's MultiConnector the worker's stats arrive as one entry per connector
    class (``MultiKVConnectorStats``): the read span still carries the worker's bytes."""
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
        MultiKVConnectorStats)

    scheduler = h.make_scheduler(h.make_config(model_dir))
    req, _, _ = p_turn2(scheduler, tokens(56), 48)
    multi = MultiKVConnectorStats(data={"KvobsNixlConnector": read_record(req.request_id)})
    # The observer's hook as MultiConnector hands it the step's output (a stand-alone
    # scheduler would then mix the multi stats with its own connector's).
    scheduler.connector._kvobs_sched.on_output(SimpleNamespace(
        kv_connector_stats=multi, finished_recving={req.request_id}, failed_recving=set(),
        finished_sending=set()))
    (read,) = spans.spans(sc.SPAN_READ)
    assert (attrs(read)[sc.READ_OUTCOME.key], attrs(read)[sc.READ_BYTES.key]) == ("done", 4096)


@pytest.mark.parametrize("ids", [{**CORR, sc.KTP_TENANT: "t1"}, {}], ids=["ids", "id-less"])
def test_every_span_of_a_conversation_carries_one_shard_and_the_params_name_it(
        model_dir, spans, ids):
    """P's and D's turn 1 and P's turn 2 of one conversation: every span carries the
    same ``kvobs.shard`` (the tenant and the first block hash of the prompt, which P's
    longer turn-2 prompt starts with too), and P returns it in its params (the proxy's
    own spans take it from there)."""
    prompt = tokens(50)
    p_scheduler = h.make_scheduler(h.make_config(model_dir))
    first = h.make_request(prompt, {"do_remote_decode": True, "do_remote_prefill": False,
                                    **ids})
    p_scheduler.add_request(first)
    _, eco = h.step(p_scheduler, h.runner_output([first]))
    p_out = eco[0].outputs[0].kv_transfer_params
    d_scheduler = h.make_scheduler(h.make_config(model_dir, {"decoder_kv_blocks_ttl": 30}))
    extra = {k: None for k in CORR} | ids
    _, eco = _d_turn(d_scheduler, prompt, extra)
    assert sc.KTP_SHARD not in eco[0].outputs[0].kv_transfer_params  # P's alone
    req = h.make_request(prompt + tokens(30, 500), h.d_params(
        "d-req", range(50 // h.BS + 1), 50, **ids))
    p_scheduler.add_request(req)
    h.step(p_scheduler, None)
    expected = shard_key(ids.get(sc.KTP_TENANT), req.block_hashes[0])
    assert expected == ("t1/" if ids else "") + req.block_hashes[0][:8].hex()
    assert p_out[sc.KTP_SHARD] == expected
    carried = {s.name: attrs(s).get(sc.SHARD.key) for s in spans.spans()}
    assert {sc.SPAN_EXPORT.name, sc.SPAN_DECODE_REQUEST.name,
            sc.SPAN_PULL_DECISION.name} <= set(carried)
    assert set(carried.values()) == {expected}


def test_a_prompt_shorter_than_a_block_has_no_shard(model_dir, spans):
    scheduler = h.make_scheduler(h.make_config(model_dir))
    req = h.make_request(tokens(10), {"do_remote_decode": True, "do_remote_prefill": False,
                                      **CORR})
    scheduler.add_request(req)
    h.step(scheduler, h.runner_output([req]))
    (decision,) = spans.spans(sc.SPAN_PULL_DECISION)
    assert sc.SHARD.key not in attrs(decision)
