"""The live classifier's stream throughput of two kvobs trees, run by turns (A, B, A, B,
...) in two worker processes that keep the synthetic spans loaded: on a shared box whose
load changes by the second, runs seconds apart see the same load, where whole
``classifier_bench.py`` runs a minute apart do not.

    python bench/classifier_ab.py --a /tmp/before --b . [--rounds 8] \\
        [--conversations 1000 --spans-per-pass 10000 --window 0 ...]

Each tree is a directory holding ``kvobs`` and ``bench`` (``git archive`` of a commit).
Prints every round's stream figure (spans per CPU-second, ``classifier_bench._stream``)
of each, then their medians and bests. The options after the trees are
``classifier_bench.py``'s workload options. ``--stage MODULE:CLASS.METHOD`` (or
``MODULE:FUNCTION``) also times that stage of each run (CPU µs a span, the calls'
process time summed; a stage called within itself is counted once).
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
    parser.add_argument("--stage", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args, workload = parser.parse_known_args()
    if args.worker:
        return _work(args.a, workload, args.stage)
    staged = ["--stage", args.stage] if args.stage else []
    trees = {"a": os.path.abspath(args.a), "b": os.path.abspath(args.b)}
    workers = {
        name: subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--a", tree, "--b", tree, "--worker",
             *staged, *workload],
            env={**os.environ, "PYTHONPATH": tree},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for name, tree in trees.items()
    }
    spans = {name: json.loads(w.stdout.readline())["spans"] for name, w in workers.items()}
    rates: dict[str, list[float]] = {"a": [], "b": []}
    stage_us: dict[str, list[float]] = {"a": [], "b": []}
    for round_ in range(args.rounds):
        for name in ("a", "b") if round_ % 2 == 0 else ("b", "a"):
            worker = workers[name]
            worker.stdin.write("run\n")
            worker.stdin.flush()
            answer = json.loads(worker.stdout.readline())
            rates[name].append(spans[name] / answer["seconds"])
            stage_us[name].append(answer["stage_s"] / spans[name] * 1e6)
        staged_line = (f"; {args.stage}: a {stage_us['a'][-1]:.2f}  b {stage_us['b'][-1]:.2f} "
                       "us/span" if args.stage else "")
        print(f"round {round_ + 1}: a {rates['a'][-1]:8.0f}  b {rates['b'][-1]:8.0f} spans/CPU-s"
              + staged_line, flush=True)
    for worker in workers.values():
        worker.stdin.close()
        worker.wait()
    for name in ("a", "b"):
        print(f"{name} ({trees[name]}): median {statistics.median(rates[name]):.0f}, best "
              f"{max(rates[name]):.0f} spans/CPU-s; every round: "
              + ", ".join(f"{rate:.0f}" for rate in rates[name]))
        if args.stage:
            print(f"  {args.stage}: median {statistics.median(stage_us[name]):.2f} us/span")


def _work(tree: str, workload: list[str], stage: str | None) -> None:
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
    spent = _timed(stage) if stage else [0.0]
    print(json.dumps({"spans": len(rows)}), flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        spent[0] = 0.0
        with contextlib.redirect_stdout(io.StringIO()):  # the run's own lines
            seconds = bench._stream(rows, args)[0]
        print(json.dumps({"seconds": seconds, "stage_s": spent[0]}), flush=True)


def _timed(stage: str) -> list[float]:
    """Wrap the stage (``MODULE:NAME`` or ``MODULE:CLASS.NAME``) so that its calls' CPU
    time adds up in the list returned (its one item)."""
    import functools
    import importlib
    import time

    module_name, _, path = stage.partition(":")
    *owner_names, name = path.split(".")
    owner = importlib.import_module(module_name)
    for owner_name in owner_names:
        owner = getattr(owner, owner_name)
    inner = getattr(owner, name)
    spent, depth = [0.0], [0]

    @functools.wraps(inner)
    def timed(*args, **kwargs):
        depth[0] += 1
        started = time.process_time()
        try:
            return inner(*args, **kwargs)
        finally:
            depth[0] -= 1
            if not depth[0]:
                spent[0] += time.process_time() - started

    setattr(owner, name, timed)
    return spent


if __name__ == "__main__":
    main()
