"""Session fixtures shared by the testbed's test files: one real run per scenario, the
engines started once (everything stopped by PID, also on failure: ``Stack``)."""

from __future__ import annotations

import dataclasses
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvobs.testbed.runner import TurnResult
from kvobs.testbed.scenario import Scenario

ROOT = Path(__file__).resolve().parents[2]
# vllm-router's policies run after round_robin on the same engines; None: no --policy,
# the router's own default (its --help: cache_aware; its log names what it ran).
ROUTER_POLICIES = ("cache_aware", "power_of_two", None)


@dataclass
class ScenarioRun:
    scenario: Scenario
    out: Path  # the run's output directory: a span source (spans/, logs/, metrics/)
    results: list[TurnResult]  # what the client saw, per turn


@dataclass
class PolicyRun:
    policy: str | None  # None: the router's default
    scenario: Scenario
    results: list[TurnResult]
    router_log: Path  # the router's log of this policy's start


@dataclass
class RouterRuns:
    round_robin: ScenarioRun  # router.toml; out holds its spans only
    out: Path  # the engines' store over every run: round_robin's, then each policy's
    results: list[TurnResult]  # every turn of every run, in the order sent
    policies: list[PolicyRun]


def policy_label(policy: str | None) -> str:
    return policy or "default"


@pytest.fixture(scope="session")
def router_runs(tmp_path_factory) -> RouterRuns:
    """P and D started once behind vllm-router: scenarios/router.toml under round_robin,
    its spans copied aside once they left the engines, then the router restarted under
    each of ``ROUTER_POLICIES`` for scenarios/router-policies.toml (its own seed each
    time, so no policy's prompts extend another's)."""
    import time

    from kvobs.testbed.runner import run_scenario, write_results
    from kvobs.testbed.scenario import load
    from kvobs.testbed.stack import METRICS, TELEMETRY_DRAIN_S, Stack

    out = tmp_path_factory.mktemp("router")
    scenario = load(str(ROOT / "scenarios" / "router.toml"))
    small = load(str(ROOT / "scenarios" / "router-policies.toml"))
    assert small.engines == scenario.engines  # the same engines serve both
    alone = tmp_path_factory.mktemp("router-round-robin")
    policies = []
    with Stack(scenario.engines, out) as stack:
        results = run_scenario(scenario, stack)
        time.sleep(TELEMETRY_DRAIN_S)  # every span of the run has left the engines
        stack.snapshot_metrics()
        for part in ("spans", METRICS):
            shutil.copytree(out / part, alone / part)
        write_results(str(alone), scenario, results)
        for n, policy in enumerate(ROUTER_POLICIES, 1):
            stack.restart_router(policy)
            run = dataclasses.replace(small, seed=small.seed + n)
            log = stack.proxy.log_path
            policies.append(PolicyRun(policy, run, run_scenario(run, stack), log))
        time.sleep(TELEMETRY_DRAIN_S)
    every = results + [r for p in policies for r in p.results]
    write_results(str(out), small, every)  # what the client saw of every run, with the store
    return RouterRuns(ScenarioRun(scenario, alone, results), out, every, policies)


@pytest.fixture(scope="session")
def router_run(router_runs) -> ScenarioRun:
    """scenarios/router.toml: P and D behind vllm-router (round_robin) instead of the
    kvobs proxy."""
    return router_runs.round_robin


@pytest.fixture(scope="session", params=ROUTER_POLICIES, ids=policy_label)
def router_policy_run(router_runs, request) -> PolicyRun:
    """One of ``router_runs``'s policies (parametrized: a test per policy)."""
    return next(p for p in router_runs.policies if p.policy == request.param)
