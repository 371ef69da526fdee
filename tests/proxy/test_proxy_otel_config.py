"""OpenTelemetry configured the OpenTelemetry way (#14): OTEL_SERVICE_NAME names the
service (the role is the resource attribute kvobs.role), OTEL_TRACES_EXPORTER and
OTEL_BSP_* are honoured through the SDK's own machinery, OTEL_PROPAGATORS decides the
proxy's trace headers; GenAI attributes on the turn span. Proxy and stand-ins, a real
span store."""

from __future__ import annotations

import logging

import pytest
from harness import Harness
from opentelemetry import propagate, trace
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.sdk.trace.export import ConsoleSpanExporter
from test_proxy_flow import converse, run
from test_proxy_http_spans import converse_into_store

from kvobs import semconv as sc
from kvobs.emit.otlp_json import OtlpJsonFileExporter
from kvobs.emit.setup import DroppingBatchProcessor, configure_tracing, span_losses
from kvobs.sources import open_source

_ENV = ("OTEL_SDK_DISABLED", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "KVOBS_STORE",
        "OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES", "OTEL_TRACES_EXPORTER",
        "OTEL_BSP_MAX_QUEUE_SIZE", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "OTEL_BSP_SCHEDULE_DELAY",
        "KVOBS_SPAN_QUEUE_SIZE")


@pytest.fixture
def clean_env(monkeypatch):
    for name in _ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _processors(tracer) -> list:
    return list(tracer.span_processor._span_processors)


def _stored_turns(store):
    converse_into_store(store, "named", 2)
    return open_source(str(store)).spans()


def test_otel_service_name_names_the_proxy_and_the_role_is_an_attribute(clean_env, tmp_path):
    clean_env.setenv("OTEL_SERVICE_NAME", "foo")
    clean_env.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test")
    spans = _stored_turns(tmp_path / "store")
    assert set(spans["service"]) == {"foo"}
    assert set(spans[sc.ROLE.key]) == {"proxy"}
    turns = spans[spans["name"] == sc.SPAN_PROXY_TURN.name]
    assert len(turns) == 2
    # GenAI conventions: what the client asked for and got, P's and D's token counts
    assert set(turns[sc.REQUEST_MODEL.key]) == {"m"}
    assert turns[sc.RESPONSE_ID.key].notna().all()
    assert turns[sc.PROMPT_TOKENS.key].notna().all()


def test_without_a_service_name_each_role_keeps_its_default(clean_env, tmp_path):
    spans = _stored_turns(tmp_path / "store")
    assert set(spans["service"]) == {sc.Service.PROXY.value}
    tracer = configure_tracing(sc.Service.DECODE, str(tmp_path / "other"))
    resource = tracer.resource.attributes
    assert resource["service.name"] == "kvobs-decode" and resource[sc.ROLE.key] == "decode"


def test_otel_traces_exporter_is_the_sdks(clean_env, tmp_path, caplog):
    clean_env.setenv("OTEL_TRACES_EXPORTER", "console")
    exporters = [p._exporter for p in _processors(configure_tracing(sc.Service.PROXY))]
    assert [type(e) for e in exporters] == [ConsoleSpanExporter]
    clean_env.setenv("OTEL_TRACES_EXPORTER", "none")  # nothing but the kvobs store
    assert isinstance(configure_tracing(sc.Service.PROXY), trace.NoOpTracer)
    exporters = [p._exporter for p in
                 _processors(configure_tracing(sc.Service.PROXY, str(tmp_path)))]
    assert [type(e) for e in exporters] == [OtlpJsonFileExporter]
    # an exporter that is not installed: logged, and serving goes on with the store
    clean_env.setenv("OTEL_TRACES_EXPORTER", "no-such-exporter")
    with caplog.at_level(logging.ERROR, logger="kvobs.emit.setup"):
        tracer = configure_tracing(sc.Service.PROXY, str(tmp_path))
    assert [type(p._exporter) for p in _processors(tracer)] == [OtlpJsonFileExporter]
    assert "no-such-exporter" in caplog.text
    # unset: OTLP only with an endpoint, http/protobuf (port 4318) unless told grpc
    clean_env.delenv("OTEL_TRACES_EXPORTER")
    clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    (exporter,) = [p._exporter for p in _processors(configure_tracing(sc.Service.PROXY))]
    assert type(exporter).__module__.endswith("proto.http.trace_exporter")
    clean_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    (exporter,) = [p._exporter for p in _processors(configure_tracing(sc.Service.PROXY))]
    assert type(exporter).__module__.endswith("proto.grpc.trace_exporter")


def test_otel_bsp_settings_reach_the_processor(clean_env, tmp_path):
    clean_env.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "3")
    clean_env.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "2")
    clean_env.setenv("OTEL_BSP_SCHEDULE_DELAY", "60000")  # the export thread waits: a queue
    tracer = configure_tracing(sc.Service.PROXY, str(tmp_path))
    (processor,) = _processors(tracer)
    assert isinstance(processor, DroppingBatchProcessor)
    assert (processor._max_queue, processor._batch, processor._interval_s) == (3, 2, 60.0)
    for i in range(5):
        tracer.start_span(f"s{i}").end()
    assert span_losses(tracer)["queue-full"] == 2  # the bound is OTEL_BSP_MAX_QUEUE_SIZE


def test_otel_propagators_decide_the_legs_headers(clean_env):
    """The global propagator (OTEL_PROPAGATORS, read by the API at import) writes the
    legs' trace headers and reads the client's: with baggage only, no traceparent goes
    out, and the kvobs correlation still travels in kv_transfer_params."""
    previous = propagate.get_global_textmap()
    propagate.set_global_textmap(CompositePropagator([W3CBaggagePropagator()]))
    try:
        async def scenario():
            async with Harness() as h:
                await converse(h, "no-tc", 2)
                assert h.decode.headers and all(
                    "traceparent" not in headers for headers in h.decode.headers)
                assert all(sc.KTP_TRACEPARENT in body["kv_transfer_params"]
                           for body in h.decode.requests)
        run(scenario())
    finally:
        propagate.set_global_textmap(previous)
