"""``kvobs tune`` from classified turn rows against the span path, on the same data, in
one run, at several fleet sizes: wall, CPU and peak RSS of each (``/usr/bin/time``), and
the ratios of the turn-row path's peaks (memory bounded by the partition, not the fleet).

    python bench/tune_rows_bench.py --dir /tmp/kvobs-bench
        [--conversations 2000,8000,32000] [--partition-rows 8192] [--no-spans]

For each size: the synthetic span store (``_synthetic_store.bench_store``, generated
once, then reused), its turn rows backfilled from the span path's labelled table
(``kvobs.live.backfill``, one merged file an hour), then ``kvobs tune --json`` over the
spans and over the turn rows as subprocesses (the turn rows replayed in partitions of
``--partition-rows`` turns, set in the child: the default, 262,144, makes every fleet
this bench can generate in minutes one partition). The two recommendations are checked
equal. ``--no-spans`` leaves the span path out (its memory grows with the fleet).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _synthetic_store import bench_store, peak_rss_mb_of  # noqa: E402

_ROWS_TUNE = (
    "import sys; from kvobs.fleet import turn_replay as t; "
    "t.PARTITION_ROWS = int(sys.argv[1]); from kvobs.cli import main; "
    "main(['tune', '--source', sys.argv[2], '--json'])"
)


def turn_rows(store: str, directory: str) -> int:
    """The store's turns as turn rows under ``directory`` (made once); their count."""
    from kvobs.fleet import fleet_turns
    from kvobs.fleet.report import label_turns
    from kvobs.live.backfill import turn_rows_table, write_turn_rows
    from kvobs.sources import open_source

    marker = os.path.join(directory, "rows.json")
    if os.path.exists(marker):
        with open(marker, encoding="utf-8") as handle:
            return json.load(handle)["turns"]
    labelled, rate = label_turns(fleet_turns(open_source(store)))
    write_turn_rows(directory, turn_rows_table(labelled, rate))
    with open(marker, "w", encoding="utf-8") as handle:
        json.dump({"turns": len(labelled)}, handle)
    return len(labelled)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default="/tmp/kvobs-bench")
    parser.add_argument("--conversations", default="2000,8000,32000")
    parser.add_argument("--partition-rows", type=int, default=8192)
    parser.add_argument("--no-spans", action="store_true")
    args = parser.parse_args()
    peaks, table = [], []
    for conversations in (int(n) for n in args.conversations.split(",")):
        store, _ = bench_store(args.dir, conversations)
        rows_dir = os.path.join(args.dir, f"tune-rows-{conversations}")
        turns = turn_rows(store, rows_dir)
        results = {}
        commands = [
            ("spans", [sys.executable, "-m", "kvobs", "tune", "--source", store, "--json"]),
            ("turn rows", [sys.executable, "-c", _ROWS_TUNE, str(args.partition_rows), rows_dir]),
        ]
        for name, command in commands[1:] if args.no_spans else commands:
            wall, peak, out, cpu = peak_rss_mb_of(command)
            results[name] = json.loads(out)
            print(f"{conversations:,} conversations, {turns:,} turns, tune from {name}: "
                  f"wall {wall:.1f} s, CPU {cpu:.1f} s, peak RSS {peak:,.0f} MiB", flush=True)
            table.append(f"| {turns:,} turns | {name} | {wall:.1f} s | {cpu:.1f} s "
                         f"| {peak:,.0f} MiB |")
            if name == "turn rows":
                peaks.append(peak)
        if not args.no_spans:
            keys = ("recommended_threshold", "recommended_ttl_s", "current_threshold")
            same = all(results["spans"][k] == results["turn rows"][k] for k in keys)
            print(f"  recommendations equal: {same}", flush=True)
    print("| fleet | tune from | wall | CPU | peak RSS |\n|---|---|---|---|---|")
    print("\n".join(table))
    if len(peaks) > 1:
        print(f"turn rows' peak RSS, largest over smallest fleet: {peaks[-1] / peaks[0]:.2f}x; "
              f"largest over the one before: {peaks[-1] / peaks[-2]:.2f}x")


if __name__ == "__main__":
    main()
