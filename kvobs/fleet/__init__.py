"""Fleet analysis: every turn of a source at once (report, tune, what-if).

``fleet_turns(source)`` builds the turn table column-wise (Arrow/numpy for the embedded
store, SQL for ClickHouse); ``kvobs.verdicts.classify_frame`` (the rules themselves,
which decide over whole tables) labels it; ``build_report``, ``tune`` and ``whatif`` work
on the labelled table.
"""

from kvobs.fleet._turns import fleet_turns
from kvobs.fleet.report import FleetReport, build_report, label_turns
from kvobs.fleet.tune import Tuning, tune
from kvobs.verdicts import classify_frame
from kvobs.fleet.whatif import WhatIf, whatif

__all__ = ["fleet_turns", "classify_frame", "FleetReport", "build_report", "label_turns",
           "Tuning", "tune", "WhatIf", "whatif"]

