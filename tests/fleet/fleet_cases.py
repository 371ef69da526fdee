"""Cases and checks the fleet tests share (a module of its own: ``from conftest import``
would find whichever directory's conftest pytest imported first)."""

import os
import sys

import pandas as pd

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from spanfactory import TurnSpec  # noqa: E402

from kvobs import synth  # noqa: E402
from kvobs.turns.schema import FLEET_COLUMNS, Agg  # noqa: E402

CONFIG = synth.small(250, seed=3)
PRESENCE = {name for name, c in FLEET_COLUMNS.items() if c.agg is Agg.PRESENCE}

FACTORY_CASES = {
    "hit": [TurnSpec(), TurnSpec(read="done")],
    "declined": [TurnSpec(), TurnSpec(read="declined-expired", fallback="read-declined")],
    "failed": [TurnSpec(), TurnSpec(read="failed", fallback="read-failed")],
    "stuck": [TurnSpec(), TurnSpec(stuck=True, read=None)],
    "no-lookup": [TurnSpec(), TurnSpec(lookup=None)],
    "no-decision": [TurnSpec(), TurnSpec(decision=None, read="done")],
    "pull-no-read": [TurnSpec(), TurnSpec(read=None)],
    "invalid": [TurnSpec(), TurnSpec(decision="invalid")],
    "no-id": [TurnSpec(), TurnSpec(lookup="no-id")],
    "stale": [TurnSpec(), TurnSpec(lookup="stale", decision="no-params")],
    "released": [TurnSpec(release="expired", ttl_s=10), TurnSpec(gap_s=20, decision="local-hit")],
    "slow": [TurnSpec(prefill_leg_s=0.1), TurnSpec(read="done", read_duration_s=5.0)],
    "miss": [TurnSpec(), TurnSpec(decision="no-params")],
    "below": [TurnSpec(), TurnSpec(decision="below-threshold", local=960)],
    "no-proxy-span": [TurnSpec(), TurnSpec(proxy=False, read="done")],
}
# One conversation id used by two tenants: two conversations with different histories
# (a merge would give 3 turns instead of 2 + 3, and shift one tenant's export onto the
# other's turn).
SHARED_ID = "shared"
TENANTS = {"tenant0": [TurnSpec(release="expired", ttl_s=10),
                       TurnSpec(gap_s=20, decision="local-hit")],
           "tenant1": [TurnSpec(), TurnSpec(read="done"), TurnSpec(read="done")]}


def chdb_table(chdb_path: str, table: str, store: str, attributes: str = "map",
               view: bool = False):
    """A compacted store's spans in the exporter's span ``table`` on chdb, its attributes
    a Map or JSON; inserted after the turn view was created (as a collector would insert
    them) when ``view``."""
    from kvobs.sources.clickhouse import ClickHouseSource

    source = ClickHouseSource.chdb(chdb_path, table)
    source.create_table(attributes)
    if view:
        source.create_turns_view()
    source.load_store(store)
    return source


def same_figures(a, b, relative: float = 1e-12) -> bool:
    """Equal, floats to ``relative``: two sources hand the same turns in different orders,
    and a float sum over them rounds apart."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b or abs(a - b) <= relative * max(abs(a), abs(b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_figures(a[k], b[k], relative) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_figures(x, y, relative) for x, y in zip(a, b))
    return a == b


def assert_one_row_per_turn(turns: pd.DataFrame) -> None:
    """One row per (tenant, conversation, turn), in whatever order the source gave
    (``SpanSource.turn_row_slices``)."""
    keys = list(zip(turns["tenant"].astype(str), turns["conversation_id"].astype(str),
                    turns["turn"].tolist()))
    assert len(keys) == len(set(keys)), "a turn in two rows"


def by_key(turns: pd.DataFrame) -> pd.DataFrame:
    order = sorted(range(len(turns)), key=lambda i: (str(turns["tenant"].iloc[i]),
                                                     str(turns["conversation_id"].iloc[i]),
                                                     int(turns["turn"].iloc[i])))
    return turns.iloc[order].reset_index(drop=True)


def assert_same_turns(turns: pd.DataFrame, reference: pd.DataFrame) -> None:
    """Same rows (one per turn; compared in key order), and equal values in every shared
    column."""
    assert_one_row_per_turn(turns)
    assert_one_row_per_turn(reference)
    turns, reference = by_key(turns), by_key(reference)
    for key in ("tenant", "conversation_id", "turn"):
        assert list(turns[key].astype(str)) == list(reference[key].astype(str)), key
    for column in turns.columns:
        if column not in reference.columns:
            continue
        if column in PRESENCE:  # the fleet keeps only whether the span exists
            assert (turns[column].notna() == reference[column].notna()).all(), column
            continue
        left = pd.Series(turns[column].astype(object)).where(turns[column].notna(), None)
        right = pd.Series(reference[column].astype(object)).where(
            reference[column].notna(), None)
        assert all(a == b or (a is not None and b is not None and not isinstance(a, str)
                              and abs(float(a) - float(b))
                              <= 1e-6 * max(1, abs(float(a)) / 1e9))
                   for a, b in zip(left, right)), column
