"""Time ``kvobs report`` over ~10,000,000 synthetic spans: embedded store and chdb.

    python bench/report_bench.py --dir /tmp/kvobs-bench [--conversations 270000]

Generates (once, cached under ``--dir``) a synthetic store (``kvobs.synth``; about 7.4
spans and 5 turns per conversation, so 270,000 conversations give ~10M spans), loads it
into an embedded ClickHouse (chdb) ``otel_traces`` table the way the collector's exporter
writes it, its turn view created first as docs/clickhouse.md says (``kvobs clickhouse
init``), and copies the spans into a second table without view; then runs ``kvobs report
--json`` as a subprocess against each source and prints wall time, CPU time (steadier on
a shared box) and peak RSS. Target: under 10 s wall each. The store is read through the
per-turn files its compaction wrote, ``otel_traces`` through its turn view.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _synthetic_store import dir_size, ensure_store, peak_rss_mb_of  # noqa: E402

from kvobs import synth  # noqa: E402

VIEWED, PLAIN = "otel_traces", "otel_traces_no_view"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp/kvobs-bench")
    parser.add_argument("--conversations", type=int, default=270_000)
    parser.add_argument("--skip-chdb", action="store_true")
    parser.add_argument("--repeat", type=int, default=1, help="Runs per source.")
    args = parser.parse_args()
    store = os.path.join(args.dir, f"synthetic-{args.conversations}")
    info = ensure_store(store, synth.SyntheticConfig(conversations=args.conversations))
    print(f"store {store}: {info['conversations']:,} synthetic conversations, "
          f"{info['turns']:,} turns, {info['spans']:,} spans, "
          f"{dir_size(store) / 2**20:.0f} MiB")
    kvobs = os.path.join(os.path.dirname(sys.executable), "kvobs")
    sources = [("embedded store", store)]
    if not args.skip_chdb:
        chdb_dir = store + ".chdb"
        load_chdb(chdb_dir, store, info)
        sources += [("chdb, turn view", f"chdb:{chdb_dir}?table={VIEWED}"),
                    ("chdb, spans only", f"chdb:{chdb_dir}?table={PLAIN}")]
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())} "
          f"({os.cpu_count()} cores; other engineers share the box)")
    reports = {}
    for _ in range(args.repeat):
        for label, location in sources:
            wall, peak, out, cpu = peak_rss_mb_of([kvobs, "report", "--source", location,
                                                   "--json"])
            report = json.loads(out) if out.strip().startswith("{") else {}
            reports[label] = {k: v for k, v in report.items() if k != "source"}
            status = "PASS" if wall < 10 else "FAIL"
            print(f"kvobs report [{label}]: {wall:.2f}s wall, {cpu:.2f}s CPU, "
                  f"peak RSS {peak:,.0f} MiB, "
                  f"{report.get('turns', '?'):,} turns -> {status} (target < 10 s); "
                  f"load {os.getloadavg()[0]:.2f}", flush=True)
    (first, reference), *others = reports.items()
    for label, report in others:
        print(f"report [{label}] == report [{first}] (all but 'source'): "
              f"{report == reference}")


def load_chdb(chdb_dir: str, store: str, info: dict) -> None:
    """Both chdb tables, (re)loaded unless ``chdb_dir`` already holds this store."""
    from kvobs.sources.clickhouse import TURNS_SUFFIX, ClickHouseSource, turns_view_ddl

    marker = os.path.join(chdb_dir, "loaded.json")
    wanted = {"spans": info["spans"], "config": info["config"], "tables": [VIEWED, PLAIN],
              "view": hashlib.sha256("".join(turns_view_ddl(VIEWED)).encode()).hexdigest()}
    if os.path.exists(marker) and json.load(open(marker, encoding="utf-8")) == wanted:
        return
    shutil.rmtree(chdb_dir, ignore_errors=True)  # a regenerated store: reload
    started = time.perf_counter()
    source = ClickHouseSource.chdb(chdb_dir, VIEWED)
    source.create_table()
    source.create_turns_view()  # before the spans arrive, as a collector would insert them
    loaded = source.load_store(store)
    rows = source.query(f"SELECT count() FROM {VIEWED}{TURNS_SUFFIX}").column(0)[0].as_py()
    print(f"loaded {loaded:,} spans into chdb {VIEWED} ({rows:,} turn view rows) in "
          f"{time.perf_counter() - started:.0f}s")
    plain = ClickHouseSource(source.query, PLAIN)
    plain.create_table()
    source.query(f"INSERT INTO {PLAIN} SELECT * FROM {VIEWED}")
    settle(source)
    with open(marker, "w", encoding="utf-8") as handle:
        json.dump({**wanted, "spans": loaded}, handle)


def settle(source, quiet_s: float = 20, limit_s: float = 600) -> None:
    """Wait for chdb's background merges of the fresh parts: a server has long merged
    them when someone reports; a report process would otherwise run them, and pay."""
    started = quiet = time.perf_counter()
    while time.perf_counter() - quiet < quiet_s and time.perf_counter() - started < limit_s:
        if source.query("SELECT count() FROM system.merges").column(0)[0].as_py():
            quiet = time.perf_counter()
        time.sleep(1)
    print(f"background merges settled in {time.perf_counter() - started:.0f}s")


if __name__ == "__main__":
    main()
