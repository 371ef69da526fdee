"""The proxy survives voluntary disruptions, and ClickHouse credentials live in a Secret.

- The grace period covers the proxy's drain: on SIGTERM aiohttp's ``web.run_app`` waits
  ``shutdown_timeout`` for open streams (the proxy's RUNNER_OPTIONS, else aiohttp's
  default), then cancels them and waits as long again; a stream in between is cut.
  Kubernetes kills the pod after ``terminationGracePeriodSeconds`` counted from the
  preStop hook, so the period must hold the hook and both waits.
- A PodDisruptionBudget selects the proxy's pods and lets one go at a time.
- The ClickHouse component's Secret feeds the Collector's exporter and the variables
  kvobs' ClickHouse reader reads (``kvobs.sources.clickhouse.ENV_USER``/``ENV_PASSWORD``).
"""

from __future__ import annotations

import importlib.util
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location(
    "kvobs_deploy_helpers_disruption", ROOT / "tests" / "monitoring" / "test_deploy.py")
DEPLOY = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(DEPLOY)


@pytest.fixture(scope="module")
def kubectl() -> str:
    return DEPLOY.CONF.require_binary("kubectl", DEPLOY.KUBECTL_INSTALL)


@pytest.fixture(scope="module")
def example(kubectl):
    return DEPLOY.render(kubectl, DEPLOY.KUBE / "overlays" / "example")


def longest_drain_s() -> float:
    """How long the proxy can go on serving open streams after SIGTERM."""
    from aiohttp import web

    try:
        from kvobs.proxy import RUNNER_OPTIONS
    except ImportError:  # before the proxy's move into kvobs/
        from connector_instrumented.proxy import RUNNER_OPTIONS
    timeout = RUNNER_OPTIONS.get(
        "shutdown_timeout", inspect.signature(web.run_app).parameters["shutdown_timeout"].default)
    return 2 * timeout  # the wait for the handler, then the wait for its cancellation


def _pre_stop_s(container: dict) -> float:
    command = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command")
    if not command:
        return 0.0
    assert command[0] == "sleep", command
    return float(command[1])


@pytest.mark.parametrize("variant", ["base", "example"])
def test_grace_period_holds_the_longest_drain(kubectl, variant):
    directory = DEPLOY.KUBE / ("base" if variant == "base" else "overlays/example")
    deployment = DEPLOY.by_kind(DEPLOY.render(kubectl, directory), "Deployment")["kvobs-proxy"]
    pod = deployment["spec"]["template"]["spec"]
    proxy = DEPLOY._container(deployment, "proxy")
    needed = _pre_stop_s(proxy) + longest_drain_s()
    assert longest_drain_s() >= 60  # aiohttp 3.x: 60 s, then 60 s more
    assert pod["terminationGracePeriodSeconds"] >= needed + 5, (pod, needed)
    assert pod["terminationGracePeriodSeconds"] <= needed + 60  # not an unbounded wait
    assert _pre_stop_s(proxy) > 0  # endpoints drop the pod before it stops accepting


def test_a_disruption_budget_covers_the_proxy(example):
    (budget,) = DEPLOY.by_kind(example, "PodDisruptionBudget").values()
    deployment = DEPLOY.by_kind(example, "Deployment")["kvobs-proxy"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert budget["metadata"]["namespace"] == deployment["metadata"]["namespace"]
    replicas = deployment["spec"]["replicas"]
    # one proxy at a time, and with the example's two, one always serves
    assert budget["spec"].get("maxUnavailable") == 1 or \
        budget["spec"].get("minAvailable", 0) <= replicas - 1
    assert replicas >= 2
    others = [d for name, d in DEPLOY.by_kind(example, "Deployment").items()
              if name != "kvobs-proxy"]
    for other in others:  # it selects no other pods
        assert not budget["spec"]["selector"]["matchLabels"].items() <= \
            other["spec"]["template"]["metadata"]["labels"].items()


def test_clickhouse_credentials_come_from_a_secret(kubectl, tmp_path):
    from kvobs.sources.clickhouse import ENV_PASSWORD, ENV_USER

    docs = DEPLOY.render(kubectl, DEPLOY._with_component(tmp_path, "clickhouse"))
    (secret,) = DEPLOY.by_kind(docs, "Secret").values()
    assert set(secret["data"]) >= {"username", "password"}
    collector = DEPLOY.by_kind(docs, "Deployment")["kvobs-collector"]

    def from_secret(container: str) -> dict[str, str]:
        env = DEPLOY._container(collector, container).get("env", ())
        refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in env
                if "secretKeyRef" in e.get("valueFrom", {})}
        for ref in refs.values():
            assert ref["name"] == secret["metadata"]["name"]  # the hashed name, resolved
        return {name: ref["key"] for name, ref in refs.items()}

    kvobs = from_secret("kvobs")
    assert kvobs == {ENV_USER: "username", ENV_PASSWORD: "password"}
    otelcol = from_secret("otelcol")
    exporter = DEPLOY._collector_config(docs)["exporters"]["clickhouse"]
    for field, key in (("username", "username"), ("password", "password")):
        (variable,) = re.findall(r"\$\{env:(\w+)\}", exporter[field])
        assert otelcol[variable] == key
    # no credential written into the Collector's config or a plain env value
    assert not [e for e in DEPLOY._container(collector, "otelcol")["env"]
                if "PASSWORD" in e["name"] and "value" in e]
