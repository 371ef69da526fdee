"""Time ``kvobs report`` from classified turn rows against the span path, in one run.

    python bench/turn_report_bench.py --dir /tmp/kvobs-bench [--conversations 270000]
        [--spans 10000000,100000000] [--skip-spans-report]

1. The synthetic store of ``--conversations`` (``_synthetic_store.bench_store``: 270,000
   give ~14M spans, 1.35M turns; generated once, then reused).
2. Its turn rows, from the span path's own labelled table (``kvobs.live.backfill``: every
   turn as the classifier would have stored it, one merged, indexed file per hour). Each
   row's JSON holds its keys and verdict only (no causes: the drill-down's top cause is
   then empty; computing causes for 1.35M turns takes minutes).
3. Turn stores of ``--spans`` spans' worth of turns (the 14M store's spans per turn), made
   by copying step 2's rows under fresh conversation ids, each copy a day later: turn
   rows generated directly, because generating and classifying 100M spans takes longer
   than this bench may.
4. ``kvobs report --json`` as a subprocess over the span store and over every turn store:
   wall time, CPU time and peak RSS (``/usr/bin/time``). The span report's and the 14M
   turn rows' report's counts are checked equal.
5. Each turn store again with the tallies ``kvobs collect`` keeps next to its merged files
   (``kvobs.fleet.turn_report.summarize``, timed in this process: what the service pays
   once per merged file), the report JSON checked equal to step 4's (floats to 9
   significant digits: sums added in another order). Step 4 runs with the tallies moved
   aside.

Targets (issue #24): 100M spans' worth under 30 s, peak RSS at most 1 GiB, the 10M and
100M peaks within 1.2x; the 14M store's turn rows under 3 s.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import math
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _synthetic_store import bench_store, dir_size, peak_rss_mb_of  # noqa: E402

KVOBS = [sys.executable, "-m", "kvobs"]
DONE = "turn-rows.json"


def template_rows(store: str, directory: str):
    """The store's turns as turn rows under ``directory`` (made once); returns the table."""
    import pyarrow.parquet as pq

    from kvobs.fleet import fleet_turns
    from kvobs.fleet.report import label_turns
    from kvobs.live.backfill import turn_rows_table, write_turn_rows
    from kvobs.sources import open_source

    marker = os.path.join(directory, DONE)
    cached = os.path.join(directory, "template.parquet")
    if os.path.exists(marker):
        return pq.read_table(cached)
    shutil.rmtree(directory, ignore_errors=True)
    started = time.perf_counter()
    labelled, rate = label_turns(fleet_turns(open_source(store)))
    table = turn_rows_table(labelled, rate)
    del labelled
    write_turn_rows(directory, table)
    pq.write_table(table, cached)
    with open(marker, "w", encoding="utf-8") as handle:
        json.dump({"rows": table.num_rows, "made_s": time.perf_counter() - started}, handle)
    print(f"turn rows of {store}: {table.num_rows:,} in {time.perf_counter() - started:.0f}s")
    return table


def copied_store(template, directory: str, rows: int) -> str:
    """A turn store of ``rows`` rows: the template's, copied under fresh ids a day apart."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from kvobs.live.backfill import write_turn_rows
    from kvobs.live.turn_measures import MEASURES_COLUMN

    marker = os.path.join(directory, DONE)
    if os.path.exists(marker):
        with open(marker, encoding="utf-8") as handle:
            if json.load(handle)["rows"] == rows:
                return directory
    shutil.rmtree(directory, ignore_errors=True)
    started = time.perf_counter()
    written = 0
    for copy in range(math.ceil(rows / template.num_rows)):
        part = template.slice(0, min(template.num_rows, rows - written))
        ids = pc.binary_join_element_wise(part["conversation_id"], pa.scalar(f"~{copy}"), "")
        part = part.set_column(part.schema.get_field_index("conversation_id"),
                               "conversation_id", ids)
        shifted = pc.add(part["finalized_at"], 86_400.0 * copy)
        part = part.set_column(part.schema.get_field_index("finalized_at"), "finalized_at",
                               shifted)
        at = part.schema.get_field_index(MEASURES_COLUMN)
        part = part.set_column(at, MEASURES_COLUMN, _later(part[MEASURES_COLUMN], copy))
        write_turn_rows(directory, part, stamp=f"copy{copy}")
        written += part.num_rows
    with open(marker, "w", encoding="utf-8") as handle:
        json.dump({"rows": written}, handle)
    print(f"turn store {directory}: {written:,} rows in {time.perf_counter() - started:.0f}s")
    return directory


def _later(measures, days: int):
    """The packed measures with every instant ``days`` later."""
    import numpy as np
    import pyarrow as pa

    from kvobs.live.turn_measures import MEASURE_DTYPE, NULL_INT

    column = measures.combine_chunks()
    offsets = np.frombuffer(column.buffers()[1], np.int32, len(column) + 1)
    data = memoryview(column.buffers()[2])[offsets[0] : offsets[-1]]
    records = np.frombuffer(data, MEASURE_DTYPE, len(column)).copy()
    for name in MEASURE_DTYPE.names:
        if name.endswith("_ns"):
            known = records[name] != NULL_INT
            records[name][known] += 86_400 * 10**9 * days
    size = MEASURE_DTYPE.itemsize
    packed = pa.FixedSizeBinaryArray.from_buffers(
        pa.binary(size), len(records), [None, pa.py_buffer(records.tobytes())]
    )
    return packed.cast(pa.binary())


@contextlib.contextmanager
def tallies_aside(directory: str):
    """The store as it is without the tallies next to its merged files."""
    tallies = glob.glob(os.path.join(directory, "turns", "*", "*.tally"))
    for path in tallies:
        os.replace(path, path + ".aside")
    try:
        yield
    finally:
        for path in tallies:
            os.replace(path + ".aside", path)


def summarized(directory: str) -> float:
    """Keeps a tally next to each merged file lacking one; returns the CPU seconds."""
    from kvobs.fleet.turn_report import summarize
    from kvobs.live.turnstore import TurnStore

    started = time.process_time()
    done = summarize(TurnStore(directory, 0))
    spent = time.process_time() - started
    if done:
        print(f"  tallies of {len(done)} merged files of {directory}: {spent:.1f} CPU-s")
    return spent


def _rounded(value):
    if isinstance(value, float):
        return float(f"{value:.9g}")
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


def timed_report(source: str) -> dict:
    wall, peak, out, cpu = peak_rss_mb_of([*KVOBS, "report", "--json", "--source", source])
    report = json.loads(out)
    print(f"  kvobs report --json --source {source}: {report['turns']:,} turns, "
          f"{wall:.2f} s wall, {cpu:.2f} s CPU, {peak:.0f} MiB peak RSS", flush=True)
    return {"wall_s": wall, "cpu_s": cpu, "peak_mib": peak, "report": report}


def _counts(report: dict) -> dict:
    return {
        "conversations": report["conversations"],
        "turns": report["turns"],
        **{s: report[s]["verdicts"] for s in ("first_turn", "later_turns")},
        "bytes_read": report["later_turns"]["bytes_read"],
        "fault_turns": report["drill_down"]["fault_turns"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default="/tmp/kvobs-bench")
    parser.add_argument("--conversations", type=int, default=270_000)
    parser.add_argument("--spans", default="10000000,100000000")
    parser.add_argument("--skip-spans-report", action="store_true")
    args = parser.parse_args()
    store, _ = bench_store(args.dir, args.conversations)
    with open(os.path.join(store, "synthetic.json"), encoding="utf-8") as handle:
        info = json.load(handle)
    spans_per_turn = info["spans"] / info["turns"]
    template_dir = os.path.join(args.dir, f"turn-rows-{args.conversations}")
    template = template_rows(store, template_dir)
    results, stores = [], [template_dir]
    if not args.skip_spans_report:
        span = timed_report(store)
        results.append((f"spans, {info['spans'] / 1e6:.2f}M spans", span, info["turns"]))
    with tallies_aside(template_dir):
        same = timed_report(template_dir)
    name = f"turn rows of that store ({template.num_rows:,})"
    results.append((name, same, template.num_rows))
    if not args.skip_spans_report:
        assert _counts(same["report"]) == _counts(span["report"]), "counts differ"
        print("counts of the turn-row report equal the span report's")
    summarized(template_dir)
    tallied = timed_report(template_dir)
    assert _rounded(tallied["report"]) == _rounded(same["report"]), "tallies change the report"
    results.append(("  the same, with the merged files' tallies", tallied, template.num_rows))
    for spans in (int(s) for s in args.spans.split(",")):
        rows = round(spans / spans_per_turn)
        directory = copied_store(template, os.path.join(args.dir, f"turn-rows-{spans}"), rows)
        stores.append(directory)
        with tallies_aside(directory):
            from_rows = timed_report(directory)
        results.append((f"turn rows, {spans / 1e6:.0f}M spans' worth ({rows:,})", from_rows, rows))
        summarized(directory)
        tallied = timed_report(directory)
        assert _rounded(tallied["report"]) == _rounded(from_rows["report"]), "tallies differ"
        results.append(("  the same, with the merged files' tallies", tallied, rows))
    print("every report with tallies equals the one from rows (floats to 9 digits)")
    print(f"{'source':48} {'turns':>10} {'wall s':>7} {'cpu s':>7} {'peak MiB':>9}")
    for name, result, turns in results:
        print(f"{name:48} {turns:>10,} {result['wall_s']:7.2f} {result['cpu_s']:7.2f} "
              f"{result['peak_mib']:9.0f}")
    for directory in stores:
        print(f"{directory}: {dir_size(directory) / 2**20:,.0f} MiB on disk")


if __name__ == "__main__":
    main()
