"""Shared by the benchmarks: build (or reuse) a cached synthetic store."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import time

from kvobs import synth

MARKER = "synthetic.json"


def dir_size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, name))
               for root, _, names in os.walk(path) for name in names)


def ensure_store(directory: str, config: synth.SyntheticConfig,
                 buckets_per_chunk: int = 2) -> dict:
    """The store for ``config`` under ``directory``; generated once, then reused."""
    marker = os.path.join(directory, MARKER)
    wanted = dataclasses.asdict(config)
    if os.path.exists(marker):
        with open(marker, encoding="utf-8") as handle:
            recorded = json.load(handle)
        if recorded.get("config") == wanted:
            recorded["reused"] = True
            return recorded
    if os.path.exists(directory):
        shutil.rmtree(directory)
    os.makedirs(directory)
    started = time.perf_counter()

    def progress(bucket, result):
        print(f"  synthetic: buckets < {min(bucket, 64)}: {result.conversations} "
              f"conversations, {result.spans} spans, {time.perf_counter() - started:.0f}s",
              flush=True)

    result = synth.write_store(directory, config, buckets_per_chunk, progress)
    recorded = {"config": wanted, "conversations": result.conversations,
                "turns": result.turns, "spans": result.spans,
                "scenarios": result.scenarios,
                "generate_s": round(time.perf_counter() - started, 1)}
    with open(marker, "w", encoding="utf-8") as handle:
        json.dump(recorded, handle, indent=1)
    recorded["reused"] = False
    return recorded


def bench_store(directory: str, conversations: int) -> tuple[str, synth.SyntheticConfig]:
    """The default synthetic store of ``conversations`` under ``directory`` (generated
    once, then reused), described on stdout: (its path, its config)."""
    store = os.path.join(directory, f"synthetic-{conversations}")
    config = synth.SyntheticConfig(conversations=conversations)
    info = ensure_store(store, config)
    how = "reused" if info["reused"] else f"generated in {info['generate_s']}s"
    print(f"store {store}: {info['conversations']:,} synthetic conversations, "
          f"{info['turns']:,} turns, {info['spans']:,} spans, "
          f"{dir_size(store) / 2**20:.0f} MiB on disk ({how})")
    return store, config

def peak_rss_mb_of(command: list[str]) -> tuple[float, float, str, float]:
    """Run a command; (wall s, peak RSS MiB, stdout, CPU s). CPU (user + system, the
    command and its children) is steadier than wall on a shared box."""
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    timed = ["/usr/bin/time", "-f", "%M", *command] if shutil.which("/usr/bin/time") else command
    done = subprocess.run(timed, capture_output=True, text=True)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    lines = done.stderr.strip().splitlines()
    peak = int(lines[-1]) / 1024 if timed is not command and lines and lines[-1].isdigit() \
        else float("nan")
    return wall, peak, done.stdout, cpu
