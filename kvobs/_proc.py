"""Stopping the processes kvobs starts: by PID, the whole process group, always."""

from __future__ import annotations

import os
import signal
import subprocess


def stop_process_group(proc: subprocess.Popen, grace_s: float = 5.0, crash: bool = False) -> None:
    """SIGTERM the group of ``proc`` (started with ``start_new_session=True``), wait
    ``grace_s``, then SIGKILL whatever is left, stragglers included. ``crash``: SIGKILL
    at once, as an OOM kill or a lost node ends a process: no handler of its own runs."""
    steps = [(signal.SIGTERM, grace_s)] if not crash else []
    for sig, wait_s in (*steps, (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            break
        try:
            proc.wait(timeout=wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    try:  # stragglers of the group after the leader exited
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def yield_cpu(pid: int, niceness: int) -> None:
    """Lower the priority of ``pid``'s session (all its processes): with autogroup
    scheduling a process's own nice value only counts inside its session, so the
    session's is set. Without autogroup (nice values compete directly) the process is
    reniced instead."""
    try:
        with open(f"/proc/{pid}/autogroup", "w") as group:
            group.write(str(niceness))
        return
    except OSError:
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, pid, niceness)
    except OSError:  # gone, or not ours to lower: it runs as started
        pass
