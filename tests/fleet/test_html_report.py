"""The HTML report's content, without a browser: labelled columns with units, numbers
formatted for people, verdict mixes as charts whose counts are the report's, gaps binned
around D's TTL."""

import re

import pytest

from kvobs.fleet import build_report, fleet_turns
from kvobs.fleet.html import gap_bins, number, percent, render_html
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
