"""`kvobs diagnose` in a terminal of 80, 100 and 120 columns: every table row on one
line (no cell folded letter by letter), no line wider than the terminal, and every
remedy and reason word intact (wrapped only between words)."""

import io
import re

import pytest
from rich.console import Console

from kvobs.diagnose import diagnose
from kvobs.render import print_diagnosis
from kvobs.sources import open_source
from spanfactory import Tracers, TurnSpec, write_conversation

LONG = dict(n=128_000, remote=127_000, read_bytes=9_876_543_210, gap_s=599.0, ttl_s=900.0)
TURNS = [
    TurnSpec(n=120_000, phases={"p-compute": 12.0, "decode": 30.0}),
    TurnSpec(read="done", phases={"p-queue": 2.0, "read": 0.9, "decode": 1.0}, **LONG),
    TurnSpec(read="declined-expired", fallback="read-declined", **LONG),
    TurnSpec(decision=None, omit=("kvobs.prefill.request",), phases={"decode": 1.0}),
]


@pytest.fixture(scope="module")
def diagnosis(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("layout"))
    tracers = Tracers(path)
    write_conversation(tracers, "agent-with-a-rather-long-conversation-id", TURNS)
    tracers.flush()
    return diagnose(open_source(path), "agent-with-a-rather-long-conversation-id")


def _render(diagnosis, width: int) -> str:
    out = io.StringIO()
    print_diagnosis(Console(file=out, width=width, color_system=None), diagnosis)
    return out.getvalue()


def _words(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("width", [80, 100, 120, 200])
def test_table_rows_stay_on_one_line(diagnosis, width):
    lines = _render(diagnosis, width).splitlines()
    assert max(len(line.rstrip()) for line in lines) <= width
    for item in diagnosis.turns:
        verdict = item.finding.verdict.value
        (row,) = [line for line in lines
                  if re.match(rf"\s*{item.turn.index}\s+{verdict}\s", line)]
        if item.turn.get("prompt_tokens"):
            assert f"{item.turn.get('prompt_tokens'):,}" in row
    assert "…" not in "\n".join(lines)
    headers = next(line for line in lines if re.match(r"\s*turn\s+verdict", line)).split()
    # The wide columns (L, C, bytes, read time, slowest) only where they fit.
    assert ("slowest" in headers) is (width >= 150)


@pytest.mark.parametrize("width", [80, 100, 120])
def test_remedies_causes_and_reasons_wrap_between_words(diagnosis, width):
    text = _words(_render(diagnosis, width))
    for item in diagnosis.turns:
        assert _words(item.finding.remedy) in text
        for cause in item.causes:
            assert _words(cause.remedy) in text
    insufficient = diagnosis.turns[-1]
    assert insufficient.finding.verdict.value == "insufficient-evidence"
    assert insufficient.timeline.unmeasured
    # Each merged stretch once (not once per phase in it), with the span that would
    # have split it.
    reasons = sum(len(set(item.timeline.unmeasured.values())) for item in diagnosis.turns)
    assert reasons < sum(len(item.timeline.unmeasured) for item in diagnosis.turns)
    assert text.count("unmeasured ") == reasons
    assert "no kvobs.prefill.request span (kvobs-prefill)" in text
