"""Time ``kvobs report`` over a ClickHouse (chdb) turn table, the aggregation pushed into
the engine (``kvobs.fleet.turn_sql``) against the rows read in batches, in one run.

    python bench/turn_report_chdb_bench.py --dir /tmp/kvobs-chbench [--conversations 20000]
        [--rows 1000000] [--before PATH] [--repeat 2]

1. The synthetic store of ``--conversations`` and its turn rows (``turn_report_bench``'s
   ``template_rows``: the span path's labelled table as the classifier would store it).
2. A chdb turn table (``ClickHouseTurns``'s DDL) of ``--rows`` rows: the template copied
   under fresh conversation ids, each copy a day later (``copied_store``'s way), in a
   process of its own (a chdb directory is opened by one process at a time). No hour
   has a tally: every row is aggregated.
3. ``kvobs report --json --source chdb:DIR?turn_table=T`` as a subprocess, alternating
   this tree and ``--before`` (a tree without the push-down, e.g. ``git archive`` of the
   parent commit, put first on ``PYTHONPATH``): wall, CPU, peak RSS (``/usr/bin/time``)
   and the load average; the two reports checked equal (floats to 9 digits).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _synthetic_store import bench_store, peak_rss_mb_of  # noqa: E402
from turn_report_bench import KVOBS, _later, _rounded, template_rows  # noqa: E402

TABLE = "bench_turns"


def build(directory: str, template_dir: str, rows: int) -> None:
    """The chdb turn table of ``rows`` rows under ``directory`` (once)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from kvobs.live.clickhouse_turns import ClickHouseTurns, table_ddl
    from kvobs.live.turn_measures import MEASURES_COLUMN

    template = pq.read_table(os.path.join(template_dir, "template.parquet"))
    turns = ClickHouseTurns.from_url(f"chdb:{directory}?turn_table={TABLE}",
                                     retention_s=3650 * 86400.0)
    turns.database.query(table_ddl(TABLE, turns.retention_s))
    started, written = time.perf_counter(), 0
    for copy in range(math.ceil(rows / template.num_rows)):
        part = template.slice(0, min(template.num_rows, rows - written))
        ids = pc.binary_join_element_wise(part["conversation_id"], pa.scalar(f"~{copy}"), "")
        part = part.set_column(part.schema.get_field_index("conversation_id"),
                               "conversation_id", ids)
        part = part.set_column(part.schema.get_field_index("finalized_at"), "finalized_at",
                               pc.add(part["finalized_at"], 86_400.0 * copy))
        at = part.schema.get_field_index(MEASURES_COLUMN)
        part = part.set_column(at, MEASURES_COLUMN, _later(part[MEASURES_COLUMN], copy))
        turns.database.insert(TABLE, part)
        written += part.num_rows
    turns.database.query(f"OPTIMIZE TABLE {TABLE} FINAL")
    print(f"chdb turn table {directory} {TABLE}: {written:,} rows in "
          f"{time.perf_counter() - started:.0f}s")


def timed(source: str, tree: str) -> dict:
    # ``python -m`` puts the working directory first on sys.path: run from the tree
    os.environ["PYTHONPATH"] = tree
    here = os.getcwd()
    os.chdir(tree)
    try:
        wall, peak, out, cpu = peak_rss_mb_of([*KVOBS, "report", "--json", "--source", source])
    finally:
        os.chdir(here)
    load = os.getloadavg()[0]
    report = json.loads(out)
    print(f"  {tree}: {report['turns']:,} turns, {wall:.2f} s wall, {cpu:.2f} s CPU, "
          f"{peak:.0f} MiB peak RSS, load {load:.2f}", flush=True)
    return {"wall_s": wall, "cpu_s": cpu, "peak_mib": peak, "load": load, "report": report}


_SUMMARIZE = """
import json, sys, time
from kvobs.fleet.turn_report import summarize
from kvobs.live.clickhouse_turns import ClickHouseTurns
if sys.argv[3] == "engine":
    import kvobs.fleet.turn_sql as turn_sql
    turn_sql.ENGINE_MIN_ROWS = 0
turns = ClickHouseTurns.from_url(sys.argv[1], retention_s=3650 * 86400.0)
turns.database.query(f"DROP TABLE IF EXISTS {turns.tallies}")
hours = turns.unsummarized()
picked = hours[len(hours) // 2 : len(hours) // 2 + int(sys.argv[2])]
turns.unsummarized = lambda: picked
wall, cpu = time.perf_counter(), time.process_time()
done = summarize(turns)
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
rows = sum(turns._counted[hour] for hour in picked)
turns.database.query(f"DROP TABLE IF EXISTS {turns.tallies}")
print(json.dumps({"hours": len(done), "rows": rows, "wall_s": wall, "cpu_s": cpu}))
"""


def timed_summarize(source: str, tree: str, hours: int, engine: bool) -> dict:
    """``summarize`` (what ``kvobs collect`` runs once per closed hour) of ``hours``
    hours from the middle of the table, in a process of its own from ``tree``
    (``engine``: every hour by the engine, whatever its size); the tallies dropped."""
    env = {**os.environ, "PYTHONPATH": tree}
    done = subprocess.run(
        [sys.executable, "-c", _SUMMARIZE, source, str(hours), "engine" if engine else ""],
        cwd=tree, env=env, capture_output=True, text=True, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"  summarize, {tree}{' (engine forced)' if engine else ''}: {result['hours']} "
          f"hours, {result['rows']:,} rows, {result['wall_s']:.2f} s wall, "
          f"{result['cpu_s']:.2f} s CPU, load {os.getloadavg()[0]:.2f}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default="/tmp/kvobs-chbench")
    parser.add_argument("--conversations", type=int, default=20_000)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--before", help="a kvobs tree without the push-down")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--build-only", action="store_true")
    parser.add_argument("--summarize", type=int, default=0, metavar="HOURS",
                        help="also time summarize of HOURS hours per tree")
    args = parser.parse_args()
    template_dir = os.path.join(args.dir, f"turn-rows-{args.conversations}")
    database = os.path.join(args.dir, f"chdb-{args.rows}")
    if args.build_only:
        build(database, template_dir, args.rows)
        return
    store, _ = bench_store(args.dir, args.conversations)
    template_rows(store, template_dir)
    if not os.path.exists(database):
        subprocess.run([sys.executable, __file__, "--dir", args.dir, "--conversations",
                        str(args.conversations), "--rows", str(args.rows), "--build-only"],
                       check=True)
    source = f"chdb:{database}?turn_table={TABLE}"
    after_tree = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = {"after": after_tree, **({"before": args.before} if args.before else {})}
    results: dict[str, list[dict]] = {name: [] for name in trees}
    for _ in range(args.repeat):
        for name, tree in trees.items():
            results[name].append(timed(source, tree))
    if args.summarize:
        for _ in range(args.repeat):
            for name, tree in trees.items():
                timed_summarize(source, tree, args.summarize, False)
                if name == "after":
                    timed_summarize(source, tree, args.summarize, True)
    reports = [_rounded(r["report"]) for runs in results.values() for r in runs]
    assert all(r == reports[0] for r in reports), "the reports differ"
    print("every report equal (floats to 9 significant digits)")
    print(f"{'code':8} {'wall s':>14} {'cpu s':>14} {'peak MiB':>12} {'load':>10}")
    for name, runs in results.items():
        print(f"{name:8} {_joined(runs, 'wall_s'):>14} {_joined(runs, 'cpu_s'):>14} "
              f"{_joined(runs, 'peak_mib', 0):>12} {_joined(runs, 'load'):>10}")


def _joined(runs: list[dict], key: str, digits: int = 2) -> str:
    return " / ".join(f"{r[key]:.{digits}f}" for r in runs)


if __name__ == "__main__":
    main()
