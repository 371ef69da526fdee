"""OTel by the book (#27): OTLP's protocol follows the endpoint where none is set, a gRPC
exporter towards an OTLP/HTTP endpoint is a clear start-up error, and the instrumentation
scope carries kvobs' version."""

from __future__ import annotations

import logging

import pytest

import kvobs
from kvobs import semconv as sc
from kvobs.emit.setup import configure_tracing, exporter_names

_ENV = ("OTEL_SDK_DISABLED", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "KVOBS_STORE",
        "OTEL_TRACES_EXPORTER")


@pytest.fixture
def env(monkeypatch):
    for name in _ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize("variable, endpoint", [
    ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318"),
    ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://collector:4318/v1/traces"),
    ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "https://otlp.example.com/v1/traces"),
    ("OTEL_EXPORTER_OTLP_ENDPOINT", "collector:4318"),
])
def test_otlp_without_a_protocol_follows_an_http_endpoint(env, variable, endpoint):
    env.setenv("OTEL_TRACES_EXPORTER", "otlp")
    env.setenv(variable, endpoint)
    assert exporter_names() == ["otlp_proto_http"]
    env.setenv("OTEL_TRACES_EXPORTER", "console,otlp")
    assert exporter_names() == ["console", "otlp_proto_http"]


def test_otlp_keeps_the_sdks_rule_elsewhere(env):
    env.setenv("OTEL_TRACES_EXPORTER", "otlp")
    assert exporter_names() == ["otlp_proto_grpc"]  # no endpoint: the SDK's default, gRPC
    env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317")
    assert exporter_names() == ["otlp_proto_grpc"]
    env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    env.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    assert exporter_names() == ["otlp_proto_http"]
    env.setenv("OTEL_TRACES_EXPORTER", "none")
    assert exporter_names() == []
    env.delenv("OTEL_TRACES_EXPORTER")  # unset: OTLP over HTTP where an endpoint is set
    assert exporter_names() == ["otlp_proto_http"]


@pytest.mark.parametrize("exporter, protocol", [
    ("otlp", "grpc"), ("otlp_proto_grpc", None), (None, "grpc")])
def test_grpc_to_an_http_endpoint_is_a_start_up_error(env, tmp_path, caplog, exporter,
                                                       protocol):
    if exporter:
        env.setenv("OTEL_TRACES_EXPORTER", exporter)
    if protocol:
        env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
    env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf"):
        exporter_names()
    # configure_tracing says so at start-up and serves on, with the kvobs store only
    with caplog.at_level(logging.ERROR, logger="kvobs.emit.setup"):
        tracer = configure_tracing(sc.Service.PROXY, str(tmp_path))
    assert "gRPC to an OTLP/HTTP endpoint" in caplog.text
    assert [type(p._exporter).__name__ for p in tracer.span_processor._span_processors] == [
        "OtlpJsonFileExporter"]


def test_the_instrumentation_scope_has_kvobs_version(env, tmp_path):
    tracer = configure_tracing(sc.Service.PROXY, str(tmp_path))
    with tracer.start_as_current_span("s") as span:
        pass
    assert span.instrumentation_scope.name == "kvobs"
    assert span.instrumentation_scope.version == kvobs.__version__
