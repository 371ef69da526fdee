"""The HTML report's content, without a browser: labelled columns with units, numbers
formatted for people, verdict mixes as charts whose counts are the report's, gaps binned
around D's TTL."""

import doctest
import html
import re
import shlex
from pathlib import Path

import pytest

from kvobs import semconv as sc
from kvobs.causes import CAUSE_OF
from kvobs.fleet import build_report, fleet_turns
from kvobs.fleet._plots import GROUP_COLOURS, GROUPS, PHASE_COLOURS, worst_conversations
from kvobs.fleet.html import RETENTION, gap_bins, number, percent, render_html
from kvobs.fleet.report import add_trace_ids, diagnose_command
from kvobs.render import fault_count
from kvobs.semconv import Phase
from kvobs.sources import open_source


@pytest.fixture(scope="module")
def built(synthetic_store):
    return build_report(fleet_turns(open_source(synthetic_store[0])), "synthetic")


@pytest.fixture(scope="module")
def page(built):
    report, labelled = built
    return render_html(report, labelled)


def _text(page: str) -> str:
    """The page without its embedded images (base64 can look like anything)."""
    return re.sub(r"data:image/png;base64,[A-Za-z0-9+/=]+", "", page)


@pytest.mark.parametrize("value, shown", [
    (9.182e-05, "0.000092"), (0.8965, "0.90"), (123_456_789.0, "123,456,789"),
    (2.0e6, "2,000,000"), (3, "3"), (None, "–")])
def test_numbers_never_in_exponent_notation(value, shown):
    assert number(value) == shown


@pytest.mark.parametrize("value, shown", [
    (0.4588, "45.9 %"), (0.0004, "<0.1 %"), (0, "0 %"), (None, "–")])
def test_percentages(value, shown):
    assert percent(value) == shown


def test_columns_are_labelled_with_units_and_numbers_formatted(page):
    text = _text(page)
    headings = re.findall(r"<th>([^<]+)</th>", text)
    assert {"Remote hits", "KV read (bytes)", "TTFT p50", "Latency p95",
            "Tokens recomputed", "Share of latency", "p95 per turn"} <= set(headings)
    assert not [h for h in headings if "_" in h]
    assert not re.search(r"\d\.?\d*e[-+]\d", text)
    assert "{&quot;" not in text and '{"' not in text  # no dict dumped in a cell


def test_verdict_mix_chart_counts_are_the_reports(built, page):
    report, _ = built
    for verdict, n in report.later_turns["verdicts"].items():
        total = report.later_turns["turns"]
        assert f"later turns: {verdict} {n:,} of {total:,} turns" in page


def test_gaps_are_binned_around_the_ttl(built):
    _, labelled = built
    rows, ttl = gap_bins(labelled)
    assert ttl == 480
    labels = [label for label, _ in rows]
    assert "5 min – 8 min" in labels and "8 min – 10 min (past TTL)" in labels
    past = [i for i, label in enumerate(labels) if "past TTL" in label]
    assert past == list(range(past[0], len(labels)))
    later = labelled[(labelled["turn"] > 1) & labelled["gap_s"].notna()]
    assert sum(sum(counts.values()) for _, counts in rows) == len(later)
    # Past the TTL, expired dominates; well within it, remote hits do.
    counts = dict(rows)
    assert max(counts["8 min – 10 min (past TTL)"],
               key=counts["8 min – 10 min (past TTL)"].get) == "expired"
    assert max(counts["under 10 s"], key=counts["under 10 s"].get) == "remote-hit"


def test_html_without_matplotlib_names_the_extra(synthetic_store, tmp_path, monkeypatch):
    import sys

    from click.testing import CliRunner

    from kvobs.cli import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    page = tmp_path / "report.html"
    result = CliRunner().invoke(main, ["report", "--source", synthetic_store[0],
                                       "--html", str(page)])
    assert result.exit_code == 2
    assert "pip install 'kvobs[fleet]'" in result.output and not page.exists()


# --------------------------------------------------------------------------- #27: a report to
# drill into, on the demo run's spans (tests/data/demo-spans.otlp.jsonl)

DEMO_SPANS = str(Path(__file__).resolve().parents[1] / "data" / "demo-spans.otlp.jsonl")


@pytest.fixture(scope="module")
def demo():
    source = open_source(DEMO_SPANS)
    report, labelled = build_report(fleet_turns(source), DEMO_SPANS)
    add_trace_ids(report.extras["drill_down"], source)
    return report, labelled, render_html(report, labelled)


def test_render_doctests():
    import kvobs.fleet.report
    import kvobs.render

    for module in (kvobs.render, kvobs.fleet.report):
        failures, tried = doctest.testmod(module)
        assert tried > 0 and failures == 0


def test_every_fault_is_listed_with_its_trace_and_command(demo):
    report, labelled, _ = demo
    drill = report.extras["drill_down"]
    faults = fault_count(report.first_turn["verdicts"]) + fault_count(
        report.later_turns["verdicts"])
    listed = [row for row in drill["rows"] if row["kind"] == "fault"]
    assert drill["fault_turns"] == len(listed) == faults == 5
    assert {(row["conversation_id"], row["verdict"]) for row in listed} == {
        ("agent-slow-tool", "expired"), ("agent-late-id", "missing-metadata"),
        ("agent-unstable", "prefix-mismatch"), ("agent-rewrite", "prefix-mismatch"),
        ("agent-d-restart", "transfer-failed")}
    latencies = [row["latency_s"] for row in listed]
    assert latencies == sorted(latencies, reverse=True)  # the slowest first
    for row in drill["rows"]:
        assert re.fullmatch(r"[0-9a-f]{32}", row["trace_id"])
        assert row["top_cause"] in {c.value for c in sc.LatencyCause}
        assert shlex.split(row["command"]) == [
            "kvobs", "diagnose", row["conversation_id"], "--source", DEMO_SPANS]
    # The trace id is the turn's: the proxy's turn span in that trace.
    spans = open_source(DEMO_SPANS).spans("agent-d-restart")
    (row,) = [r for r in listed if r["conversation_id"] == "agent-d-restart"]
    turn_spans = spans[(spans["name"] == sc.SPAN_PROXY_TURN.name)
                       & (spans[sc.TURN_INDEX.key] == row["turn"])]
    assert list(turn_spans["trace_id"]) == [row["trace_id"]]


def test_a_shared_id_names_its_tenant_and_odd_ids_are_quoted():
    assert diagnose_command("my dir", "agent's", "t1", None) == (
        "kvobs diagnose 'agent'\"'\"'s' --source 'my dir' --tenant t1")
    assert shlex.split(diagnose_command("d", "--help")) == [
        "kvobs", "diagnose", "--source", "d", "--", "--help"]


def test_the_worst_conversations_get_waterfalls(demo):
    report, labelled, page = demo
    worst = worst_conversations(report.extras["drill_down"], labelled)
    assert [cid for cid, _ in worst] == ["agent-slow-tool", "agent-late-id",
                                         "agent-unstable"]
    assert page.count("<img alt='phases of each turn of conversation") == 3
    for cid, tenant in worst:
        assert f"id='waterfall-{tenant}-{cid}'" in page
        assert f"<a href='#waterfall-{tenant}-{cid}'>{cid}</a>" in page


def test_nothing_leaks_into_the_page(demo):
    """Tooltips and alt texts included (a browser shows them only on hover)."""
    _, _, page = demo
    text = html.unescape(re.sub(r"<[^>]+>", " ", _text(page)))
    titles = " ".join(html.unescape(t) for t in re.findall(r"<title>([^<]*)</title>", page))
    for shown in (text, titles):
        assert "`" not in shown
        assert not re.search(r"(?<![\d.,])1 (turns|conversations|exports|tokens)\b", shown)
        assert not re.search(r"\b(gib|byte|block) (hours|seconds)\b", shown)
        assert not re.search(r"(?<![\w.])-\d[\d.,]*\s?(ms|s)\b", shown)
    assert "0 < M < kv_recompute_threshold" in text  # the literal, without its markup
    assert "D: held (GiB-hours)" in text and "Host tier: held (byte-seconds" in text


def test_retention_keys_all_have_labels(demo):
    report, _, _ = demo
    for place in ("device", "host"):
        assert set(report.retention[place]) <= set(RETENTION)


def test_phases_take_their_groups_hue():
    """Every phase has a colour in its latency cause's group; groups never share one."""
    assert set(PHASE_COLOURS) == set(Phase)
    for group, shades in GROUP_COLOURS.items():
        assert all(CAUSE_OF[phase] is group for phase in shades)
    assert len(set(PHASE_COLOURS.values())) == len(PHASE_COLOURS)
    assert set(GROUPS) == set(CAUSE_OF.values())
