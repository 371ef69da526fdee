"""One conversation from the live classifier's turn store, at fleet size: the answer
``GET /conversations/ID`` gives once the conversation left the classifier's memory.

    python bench/turnstore_bench.py [--conversations 1000000] [--turns 3] [--hours 24]
                                    [--pass-every 10] [--lookups 200] [--baseline 2000]
                                    [--dir DIR] [--add-group-sidecars]

Rows: ``--conversations`` x ``--turns`` final turns, each the ``kvobs diagnose --json``
turn of a real testbed turn (tests/data/demo-spans.otlp.jsonl) under fresh ids,
finalized evenly over ``--hours`` hours and written as the service writes them: a part
file per classification pass (here one every ``--pass-every`` simulated seconds; the
service passes every second), ``TurnStore.compact`` every 600 s as the service calls it.
Measured in one run:

- ``merged``: lookups in that store (closed hours one indexed file each, the last hour's
  merged parts and the parts since);
- ``http``: the same lookups through the service's route (aiohttp, in process);
- ``parts``: the baseline, the first ``--baseline`` conversations written the same way
  but never compacted (every part file opened by a lookup), and the merged lookup of
  the same conversations in a store of that size.

Prints p50/p99 per lookup (wall clock), files and bytes on disk, the ratio, and what
the writing's ``compact`` calls cost. ``--dir DIR`` keeps the store (written only when
DIR/fleet is absent): another tree's copy of this script (main's, for the baseline) then
looks up the same conversations in the same files. ``--add-group-sidecars`` first gives
a store an older kvobs merged its row-group sidecars (``TurnStore.add_group_sidecars``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from kvobs.live.turnstore import TurnStore  # noqa: E402

T0 = 1_767_225_600.0  # 2026-01-01T00:00:00Z


def _template() -> dict:
    from kvobs.diagnose import all_turns
    from kvobs.sources import open_source

    turns = all_turns(open_source(os.path.join(ROOT, "tests", "data",
                                               "demo-spans.otlp.jsonl")))
    return max((t.to_dict() for t in turns if t.turn.index > 1),
               key=lambda row: len(json.dumps(row, default=str)))


def write_store(directory: str, conversations: int, turns: int, hours: int,
                pass_every: float, compact: bool, compactions: list | None = None) -> int:
    """Returns the part files written; the seconds of each ``compact`` call that merged
    something go to ``compactions``."""
    template = _template()
    store = TurnStore(directory, 400 * 86400)
    rows_total = conversations * turns
    passes = max(1, int(hours * 3600 / pass_every))
    per_pass = max(1, -(-rows_total // passes))
    rng = random.Random(7)
    parts = 0
    compacted_at = T0
    for index, start in enumerate(range(0, rows_total, per_pass)):
        now = T0 + index * pass_every
        batch = []
        for row_number in range(start, min(rows_total, start + per_pass)):
            turn, c = divmod(row_number, conversations)
            batch.append(dict(template, conversation_id=f"conv-{c:07d}", turn=turn + 1,
                              version=1, trace_id=f"{rng.getrandbits(128):032x}"))
        store.write(batch, now=now)
        parts += 1
        if compact and now - compacted_at >= 600:
            begin = time.perf_counter()
            merged = store.compact(now)
            if merged and compactions is not None:
                compactions.append(time.perf_counter() - begin)
            compacted_at = now
    return parts


def _disk(directory: str) -> tuple[int, int]:
    files = size = 0
    for base, _, names in os.walk(directory):
        for name in names:
            files += 1
            size += os.path.getsize(os.path.join(base, name))
    return files, size


def _percentiles(seconds: list[float]) -> tuple[float, float]:
    ordered = sorted(seconds)
    return (ordered[len(ordered) // 2] * 1e3,
            ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e3)


def lookups(store: TurnStore, ids: list[str], turns: int) -> list[float]:
    out = []
    for cid in ids:
        begin = time.perf_counter()
        found = store.latest(cid)
        out.append(time.perf_counter() - begin)
        assert len(found) == turns, (cid, len(found))
    return out


def http_lookups(directory: str, ids: list[str], turns: int) -> list[float]:
    from aiohttp.test_utils import TestClient, TestServer

    from kvobs.live.service import LIVE, LiveSettings, build_app

    async def run() -> list[float]:
        app = build_app(directory, LiveSettings(window_s=60, turn_retention_s=400 * 86400))
        # No upkeep meanwhile: it would merge the bench's open hour (the store would no
        # longer be the one the other lookups and another tree's run read).
        app[LIVE]._maintained_at = time.time()
        out = []
        async with TestClient(TestServer(app)) as client:
            for cid in ids:
                begin = time.perf_counter()
                answer = await client.get(f"/conversations/{cid}")
                body = await answer.json()
                out.append(time.perf_counter() - begin)
                assert answer.status == 200 and len(body["turns"]) == turns
        return out

    return asyncio.run(run())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=100_000)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--hours", type=int, default=24)
    parser.add_argument("--pass-every", type=float, default=10.0)
    parser.add_argument("--lookups", type=int, default=200)
    parser.add_argument("--baseline", type=int, default=2000,
                        help="0: no small never-compacted store")
    parser.add_argument("--dir", help="keep the store here (written only if absent): "
                        "another tree's bench then looks up in the same files")
    parser.add_argument("--add-group-sidecars", action="store_true",
                        help="first give the store's merged files their .groups (a "
                        "store an older kvobs wrote, upgraded in place)")
    args = parser.parse_args()
    directory = args.dir or tempfile.mkdtemp(prefix="kvobs-turnstore-bench-")
    try:
        rng = random.Random(11)
        fleet = os.path.join(directory, "fleet")
        if not os.path.isdir(fleet):
            begin = time.perf_counter()
            compactions: list[float] = []
            parts = write_store(fleet, args.conversations, args.turns, args.hours,
                                args.pass_every, compact=True, compactions=compactions)
            print(f"rows: {args.conversations:,} conversations x {args.turns} turns over "
                  f"{args.hours} h, {parts:,} passes (one every {args.pass_every:g} s), "
                  f"compacted every 600 s; written in {time.perf_counter() - begin:.0f} s; "
                  f"compact: {len(compactions)} calls that merged, "
                  f"{sum(compactions):,.1f} s in all, longest {max(compactions, default=0):,.2f} s")
        files, size = _disk(fleet)
        print(f"store {fleet}: {files:,} files, {size / 2**20:,.0f} MiB "
              f"(kvobs from {os.path.dirname(sys.modules['kvobs'].__file__)})")
        ids = [f"conv-{rng.randrange(args.conversations):07d}" for _ in range(args.lookups)]
        if not args.lookups:
            return
        store = TurnStore(fleet, 400 * 86400)
        if args.add_group_sidecars and hasattr(store, "add_group_sidecars"):
            begin = time.perf_counter()
            added = store.add_group_sidecars()
            print(f"row-group sidecars added to {len(added)} merged files an older kvobs "
                  f"wrote, in {time.perf_counter() - begin:,.1f} s")
        p50, p99 = _percentiles(lookups(store, ids, args.turns))
        print(f"merged: lookup p50 {p50:,.1f} ms, p99 {p99:,.1f} ms ({len(ids)} lookups)")
        h50, h99 = _percentiles(http_lookups(fleet, ids, args.turns))
        print(f"http  : GET /conversations/ID p50 {h50:,.1f} ms, p99 {h99:,.1f} ms")
        if not args.baseline:
            return
        small = args.baseline
        hours = max(1, round(args.hours * small / args.conversations))
        layouts = {}
        for name, compact in (("parts", False), ("merged", True)):
            path = os.path.join(directory, name)
            shutil.rmtree(path, ignore_errors=True)
            write_store(path, small, args.turns, hours, args.pass_every, compact)
            files, _ = _disk(path)
            sample = [f"conv-{rng.randrange(small):07d}" for _ in range(20)]
            layouts[name] = (_percentiles(lookups(TurnStore(path, 400 * 86400), sample,
                                                  args.turns)), files)
            shutil.rmtree(path, ignore_errors=True)
        (b50, b99), bfiles = layouts["parts"]
        (m50, m99), mfiles = layouts["merged"]
        print(f"baseline, {small:,} conversations over {hours} h: never compacted "
              f"({bfiles:,} files) p50 {b50:,.1f} ms, p99 {b99:,.1f} ms; compacted "
              f"({mfiles:,} files) p50 {m50:,.1f} ms, p99 {m99:,.1f} ms; "
              f"ratio p99 {b99 / m99:,.1f}x")
    finally:
        if not args.dir:
            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
