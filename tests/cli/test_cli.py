"""The kvobs CLI through click's CliRunner."""

import json

import pytest
from click.testing import CliRunner

from kvobs.cli import main
from spanfactory import Tracers, TurnSpec, write_conversation


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli")
    tracers = Tracers(str(path))
    write_conversation(tracers, "healthy-1", [TurnSpec(), TurnSpec(read="done")])
    write_conversation(tracers, "faulty-1", [TurnSpec(), TurnSpec(lookup="miss",
                                                                  decision="no-params")])
    write_conversation(tracers, "partial-1", [TurnSpec(), TurnSpec(decision=None)])
    return str(path)


def run(*args):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_diagnose_json_shape_and_exit_ok(source):
    result = run("diagnose", "healthy-1", "--source", source, "--json")
    assert result.exit_code == 0
    payload = json.loads(result.output)
    assert payload["conversation_id"] == "healthy-1"
    assert [(t["turn"], t["verdict"]) for t in payload["turns"]] == [
        (1, "first-turn"), (2, "remote-hit")]
    assert payload["turns"][1]["evidence"]["read_bytes"] == 2_000_000
    # 900 tokens at the rate measured from turn 1 (1000 tokens over its 0.2 s P leg)
    # saved 180 ms of P compute; the read (5 ms) cost less: TTFT gained 175 ms.
    assert payload["turns"][1]["remedy"] == (
        "Remote KV read paid off: 900 tokens (180 ms of P compute) saved, TTFT 175 ms "
        "better than recomputing.")
    assert payload["turns"][1]["compute_saved_tokens"] == 900
    assert payload["turns"][1]["ttft_gained_s"] == pytest.approx(0.175)
    # These turns carry no timeline spans (only the turn and read spans): nothing is
    # guessed: the phases between known marks stay merged and still add up.
    turn = payload["turns"][1]
    assert turn["ttft_s"] is None
    assert list(turn["phases"]) == [
        "proxy-in+p-frontend+p-queue+p-schedule+read-wait+read-setup",
        "read+p-compute+p-return+proxy-hop+d-frontend+d-queue+handoff-wait+handoff-setup"
        "+handoff+d-first-token+decode+proxy-out"]
    assert sum(turn["phases"].values()) == pytest.approx(turn["latency_s"])
    assert turn["slowest_phase"] is None
    assert "kvobs.prefill.request" in turn["unmeasured"]["p-queue"]


def test_diagnose_fault_exit_status_and_table(source):
    result = run("diagnose", "faulty-1", "--source", source)
    assert result.exit_code == 1
    assert "missing-metadata" in result.output
    assert "proxy had no entry" in result.output


def test_diagnose_insufficient_evidence_exit_status(source):
    result = run("diagnose", "partial-1", "--source", source, "--json")
    assert result.exit_code == 3
    turn = json.loads(result.output)["turns"][1]
    assert turn["verdict"] == "insufficient-evidence"
    assert turn["evidence"]["missing_span"] == "kvobs.prefill.pull_decision"


def test_unknown_conversation_lists_near_matches(source):
    result = CliRunner().invoke(main, ["diagnose", "healthy-2", "--source", source])
    assert result.exit_code == 2
    assert "unknown conversation id 'healthy-2'" in result.stderr
    assert "healthy-1" in result.stderr


def test_bad_source_is_input_error(tmp_path):
    result = CliRunner().invoke(main, ["diagnose", "x", "--source", str(tmp_path / "none")])
    assert result.exit_code == 2
    assert "source not found" in result.stderr


def test_turns_json_and_filters(source):
    rows = json.loads(run("turns", "--source", source, "--json").output)
    assert {(r["conversation_id"], r["turn"], r["verdict"]) for r in rows} == {
        ("healthy-1", 1, "first-turn"), ("healthy-1", 2, "remote-hit"),
        ("faulty-1", 1, "first-turn"), ("faulty-1", 2, "missing-metadata"),
        ("partial-1", 1, "first-turn"), ("partial-1", 2, "insufficient-evidence")}
    only = json.loads(run("turns", "--source", source, "--json", "--min-turn", "2",
                          "--verdict", "remote-hit").output)
    assert [(r["conversation_id"], r["turn"]) for r in only] == [("healthy-1", 2)]


def test_turns_csv_loads_into_pandas(source):
    import io

    import pandas as pd

    result = run("turns", "--source", source, "--format", "csv")
    frame = pd.read_csv(io.StringIO(result.output))
    assert len(frame) == 6
    assert {"conversation_id", "turn", "verdict", "remedy", "evidence"} <= set(frame.columns)


def test_turns_csv_has_one_line_per_turn_with_json_cells(source):
    import csv
    import io

    result = run("turns", "--source", source, "--format", "csv")
    lines = result.output.splitlines()
    rows = list(csv.DictReader(io.StringIO(result.output)))
    assert len(lines) == len(rows) + 1 == 7
    for row in rows:
        assert isinstance(json.loads(row["evidence"]), dict)
        assert isinstance(json.loads(row["phases"]), dict)


@pytest.fixture(scope="module")
def two_tenants(tmp_path_factory):
    path = tmp_path_factory.mktemp("tenants")
    tracers = Tracers(str(path))
    write_conversation(tracers, "shared", [TurnSpec(), TurnSpec(read="done")], tenant="aaaa")
    write_conversation(tracers, "shared", [TurnSpec(), TurnSpec(lookup="miss",
                                                                decision="no-params")],
                       start_s=1_700_000_100.0, tenant="bbbb")
    return str(path)


def test_one_id_used_by_two_tenants_is_two_conversations(two_tenants):
    ambiguous = run("diagnose", "shared", "--source", two_tenants)
    assert ambiguous.exit_code == 2 and "2 tenants (aaaa, bbbb)" in ambiguous.output
    for tenant, verdicts, status in (("aaaa", ["first-turn", "remote-hit"], 0),
                                     ("bbbb", ["first-turn", "missing-metadata"], 1)):
        result = run("diagnose", "shared", "--tenant", tenant, "--source", two_tenants,
                     "--json")
        assert result.exit_code == status
        payload = json.loads(result.output)
        assert payload["tenant"] == tenant
        assert [t["verdict"] for t in payload["turns"]] == verdicts
    unknown = run("diagnose", "shared", "--tenant", "cccc", "--source", two_tenants)
    assert unknown.exit_code == 2 and "tenant aaaa" in unknown.output
    rows = json.loads(run("turns", "--tenant", "bbbb", "--source", two_tenants,
                          "--json").output)
    assert [(r["tenant"], r["turn"]) for r in rows] == [("bbbb", 1), ("bbbb", 2)]


def test_source_failing_after_open_is_an_input_error(monkeypatch, source):
    """A server that answered at open time and fails a later query: exit 2, one line."""
    from kvobs.sources import SourceError

    class Failing:
        problems: list = []

        def spans(self, conversation_id=None):
            raise SourceError("clickhouse://db: Code: 60. Unknown table")

        span_table = spans

        def conversation_ids(self):
            return []

    monkeypatch.setattr("kvobs.cli._common.open_source", lambda location: Failing())
    result = CliRunner().invoke(main, ["diagnose", "x", "--source", "clickhouse://db"])
    assert result.exit_code == 2
    assert "Unknown table" in result.output and "Traceback" not in result.output


def test_turns_exit_0_unless_asked_to_fail(source):
    """turns lists faulty turns and still exits 0 (it runs under set -e); --fail-on
    fault gives diagnose's status."""
    assert run("turns", "--source", source, "--json").exit_code == 0
    assert run("turns", "--source", source, "--json", "--fail-on", "fault").exit_code == 1


def test_a_bug_in_kvobs_exits_4_with_one_line_never_1(monkeypatch, source):
    import kvobs.diagnose

    def broken(*args, **kwargs):
        raise ZeroDivisionError("boom")

    monkeypatch.setattr(kvobs.diagnose, "turns_from_spans", broken)
    result = run("diagnose", "faulty-1", "--source", source)
    assert result.exit_code == 4
    assert "internal error (ZeroDivisionError: boom)" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("chosen, expected", [(None, "system"), ("mimalloc", "mimalloc")])
def test_cli_uses_the_c_allocator_for_arrow_unless_told_otherwise(chosen, expected):
    """The CLI picks Arrow's pool before pyarrow loads (mimalloc's page churn cost
    `kvobs report` seconds of system time, bench/README.md); a pool the user set wins."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "ARROW_DEFAULT_MEMORY_POOL"}
    if chosen:
        env["ARROW_DEFAULT_MEMORY_POOL"] = chosen
    out = subprocess.run([sys.executable, "-c", "import kvobs.cli, pyarrow; "
                          "print(pyarrow.default_memory_pool().backend_name)"],
                         env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == expected



@pytest.mark.parametrize("user_tuned", [False, True])
def test_fleet_commands_tune_glibc_unless_the_user_did(user_tuned):
    """keep_freed_memory (report, tune, whatif) sets glibc's thresholds; a user's
    MALLOC_* setting wins. Its effect is measured in bench/README.md (report_bench)."""
    import os
    import platform
    import subprocess
    import sys

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("not glibc: nothing to tune")
    env = dict(os.environ)
    if user_tuned:
        env["MALLOC_MMAP_THRESHOLD_"] = "131072"
    out = subprocess.run([sys.executable, "-c", "from kvobs._memory import "
                          "keep_freed_memory; print(keep_freed_memory())"],
                         env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(not user_tuned)
