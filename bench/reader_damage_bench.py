"""Time and memory of reading damaged span files (issue 27): NUL runs, a gzip bomb.

    python bench/reader_damage_bench.py [--dir /tmp/kvobs-reader-damage] [--repeat 3]
        [--also-rev REV] [--limit-s 60]

Files (written once under ``--dir``): the demo run's spans as JSON lines (clean: what
reading them costs); 8 MiB of NULs (a preallocated file never written);
the same NUL block, then the demo run's spans as JSON lines (they must all be read);
those spans as framed protobuf (the Collector's ``format: proto``) with 1 MiB NUL runs
between the messages, 8 MiB in all; 872 KB of gzip'd NULs (870 MB decompressed, the
issue's bomb); and an empty file (the baseline: interpreter and imports). Each read runs
in a fresh process (``kvobs.sources.otlp_json.read_rows``, what every span source reads a
file with): the read's wall time, the process's peak resident memory (``VmHWM``) and
that less the empty file's, rows, warnings. ``--also-rev REV`` runs the same reads with
kvobs/ as it was at a git revision (a change's before), each cut off at ``--limit-s``.
Prints medians; asserts nothing (the tests count the work instead:
tests/sources/test_damaged_span_files.py).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from startup_bench import ENV, kvobs_at  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO_SPANS = os.path.join(ROOT, "tests", "data", "demo-spans.otlp.jsonl")
MIB = 1 << 20

# One read in a fresh process: prints {"s", "peak_kib", "rows", "warnings"}. The peak is
# VmHWM (ru_maxrss carries the parent's peak across exec: this script's own 870 MB).
_READ = """
import json, sys, time
from kvobs.sources.otlp_json import read_rows
problems = []
start = time.perf_counter()
rows = sum(1 for _ in read_rows(sys.argv[1], problems))
elapsed = time.perf_counter() - start
peak = next(int(line.split()[1]) for line in open("/proc/self/status")
            if line.startswith("VmHWM:"))
print(json.dumps({"s": elapsed, "rows": rows, "warnings": len(problems),
                  "peak_kib": peak}))
"""


def _framed_with_nul_runs(lines: list[str]) -> bytes:
    from google.protobuf.json_format import ParseDict
    from opentelemetry.proto.trace.v1.trace_pb2 import TracesData

    out = []
    for line in lines:
        message = ParseDict(json.loads(line), TracesData(),
                            ignore_unknown_fields=True).SerializeToString()
        out.append(b"\0" * MIB + len(message).to_bytes(4, "big") + message)
        if sum(map(len, out)) >= 8 * MIB:
            break
    return b"".join(out)


def files(directory: str) -> dict[str, str]:
    """Name -> path of each bench file, written when missing."""
    with open(DEMO_SPANS) as handle:
        lines = handle.read().splitlines(keepends=True)
    makers = {
        "empty file (baseline)": lambda: b"",
        "the JSON lines alone (clean)": lambda: "".join(lines).encode(),
        "8 MiB of NULs": lambda: b"\0" * (8 * MIB),
        "8 MiB of NULs, then JSON lines": lambda: b"\0" * (8 * MIB) + "".join(lines).encode(),
        "framed protobuf, 1 MiB NUL runs between": lambda: _framed_with_nul_runs(lines),
        "872 KB gzip of NULs": lambda: gzip.compress(b"\0" * (870 * 1000 * 1000), 9),
    }
    os.makedirs(directory, exist_ok=True)
    paths = {}
    for number, (name, make) in enumerate(makers.items()):
        path = os.path.join(directory, f"case-{number}")
        if not os.path.exists(path):
            with open(path + ".tmp", "wb") as handle:
                handle.write(make())
            os.replace(path + ".tmp", path)
        paths[name] = path
    return paths


def read(path: str, env: dict, limit_s: float) -> dict | None:
    try:
        # cwd: not the checkout, whose kvobs/ ``python -c`` would import first
        done = subprocess.run([sys.executable, "-c", _READ, path], env=env, check=True,
                              capture_output=True, text=True, timeout=limit_s,
                              cwd=os.path.dirname(path))
    except subprocess.TimeoutExpired:
        return None
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp/kvobs-reader-damage")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--also-rev", help="also read with kvobs/ at this git revision")
    parser.add_argument("--limit-s", type=float, default=60.0)
    args = parser.parse_args()
    paths = files(args.dir)
    versions = {"this tree": {**ENV, "PYTHONPATH": ROOT}}
    if args.also_rev:
        versions[f"@{args.also_rev}"] = {**ENV, "PYTHONPATH": kvobs_at(args.also_rev,
                                                                       args.dir)}
    print(f"reads in fresh processes, median of {args.repeat}; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs at the start")
    print(f"{'file':42} {'kvobs':>12} {'bytes':>11} {'read s':>8} {'peak MiB':>9} "
          f"{'over base':>9} {'rows':>5} {'warnings':>8}")
    for version, env in versions.items():
        base = None
        for name, path in paths.items():
            runs = [read(path, env, args.limit_s) for _ in range(args.repeat)]
            size = os.path.getsize(path)
            if any(run is None for run in runs):
                print(f"{name:42} {version:>12} {size:11d} {'> ' + str(args.limit_s):>8}")
                continue
            seconds = statistics.median(run["s"] for run in runs)
            peak = statistics.median(run["peak_kib"] for run in runs) / 1024
            base = peak if base is None else base
            print(f"{name:42} {version:>12} {size:11d} {seconds:8.3f} {peak:9.1f} "
                  f"{peak - base:9.1f} {runs[0]['rows']:5d} {runs[0]['warnings']:8d}")


if __name__ == "__main__":
    main()
