"""`kvobs report` in a terminal of 80, 100 and 200 columns: the table keeps the columns
that fit, never folds or truncates a cell, and the verdict mixes follow it in full."""

import re

import pytest
from click.testing import CliRunner
from rich.console import Console

from kvobs.cli import main
from kvobs.cli import report as report_cli


@pytest.mark.parametrize("width, headers", [
    (80, ["turns", "prompt", "n", "remote-hit", "faults", "TTFT p50", "latency p50"]),
    (100, ["turns", "prompt", "n", "remote-hit", "faults", "TTFT p50", "TTFT p95",
           "latency p50", "latency p95"]),
    (200, ["turns", "prompt", "n", "remote-hit", "faults", "TTFT p50", "TTFT p95",
           "latency p50", "latency p95", "bytes read", "reused tok", "host-hit", "host tok",
           "recomputed tok", "no TTFT"])])
def test_report_table_fits_the_terminal(synthetic_store, monkeypatch, width, headers):
    monkeypatch.setattr(report_cli, "console",
                        lambda: Console(width=width, color_system=None))
    result = CliRunner().invoke(main, ["report", "--source", synthetic_store[0]])
    assert result.exit_code == 0
    lines = result.output.splitlines()
    table = lines[:lines.index(next(line for line in lines if line.startswith("verdicts")))]
    assert max(len(line.rstrip()) for line in table) <= width
    assert "…" not in "\n".join(table)
    (head,) = [line for line in table if re.match(r"\s*turns\s+prompt", line)]
    assert re.split(r"\s{2,}", head.strip()) == headers
    rows = [line for line in table if re.match(r"\s*(1|2\+|2|3-4|5-8|9\+)\s+\S", line)]
    assert [row.split()[:2] for row in rows][:2] == [["1", "all"], ["2+", "all"]]
    text = " ".join(result.output.split())
    assert "verdicts, turns 2+, prompt all: missing-metadata" in text
