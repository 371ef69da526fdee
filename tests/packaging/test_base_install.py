"""A lean base install: OTLP over HTTP only, the gRPC exporter (and grpcio) an extra.

`pip install .` installs the base requirements and theirs. The check resolves that
closure from pyproject.toml through the installed distributions' own metadata
(requirements with their environment markers, no extras), the versions pip would take
here, so a base requirement that pulls grpcio, directly or through another package (the
`opentelemetry-exporter-otlp` meta-package did), fails it. The gRPC exporter is imported
only when the environment asks for it, and then says which extra to install.
"""

from __future__ import annotations

import logging
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
GRPC_EXPORTER = "opentelemetry-exporter-otlp-proto-grpc"


def closure(requirements: list[str]) -> set[str]:
    """Canonical names of ``requirements`` and of everything they require, transitively,
    as the installed distributions declare it (markers evaluated, extras not taken)."""
    seen: set[str] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        requirement = todo.pop()
        if requirement.marker and not requirement.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(requirement.name)
        if name in seen:
            continue
        seen.add(name)
        try:
            declared = metadata.requires(requirement.name) or []
        except metadata.PackageNotFoundError:
            pytest.fail(f"{requirement.name} (required by kvobs' base) is not installed")
        todo += [Requirement(r) for r in declared]
    return seen


def test_base_requirements_carry_no_grpc():
    base = closure(PROJECT["dependencies"])
    assert "grpcio" not in base, sorted(base)
    assert canonicalize_name(GRPC_EXPORTER) not in base
    assert "opentelemetry-exporter-otlp" not in base  # the meta-package pulls gRPC
    assert "opentelemetry-exporter-otlp-proto-http" in base


def test_the_closure_finds_grpc_where_it_is():
    """The check can fail: the grpc extra (installed for the tests) pulls grpcio, and so
    does the meta-package the base once required, where it is installed."""
    assert "grpcio" in closure(PROJECT["optional-dependencies"]["grpc"])
    try:
        metadata.distribution("opentelemetry-exporter-otlp")
    except metadata.PackageNotFoundError:
        return
    assert "grpcio" in closure(["opentelemetry-exporter-otlp>=1.25"])


def test_the_grpc_extra_is_the_grpc_exporter():
    (requirement,) = PROJECT["optional-dependencies"]["grpc"]
    assert Requirement(requirement).name == GRPC_EXPORTER


def test_every_opentelemetry_module_kvobs_imports_is_a_base_requirement():
    """kvobs' own OTLP code (store exporter, collector receiver, span sources) imports
    opentelemetry-proto and the exporters' common encoder: declared, not borrowed; the
    gRPC exporter is imported nowhere at module level."""
    declared = {canonicalize_name(Requirement(r).name) for r in PROJECT["dependencies"]}
    assert "opentelemetry-exporter-otlp-proto-http" in declared
    lines = [line for path in (ROOT / "kvobs").rglob("*.py")
             for line in path.read_text().splitlines()]
    for module, distribution in (("opentelemetry.proto", "opentelemetry-proto"),
                                 ("opentelemetry.exporter.otlp.proto.common",
                                  "opentelemetry-exporter-otlp-proto-common")):
        assert any(f"from {module}." in line for line in lines), module
        assert distribution in declared, distribution
    grpc = [line for line in lines if "opentelemetry.exporter.otlp.proto.grpc" in line
            and line.lstrip().startswith(("import ", "from "))]
    assert grpc and all(line.startswith(" ") for line in grpc), grpc


@pytest.fixture
def without_grpc(monkeypatch):
    """This interpreter as a base install sees it: the gRPC exporter cannot be imported."""
    for name in [m for m in sys.modules if m.startswith("opentelemetry.exporter.otlp.proto.grpc")]:
        monkeypatch.delitem(sys.modules, name)
    for name in ("opentelemetry.exporter.otlp.proto.grpc",
                 "opentelemetry.exporter.otlp.proto.grpc.trace_exporter"):
        monkeypatch.setitem(sys.modules, name, None)
    for variable in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_PROTOCOL",
                     "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    return monkeypatch


def test_http_export_needs_no_grpc(without_grpc):
    from kvobs.emit import setup

    (exporter,) = setup._exporters()
    assert type(exporter).__module__.endswith("proto.http.trace_exporter")
    exporter.shutdown()


def test_asking_for_grpc_without_the_extra_names_it(without_grpc, caplog):
    from kvobs.emit import setup

    without_grpc.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    with caplog.at_level(logging.ERROR, logger="kvobs.emit.setup"):
        assert setup._exporters() == []  # serving goes on, spans to the store only
    assert setup.GRPC_EXTRA in caplog.text
    assert "pip install 'kvobs[grpc]'" in caplog.text
