"""The HTML report in a real browser: Debian's headless Chromium loads it with no console
error or warning, every plot decodes, nothing overflows a 1300-pixel window, and a
full-page screenshot is kept (path printed; CI keeps out/artifacts/). On the demo run's
spans: a row per fault in the table of turns to follow up, each with its trace id and
`kvobs diagnose` command, and nothing leaked (docstring markup, "1 turns", raw keys, a
negative phase) in the page or the terminal report."""

import os
import re
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner

import headless
from kvobs.cli import main

ROOT = Path(__file__).resolve().parents[2]
DEMO_SPANS = ROOT / "tests" / "data" / "demo-spans.otlp.jsonl"
ARTIFACTS = Path(os.environ.get("KVOBS_ARTIFACTS", ROOT / "out" / "artifacts"))
WIDTH = 1300

needs_chromium = pytest.mark.skipif(
    headless.CHROMIUM is None,
    reason="chromium is not installed (Debian package `chromium`; scripts/setup.sh "
           "installs it)")

PROBES = {
    "images": "[...document.images].map(i => i.complete && i.naturalWidth)",
    "page_width": "document.documentElement.scrollWidth",
    "charts": "document.querySelectorAll('svg.bars').length",
    "bar_tips": "[...document.querySelectorAll('svg.bars rect title')].length",
    "text": "document.body.innerText",
    "headings": "[...document.querySelectorAll('thead th')].map(th => th.innerText)",
    "follow_up": "[...document.querySelectorAll('table.follow-up tbody tr')].map("
                 "tr => [...tr.cells].map(td => td.innerText))",
    "links": "[...document.querySelectorAll('a[href^=\"#\"]')].map(a => "
             "!!document.getElementById(a.getAttribute('href').slice(1)))",
    "phase_cells": "[...document.querySelectorAll('table:not(.follow-up) tbody tr')].map("
                   "tr => tr.innerText)",
}
# What must never show: docstring markup, a count that disagrees with its noun, a raw
# key, a negative duration.
LEAKS = {
    "backticks": re.compile(r"`"),
    "one with a plural": re.compile(r"(?<![\d.,])1 (turns|conversations|exports|tokens|"
                                    r"copies|slow turns|later turns)\b"),
    "raw key": re.compile(r"\b(gib|byte|block) (hours|seconds)\b|\b[a-z]+_[a-z_]+_(s|ns|"
                          r"seconds|hours|turns|tokens|ratio|bytes)\b"),
    "negative duration": re.compile(r"(?<![\w.])-\d[\d.,]*\s?(ms|s)\b"),
    "clock skew": re.compile(r"clocks of"),
}


def _leaks(text: str) -> dict[str, list[str]]:
    return {name: pattern.findall(text) for name, pattern in LEAKS.items()
            if pattern.search(text)}


@needs_chromium
def test_the_console_capture_sees_what_a_broken_page_does(tmp_path):
    page = tmp_path / "broken.html"
    page.write_text("<!doctype html><html><head><meta charset='utf-8'><title>x</title>"
                    "</head><body><img src='missing.png'><script>console.error('boom');"
                    "undefined_function();</script></body></html>")
    loaded = headless.load(page.as_uri())
    assert any("ERR_FILE_NOT_FOUND" in line for line in loaded.console)
    assert "console.error: boom" in loaded.console
    assert any("undefined_function is not defined" in line for line in loaded.console)


@pytest.fixture(scope="module")
def report_page(synthetic_store, tmp_path_factory):
    page = tmp_path_factory.mktemp("html") / "report.html"
    result = CliRunner().invoke(main, ["report", "--source", synthetic_store[0],
                                       "--html", str(page)])
    assert result.exit_code == 0, result.output
    return page


@needs_chromium
def test_report_renders_cleanly_in_chromium(report_page):
    loaded = headless.load(report_page.as_uri(), WIDTH, PROBES)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "html-report.png"
    shot.write_bytes(loaded.screenshot)
    print(f"screenshot of the HTML report: {shot}")
    assert loaded.console == []
    values = loaded.values
    # the worst conversations' waterfalls (three), phase shares, read time vs tokens
    assert len(values["images"]) == 5 and all(w and w > 0 for w in values["images"])
    assert values["page_width"] <= WIDTH
    assert values["charts"] == 3 and values["bar_tips"] > 20
    # Labelled columns, formatted numbers: no raw keys, no exponents.
    text = values["text"]
    assert not re.search(r"\b\w+_(ratio|s|turns|bytes|tokens)\b", text)
    assert not re.search(r"\d\.?\d*e[-+]\d", text)
    assert {"Remote hits", "TTFT p50", "Latency p95", "Share of latency"} <= set(
        values["headings"])
    assert loaded.screenshot[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def demo_report(tmp_path_factory):
    """The demo run's report: the HTML page and the terminal text."""
    page = tmp_path_factory.mktemp("demo-html") / "report.html"
    result = CliRunner().invoke(main, ["report", "--source", str(DEMO_SPANS), "--html",
                                       str(page)])
    assert result.exit_code == 0, result.output
    return page, result.output


def test_the_demo_terminal_report_lists_the_faults_and_leaks_nothing(demo_report):
    from kvobs.fleet import build_report, fleet_turns
    from kvobs.render import fault_count
    from kvobs.sources import open_source

    _, text = demo_report
    report, _ = build_report(fleet_turns(open_source(str(DEMO_SPANS))), str(DEMO_SPANS))
    faults = fault_count(report.later_turns["verdicts"]) + fault_count(
        report.first_turn["verdicts"])
    assert faults == 5  # the scenario's faults that reach the report
    assert len(re.findall(r"^\s*fault\s", text, re.M)) == faults
    assert f"{faults} turns with a fault verdict" in text
    assert not _leaks(text), _leaks(text)
    command = f"kvobs diagnose agent-d-restart --source {shlex.quote(str(DEMO_SPANS))}"
    assert command in text


@needs_chromium
def test_the_demo_page_has_a_row_per_fault_and_leaks_nothing(demo_report):
    from kvobs.fleet import build_report, fleet_turns
    from kvobs.render import fault_count
    from kvobs.sources import open_source

    page, _ = demo_report
    loaded = headless.load(page.as_uri(), WIDTH, PROBES)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / "html-report-demo.png").write_bytes(loaded.screenshot)
    assert loaded.console == []
    values = loaded.values
    assert values["page_width"] <= WIDTH
    assert len(values["images"]) == 5 and all(w and w > 0 for w in values["images"])
    report, _ = build_report(fleet_turns(open_source(str(DEMO_SPANS))), str(DEMO_SPANS))
    faults = fault_count(report.later_turns["verdicts"]) + fault_count(
        report.first_turn["verdicts"])
    rows = values["follow_up"]
    fault_rows = [row for row in rows if row[0] == "fault"]
    assert len(fault_rows) == faults == 5
    by_conversation = {row[1]: row for row in fault_rows}
    restart = by_conversation["agent-d-restart"]
    assert restart[2:4] == ["2", "transfer-failed"]
    assert re.fullmatch(r"[0-9a-f]{32}", restart[6])  # the turn's trace id
    assert restart[7] == (f"kvobs diagnose agent-d-restart --source "
                          f"{shlex.quote(str(DEMO_SPANS))}")
    assert all(row[5] != "–" for row in fault_rows)  # every fault has a top cause
    assert values["links"] and all(values["links"])  # every in-page link lands
    text = values["text"]
    assert not _leaks(text), _leaks(text)
    # The phase tables name every phase some turn spent time in, none below zero.
    assert not [row for row in values["phase_cells"] if re.search(r"\t-\d", row)]
