"""Processes kvobs starts: lowered as a whole session, stopped as a whole group."""

import os
import subprocess
import sys
import time
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


def test_a_crash_kills_at_once_where_a_stop_lets_the_process_finish(tmp_path):
    """A stop's SIGTERM runs the child's handler; a crash (SIGKILL) runs nothing."""
    script = ("import signal, sys, time\n"
              "def bye(*_):\n"
              f"    open({str(tmp_path / 'finished')!r}, 'w').close(); sys.exit(0)\n"
              "signal.signal(signal.SIGTERM, bye)\n"
              f"open({str(tmp_path / 'ready')!r}, 'w').close()\n"
              "time.sleep(30)\n")
    for crash in (True, False):
        (tmp_path / "finished").unlink(missing_ok=True)
        (tmp_path / "ready").unlink(missing_ok=True)
        proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
        while not (tmp_path / "ready").exists():
            assert proc.poll() is None
            time.sleep(0.01)
        stop_process_group(proc, crash=crash)
        assert proc.poll() is not None
        assert (tmp_path / "finished").exists() is (not crash)
