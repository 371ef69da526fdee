"""One config per deployment: the example overlay's kvobs.env sets the engines and D's TTL,
and everything that must agree with them is derived from it.

The acceptance of #27: with only kvobs.env edited (a copy of deploy/kubernetes, TTL 300 s
and a 20 s expiry margin), ``kubectl kustomize`` renders the proxy, both engines and the
monitoring with that TTL everywhere: the proxy's --decode-kv-ttl and every engine's
decoder_kv_blocks_ttl (after the kubelet's ``$(VAR)`` expansion) are 300, the proxy's
entry lifetime derived from them is what the monitoring config derives, and the
PrometheusRule and dashboards carry no TTL of their own (they read the TTL the proxy
reports), so they are the same objects whatever the TTL.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest

from kvobs.monitoring import config as monitoring
from kvobs.semconv import M_PROXY_DECODE_TTL
from kvobs.settings import entry_lifetime_s

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The kustomize helpers of the deploy tests (render, by_kind, container, env, $(VAR)).
DEPLOY = _load("kvobs_deploy_helpers_one_config", ROOT / "tests" / "monitoring" / "test_deploy.py")


@pytest.fixture(scope="module")
def kubectl() -> str:
    return DEPLOY.CONF.require_binary("kubectl", DEPLOY.KUBECTL_INSTALL)


def _settings(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines()
                if line.strip() and not line.startswith("#"))


def render_with(kubectl: str, tmp_path: Path, **values: str) -> list[dict]:
    """The example overlay of a copy of deploy/kubernetes with kvobs.env edited only."""
    copy = tmp_path / "kubernetes"
    shutil.copytree(KUBE, copy)
    env = copy / "overlays" / "example" / "kvobs.env"
    text = env.read_text()
    for key, value in values.items():
        text, n = re.subn(rf"^{key}=.*$", f"{key}={value}", text, flags=re.MULTILINE)
        assert n == 1, key
    env.write_text(text)
    return DEPLOY.render(kubectl, copy / "overlays" / "example")


def _engines(docs: list[dict]) -> dict[str, dict]:
    return {name: d for name, d in DEPLOY.by_kind(docs, "Deployment").items()
            if "kvobs.io/engine-role" in d["metadata"].get("labels", {})}


def _proxy_args(docs: list[dict]) -> dict[str, str]:
    proxy = DEPLOY._container(DEPLOY.by_kind(docs, "Deployment")["kvobs-proxy"], "proxy")
    env = DEPLOY._env(proxy)
    expanded = [DEPLOY.expand(a, env) for a in proxy["args"]]
    assert not [a for a in expanded if "$(" in a], expanded  # every variable defined
    return dict(a.removeprefix("--").split("=", 1) for a in expanded if "=" in a)


def _engine_ttls(docs: list[dict]) -> dict[str, float]:
    out = {}
    for name, deployment in _engines(docs).items():
        vllm = DEPLOY._container(deployment, "vllm")
        env = DEPLOY._env(vllm)
        (config,) = [DEPLOY.expand(a, env).split("=", 1)[1] for a in vllm["args"]
                     if a.startswith("--kv-transfer-config=")]
        extra = json.loads(config)["kv_connector_extra_config"]
        assert extra["kvobs_role"] == deployment["metadata"]["labels"]["kvobs.io/engine-role"]
        out[name] = float(extra["decoder_kv_blocks_ttl"])
    return out


def _monitoring(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] == "PrometheusRule"
            or (d["kind"] == "ConfigMap" and d["metadata"]["name"] == "kvobs-dashboards")]


def _proxy_cli(args: dict[str, str]) -> dict:
    """What `kvobs proxy` makes of the rendered flags (its own option parsing)."""
    from kvobs.cli.proxy import proxy_command

    argv = [f"--{k}={v}" for k, v in args.items()]
    with proxy_command.make_context("proxy", argv) as ctx:
        return ctx.params


@pytest.fixture(scope="module")
def default_render(kubectl, tmp_path_factory):
    return render_with(kubectl, tmp_path_factory.mktemp("default"))


@pytest.fixture(scope="module")
def changed_render(kubectl, tmp_path_factory):
    return render_with(kubectl, tmp_path_factory.mktemp("changed"), decode_ttl_seconds="300",
                       proxy_expiry_margin_seconds="20",
                       prefill_hosts="p-0.engines,p-1.engines", prefill_ports="8100",
                       decode_hosts="d-0.engines", decode_ports="8200")


def test_the_example_sets_each_value_in_kvobs_env_only():
    """No JSON patch by argument index, no TTL or engine host outside the one config."""
    overlay = KUBE / "overlays" / "example"
    for kustomization in KUBE.rglob("kustomization.yaml"):
        assert not re.search(r"/args/\d", kustomization.read_text()), kustomization
    values = _settings(overlay / "kvobs.env")
    assert set(values) == set(_settings(KUBE / "base" / "settings.env"))
    assert "decode-kv-ttl" not in (overlay / "kustomization.yaml").read_text()
    for manifest in [*KUBE.rglob("*.yaml")]:
        text = manifest.read_text()
        assert not re.search(r"--decode-kv-ttl=\d|decoder_kv_blocks_ttl\"?: *\d", text), \
            manifest


def test_one_edit_changes_the_ttl_everywhere(changed_render):
    docs = changed_render
    args = _proxy_args(docs)
    assert float(args["decode-kv-ttl"]) == 300.0
    assert float(args["expiry-margin"]) == 20.0
    ttls = _engine_ttls(docs)
    assert set(ttls) == {"vllm-prefill", "vllm-decode"}
    assert set(ttls.values()) == {300.0}
    (settings,) = [d for d in docs if d["kind"] == "ConfigMap"
                   and d["metadata"]["name"].startswith("kvobs-settings")]
    assert settings["data"]["decode_ttl_seconds"] == "300"
    # the monitoring config takes the same keys and derives the entry lifetime the proxy
    # derives from these flags (kvobs.settings.entry_lifetime_s): 280 s, below the TTL
    config = monitoring.load(None, [f"{k}={settings['data'][k]}" for k in
                                    ("decode_ttl_seconds", "proxy_expiry_margin_seconds")])
    assert config.entry_lifetime_seconds == entry_lifetime_s(300.0, 20.0) == 280.0


def test_one_edit_sets_the_engines_of_the_proxy(changed_render):
    params = _proxy_cli(_proxy_args(changed_render))
    assert params["prefiller_hosts"] == ("p-0.engines,p-1.engines",)
    assert params["decoder_hosts"] == ("d-0.engines",)
    assert params["prefiller_ports"] == ("8100",) and params["decoder_ports"] == ("8200",)
    assert params["decode_kv_ttl"] == 300.0 and params["expiry_margin"] == 20.0


def test_monitoring_reads_the_ttl_the_proxy_reports(default_render, changed_render):
    """Nothing in the rendered monitoring depends on the TTL: the rule and the panels of
    gaps beyond D's TTL read the proxy's gauge, set from its --decode-kv-ttl."""
    before, after = _monitoring(default_render), _monitoring(changed_render)
    assert len(before) == 2 and before == after
    text = json.dumps(after)
    assert M_PROXY_DECODE_TTL.name in text
    assert "gap_over_decode_ttl" in text


def test_the_default_render_is_kvobs_defaults(default_render):
    args = _proxy_args(default_render)
    assert float(args["decode-kv-ttl"]) == monitoring.DEFAULT.decode_ttl_seconds
    assert float(args["expiry-margin"]) == monitoring.DEFAULT.proxy_expiry_margin_seconds
    assert set(_engine_ttls(default_render).values()) == {monitoring.DEFAULT.decode_ttl_seconds}
    services = DEPLOY.by_kind(default_render, "Service")
    for host in (args["prefiller-host"], args["decoder-host"]):
        assert host in services  # the example engines' Services
