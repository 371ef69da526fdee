"""The testbed stack stops what it started on SIGTERM, even when a second SIGTERM
arrives during the teardown (``timeout`` forwarding its own, an impatient ``kill``).

A real ``redis-server`` stands in for the engines: the stack's lifecycle code is what is
under test, and it stops every component the same way.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from kvobs.testbed.scenario import EngineSettings
    from kvobs.testbed.services import RedisServer
    from kvobs.testbed.stack import Stack

    class SlowToStop(RedisServer):
        def stop(self, *args, **kwargs):
            print("stopping", flush=True)
            time.sleep(1.0)  # long enough for the second signal to land mid-teardown
            super().stop(*args, **kwargs)

    class RedisOnly(Stack):
        def start(self):
            self.redis = SlowToStop(Path(sys.argv[1]))

    with RedisOnly(EngineSettings(), sys.argv[1]) as stack:
        print("ready", stack.redis.pid, flush=True)
        time.sleep(120)
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().split()[2] if Path(
        f"/proc/{pid}/stat").exists() else "X"
    return state != "Z"


@pytest.mark.skipif(not any(os.access(os.path.join(p, "redis-server"), os.X_OK)
                            for p in os.environ.get("PATH", "").split(os.pathsep)),
                    reason="redis-server not installed (scripts/setup.sh installs it)")
def test_sigterm_twice_still_stops_every_process(tmp_path):
    runner = subprocess.Popen([sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    redis_pid = None
    try:
        line = runner.stdout.readline().split()
        assert line[:1] == ["ready"], runner.stderr.read()
        redis_pid = int(line[1])
        assert _alive(redis_pid)
        runner.send_signal(signal.SIGTERM)
        assert runner.stdout.readline().strip() == "stopping"
        runner.send_signal(signal.SIGTERM)  # during the teardown
        runner.wait(timeout=30)
        deadline = time.monotonic() + 10
        while _alive(redis_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(redis_pid)
        assert runner.returncode != 0  # interrupted, and says so
    finally:
        if runner.poll() is None:
            runner.kill()
        if redis_pid is not None and _alive(redis_pid):  # the failure must not leak it
            os.kill(redis_pid, signal.SIGKILL)
