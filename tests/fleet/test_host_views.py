"""Host-path verdicts in the fleet views (``kvobs report`` text/JSON/HTML, ``kvobs
turns``): counted and explained like the device verdicts, from host spans written
through the real SDK/exporter (``tests/verdicts/test_verdicts_host.py``'s conversations)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from verdicts.test_verdicts_host import CASES, write_cases
from kvobs.cli import main
from kvobs.fleet import build_report, fleet_turns
from kvobs.semconv import Verdict
from kvobs.sources import open_source

HOST = [v.value for v in (Verdict.HOST_HIT, Verdict.HOST_EVICTED, Verdict.HOST_SAVE_INCOMPLETE,
                          Verdict.HOST_COPY_LACKS_RESPONSE)]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return write_cases(str(tmp_path_factory.mktemp("host-views")))


def _expected() -> dict[str, int]:
    counts: dict[str, int] = {}
    for _, verdict in CASES.values():
        counts[verdict.value] = counts.get(verdict.value, 0) + 1
    return counts


def test_fleet_table_decides_as_diagnose(store):
    """The fleet's compact table carries what the host rules read: each conversation's
    turn 2 gets diagnose's verdict, not insufficient-evidence."""
    report, labelled = build_report(fleet_turns(open_source(store)), store)
    later = labelled[labelled["turn"] == 2].set_index("conversation_id")["verdict"]
    assert {cid: later[cid] for cid in CASES} == {cid: v.value for cid, (_, v) in CASES.items()}
    assert report.later_turns["verdicts"] == _expected()


def test_report_counts_host_reuse(store):
    report, _ = build_report(fleet_turns(open_source(store)), store)
    later = report.later_turns
    hits = _expected()[Verdict.HOST_HIT.value]
    assert later["host_hit_ratio"] == hits / len(CASES)
    assert later["host_path_turns"] == len(CASES)
    # the spans' loads: accepted // 16 blocks of 64 KiB each, tokens as accepted
    loaded = [kw.get("accepted", 80) for kw, _ in CASES.values()]
    assert later["host_bytes_loaded"] == sum(a // 16 * 65536 for a in loaded)
    assert later["host_reused_tokens"] == sum(loaded)
    # a host-only engine has no P decision: its lookup's prompt buckets the turn
    assert sum(row["turns"] for row in report.by_prompt) == len(CASES)


def test_report_cli_text_json_html(store, tmp_path):
    runner = CliRunner()
    data = json.loads(runner.invoke(main, ["report", "-s", store, "--json"]).output)
    assert data["later_turns"]["verdicts"] == _expected()
    text = runner.invoke(main, ["report", "-s", store], terminal_width=200).output
    for verdict in HOST:
        assert verdict in text
    page = tmp_path / "report.html"
    result = runner.invoke(main, ["report", "-s", store, "--html", str(page)])
    assert result.exit_code in (0, 1), result.output
    html = page.read_text()
    assert "healthy: part of the prompt&#x27;s KV was loaded from an offloading tier" in html
    assert "the tier refused part of the previous turn&#x27;s copy" in html
    assert "KV loaded from the host tier" in html


def test_turns_lists_host_verdicts(store):
    runner = CliRunner()
    rows = json.loads(runner.invoke(main, ["turns", "-s", store, "--json", "--verdict",
                                           Verdict.HOST_SAVE_INCOMPLETE.value]).output)
    assert sorted(r["conversation_id"] for r in rows) == ["save-refused", "save-refused-tail"]
    assert all("cpu_bytes_to_use" in r["remedy"] for r in rows)
    table = runner.invoke(main, ["turns", "-s", store, "--conversation", "hit"],
                          terminal_width=200).output
    assert "host-hit" in table and "80 tok" in table and "140" in table


def test_every_verdict_has_a_colour_and_a_meaning():
    """A verdict added without them would crash the HTML report (as the host ones did)."""
    from kvobs.fleet.html import VERDICT_COLOURS, VERDICT_NOTES

    assert set(VERDICT_COLOURS) == set(VERDICT_NOTES) == {v.value for v in Verdict}
    assert all(VERDICT_NOTES.values())
