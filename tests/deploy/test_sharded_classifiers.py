"""components/sharded-classifiers: several live classifiers behind the Collector's
loadbalancing exporter (docs/live.md, "Several classifiers").

Rendered with ``kubectl kustomize`` on the base (and on the example overlay with the
component enabled) and validated as the other manifests are. The wiring is checked where a
typo would silently break the sharding: the gateway routes on ``kvobs.semconv.SHARD`` (the
one name the connector and the proxy write) and sends the spans without it by trace id, its
resolver lists exactly the StatefulSet's replicas at the port their Collector listens on,
each replica's --peer list names every replica at the classifier's port, each replica's
store is its own PVC, and the monitor scrapes every replica. Each check is also run on a
broken copy of the render (a wrong attribute, a port or replica count that no longer agree,
a shared volume, a monitor that selects nothing) and must fail there.
"""

from __future__ import annotations

import copy
import importlib.util
import re
import shutil
from pathlib import Path
from typing import Callable

import pytest
import yaml

from kvobs.monitoring.config import DEFAULT
from kvobs.semconv import SHARD

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location(
    "kvobs_deploy_helpers_sharded", ROOT / "tests" / "monitoring" / "test_deploy.py")
DEPLOY = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(DEPLOY)

COMPONENT = "sharded-classifiers"
kubectl = DEPLOY.kubectl
validators = DEPLOY.validators


@pytest.fixture(scope="module")
def sharded(kubectl, tmp_path_factory):
    return DEPLOY.render(kubectl, DEPLOY._with_component(tmp_path_factory.mktemp("s"), COMPONENT))


@pytest.fixture(scope="module")
def example_sharded(kubectl, tmp_path_factory):
    """The example overlay with its commented-out line for the component enabled."""
    copy_ = tmp_path_factory.mktemp("example") / "kubernetes"
    shutil.copytree(DEPLOY.KUBE, copy_)
    overlay = copy_ / "overlays" / "example" / "kustomization.yaml"
    text, n = re.subn(rf"^  # (- \.\./\.\./components/{COMPONENT})$", r"  \1",
                      overlay.read_text(), flags=re.MULTILINE)
    assert n == 1
    overlay.write_text(text)
    return DEPLOY.render(kubectl, overlay.parent)


def _only(items: list):
    """The one item of ``items`` (a check's failure, not an unpacking error, otherwise)."""
    assert len(items) == 1, items
    return items[0]


def _config(docs: list[dict], prefix: str) -> dict:
    config_map = _only([d for d in docs if d["kind"] == "ConfigMap"
                        and re.fullmatch(rf"{prefix}(-\w+)?", d["metadata"]["name"])])
    config = yaml.safe_load(config_map["data"]["config.yaml"])
    DEPLOY._check_pipelines(config)
    return config


def _statefulset(docs: list[dict]) -> dict:
    return _only(list(DEPLOY.by_kind(docs, "StatefulSet").values()))


def _pod_ports(workload: dict) -> dict[str, tuple[str, int]]:
    """Each named container port of the workload's pods: (container, port)."""
    return {p["name"]: (c["name"], p["containerPort"])
            for c in workload["spec"]["template"]["spec"]["containers"]
            for p in c.get("ports", ())}


def _kvobs_command(statefulset: dict) -> list[tuple[str, str]]:
    """(option, value) pairs of the replicas' `kvobs collect` (every option takes one)."""
    command = DEPLOY._container(statefulset, "kvobs")["command"]
    assert command[:2] == ["kvobs", "collect"]
    return list(zip(command[2::2], command[3::2]))


def _kvobs_options(statefulset: dict) -> dict[str, str]:
    return dict(_kvobs_command(statefulset))


def _dropped_unless(processor: dict) -> tuple[str, str]:
    """(attribute, test) of a filter processor dropping spans on one `nil` test."""
    condition = _only(processor["traces"]["span"])
    found = re.fullmatch(r'attributes\["([^"]+)"\] (==|!=) nil', condition)
    assert found, condition
    return found.group(1), found.group(2)


# --------------------------------------------------------------------------- the checks


def check_routes_on_the_shard(docs: list[dict]) -> None:
    """Two pipelines from the one OTLP receiver: the spans that carry SHARD, routed on it;
    the others (which the exporter would send all to one backend) by trace id."""
    gateway = _config(docs, "kvobs-collector")
    routes = {}
    for pipeline in gateway["service"]["pipelines"].values():
        assert pipeline["receivers"] == ["otlp"]
        exporter_name = _only(pipeline["exporters"])
        assert exporter_name.split("/")[0] == "loadbalancing"
        exporter = gateway["exporters"][exporter_name]
        assert set(exporter["protocol"]) == {"otlp"}  # OTLP/gRPC, the only one it has
        filters = [gateway["processors"][p] for p in pipeline["processors"]
                   if p.split("/")[0] == "filter"]
        dropped = _only([_dropped_unless(f) for f in filters])
        routes[dropped] = exporter
    assert set(routes) == {(SHARD.key, "=="), (SHARD.key, "!=")}  # every span, once
    by_shard, by_trace = routes[SHARD.key, "=="], routes[SHARD.key, "!="]
    assert by_shard["routing_key"] == "attributes"
    assert by_shard["routing_attributes"] == [SHARD.key]
    assert by_trace["routing_key"] == "traceID" and "routing_attributes" not in by_trace


def check_resolver_lists_every_replica(docs: list[dict]) -> None:
    """The static ring is the StatefulSet's replicas by their names under its headless
    Service, at the Service port that reaches their Collector's gRPC receiver, which hands
    the spans to the classifier's own port."""
    statefulset = _statefulset(docs)
    name, spec = statefulset["metadata"]["name"], statefulset["spec"]
    service = DEPLOY.by_kind(docs, "Service")[spec["serviceName"]]
    assert service["spec"]["clusterIP"] == "None"  # per-pod DNS names
    pod_ports = _pod_ports(statefulset)
    gateway = _config(docs, "kvobs-collector")
    for exporter in gateway["exporters"].values():
        hostnames = exporter["resolver"]["static"]["hostnames"]
        assert len(hostnames) == spec["replicas"]
        for i, hostname in enumerate(hostnames):
            host, port = hostname.rsplit(":", 1)
            assert host == f"{name}-{i}.{service['metadata']['name']}"
            target = _only([p["targetPort"] for p in service["spec"]["ports"]
                            if p["port"] == int(port)])
            container, container_port = pod_ports[target]
            assert container == "otelcol"
            receiver = _config(docs, "kvobs-classifier")["receivers"]["otlp"]["protocols"]
            assert set(receiver) == {"grpc"}
            assert receiver["grpc"]["endpoint"].endswith(f":{container_port}")
    sidecar = _config(docs, "kvobs-classifier")
    hop = _only(sidecar["service"]["pipelines"]["traces"]["exporters"])
    assert hop.split("/")[0] == "otlphttp"  # what `kvobs collect` receives
    assert sidecar["exporters"][hop]["endpoint"] == \
        f"http://localhost:{_kvobs_options(statefulset)['--port']}"
    assert pod_ports["classifier"] == ("kvobs", int(_kvobs_options(statefulset)["--port"]))


def check_each_replica_owns_its_store(docs: list[dict]) -> None:
    """The store is a volumeClaimTemplate (a PVC per replica), mounted read-write where
    the classifier keeps it; no pod volume by that name shadows it, and the single
    classifier's PVC and container are gone from the gateway."""
    statefulset = _statefulset(docs)
    template = _only([t for t in statefulset["spec"]["volumeClaimTemplates"]
                      if t["metadata"]["name"] == "store"])
    assert template["spec"]["accessModes"] == ["ReadWriteOnce"]
    pod = statefulset["spec"]["template"]["spec"]
    assert "store" not in {v["name"] for v in pod.get("volumes", ())}
    mount = _only([m for m in DEPLOY._container(statefulset, "kvobs")["volumeMounts"]
                   if m["name"] == "store"])
    assert mount["mountPath"] == _kvobs_options(statefulset)["--store-dir"]
    assert not mount.get("readOnly")
    assert not DEPLOY.by_kind(docs, "PersistentVolumeClaim")
    gateway = DEPLOY.by_kind(docs, "Deployment")["kvobs-collector"]
    assert [c["name"] for c in gateway["spec"]["template"]["spec"]["containers"]] == ["otelcol"]
    assert not [v for v in gateway["spec"]["template"]["spec"].get("volumes", ())
                if "persistentVolumeClaim" in v]


def check_monitor_scrapes_every_replica(docs: list[dict]) -> None:
    """The classifiers' monitor selects the headless Service of the StatefulSet's pods and
    scrapes the classifier's and its Collector's /metrics; the gateway's monitor keeps to
    the ports its pod still has."""
    statefulset = _statefulset(docs)
    service = DEPLOY.by_kind(docs, "Service")[statefulset["spec"]["serviceName"]]
    pod_labels = statefulset["spec"]["template"]["metadata"]["labels"]
    assert statefulset["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert service["spec"]["selector"].items() <= pod_labels.items()
    monitor = _only([m for m in DEPLOY.by_kind(docs, "ServiceMonitor").values()
                     if m["spec"]["selector"]["matchLabels"].items()
                     <= service["metadata"]["labels"].items()])
    targets = {p["name"]: p["targetPort"] for p in service["spec"]["ports"]}
    scraped = {e["port"]: e["path"] for e in monitor["spec"]["endpoints"]}
    assert scraped == {"classifier": "/metrics", "otelcol-metrics": "/metrics"}
    pod_ports = _pod_ports(statefulset)
    assert pod_ports[targets["classifier"]][0] == "kvobs"
    assert pod_ports[targets["otelcol-metrics"]] == (
        "otelcol",
        _config(docs, "kvobs-classifier")["service"]["telemetry"]["metrics"]["readers"][0]
        ["pull"]["exporter"]["prometheus"]["port"])
    gateway = DEPLOY.by_kind(docs, "Deployment")["kvobs-collector"]
    gateway_service = DEPLOY.by_kind(docs, "Service")["kvobs-collector"]
    gateway_ports = {p["name"]: p["targetPort"] for p in gateway_service["spec"]["ports"]}
    assert set(gateway_ports.values()) <= set(_pod_ports(gateway))
    gateway_monitor = DEPLOY.by_kind(docs, "ServiceMonitor")["kvobs-collector"]
    assert {e["port"] for e in gateway_monitor["spec"]["endpoints"]} <= set(gateway_ports)
    # The classifiers' job is their Service's name, which the classifier alerts pick; the
    # gateway's (a Collector alone) they leave alone.
    (targets,) = re.findall(r'job=~"([^"]*)"', DEFAULT.selectors.classifier_targets)
    assert not any("relabelings" in e for e in monitor["spec"]["endpoints"])
    assert re.fullmatch(targets, service["metadata"]["name"])
    assert not any(rule.get("targetLabel") == "job" for e in gateway_monitor["spec"]["endpoints"]
                   for rule in e.get("relabelings", ()))
    assert not re.fullmatch(targets, "kvobs-collector")


def check_every_replica_knows_its_peers(docs: list[dict]) -> None:
    """Each replica's `--peer` list is every replica by its stable name under the headless
    Service, at the Service port that reaches the classifier's own port, so that any
    replica answers GET /conversations/ID for a conversation another holds."""
    statefulset = _statefulset(docs)
    name, spec = statefulset["metadata"]["name"], statefulset["spec"]
    service = DEPLOY.by_kind(docs, "Service")[spec["serviceName"]]
    assert service["spec"]["clusterIP"] == "None"
    peers = [value for option, value in _kvobs_command(statefulset) if option == "--peer"]
    assert len(peers) == spec["replicas"]
    pod_ports = _pod_ports(statefulset)
    for i, peer in enumerate(peers):
        found = re.fullmatch(r"http://([^:/]+):(\d+)", peer)
        assert found, peer
        assert found.group(1) == f"{name}-{i}.{service['metadata']['name']}"
        target = _only([p["targetPort"] for p in service["spec"]["ports"]
                        if p["port"] == int(found.group(2))])
        assert pod_ports[target] == ("kvobs", int(_kvobs_options(statefulset)["--port"]))


CHECKS = [check_routes_on_the_shard, check_resolver_lists_every_replica,
          check_each_replica_owns_its_store, check_monitor_scrapes_every_replica,
          check_every_replica_knows_its_peers]


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("variant", ["component", "example"])
def test_the_sharded_tier_renders_and_validates(sharded, example_sharded, validators, variant):
    docs = {"component": sharded, "example": example_sharded}[variant]
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for expected in [("StatefulSet", "kvobs-classifier"), ("Service", "kvobs-classifier"),
                     ("ServiceMonitor", "kvobs-classifier"),
                     ("Deployment", "kvobs-collector"), ("Service", "kvobs-collector")]:
        assert expected in kinds, expected
    for doc in docs:
        DEPLOY.validate(doc, validators)


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("variant", ["component", "example"])
def test_the_sharded_tier_is_wired(sharded, example_sharded, check, variant):
    check({"component": sharded, "example": example_sharded}[variant])


def test_the_example_overlay_applies_to_the_replicas(example_sharded):
    """Its namespace, images and release label reach the StatefulSet and its monitor."""
    statefulset = _statefulset(example_sharded)
    proxy = DEPLOY.by_kind(example_sharded, "Deployment")["kvobs-proxy"]
    gateway = DEPLOY.by_kind(example_sharded, "Deployment")["kvobs-collector"]
    assert DEPLOY._container(statefulset, "kvobs")["image"] == \
        DEPLOY._container(proxy, "proxy")["image"]
    assert DEPLOY._container(statefulset, "otelcol")["image"] == \
        DEPLOY._container(gateway, "otelcol")["image"]
    assert statefulset["metadata"]["namespace"] == "serving"
    monitor = DEPLOY.by_kind(example_sharded, "ServiceMonitor")["kvobs-classifier"]
    assert monitor["metadata"]["labels"]["release"] == "monitoring"


def test_the_default_stays_one_classifier(kubectl):
    for directory in (DEPLOY.KUBE / "base", DEPLOY.KUBE / "overlays" / "example"):
        docs = DEPLOY.render(kubectl, directory)
        assert not DEPLOY.by_kind(docs, "StatefulSet")
        assert "kvobs-store" in DEPLOY.by_kind(docs, "PersistentVolumeClaim")
        exporters = _config(docs, "kvobs-collector")["exporters"]
        assert not [e for e in exporters if e.split("/")[0] == "loadbalancing"]


def _edit_config(prefix: str, old: str, new: str) -> Callable[[list[dict]], None]:
    def edit(docs: list[dict]) -> None:
        (config_map,) = [d for d in docs if d["kind"] == "ConfigMap"
                         and d["metadata"]["name"].startswith(prefix + "-")]
        text = config_map["data"]["config.yaml"]
        assert old in text
        config_map["data"]["config.yaml"] = text.replace(old, new)
    return edit


def _edit(kind: str, name: str, change: Callable[[dict], None]) -> Callable[[list[dict]], None]:
    return lambda docs: change(DEPLOY.by_kind(docs, kind)[name])


def _replace_in_command(statefulset: dict, old: str, new: str) -> None:
    container = DEPLOY._container(statefulset, "kvobs")
    assert any(old in word for word in container["command"])
    container["command"] = [word.replace(old, new) for word in container["command"]]


def _share_the_store(statefulset: dict) -> None:
    statefulset["spec"]["template"]["spec"]["volumes"].append(
        {"name": "store", "persistentVolumeClaim": {"claimName": "kvobs-store"}})


BREAKAGES = {
    "another attribute": (check_routes_on_the_shard,
                          _edit_config("kvobs-collector", f"[{SHARD.key}]", "[kvobs.shard_id]")),
    "a filter on another attribute": (
        check_routes_on_the_shard,
        _edit_config("kvobs-collector", f'"{SHARD.key}"] != nil', '"kvobs.shard_id"] != nil')),
    "the unsharded spans routed on the attribute too": (
        check_routes_on_the_shard,
        _edit_config("kvobs-collector", "exporters: [loadbalancing/kvobs-trace]",
                     "exporters: [loadbalancing/kvobs-shard]")),
    "a Service port the resolver does not name": (
        check_resolver_lists_every_replica,
        _edit("Service", "kvobs-classifier",
              lambda s: s["spec"]["ports"][0].update(port=4318))),
    "a receiver on another port": (
        check_resolver_lists_every_replica,
        _edit_config("kvobs-classifier", "0.0.0.0:4317", "0.0.0.0:4327")),
    "a replica the ring lacks": (
        check_resolver_lists_every_replica,
        _edit("StatefulSet", "kvobs-classifier", lambda s: s["spec"].update(replicas=4))),
    "a replica no peer list names": (
        check_every_replica_knows_its_peers,
        _edit("StatefulSet", "kvobs-classifier", lambda s: s["spec"].update(replicas=4))),
    "peers asked on the Collector's port": (
        check_every_replica_knows_its_peers,
        _edit("StatefulSet", "kvobs-classifier", lambda s: _replace_in_command(
            s, ":4319", ":4317"))),
    "one store for all replicas": (
        check_each_replica_owns_its_store,
        _edit("StatefulSet", "kvobs-classifier", _share_the_store)),
    "a monitor that selects nothing": (
        check_monitor_scrapes_every_replica,
        _edit("ServiceMonitor", "kvobs-classifier",
              lambda m: m["spec"]["selector"]["matchLabels"].update(
                  {"app.kubernetes.io/name": "kvobs-classifiers"}))),
}


@pytest.mark.parametrize("breakage", BREAKAGES)
def test_the_checks_fail_on_a_broken_render(sharded, breakage):
    check, edit = BREAKAGES[breakage]
    broken = copy.deepcopy(sharded)
    edit(broken)
    with pytest.raises(AssertionError):
        check(broken)


def _classifier_containers(docs: list[dict]):
    """(workload, container) of every ``kvobs collect`` container of a render."""
    for doc in docs:
        if doc["kind"] in ("Deployment", "StatefulSet"):
            for container in doc["spec"]["template"]["spec"]["containers"]:
                if container.get("command", [])[:2] == ["kvobs", "collect"]:
                    yield doc["metadata"]["name"], container


def test_liveness_waits_for_a_restarted_classifier(kubectl, sharded, example_sharded):
    """A restarted classifier classifies the window's spans again before it listens
    (``Live.resume``): minutes for a fleet's window. Its liveness probe alone (30 s by
    default) would kill it meanwhile, and every start after alike: a startup probe on
    the same endpoint waits, 10 min at least, in every render; the Collector feeding it
    retries as long."""
    renders = [DEPLOY.render(kubectl, DEPLOY.KUBE / "base"),
               DEPLOY.render(kubectl, DEPLOY.KUBE / "overlays" / "example"),
               sharded, example_sharded]
    for docs in renders:
        containers = list(_classifier_containers(docs))
        assert containers
        for name, container in containers:
            startup, liveness = container.get("startupProbe"), container["livenessProbe"]
            assert startup and startup["httpGet"] == liveness["httpGet"], name
            assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, name
        # ... and the Collector that feeds it retries until it listens (by default it
        # gives up after 300 s: the spans of a longer restart were dropped)
        feeding = [exporter for doc in docs if doc["kind"] == "ConfigMap"
                   and "config.yaml" in doc.get("data", {})
                   for name, exporter in yaml.safe_load(doc["data"]["config.yaml"])
                   .get("exporters", {}).items() if name == "otlphttp/kvobs-classifier"]
        assert feeding
        assert all(e["retry_on_failure"].get("max_elapsed_time") == "0s" for e in feeding)
