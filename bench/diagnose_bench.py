"""Time ``kvobs diagnose`` for one conversation in a 1,000,000-conversation synthetic store.

    python bench/diagnose_bench.py --dir /tmp/kvobs-bench [--conversations 1000000]

The store is synthetic (``kvobs.synth``), generated once under ``--dir`` and reused.
Prints the library-call and CLI-subprocess times (best and median of ``--repeat``), the
spans count and the store's size on disk. Target: the CLI process under 0.5 s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _synthetic_store import bench_store  # noqa: E402

from kvobs import synth  # noqa: E402
from kvobs.diagnose import diagnose  # noqa: E402
from kvobs.sources import open_source  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp/kvobs-bench")
    parser.add_argument("--conversations", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    store, config = bench_store(args.dir, args.conversations)
    ids = synth.conversation_ids(config)
    picks = [ids[i * (len(ids) // args.repeat)] for i in range(args.repeat)]

    library = []
    for cid in picks:
        started = time.perf_counter()
        result = diagnose(open_source(store), cid)
        library.append(time.perf_counter() - started)
    print(f"library diagnose(): best {min(library):.3f}s median "
          f"{statistics.median(library):.3f}s ({len(result.turns)} turns in the last)")

    kvobs = os.path.join(os.path.dirname(sys.executable), "kvobs")
    cli = []
    for cid in picks:
        started = time.perf_counter()
        done = subprocess.run([kvobs, "diagnose", cid, "--source", store, "--json"],
                              capture_output=True, text=True)
        cli.append(time.perf_counter() - started)
        if done.returncode not in (0, 1, 3):
            print(done.stderr, file=sys.stderr)
    started = time.perf_counter()
    subprocess.run([kvobs, "--help"], capture_output=True)
    startup = time.perf_counter() - started
    print(f"CLI `kvobs diagnose --json` subprocess: best {min(cli):.3f}s median "
          f"{statistics.median(cli):.3f}s (`kvobs --help` alone {startup:.3f}s; "
          "bench/startup_bench.py sets both against interpreter baselines)")
    # The target is the user's: the whole CLI process (bench/startup_bench.py times it
    # under /usr/bin/time against interpreter baselines).
    verdict = "PASS" if statistics.median(cli) < 0.5 else "FAIL"
    print(f"target < 0.5 s (CLI process, median): {verdict}")


if __name__ == "__main__":
    main()
