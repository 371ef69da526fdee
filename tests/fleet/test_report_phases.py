"""The report's phase ranking, TTFT apart from latency, and the HTML waterfall, on turns
whose phases the span factory set (so every total, share and rank is known)."""

import json
import re

import numpy as np
import pytest
from click.testing import CliRunner
from spanfactory import Tracers, TurnSpec, write_conversation

from kvobs import semconv as sc
from kvobs.cli import main
from kvobs.fleet import build_report, fleet_turns
from kvobs.fleet._plots import UNMEASURED, phase_colour, waterfall
from kvobs.fleet.html import render_html
from kvobs.sources import open_source

NO_P_D = (sc.SPAN_PREFILL_REQUEST.name, sc.SPAN_DECODE_REQUEST.name)
# Turn 1 spends its time computing and decoding; later turns queue at P. One later turn
# lacks P's and D's request spans: all its time but proxy-in is unmeasured, its TTFT too.
CONVERSATIONS = {
    "queued": [
        TurnSpec(decision="no-params", stream=True,
                 phases={"proxy-in": 0.01, "p-compute": 0.4, "decode": 1.0}),
        TurnSpec(read="done", phases={"p-queue": 2.0, "read": 0.1, "p-compute": 0.05,
                                      "decode": 1.0}),
        TurnSpec(read="done", phases={"p-queue": 3.0, "read": 0.1, "p-compute": 0.05,
                                      "decode": 0.5})],
    "long-output": [
        TurnSpec(decision="no-params", phases={"p-compute": 0.6, "decode": 2.0}),
        TurnSpec(decision="no-params", phases={"p-queue": 1.0, "p-compute": 0.5,
                                               "d-queue": 0.25, "decode": 0.5})],
    "unmeasured": [
        TurnSpec(decision="no-params", phases={"p-compute": 0.3, "decode": 0.2}),
        TurnSpec(read="done", omit=NO_P_D, phases={
            "proxy-in": 0.05, "p-queue": 0.4, "read": 0.2, "p-compute": 0.1,
            "decode": 0.2})],
}
# Marks are float unix seconds (~0.24 us apart at 1.7e9 s): phases are exact to ~1 us.
US = 1e-6


@pytest.fixture(scope="module")
def phase_store(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("phases"))
    tracers = Tracers(path)
    for offset, (name, specs) in enumerate(CONVERSATIONS.items()):
        write_conversation(tracers, name, specs, 1_700_000_000.0 + 100 * offset)
    return path


@pytest.fixture(scope="module")
def built(phase_store):
    return build_report(fleet_turns(open_source(phase_store)), phase_store)


def _ranked(section):
    """Phases with time in them (a step not taken reads ~0.1 us: mark rounding)."""
    return [(row["phase"], row["total_s"]) for row in section["phases"]
            if row["total_s"] > 10 * US]


def test_later_turns_rank_p_queue_first_with_exact_totals_and_shares(built):
    later = built[0].phases["later_turns"]
    assert later["turns"] == later["timed_turns"] == 4
    assert later["latency_s"] == pytest.approx(10.0, abs=10 * US)
    expected = [("p-queue", 6.0), ("decode", 2.0), ("p-compute", 0.6), ("d-queue", 0.25),
                ("read", 0.2), ("proxy-in", 0.05)]
    assert [name for name, _ in _ranked(later)] == [name for name, _ in expected]
    for (_, total), row in zip(expected, later["phases"]):
        assert row["total_s"] == pytest.approx(total, abs=10 * US)
        assert row["share"] == pytest.approx(total / 10.0, abs=10 * US)
    # The turn without P's and D's request spans: 0.9 s not measured phase by phase.
    assert later["unmeasured_turns"] == 1
    assert later["unmeasured_s"] == pytest.approx(0.9, abs=10 * US)
    shares = sum(row["share"] for row in later["phases"]) + later["unmeasured_share"]
    assert shares == pytest.approx(1.0, abs=10 * US)


def test_percentiles_and_slowest_counts_per_phase(built):
    rows = {row["phase"]: row for row in built[0].phases["later_turns"]["phases"]}
    queue = rows["p-queue"]  # 2, 3, 1 s; not measured alone on the span-less turn
    assert queue["measured_turns"] == 3 and queue["slowest_turns"] == 3
    assert queue["p50_s"] == pytest.approx(2.0, abs=US)
    assert queue["p95_s"] == pytest.approx(np.quantile([1.0, 2.0, 3.0], 0.95), abs=US)
    # A step no turn took is measured as 0 s, never slowest.
    assert rows["p-retry"]["measured_turns"] == 4 and rows["p-retry"]["total_s"] < US
    assert rows["proxy-in"]["slowest_turns"] == 1  # the only phase the bare turn measured
    assert sum(row["slowest_turns"] for row in rows.values()) == 4


def test_turn_one_is_ranked_apart(built):
    first = built[0].phases["first_turn"]
    assert first["turns"] == 3 and first["unmeasured_turns"] == 0
    assert first["latency_s"] == pytest.approx(4.51, abs=10 * US)
    ranked = _ranked(first)
    assert [name for name, _ in ranked] == ["decode", "p-compute", "proxy-in"]
    assert [total for _, total in ranked] == pytest.approx([3.2, 1.3, 0.01], abs=10 * US)
    slowest = {row["phase"]: row["slowest_turns"] for row in first["phases"]}
    assert slowest["decode"] == 2 and slowest["p-compute"] == 1
    assert all(row["total_s"] < US for row in first["phases"] if row["phase"] == "p-queue")


def test_ttft_and_latency_apart_and_unmeasured_ttft_counted(built):
    report, _ = built
    first, later = report.first_turn, report.later_turns
    assert first["ttft_unmeasured_turns"] == 0 and later["ttft_unmeasured_turns"] == 1
    # TTFT: the phases before decode (0.41, 0.6, 0.3 s); latency: all of them.
    assert first["ttft_p50_s"] == pytest.approx(0.41, abs=10 * US)
    assert first["latency_p50_s"] == pytest.approx(1.41, abs=10 * US)
    assert later["latency_p50_s"] == pytest.approx((2.25 + 3.15) / 2, abs=10 * US)


def test_cli_prints_ranked_phases(phase_store):
    runner = CliRunner()
    text = runner.invoke(main, ["report", "--source", phase_store]).output
    later = text[text.index("where the time went, later turns"):]
    assert later.index("p-queue") < later.index("decode") < later.index("p-compute")
    assert "unmeasured (1 turn)" in later
    data = json.loads(runner.invoke(main, ["report", "--source", phase_store,
                                           "--json"]).output)
    assert data["phases"]["later_turns"]["phases"][0]["phase"] == "p-queue"
    assert data["phases"]["first_turn"]["phases"][0]["phase"] == "decode"
    assert data["later_turns"]["ttft_unmeasured_turns"] == 1


def _bars(axis, turn):
    """The turn's bar segments, left to right: (left, width, facecolour, hatch)."""
    return sorted((patch.get_x(), patch.get_width(), patch.get_facecolor(), patch.get_hatch())
                  for patch in axis.patches if abs(patch.get_y() + patch.get_height() / 2
                                                   - turn) < 1e-9)


def test_waterfall_draws_phases_in_order_and_hatches_the_unmeasured(built):
    import matplotlib

    matplotlib.use("Agg")
    _, labelled = built
    axis = waterfall(labelled, "queued").axes[0]
    segments = [s for s in _bars(axis, 2) if s[1] > 10 * US]
    colours = [phase_colour(name) for name in ("p-queue", "read", "p-compute", "decode")]
    assert [tuple(s[2]) for s in segments] == [tuple(c) for c in colours]
    assert [s[1] for s in segments] == pytest.approx([2.0, 0.1, 0.05, 1.0], abs=10 * US)
    notes = [t.get_text() for t in axis.texts]
    assert any("queued-at-p" in note for note in notes)
    # Segments wide enough carry their phase's name (the rest are in the legend).
    assert {"p-queue", "decode"} <= set(notes)
    assert {"p-queue", "read", "p-compute", "decode"} <= {
        t.get_text() for t in axis.get_legend().get_texts()}
    axis = waterfall(labelled, "unmeasured").axes[0]
    hatched = [s for s in _bars(axis, 2) if s[3]]
    assert sum(s[1] for s in hatched) == pytest.approx(0.9, abs=10 * US)
    assert UNMEASURED in [t.get_text() for t in axis.get_legend().get_texts()]


def test_html_has_phase_sections(built):
    report, labelled = built
    text = render_html(report, labelled, "queued")
    assert "Where the time went: phases ranked by total seconds" in text
    assert "Per-turn waterfalls of the worst conversations: phases" in text
    assert "Phase shares of the fleet's latency, p50/p95 per turn" in text
    # the conversation asked for first, then those of the faulty and slow turns
    waterfalls = re.findall(r"<img alt='phases of each turn of conversation (\S+)'", text)
    assert waterfalls == ["queued", "long-output"]
    assert text.count("data:image/png;base64,") == len(waterfalls) + 2
    first = text.index("<h3>turn 1:")
    later = text.index("<h3>later turns:")
    assert first < text.index("</span>decode</td>", first) < later
    assert (text.index("</span>p-queue</td>", later)
            < text.index("</span>decode</td>", later))
    # Each phase with its marks; the phases no turn took named once, not as rows of 0.
    assert "<td class='span'>p-arrived → p-scheduled</td>" in text
    assert "</span>p-retry</td>" not in text and "spent time in: " in text
