"""What recalling conversations that came back costs ``kvobs collect`` (issue #24).

A store's live segments hold the synthetic fleet's export requests as the service stores
them (``collect.decode`` of protobuf bodies, one JSON line each). ``recall`` then reads
back the spans of K conversations (``kvobs.live.recall``: a line is parsed only where it
names one of them or one of their traces), against, in the same run, parsing every line
of the segments (``loads`` and the row builder: what a recall without the search, or a
replay, costs). Printed: wall and CPU seconds of each, spans found, and the ratio.

    .venv/bin/python bench/recall_bench.py --conversations 4000
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--conversations", type=int, default=4000)
    parser.add_argument("--spans-per-request", type=int, default=300)
    parser.add_argument("--recalled", type=int, nargs="+", default=[1, 10, 100])
    parser.add_argument("--chains", action="store_true",
                        help="the connector's prefix chains on P's and D's spans")
    parser.add_argument("--tmp", default=tempfile.gettempdir())
    args = parser.parse_args()
    sys.path.insert(0, HERE)
    from ingest_bench import _bodies

    from kvobs import semconv as sc
    from kvobs.emit import collect
    from kvobs.emit.segments import LiveSegmentWriter

    bodies, spans = _bodies(argparse.Namespace(
        conversations=args.conversations, chains=args.chains, format="protobuf",
        spans_per_request=args.spans_per_request))
    store = tempfile.mkdtemp(prefix="recall_bench_", dir=args.tmp)
    try:
        writer = LiveSegmentWriter(store, "bench")
        writer.makedirs()
        conversations: set[str] = set()
        for body in bodies:
            stored = collect.decode(body, False)
            writer.append(stored.line + "\n")
            for resource_spans in stored.request()["resourceSpans"]:
                for scope_spans in resource_spans["scopeSpans"]:
                    for span in scope_spans["spans"]:
                        for attribute in span.get("attributes", ()):
                            if attribute["key"] == sc.CONVERSATION_ID.key:
                                conversations.add(attribute["value"]["stringValue"])
        size = sum(os.path.getsize(os.path.join(root, name))
                   for root, _, names in os.walk(store) for name in names)
        print(f"workload: synthetic fleet, {args.conversations} conversations, {spans} spans "
              f"in {len(bodies)} requests of ~{args.spans_per_request} spans"
              + (", with the connector's prefix chains" if args.chains else "")
              + f"; live segments {size / 2**20:.0f} MiB")
        every, every_wall, every_cpu = _parse_every_line(store)
        print(f"every line parsed (the baseline): {every} spans, {every_wall:.2f} s wall, "
              f"{every_cpu:.2f} CPU s")
        pick = random.Random(0).sample(sorted(conversations), max(args.recalled))
        for k in args.recalled:
            found, wall, cpu = _recall(store, pick[:k])
            print(f"recall of {k} conversations: {found} spans, {wall:.3f} s wall, "
                  f"{cpu:.3f} CPU s; / every line parsed: {cpu / every_cpu:.3f} CPU")
    finally:
        shutil.rmtree(store, ignore_errors=True)


def _recall(store: str, conversations: list[str]) -> tuple[int, float, float]:
    from kvobs.live.recall import recall

    wall, cpu = time.perf_counter(), time.process_time()
    found = recall(store, dict.fromkeys(conversations, 0.0))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return sum(len(spans) for spans in found.spans.values()), wall, cpu


def _parse_every_line(store: str) -> tuple[int, float, float]:
    from kvobs.emit.otlp_json import loads
    from kvobs.emit.segments import written_since
    from kvobs.sources._rows import rows

    wall, cpu, count = time.perf_counter(), time.process_time(), 0
    for path, _ in written_since(store, 0.0):
        with open(path, encoding="utf-8", errors="replace") as handle:
            for line in handle:
                count += len(rows("otlp", loads(line), []))
    return count, time.perf_counter() - wall, time.process_time() - cpu


if __name__ == "__main__":
    main()
