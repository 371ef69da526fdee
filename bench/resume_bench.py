"""How long a restarted ``kvobs collect`` takes before it listens (issue #24).

A first service takes the synthetic fleet's export requests as ``kvobs collect`` does
(``collect.decode``, the live segment, ``Live.receive``, a pass every ``--spans-per-pass``
spans, then two a grace apart: every turn final in its turn store). A second one on the
same store then runs ``Live.resume``: the turn store's rows, the live segments replayed,
and the pass over them, all before it listens (a Kubernetes startup probe must wait that
long; docs/live.md, "Restart"). Printed: the resume's wall and CPU seconds, per span
replayed, against the first service's CPU for the same spans in this run, and the peak
RSS of each (separate processes).

    .venv/bin/python bench/resume_bench.py --conversations 1000 --chains
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--conversations", type=int, default=1000)
    parser.add_argument("--spans-per-request", type=int, default=300)
    parser.add_argument("--spans-per-pass", type=int, default=10000)
    parser.add_argument("--chains", action="store_true",
                        help="the connector's prefix chains on P's and D's spans")
    parser.add_argument("--tmp", default=tempfile.gettempdir())
    parser.add_argument("--step", choices=("first", "resume"), help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.step == "first":
        print(json.dumps(_first(args)))
        return
    if args.step == "resume":
        print(json.dumps(_resume(args)))
        return
    store = tempfile.mkdtemp(prefix="resume_bench_", dir=args.tmp)
    try:
        first, again = (_step(args, step, store) for step in ("first", "resume"))
    finally:
        shutil.rmtree(store, ignore_errors=True)
    spans = first["spans"]
    print(f"workload: synthetic fleet, {args.conversations} conversations, {spans} spans in "
          f"{first['requests']} protobuf requests of ~{args.spans_per_request} spans"
          + (", with the connector's prefix chains" if args.chains else ""))
    print(f"first service: {first['cpu_s']:.2f} CPU s ({1e6 * first['cpu_s'] / spans:.1f} "
          f"us a span: decode, segment, receive, passes), {first['final_turns']} final turns, "
          f"peak RSS {first['peak_rss_mb']:.0f} MB")
    print(f"resume: {again['replayed_requests']} requests replayed, {again['resumed_turns']} "
          f"turns taken from the turn store; {again['wall_s']:.2f} s wall, "
          f"{again['cpu_s']:.2f} CPU s ({1e6 * again['cpu_s'] / spans:.1f} us a span, "
          f"{spans / again['wall_s']:.0f} spans a wall second), peak RSS "
          f"{again['peak_rss_mb']:.0f} MB; resume / first service CPU "
          f"{again['cpu_s'] / first['cpu_s']:.2f}")


def _step(args, step: str, store: str) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--step", step, "--store", store,
               "--conversations", str(args.conversations),
               "--spans-per-request", str(args.spans_per_request),
               "--spans-per-pass", str(args.spans_per_pass)] + (["--chains"] if args.chains
                                                                  else [])
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _settings():
    from kvobs.live.service import LiveSettings

    # Every span within the window: the whole run is what a restart replays.
    return LiveSettings(window_s=1e9, grace_s=5.0)


def _first(args) -> dict:
    sys.path.insert(0, HERE)
    from ingest_bench import _bodies

    from kvobs.emit import collect
    from kvobs.emit.segments import LiveSegmentWriter
    from kvobs.live.service import Live

    bodies, spans = _bodies(argparse.Namespace(
        conversations=args.conversations, chains=args.chains, format="protobuf",
        spans_per_request=args.spans_per_request))
    writer = LiveSegmentWriter(args.store, "bench")
    writer.makedirs()
    live = Live(args.store, _settings())
    started, taken, now = time.process_time(), 0, time.time()
    for body in bodies:
        stored = collect.decode(body, False)
        writer.append(stored.line + "\n")
        live.receive(stored)
        before, taken = taken, live.classifier.spans_received
        if taken // args.spans_per_pass > before // args.spans_per_pass:
            live.run_pass(now)
    live.run_pass(now)
    live.run_pass(now + 2 * live.settings.grace_s)
    final = len(live.turns.latest())
    return {"spans": spans, "requests": len(bodies), "cpu_s": time.process_time() - started,
            "final_turns": final, "peak_rss_mb": _peak_rss_mb()}


def _resume(args) -> dict:
    import logging

    from kvobs.live.service import Live

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("kvobs.live").addHandler(handler)
    logging.getLogger("kvobs.live").setLevel(logging.INFO)
    live = Live(args.store, _settings())
    wall, cpu = time.perf_counter(), time.process_time()
    live.resume()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    said = next(r for r in records if r.startswith("resumed:"))
    numbers = [int(word) for word in said.replace(",", " ").split() if word.isdigit()]
    return {"wall_s": wall, "cpu_s": cpu, "resumed_turns": numbers[0],
            "replayed_requests": numbers[1], "peak_rss_mb": _peak_rss_mb()}


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


if __name__ == "__main__":
    main()
