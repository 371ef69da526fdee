"""The anonymous remedy end to end (#26 item 4), on the real testbed: a client with no API
key gets no reuse from the kvobs proxy's default isolation, and ``kvobs diagnose`` says
why and names the flag, from the real engines' and proxy's spans."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from kvobs.cli import main
from kvobs.cli._exit import EXIT_FAULT
from kvobs.sources import open_source
from kvobs.testbed.check import diagnosed_turns

pytestmark = pytest.mark.testbed
ROOT = Path(__file__).resolve().parents[2]


def test_an_anonymous_client_is_told_which_flag_restores_reuse(tmp_path):
    from kvobs.cli.testbed import run_to_dir

    out = tmp_path / "anonymous"
    _scenario, results = run_to_dir(str(ROOT / "scenarios" / "anonymous.toml"), str(out))
    assert [r.ok for r in results] == [True, True]
    turns = diagnosed_turns(open_source(str(out)), results)
    first, second = turns[("agent-no-key", 1)], turns[("agent-no-key", 2)]
    assert first.finding.verdict.value == "first-turn"
    assert second.finding.verdict.value == "missing-metadata"
    assert (second.turn.get("lookup"), second.turn.get("lookup_miss_reason")) == \
        ("miss", "anonymous")
    for flag in ("--anonymous-tenant shared", "--trusted-tenant-header"):
        assert flag in second.finding.remedy
    shown = CliRunner().invoke(main, ["diagnose", "agent-no-key", "--source", str(out)])
    assert shown.exit_code == EXIT_FAULT, shown.output  # a turn with a fault verdict
    assert "--anonymous-tenant" in shown.output and "lookup_miss_reason=anonymous" in \
        shown.output
    # the proxy counted both turns as anonymous
    metrics = "".join(p.read_text() for p in (out / "metrics").glob("*proxy*"))
    assert "kvobs_proxy_anonymous_turns_total 2.0" in metrics
