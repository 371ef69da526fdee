"""A missing promtool/prometheus/SDK fails the suite in CI and only skips elsewhere."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

# Load this directory's conftest by path: `import conftest` could find tests/conftest.py.
_spec = importlib.util.spec_from_file_location(
    "kvobs_monitoring_conftest", Path(__file__).with_name("conftest.py"))
monitoring_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(monitoring_conftest)


def test_missing_binary_fails_in_ci(monkeypatch):
    monkeypatch.setenv("CI", "true")
    monkeypatch.setattr(monitoring_conftest.shutil, "which", lambda name: None)
    with pytest.raises(pytest.fail.Exception, match="promtool is not available"):
        monitoring_conftest.require_binary("promtool")


def test_missing_binary_skips_outside_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setattr(monitoring_conftest.shutil, "which", lambda name: None)
    with pytest.raises(pytest.skip.Exception, match="apt-get install -y prometheus"):
        monitoring_conftest.require_binary("promtool")


def test_present_binary_is_returned(monkeypatch):
    monkeypatch.setenv("CI", "true")
    monkeypatch.setattr(monitoring_conftest.shutil, "which", lambda name: f"/usr/bin/{name}")
    assert monitoring_conftest.require_binary("promtool") == "/usr/bin/promtool"
