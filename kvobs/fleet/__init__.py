"""Fleet analysis: every turn of a source at once (report, tune, what-if).

``fleet_turns(source)`` is the fleet's turn table: the source's turn rows (its
``turn_row_slices()``: Arrow/numpy for the embedded store, SQL for ClickHouse) with the
derived columns (``kvobs.turns.correlate.turn_table``); ``kvobs.verdicts.classify_frame``
(the rules themselves, which decide over whole tables) labels it; ``build_report``,
``tune`` and ``whatif`` work on the labelled table.
"""

import pandas as pd

from kvobs.turns.correlate import turn_table
from kvobs.fleet.report import FleetReport, build_report, label_turns
from kvobs.fleet.tune import Tuning, tune
from kvobs.verdicts import classify_frame
from kvobs.fleet.whatif import WhatIf, whatif

__all__ = [
    "fleet_turns",
    "classify_frame",
    "FleetReport",
    "build_report",
    "label_turns",
    "Tuning",
    "tune",
    "WhatIf",
    "whatif",
]


def fleet_turns(source) -> pd.DataFrame:
    """Every turn of ``source`` (a ``kvobs.sources.SpanSource``), fleet columns."""
    return turn_table(source.turn_row_slices())
