"""Reads held by P's own compute, on the real engines (#25): three conversations' second
turns sent together (scenarios/concurrent-reads.toml), long prompts landing on P right
after them. P's worker posts the reads at the start of a step that computes a chunk of
those prompts and sees a read done only when it polls, after the step, so the reads "end"
with it; kvobs tells the time P did not watch (``kvobs.read.unobserved``) from the read's
own time and calls none of them slow-transfer.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvobs import semconv as sc
from kvobs.causes import HELD_READ_SHARE
from kvobs.sources import open_source
from kvobs.testbed.check import diagnosed_turns

pytestmark = pytest.mark.testbed
ROOT = Path(__file__).resolve().parents[2]
# A read P held at least this long is one its step held, not a transfer of three 64 KiB
# blocks over loopback (milliseconds when P polls in time).
HELD_S = 0.1


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from kvobs.cli.testbed import run_to_dir

    out = tmp_path_factory.mktemp("concurrent-reads")
    scenario, results = run_to_dir(str(ROOT / "scenarios" / "concurrent-reads.toml"), str(out))
    return scenario, out, results


def test_the_second_turns_were_in_flight_together(run):
    """The client's concurrent mode: every second turn was sent before any ended."""
    _, _, results = run
    assert [(r.label, r.turn) for r in results if not r.ok] == []
    batch = [r for r in results if r.turn == 2]
    assert len(batch) == 3
    assert max(r.started_at for r in batch) < min(r.started_at + r.latency_s for r in batch)


def _second_turns(run) -> list[tuple]:
    """(label, read seconds, unobserved seconds, diagnosis) of each second turn."""
    _, out, results = run
    diagnosed = diagnosed_turns(open_source(str(out)), results)
    turns = []
    for result in (r for r in results if r.turn == 2):
        d = diagnosed[(result.label, result.turn)]
        assert d is not None, result.label
        turns.append((result.label, d.turn.get("read_duration_s"),
                      d.turn.get("read_unobserved_s"), d))
    return turns


def test_concurrent_reads_are_not_slow_transfer(run):
    """Each second turn read its first turn's KV from D and is remote-hit, never
    slow-transfer; a slow-read cause, where named, blames P's step and not the link."""
    turns = _second_turns(run)
    seen = [(label, duration, unobserved) for label, duration, unobserved, _ in turns]
    for _, _, _, d in turns:
        assert d.turn.get("read_outcome") == sc.ReadOutcome.DONE.value, d.finding
        assert d.finding.verdict is sc.Verdict.REMOTE_HIT, (d.finding, seen)
        for cause in d.causes:
            if cause.cause is sc.LatencyCause.SLOW_READ:
                assert "P was busy, not the link" in cause.remedy, cause


def test_reads_held_by_p_s_step_are_told_apart_from_the_link(run):
    """A read P's step held (most of its duration unwatched, at least HELD_S) has only a
    small part of it known in flight. Whether P's step holds a read depends on the run:
    on a loaded box (load 12-31) two or three of the three reads were held 0.20-0.42 s;
    on an idle one (CI, 2026-12-06) all three ended in under 7 ms, before the long
    prompts' step began. With no held read there is nothing to tell apart: skipped, with
    the reads' times (making the overlap certain is open in #25)."""
    seen = [(label, duration, unobserved) for label, duration, unobserved, _ in _second_turns(run)]
    held = [(label, duration, unobserved) for label, duration, unobserved in seen
            if unobserved >= HELD_READ_SHARE * duration and unobserved >= HELD_S]
    if not held:
        pytest.skip(f"P's step held no read in this run: {seen}")
    assert all(duration - unobserved < 0.25 * duration for _, duration, unobserved in held), seen
