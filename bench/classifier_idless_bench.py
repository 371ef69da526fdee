"""The live classifier behind another router (id-less spans) against the same spans with
conversation ids (behind ``kvobs proxy``), in one run: spans per CPU-second, and how a
pass's cost grows as the window fills.

    python bench/classifier_idless_bench.py [--conversations 2000] [--turns 5]
        [--spans-per-pass 2000] [--window 960]

The spans are ``lineage_bench.spans``: P's decision span with its prompt's chain and D's
export with the chain of prompt + output, as the instrumented engines emit them (prompts
of 2,000 tokens growing 500 a turn, conversations starting over an hour, a turn every
5-35 s); with ids, each also carries its conversation id and turn index. They go to a
``kvobs.live.classifier.Classifier`` in end-time order, in requests of 300 spans, with a
pass every ``--spans-per-pass`` spans and two at the end, on the spans' own clock. CPU
seconds are the process's (one core): the buffer's ``add`` and the passes; the turn
store's writes and /metrics are not included.

Behind kvobs proxy a pass classifies only the conversations whose spans changed. Id-less
spans wait in one pool until lineage links them, and the pool is classified whole
whenever any of it changed (``SpanBuffer.take_dirty``), so there a pass costs what the
window holds: the ratio printed grows with the window.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lineage_bench  # noqa: E402
from ingest_bench import SimulatedTime  # noqa: E402

from kvobs.live import classifier as classifier_module  # noqa: E402


def run(rows: list[dict], spans_per_pass: int, window_s: float) -> tuple[float, list[float]]:
    """CPU seconds of the whole run, and of each pass."""
    clock = SimulatedTime()  # the spans' clock
    classifier_module.time = clock
    classifier = classifier_module.Classifier(window_s=window_s, grace_s=5.0)
    spent, taken, passes = 0.0, 0, []
    for i in range(0, len(rows), 300):
        request = rows[i : i + 300]
        clock.now = now = request[-1]["end_ns"] / 1e9
        started = time.process_time()
        classifier.buffer.add(request, now)
        if (taken + len(request)) // spans_per_pass > taken // spans_per_pass:
            at = time.process_time()
            classifier.run_pass(now)
            passes.append(time.process_time() - at)
        spent += time.process_time() - started
        taken += len(request)
    started = time.process_time()
    classifier.run_pass(now + 10)
    classifier.run_pass(now + 10 + classifier.grace_s)
    spent += time.process_time() - started
    classifier_module.time = time
    return spent, passes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=2000)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--spans-per-pass", type=int, default=2000)
    parser.add_argument("--window", type=float, default=960.0)
    args = parser.parse_args()
    print(f"load average at start {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    figures = {}
    for mode, with_ids in (("with ids", True), ("id-less", False)):
        table = lineage_bench.spans(args.conversations, args.turns, 2000, 400, 100, with_ids)
        table = table.sort_by([("end_ns", "ascending")])
        rows = [{k: v for k, v in row.items() if v is not None} for row in table.to_pylist()]
        spent, passes = run(rows, args.spans_per_pass, args.window)
        figures[mode] = len(rows) / spent
        quarter = max(1, len(passes) // 4)
        print(
            f"{mode:9} {len(rows):,} spans: {len(rows) / spent:8,.0f} spans/CPU-s; a pass "
            f"(CPU s), first quarter {sum(passes[:quarter]) / quarter:.2f}, last quarter "
            f"{sum(passes[-quarter:]) / quarter:.2f}"
        )
    print(f"id-less / with ids: {figures['id-less'] / figures['with ids']:.2f}")
    print(f"load average at end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
