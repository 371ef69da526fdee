"""What the live classifier's /metrics cost a final turn: ``TurnMetrics.observe`` over the
demo's final turns (tests/data/demo-spans.otlp.jsonl, 25 turns, repeated), a pass of
``--per-pass`` turns at a time, in CPU µs a turn; two kvobs trees alternating, each in a
process of its own.

    python bench/turn_metrics_bench.py --a /tmp/base_s12 --b . [--turns 5000] [--rounds 5]

Each tree is a directory holding ``kvobs`` (``git archive`` of a commit).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

DEMO = Path(__file__).resolve().parents[1] / "tests" / "data" / "demo-spans.otlp.jsonl"


def _work(turns: int, per_pass: int) -> float:
    from kvobs.live.classifier import Classifier, PassResult
    from kvobs.live.metrics import TurnMetrics

    classifier = Classifier(window_s=600, grace_s=0)
    for line in DEMO.read_text().split("\n"):
        if line.strip():
            classifier.add_request(json.loads(line), now=100.0)
    final = classifier.run_pass(now=100.0).finalized + classifier.run_pass(now=101.0).finalized
    rows = (final * (turns // len(final) + 1))[:turns]
    metrics = TurnMetrics()
    started = time.process_time()
    for i in range(0, len(rows), per_pass):
        metrics.observe(PassResult(finalized=rows[i:i + per_pass]))
    return (time.process_time() - started) / len(rows) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--a", required=True)
    parser.add_argument("--b", required=True)
    parser.add_argument("--turns", type=int, default=5000)
    parser.add_argument("--per-pass", type=int, default=800)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(_work(args.turns, args.per_pass))
        return
    spent: dict[str, list[float]] = {"a": [], "b": []}
    for _ in range(args.rounds):
        for name in ("a", "b"):
            tree = os.path.abspath(getattr(args, name))
            out = subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--worker", "--a", tree, "--b", tree,
                 "--turns",
                 str(args.turns), "--per-pass", str(args.per_pass)],
                env={**os.environ, "PYTHONPATH": tree}, cwd=tree, check=True,
                capture_output=True, text=True).stdout
            spent[name].append(float(out))
    a, b = (statistics.median(spent[n]) for n in ("a", "b"))
    print(f"{args.turns} final turns, {args.per_pass} a pass; CPU µs a turn")
    for name, median in (("a", a), ("b", b)):
        rounds = ", ".join(f"{v:.1f}" for v in spent[name])
        print(f"{name} ({getattr(args, name)}): median {median:.1f} (rounds: {rounds})")
    print(f"b/a: {b / a:.2f}")


if __name__ == "__main__":
    main()
