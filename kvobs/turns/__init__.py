"""The turn table: the stage between the span sources and the classifiers.

- ``schema``: its columns, one declaration each (span, attribute, aggregation);
- ``lineage``: which earlier D export each prompt extends, from engine evidence alone;
- ``correlate``: proxy, P and D spans joined into one row per turn;
- ``columns``: the column tests the timeline, verdicts and causes decide with;
- ``arrays``: numpy <-> Arrow without pyarrow's pandas import (the diagnose path's).
"""
