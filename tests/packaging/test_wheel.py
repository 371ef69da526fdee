"""The built wheel, installed in a fresh virtualenv away from the repository, works:
its files are complete and `kvobs demo --help`, `kvobs diagnose` and `kvobs dashboards
export` run from it.

The wheel is built offline from a copy of the tree (`pip wheel --no-deps
--no-build-isolation`: setuptools from the running environment). The fresh venv gets
kvobs from the wheel only; its dependencies come from the running environment's
site-packages through a ``.pth`` line (appended after the venv's own site-packages, so
the wheel's kvobs is the one imported; the running environment's editable-install hook
is a ``.pth`` there and is not processed from a ``.pth`` path).
"""

from __future__ import annotations

import email
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

import kvobs
from kvobs._resources import SHIPPED
from spanfactory import Tracers, TurnSpec, write_conversation

ROOT = Path(__file__).resolve().parents[2]
NOT_SOURCE = shutil.ignore_patterns(".git", ".venv", ".testbed", "out", "build", "dist",
                                    "*.egg-info", "__pycache__", ".pytest_cache")


def _run(*args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], capture_output=True, text=True,
                          timeout=300, **kwargs)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tree = tmp_path_factory.mktemp("tree") / "kvobs"
    shutil.copytree(ROOT, tree, ignore=NOT_SOURCE, symlinks=True)
    out = tmp_path_factory.mktemp("wheel")
    built = _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                 "--no-index", "-q", "-w", out, tree)
    assert built.returncode == 0, built.stderr
    (path,) = out.glob("kvobs-*.whl")
    return path


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """A fresh venv holding the wheel: returns its bin directory."""
    home = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(with_pip=False).create(home)
    python = home / "bin" / "python"
    site = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])")
                .stdout.strip())
    done = _run(sys.executable, "-m", "pip", "--python", python, "install", "--no-deps",
                "--no-index", "--force-reinstall", "-q", wheel, env=_clean_env())
    assert done.returncode == 0, done.stderr
    # After the install: pip would take the running environment's kvobs as installed.
    deps = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
    (site / "_kvobs_test_deps.pth").write_text("".join(f"{d}\n" for d in sorted(deps)))
    return home / "bin"


def _clean_env() -> dict[str, str]:
    """No PYTHONPATH (tests run with the worktree first on it), no source env var."""
    return {k: v for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "KVOBS_SOURCE", "VIRTUAL_ENV")}


def _kvobs(bin_dir: Path, cwd: Path, *args) -> subprocess.CompletedProcess:
    return _run(bin_dir / "kvobs", *args, cwd=cwd, env=_clean_env())


def test_wheel_carries_every_shipped_file_and_the_license(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {f"kvobs/_data/{p.relative_to(ROOT)}" for folder in SHIPPED
               for p in (ROOT / folder).rglob("*") if p.is_file()}
    assert shipped and not shipped - names
    assert "kvobs/_data/scenarios/demo.toml" in names
    info = next(n for n in names if n.endswith(".dist-info/METADATA"))
    metadata = email.message_from_string(zipfile.ZipFile(wheel).read(info).decode())
    assert metadata["License-Expression"] == "Apache-2.0"
    assert metadata["Requires-Python"] == ">=3.11"
    assert metadata["Version"] == kvobs.__version__
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert "Apache License" in (ROOT / "LICENSE").read_text()


def test_installed_kvobs_is_the_wheel_and_finds_its_scenarios(installed, tmp_path):
    where = _run(installed / "python", "-c",
                 "import kvobs; from kvobs.cli.testbed import DEMO_SCENARIO; "
                 "print(kvobs.__file__); print(DEMO_SCENARIO)",
                 cwd=tmp_path, env=_clean_env())
    assert where.returncode == 0, where.stderr
    module, scenario = map(Path, where.stdout.split())
    venv_root = installed.parent
    assert venv_root in module.parents and venv_root in scenario.parents
    assert scenario.read_text() == (ROOT / "scenarios" / "demo.toml").read_text()
    version = _kvobs(installed, tmp_path, "--version")
    assert version.returncode == 0 and kvobs.__version__ in version.stdout
    demo = _kvobs(installed, tmp_path, "demo", "--help")
    assert demo.returncode == 0, demo.stderr
    assert "--scenario" in demo.stdout


def test_installed_kvobs_diagnoses_a_recorded_store(installed, tmp_path):
    store = tmp_path / "spans"
    tracers = Tracers(str(store))
    write_conversation(tracers, "agent-1", [TurnSpec(), TurnSpec(read="done")])
    write_conversation(tracers, "agent-2", [TurnSpec(), TurnSpec(lookup="miss",
                                                                 decision="no-params")])
    tracers.flush()
    healthy = _kvobs(installed, tmp_path, "diagnose", "agent-1", "--source", store, "--json")
    assert healthy.returncode == 0, healthy.stderr
    verdicts = [t["verdict"] for t in json.loads(healthy.stdout)["turns"]]
    assert verdicts == ["first-turn", "remote-hit"]
    faulty = _kvobs(installed, tmp_path, "diagnose", "agent-2", "--source", store)
    assert faulty.returncode == 1, faulty.stderr
    assert "missing-metadata" in faulty.stdout


def test_installed_kvobs_exports_the_generated_dashboards(installed, tmp_path):
    exported = _kvobs(installed, tmp_path, "dashboards", "export", tmp_path / "grafana")
    assert exported.returncode == 0, exported.stderr
    files = sorted((tmp_path / "grafana").glob("*.json"))
    assert [f.name for f in files] == sorted(p.name for p in (ROOT / "dashboards").glob("*.json"))
    for path in files:
        assert json.loads(path.read_text()) == json.loads(
            (ROOT / "dashboards" / path.name).read_text())
