"""Fuzz the span readers and the turns pipeline: 10,000 seeded cases per run (a new seed
each day, printed; KVOBS_FUZZ_SEED replays one). See tests/fuzz_spans.py for the cases
and the oracle; bench/reader_fuzz.py runs more."""

import datetime
import os
import random
import signal

import pytest

from fuzz_spans import check_batch, check_case, make_case

CASES = int(os.environ.get("KVOBS_FUZZ_CASES", "10000"))
BATCHES = 10
SEED = int(os.environ.get("KVOBS_FUZZ_SEED",
                          datetime.date.today().strftime("%Y%m%d")))
CASE_LIMIT_S = 5  # a case that takes longer is a hang


class Hang(Exception):
    pass


def _alarm(_signum, _frame):
    raise Hang


@pytest.mark.timeout(600)
@pytest.mark.parametrize("batch", range(BATCHES))
def test_fuzzed_span_files(tmp_path, batch):
    rng = random.Random(SEED * 1000 + batch)
    print(f"seed {SEED} batch {batch}")
    directory = tmp_path / "cases"
    directory.mkdir()
    cases, failures, raw_rows = [], [], 0
    previous = signal.signal(signal.SIGALRM, _alarm)
    try:
        for number in range(CASES // BATCHES):
            case = make_case(rng, f"{batch}-{number}", str(directory))
            cases.append(case)
            signal.setitimer(signal.ITIMER_REAL, CASE_LIMIT_S)
            try:
                rows, _problems, case_failures = check_case(case)
            except Hang:
                failures.append(f"{case.path}: hang (over {CASE_LIMIT_S} s)")
                continue
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            raw_rows += len(rows)
            failures += case_failures
    finally:
        signal.signal(signal.SIGALRM, previous)
    assert not failures, f"seed {SEED} batch {batch}:\n" + "\n".join(failures[:20])
    failures, _dropped = check_batch(str(directory), cases, raw_rows)
    assert not failures, f"seed {SEED} batch {batch}:\n" + "\n".join(failures[:20])
