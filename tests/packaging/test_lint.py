"""ruff's lint and format check (pyproject's [tool.ruff]) and mypy's type check
([tool.mypy]) pass over the packages (ruff check also over tests and bench): a finding
fails the suite, as it fails CI (ruff and mypy come with the test extra)."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_ruff_finds_nothing():
    """The packages, and the tests and benchmarks that exercise them."""
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache",
                           "kvobs", "connector_instrumented", "tests", "bench"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def test_ruff_format_leaves_the_packages_as_they_are():
    done = subprocess.run([sys.executable, "-m", "ruff", "format", "--check", "--no-cache",
                           "kvobs", "connector_instrumented"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def test_mypy_finds_nothing(tmp_path):
    """mypy with pyproject's [tool.mypy] (the packages, the per-module overrides): a cold
    run, its cache in a fresh directory, as on a fresh clone (~40 s here)."""
    done = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
