"""Session fixtures shared by the testbed's test files: one real run per scenario, the
engines started once (everything stopped by PID, also on failure: ``Stack``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from kvobs.testbed.runner import TurnResult
from kvobs.testbed.scenario import Scenario

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class ScenarioRun:
    scenario: Scenario
    out: Path  # the run's output directory: a span source (spans/, logs/, metrics/)
    results: list[TurnResult]  # what the client saw, per turn


@pytest.fixture(scope="session")
def router_run(tmp_path_factory) -> ScenarioRun:
    """scenarios/router.toml: P and D behind vllm-router instead of the kvobs proxy."""
    from kvobs.cli.testbed import run_to_dir

    out = tmp_path_factory.mktemp("router")
    scenario, results = run_to_dir(str(ROOT / "scenarios" / "router.toml"), str(out))
    return ScenarioRun(scenario, out, results)
