"""Scenario format: every shipped file parses; bad files give errors naming the field."""

import glob
import os

import pytest

from kvobs.testbed.scenario import ScenarioError, load, parse

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "scenarios", "*.toml"))))
def test_shipped_scenarios_parse(path):
    scenario = load(path)
    assert scenario.conversations


def test_demo_expects_every_producible_verdict():
    scenario = load(os.path.join(ROOT, "scenarios", "demo.toml"))
    assert set(scenario.expectations.values()) >= {
        "first-turn", "remote-hit", "below-threshold", "missing-metadata",
        "prefix-mismatch", "expired", "transfer-failed"}


MINIMAL = """
name = "x"
[[conversations]]
id = "a"
[[conversations.turns]]
"""


def test_defaults():
    scenario = parse(MINIMAL)
    (turn,) = scenario.conversations[0].turns
    assert (turn.append_tokens, turn.gap_s, turn.before) == (200, 0.0, ())
    assert scenario.engines.ttl_s == 30.0


@pytest.mark.parametrize("text, message", [
    (MINIMAL + "bogus = 1\n", r"conversations\[1\]\.turns\[1\]: unknown field\(s\) bogus"),
    (MINIMAL + 'expect = "fast"\n', r"expect: 'fast' is not a verdict"),
    (MINIMAL + 'before = "reboot"\n', r"before: 'reboot' not one of"),
    (MINIMAL + "gap_s = -1\n", r"gap_s >= 0"),
    (MINIMAL + 'expect_cause = "slow"\n', r"expect_cause: 'slow' is not one of"),
    (MINIMAL + 'expect_cause = ["queued-at-p", "slow"]\n', r"expect_cause: .* is not one of"),
    (MINIMAL + "expect_cause = []\n", r"expect_cause: \(\) is not one of"),
    (MINIMAL + "decode_load = -1\n", r"loads >= 0"),
    ('name = "x"\n[engines]\nfailure_policy = "retry"\n' + MINIMAL.split('name = "x"')[1],
     r"engines\.failure_policy"),
    ('name = "x"\n[engines]\nrouter = "nginx"\n' + MINIMAL.split('name = "x"')[1],
     r"engines\.router: 'nginx' not one of"),
    ('name = "x"\n[engines]\nrouter = "vllm-router"\nproxy_fixed_lifetime_s = 450\n'
     + MINIMAL.split('name = "x"')[1], r"engines\.proxy_fixed_lifetime_s: a kvobs proxy"),
    ('name = "x"\n', r"no conversations"),
    ("name = ", r"<scenario>:"),
])
def test_bad_scenarios_name_the_field(text, message):
    with pytest.raises(ScenarioError, match=message):
        parse(text)


def test_missing_file(tmp_path):
    with pytest.raises(ScenarioError, match="No such file"):
        load(str(tmp_path / "none.toml"))


def test_expected_causes_one_or_any_of_several():
    scenario = parse(MINIMAL + 'expect_cause = ["decode-busy", "queued-at-d"]\n')
    assert scenario.cause_expectations == {("a", 1): ("decode-busy", "queued-at-d")}
    assert parse(MINIMAL + 'expect_cause = "queued-at-p"\n').cause_expectations == {
        ("a", 1): "queued-at-p"}
