"""deploy/Dockerfile's build context holds what the wheel is built from, so the image's
wheel carries LICENSE and kvobs/_data/ (scenarios, runbooks, dashboards, alerts).

No container daemon runs here (docs/deploy.md): the context is reproduced from
deploy/Dockerfile.dockerignore (Docker's rules: the last matching pattern wins, a pattern
matching a directory covers what is below it), the Dockerfile's build-stage COPYs are
applied to it, and the wheel is built from the result the way the Dockerfile builds it.
"""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kvobs._resources import SHIPPED

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
IGNORE = ROOT / "deploy" / "Dockerfile.dockerignore"


def _patterns() -> list[tuple[bool, str]]:
    """``(excluded, pattern)`` in file order."""
    out = []
    for line in IGNORE.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            out.append((not line.startswith("!"), line.lstrip("!").rstrip("/")))
    return out


def _matches(pattern: str, path: str) -> bool:
    parts = path.split("/")
    if pattern.startswith("**/"):
        return any(fnmatch.fnmatchcase(p, pattern[3:]) for p in parts)
    # the pattern names the path, or the directory of its first parts that holds it
    depth = pattern.count("/") + 1
    return len(parts) >= depth and fnmatch.fnmatchcase("/".join(parts[:depth]), pattern)


def in_context(path: str) -> bool:
    excluded = False
    for exclude, pattern in _patterns():
        if _matches(pattern, path):
            excluded = exclude
    return not excluded


def _build_copies() -> list[tuple[list[str], str]]:
    """``(sources, destination)`` of the build stage's COPY instructions."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    stage, copies = 0, []
    for line in text.splitlines():
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        if words[0] == "FROM":
            stage += 1
        elif words[0] == "COPY" and stage == 1 and not words[1].startswith("--"):
            copies.append((words[1:-1], words[-1]))
    return copies


def test_ignore_rules_behave_as_docker_reads_them():
    assert in_context("setup.py") and in_context("LICENSE")
    assert in_context("kvobs/cli/__init__.py")
    assert in_context("docs/runbooks/KvobsProxyFallbacks.md")
    assert not in_context("docs/verdicts.md")  # only the runbooks of docs/
    assert not in_context("tests/conftest.py") and not in_context(".venv/bin/python")
    assert not in_context("kvobs/__pycache__/x.pyc")


def test_context_holds_every_build_input():
    for name in ("pyproject.toml", "setup.py", "LICENSE", "README.md", "MANIFEST.in"):
        assert in_context(name), name
    for folder in SHIPPED:
        assert in_context(f"{folder}/x"), folder
    copied = {source.rstrip("/") for sources, _ in _build_copies() for source in sources}
    assert {"setup.py", "LICENSE", *SHIPPED} <= copied


@pytest.fixture(scope="module")
def image_wheel(tmp_path_factory) -> Path:
    """The wheel as the image's build stage builds it: from the COPYs of the context."""
    work = tmp_path_factory.mktemp("image") / "src"
    work.mkdir()
    for sources, destination in _build_copies():
        for source in sources:
            origin = ROOT / source
            # `COPY a b ./` keeps the names; `COPY dir ./dir` names the target
            target = work / (origin.name if destination == "./" else destination)
            if origin.is_dir():
                shutil.copytree(origin, target, dirs_exist_ok=True, ignore=lambda d, names: [
                    n for n in names if not in_context(
                        str((Path(d) / n).relative_to(ROOT)))])
            else:
                assert in_context(source), source
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(origin, target)
    out = tmp_path_factory.mktemp("wheel")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                            "--no-build-isolation", "--no-index", "-q", "-w", str(out),
                            str(work)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    (wheel,) = out.glob("kvobs-*.whl")
    return wheel


def test_the_image_wheel_carries_license_and_data(image_wheel):
    names = set(zipfile.ZipFile(image_wheel).namelist())
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    for folder in SHIPPED:
        files = [p for p in (ROOT / folder).rglob("*") if p.is_file()
                 and "__pycache__" not in p.parts]
        assert files, folder
        for path in files:
            assert f"kvobs/_data/{path.relative_to(ROOT)}" in names, path
