"""Fuzz the span readers and the turns pipeline with more cases than CI runs, and print
the counts.

    python bench/reader_fuzz.py [--cases 100000] [--batch 1000] [--seed N]

The cases and the oracle are tests/fuzz_spans.py's (the CI suite,
tests/sources/test_fuzz_readers.py, runs 10,000): span files in every shape real producers
write, damaged; each read alone, then each batch through the pandas turns path, the
fleet's Arrow path and a compacted store with a segment copied. Prints, per format and in
all: cases, spans written, rows read, problems reported; duplicates dropped (each
reported), oracle failures, crashes (an exception) and hangs (a case over 5 s). Exit 1 on
any failure, crash or hang.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import tempfile
import time
import traceback
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from fuzz_spans import check_batch, check_case, make_case  # noqa: E402

CASE_LIMIT_S = 5


class Hang(Exception):
    pass


def _alarm(_signum, _frame):
    raise Hang


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=int(time.strftime("%Y%m%d")))
    args = parser.parse_args()
    signal.signal(signal.SIGALRM, _alarm)
    counts: dict[str, Counter] = {}
    failures: list[str] = []
    crashes = hangs = duplicates = 0
    started = time.perf_counter()
    for batch in range(0, args.cases, args.batch):
        rng = random.Random(args.seed * 1_000_000 + batch)
        with tempfile.TemporaryDirectory(prefix="kvobs-fuzz-") as scratch:
            directory = os.path.join(scratch, "cases")
            os.mkdir(directory)
            cases, raw_rows = [], 0
            for number in range(min(args.batch, args.cases - batch)):
                case = make_case(rng, f"{batch}-{number}", directory)
                cases.append(case)
                count = counts.setdefault(case.fmt, Counter())
                count["cases"] += 1
                count["spans written"] += len(case.spans)
                count["byte-damaged"] += case.byte_damaged
                signal.setitimer(signal.ITIMER_REAL, CASE_LIMIT_S)
                try:
                    rows, problems, case_failures = check_case(case)
                except Hang:
                    hangs += 1
                    failures.append(f"{case.path}: hang")
                    continue
                except Exception:  # noqa: BLE001 - a crash is what this counts
                    crashes += 1
                    failures.append(f"{case.path}: crash\n{traceback.format_exc()}")
                    continue
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
                raw_rows += len(rows)
                count["rows read"] += len(rows)
                count["problems reported"] += len(problems)
                failures += case_failures
            try:
                batch_failures, dropped = check_batch(directory, cases, raw_rows)
                failures += batch_failures
                duplicates += dropped
            except Exception:  # noqa: BLE001
                crashes += 1
                failures.append(f"batch {batch}: crash\n{traceback.format_exc()}")
        done = min(batch + args.batch, args.cases)
        print(f"  {done:,} cases, {time.perf_counter() - started:.0f} s, "
              f"{len(failures)} failures", file=sys.stderr)
    total = Counter()
    header = ["format", "cases", "spans written", "rows read", "problems reported",
              "byte-damaged"]
    print(" | ".join(header))
    for fmt in sorted(counts):
        total.update(counts[fmt])
        print(" | ".join([fmt] + [f"{counts[fmt][h]:,}" for h in header[1:]]))
    print(" | ".join(["all"] + [f"{total[h]:,}" for h in header[1:]]))
    print(f"seed {args.seed}: {total['cases']:,} cases in "
          f"{time.perf_counter() - started:.1f} s; {duplicates:,} duplicate spans dropped "
          f"(each reported); crashes {crashes}, hangs {hangs}, "
          f"oracle failures {len(failures) - crashes - hangs}")
    for failure in failures[:20]:
        print(failure)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
