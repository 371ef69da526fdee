"""Processes kvobs starts: lowered as a whole session, stopped as a whole group."""

import os
import subprocess
from pathlib import Path

from kvobs._proc import stop_process_group, yield_cpu


def _niceness_of(pid: int) -> int:
    group = Path(f"/proc/{pid}/autogroup")
    if group.exists():  # autogroup scheduling: the session's value is what counts
        return int(group.read_text().split()[-1])
    return os.getpriority(os.PRIO_PROCESS, pid)


def test_yield_cpu_lowers_the_session_a_process_leads():
    proc = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        before = _niceness_of(proc.pid)
        yield_cpu(proc.pid, before + 7)
        assert _niceness_of(proc.pid) == before + 7
    finally:
        stop_process_group(proc)


def test_yield_cpu_on_a_gone_process_is_quiet():
    proc = subprocess.Popen(["true"])
    proc.wait()
    yield_cpu(proc.pid, 10)  # raises nothing: telemetry-side code never breaks a run
