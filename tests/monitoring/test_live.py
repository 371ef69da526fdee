"""kvobs.monitoring.live against a real Prometheus scraping a real /metrics endpoint.

The endpoint is a prometheus_client HTTP server started here, exposing a few kvobs metrics
(names from kvobs.semconv) that a thread keeps moving; Prometheus is Debian's binary,
started by ``live.start_prometheus`` in a temp dir and stopped by PID.
"""

from __future__ import annotations

import os
import threading

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from kvobs import semconv as sc
from kvobs.monitoring import live, rules
from kvobs.monitoring import queries as q
from kvobs.monitoring.config import DEFAULT, DIRECTION_D_TO_P, DIRECTION_P_TO_D


def _name(metric: sc.Metric) -> str:
    return metric.name[: -len("_total")] if metric.type == "counter" else metric.name


# Seconds each fake request spends per phase (one request, one read per tick): the queue
# time vLLM reports on P includes the D->P set-up and read, as on a real engine.
P_QUEUE, P_TTFT, P_PREFILL, P_READ, P_SETUP = 0.3, 0.5, 0.1, 0.004, 0.001


def _histogram(metric: sc.Metric, registry, labels=()) -> Histogram:
    return Histogram(_name(metric), "d", tuple(labels) + metric.labels,
                     buckets=metric.buckets or Histogram.DEFAULT_BUCKETS, registry=registry)


class FakeEngineAndProxy:
    """Three /metrics endpoints (a prefill and a decode engine, the proxy) with a few kvobs
    and vLLM series that keep changing. The engine jobs name their role, as the default
    role selectors expect."""

    def __init__(self):
        self.engine_registry = CollectorRegistry()
        self.decode_registry = CollectorRegistry()
        self.proxy_registry = CollectorRegistry()
        vllm = ("model_name", "engine")
        e, d = self.engine_registry, self.decode_registry
        self.p_queue, self.d_queue = (_histogram(sc.M_VLLM_QUEUE_TIME, r) for r in (e, d))
        self.p_ttft = _histogram(sc.M_VLLM_TTFT, e)
        self.p_prefill = _histogram(sc.M_VLLM_PREFILL_TIME, e)
        self.setup = _histogram(sc.M_READ_SETUP, e, vllm)
        self.handoff = _histogram(sc.M_READ_DURATION, d, vllm)
        self.decisions = Counter(_name(sc.M_PULL_DECISIONS), "d",
                                 vllm + sc.M_PULL_DECISIONS.labels, registry=e)
        self.reads = Counter(_name(sc.M_READS), "d", vllm + sc.M_READS.labels, registry=e)
        self.duration = Histogram(_name(sc.M_READ_DURATION), "d",
                                  vllm + sc.M_READ_DURATION.labels,
                                  buckets=sc.M_READ_DURATION.buckets, registry=e)
        self.reused = Counter(_name(sc.M_REUSED_TOKENS), "d", vllm, registry=e)
        self.retained = Gauge(_name(sc.M_RETAINED_BLOCKS), "d", vllm, registry=e)
        self.host_lookups, self.host_saves = (
            Counter(_name(m), "d", vllm + m.labels, registry=d)
            for m in (sc.M_HOST_LOOKUPS, sc.M_HOST_SAVES))
        p = self.proxy_registry
        self.turns = Counter(_name(sc.M_PROXY_TURNS), "d", sc.M_PROXY_TURNS.labels, registry=p)
        self.lookups = Counter(_name(sc.M_PROXY_LOOKUPS), "d", sc.M_PROXY_LOOKUPS.labels,
                               registry=p)
        self.latency = _histogram(sc.M_PROXY_LATENCY, p)
        self.phase = _histogram(sc.M_PROXY_PHASE, p)
        self._stop = threading.Event()
        self.servers = []

    def tick(self):
        m = ("m", "0")
        self.decisions.labels(*m, sc.PullDecision.PULL.value).inc()
        self.decisions.labels(*m, sc.PullDecision.BELOW_THRESHOLD.value).inc(0)
        self.reads.labels(*m, DIRECTION_D_TO_P, sc.ReadOutcome.DONE.value).inc()
        self.reads.labels(*m, DIRECTION_D_TO_P, sc.ReadOutcome.DECLINED_EXPIRED.value).inc(0)
        self.duration.labels(*m, DIRECTION_D_TO_P).observe(P_READ)
        self.reused.labels(*m).inc(1700)
        self.retained.labels(*m).set(42)
        # D's host tier: three lookups found their copy for one found it evicted; every
        # copy holds the prompt only.
        self.host_lookups.labels(*m, sc.HostLookupOutcome.HIT.value).inc(3)
        self.host_lookups.labels(*m, sc.HostLookupOutcome.EVICTED.value).inc()
        self.host_saves.labels(*m, "false").inc()
        self.host_saves.labels(*m, "true").inc(0)
        for turn in ("1", "2"):
            self.turns.labels(turn, "512-2k", sc.LookupOutcome.HIT.value).inc()
        self.turns.labels("2", "512-2k", sc.LookupOutcome.MISS.value).inc()
        self.lookups.labels(sc.LookupOutcome.HIT.value).inc()
        self._tick_phases(m)

    def _tick_phases(self, m):
        """One request through P and D, one turn through the proxy."""
        self.p_queue.labels(*m).observe(P_QUEUE)
        self.p_ttft.labels(*m).observe(P_TTFT)
        self.p_prefill.labels(*m).observe(P_PREFILL)
        self.setup.labels(*m, DIRECTION_D_TO_P).observe(P_SETUP)
        self.d_queue.labels(*m).observe(0.02)
        self.handoff.labels(*m, DIRECTION_P_TO_D).observe(0.01)
        self.latency.labels("2", "512-2k").observe(1.5)
        for phase in sc.PROXY_PHASE_VALUES:
            self.phase.labels(phase).observe(0.001)

    def _loop(self):
        while not self._stop.wait(0.2):
            self.tick()

    def start(self) -> dict[str, list[str]]:
        self.tick()
        targets = {}
        for job, registry in (("vllm-prefill", self.engine_registry),
                              ("vllm-decode", self.decode_registry),
                              ("kvobs-proxy", self.proxy_registry)):
            port = live.free_port()
            server, _ = start_http_server(port, addr="127.0.0.1", registry=registry)
            self.servers.append(server)
            targets[job] = [f"127.0.0.1:{port}"]
        threading.Thread(target=self._loop, daemon=True).start()
        return targets

    def stop(self):
        self._stop.set()
        for server in self.servers:
            server.shutdown()
            server.server_close()


@pytest.fixture(scope="module")
def prometheus(prometheus_binary):
    fake = FakeEngineAndProxy()
    targets = fake.start()
    handle = live.start_prometheus(targets, binary=prometheus_binary, scrape_interval="1s")
    try:
        # Every job's rates need two scrapes: wait for each of the three (a panel over
        # the decode job's series was empty when only the others were ready).
        samples = live.wait_for_data(
            handle.url, f"rate({sc.M_PULL_DECISIONS.name}[10s]) > 0 "
                        f"and on() (rate({sc.M_PROXY_TURNS.name}[10s]) > 0) "
                        f"and on() (rate({sc.M_VLLM_QUEUE_TIME.name}_count"
                        f"{{job=\"vllm-decode\"}}[10s]) > 0)", timeout=60)
        assert samples, handle.log()[-2000:]
        yield handle
    finally:
        handle.stop()
        fake.stop()


@pytest.fixture(scope="module")
def report(prometheus):
    return live.check_live(prometheus.url, interval="10s")


def _status(report, name):
    (result,) = [r for r in report.results if r.name == name]
    return result


def test_no_query_errors_in_a_real_prometheus(report):
    assert report.errors == [], [(r.name, r.error) for r in report.errors]
    assert len(report.results) > 50


def test_panels_over_exposed_metrics_return_data(report):
    for name in ("P pull decisions [A]", "D->P read outcomes [A]",
                 "Later turns by proxy lookup outcome [A]",
                 "First turns by prompt-length bucket [A]",
                 "Missing-metadata share by turn bucket [A]",
                 "Read duration percentiles [B]", "Retained blocks [A]",
                 "Expired and failed share of read attempts [A]",
                 "Reused tokens per second of read time [A]", "Lookups by outcome [A]"):
        assert _status(report, name).has_data, name


def test_panels_over_missing_metrics_are_empty(report):
    for name in ("Retained bytes [A]", "Entries in the store [A]", "Fallbacks by reason [A]",
                 "Reads per second: kvobs vs NIXL [B]",
                 "Turn latency and TTFT (proxy) [C]"):  # no streamed turn
        assert _status(report, name).status == "empty", name


def test_where_ttft_goes_panels_return_data(report):
    headline = "Mean seconds per request, by phase"
    for name in [f"{headline} [{ref}]" for ref in "ABCDEFGH"] + [
            "Turn latency and TTFT (proxy) [A]", "P queue share of P's TTFT [A]",
            "P queue (prefill engines) [C]", "NIXL connection set-up by direction [B]",
            "P->D hand-off (D reading P's KV) [B]", "D queue (decode engines) [A]",
            "Proxy's own time by phase [B]"]:
        assert _status(report, name).has_data, name


def test_prefill_queue_share_value(prometheus):
    """P's wait alone (vLLM's queue time less the D->P set-up and read) over P's TTFT."""
    s = q.Scope(DEFAULT.selectors.engine, DEFAULT.selectors.proxy, "30s",
                prefill=DEFAULT.selectors.prefill, decode=DEFAULT.selectors.decode)
    (sample,) = live.instant_query(prometheus.url, q.prefill_queue_share(s))
    expected = (P_QUEUE - P_READ - P_SETUP) / P_TTFT
    assert float(sample["value"][1]) == pytest.approx(expected, rel=0.02)


def test_host_copy_panels_return_data(report):
    for name in ("Host-tier lookups by outcome [A]", "Host copies evicted before reuse [A]",
                 "Host copies saved, with and without the response [A]",
                 "Prompt-only share of host copies [A]"):
        assert _status(report, name).has_data, name
    assert _status(report, "Host tier bytes saved and loaded [A]").status == "empty"


def test_host_copy_ratio_values(prometheus):
    s = q.Scope(DEFAULT.selectors.engine, DEFAULT.selectors.proxy, "30s")
    (evicted,) = live.instant_query(prometheus.url, q.host_evicted_lookup_ratio(s))
    assert float(evicted["value"][1]) == pytest.approx(0.25, rel=0.02)
    (prompt_only,) = live.instant_query(prometheus.url, q.host_prompt_only_ratio(s))
    assert float(prompt_only["value"][1]) == 1.0


def test_recording_rule_expressions(report):
    assert _status(report, "namespace_job:vllm_kvobs_pull_decisions:rate5m").has_data
    assert _status(report, "namespace_job:kvobs_proxy_turns_missing_metadata:ratio_rate5m").has_data
    assert _status(report, "namespace_job:vllm_kvobs_remote_reads_expired:ratio_rate5m").has_data
    assert _status(report, "namespace_job:vllm_kvobs_retained_bytes:sum").status == "empty"


def test_missing_metadata_ratio_value(prometheus):
    # The fake proxy counts per tick: turn 1 hit, turn 2 hit, turn 2 miss -> later-turn
    # missing share 1/2; the first turn is not in the denominator.
    (sample,) = live.instant_query(
        prometheus.url, _expr("namespace_job:kvobs_proxy_turns_missing_metadata:ratio_rate5m"))
    assert float(sample["value"][1]) == pytest.approx(0.5)


def _expr(record: str) -> str:
    (rec,) = [r for r in rules.recordings(DEFAULT) if r.record == record]
    return rec.expr


def test_a_bad_query_is_reported_as_error(prometheus):
    result = live._evaluate(prometheus.url, "panel", "bad", "sum(rate(x[5m])")
    assert result.status == "error" and "parse" in result.error


# What Prometheus 2.x sends when scraping (no `escaping` parameter).
PROMETHEUS_2_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
                       "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")


def test_prometheus_client_escapes_colons_for_prometheus_2_scrapes():
    """Why start_prometheus restores colons: client_python#1177 (underscore escaping)."""
    from prometheus_client.exposition import choose_encoder

    fake = FakeEngineAndProxy()
    fake.tick()
    encoder, content_type = choose_encoder(PROMETHEUS_2_ACCEPT)
    text = encoder(fake.engine_registry).decode()
    assert "escaping=underscores" in content_type
    underscored = sc.M_PULL_DECISIONS.name.replace(":", "_")
    assert any(line.startswith(underscored + "{") for line in text.splitlines())


def test_without_colon_restoring_relabel_engine_names_are_lost(prometheus_binary):
    fake = FakeEngineAndProxy()
    targets = fake.start()
    handle = live.start_prometheus(targets, binary=prometheus_binary, restore_colons=False)
    try:
        underscored = sc.M_PULL_DECISIONS.name.replace(":", "_")
        assert live.wait_for_data(handle.url, underscored, timeout=30)
        assert live.instant_query(handle.url, sc.M_PULL_DECISIONS.name) == []
    finally:
        handle.stop()
        fake.stop()


def test_stop_ends_the_process_by_pid(prometheus_binary, tmp_path):
    handle = live.start_prometheus({"nothing": ["127.0.0.1:1"]}, binary=prometheus_binary,
                                   directory=tmp_path / "prom")
    pid = handle.pid
    os.kill(pid, 0)  # alive
    handle.stop()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert (tmp_path / "prom" / "prometheus.yml").is_file()  # caller's directory is kept
