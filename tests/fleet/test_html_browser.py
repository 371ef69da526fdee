"""The HTML report in a real browser: Debian's headless Chromium loads it with no console
error or warning, every plot decodes, nothing overflows a 1300-pixel window, and a
full-page screenshot is kept (path printed; CI keeps out/artifacts/)."""

import os
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

import headless
from kvobs.cli import main

ROOT = Path(__file__).resolve().parents[2]
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
}


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
    assert len(values["images"]) == 3 and all(w and w > 0 for w in values["images"])
    assert values["page_width"] <= WIDTH
    assert values["charts"] == 3 and values["bar_tips"] > 20
    # Labelled columns, formatted numbers: no raw keys, no exponents.
    text = values["text"]
    assert not re.search(r"\b\w+_(ratio|s|turns|bytes|tokens)\b", text)
    assert not re.search(r"\d\.?\d*e[-+]\d", text)
    assert {"Remote hits", "TTFT p50", "Latency p95", "Share of latency"} <= set(
        values["headings"])
    assert loaded.screenshot[:8] == b"\x89PNG\r\n\x1a\n"
