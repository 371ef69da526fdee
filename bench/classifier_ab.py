"""The live classifier's stream throughput of two kvobs trees, run by turns (A, B, A, B,
...) in two worker processes that keep the synthetic spans loaded: on a shared box whose
load changes by the second, runs seconds apart see the same load, where whole
``classifier_bench.py`` runs a minute apart do not.

    python bench/classifier_ab.py --a /tmp/before --b . [--rounds 8] \\
        [--conversations 1000 --spans-per-pass 10000 --window 0 ...]

Each tree is a directory holding ``kvobs`` and ``bench`` (``git archive`` of a commit).
Prints every round's stream figure (spans per CPU-second, ``classifier_bench._stream``)
of each, then their medians and bests. The options after the trees are
``classifier_bench.py``'s workload options.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--a", required=True)
    parser.add_argument("--b", required=True)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args, workload = parser.parse_known_args()
    if args.worker:
        return _work(args.a, workload)
    trees = {"a": os.path.abspath(args.a), "b": os.path.abspath(args.b)}
    workers = {
        name: subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--a", tree, "--b", tree, "--worker",
             *workload],
            env={**os.environ, "PYTHONPATH": tree},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for name, tree in trees.items()
    }
    spans = {name: json.loads(w.stdout.readline())["spans"] for name, w in workers.items()}
    rates: dict[str, list[float]] = {"a": [], "b": []}
    for round_ in range(args.rounds):
        for name in ("a", "b") if round_ % 2 == 0 else ("b", "a"):
            worker = workers[name]
            worker.stdin.write("run\n")
            worker.stdin.flush()
            seconds = json.loads(worker.stdout.readline())["seconds"]
            rates[name].append(spans[name] / seconds)
        print(f"round {round_ + 1}: a {rates['a'][-1]:8.0f}  b {rates['b'][-1]:8.0f} spans/CPU-s",
              flush=True)
    for worker in workers.values():
        worker.stdin.close()
        worker.wait()
    for name in ("a", "b"):
        print(f"{name} ({trees[name]}): median {statistics.median(rates[name]):.0f}, best "
              f"{max(rates[name]):.0f} spans/CPU-s; every round: "
              + ", ".join(f"{rate:.0f}" for rate in rates[name]))


def _work(tree: str, workload: list[str]) -> None:
    """One tree's worker (its kvobs on PYTHONPATH): the bench's spans, then one stream run
    per ``run`` line, by the tree's own ``classifier_bench._stream``."""
    import contextlib
    import io

    import numpy as np

    sys.path.insert(0, os.path.join(tree, "bench"))
    import classifier_bench as bench
    from kvobs.synth import small, spans_table

    parser = argparse.ArgumentParser()
    parser.add_argument("--conversations", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--pass-every", type=float, default=2.0)
    parser.add_argument("--spans-per-pass", type=int, default=0)
    parser.add_argument("--window", type=float, default=960.0)
    parser.add_argument("--mean-turns", type=float, default=5.0)
    parser.add_argument("--chains", action="store_true")
    args = parser.parse_args(workload)
    config = small(args.conversations, mean_turns=args.mean_turns)
    table, _ = spans_table(config, np.arange(config.conversations))
    if args.chains:
        from _chains import with_prefix_chains  # this bench's own: both trees get one table

        table = with_prefix_chains(table)
    table = table.sort_by([("end_ns", "ascending")])
    rows = [{k: v for k, v in row.items() if v is not None} for row in table.to_pylist()]
    print(json.dumps({"spans": len(rows)}), flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        with contextlib.redirect_stdout(io.StringIO()):  # the run's own lines
            seconds = bench._stream(rows, args)[0]
        print(json.dumps({"seconds": seconds}), flush=True)


if __name__ == "__main__":
    main()
